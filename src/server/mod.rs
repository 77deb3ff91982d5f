//! The listener: accept loop, HTTP/1.1 (hyper) and cleartext HTTP/2 (the h2 crate) on
//! one port (or, with `[server.tls]`, TLS with ALPN `h2` / `http/1.1`, the handshake
//! inside each connection's task), graceful shutdown, and the running [`Gateway`] that
//! tests and `main` drive.
//!
//! - [`gateway`]: the gateway's lifecycle: build the first snapshot, bind the
//!   listeners, start the accept loop(s) and the admin listener, reload, shut down.
//! - `accept`: the accept loop of one proxy listener: the connection limits, refusals,
//!   and the drain at shutdown.
//! - `connection`: one client connection: its TLS handshake, then HTTP served until it
//!   ends, closes idle or is shut down.
//! - `limits`, `guards`: what a connection's timeouts read, and how they are polled.
//! - [`runtime`]: the runtime shape (`multi_thread` or `per_core` workers).
//!
//! The HTTP protocols themselves (ALPN, the HTTP/2 server, 1xx) are [`crate::wire`]'s.

mod accept;
mod connection;
pub mod gateway;
mod guards;
mod limits;
pub mod runtime;
mod shared;

pub use crate::reload::{ReloadOutcome, Reloader};
pub use gateway::{Gateway, StartError};
