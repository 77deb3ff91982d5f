//! tollgate: a reverse-proxy gateway that enforces per-caller rate limits held in the
//! process or in sharded Redis.
//!
//! A request goes through [`proxy::handle`]: identify → route → check → forward →
//! charge → headers. The config is a [`snapshot::Snapshot`] behind `arc-swap`, built by
//! [`snapshot::Snapshot::build`] from a [`config::ConfigFile`]; the listener and its
//! lifecycle are in [`server::Gateway`].

#![deny(unsafe_code)]

pub mod admin;
pub mod alloc;
pub mod budget;
pub mod clock;
pub mod config;
pub mod http;
pub mod identity;
pub mod limiter;
pub mod lines;
pub mod load;
pub mod logging;
pub mod memo;
pub mod metrics;
pub mod otel;
pub mod proxy;
pub mod reload;
pub mod replay;
pub mod response;
pub mod server;
pub mod snapshot;
pub mod tickets;
pub mod tls;
pub mod wire;
pub mod worker;

pub use server::Gateway;

/// Install rustls' ring crypto provider as the process default. Call it first thing in
/// `main` (and in tests that use TLS); calling it again is harmless.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
