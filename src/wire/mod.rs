//! The HTTP wire layer: what tollgate does under and beside hyper to speak HTTP/1.1 and
//! HTTP/2 with clients and upstreams. It knows nothing of routes, limits or the proxy;
//! the server and the request path use it.
//!
//! - [`alpn`]: one client connection served in the protocol ALPN (or its first bytes)
//!   chose, HTTP/1.1 by hyper's server, HTTP/2 by [`h2server`]; both call one
//!   [`handler::Handler`].
//! - [`h2server`]: the HTTP/2 server on the h2 crate (hyper's cannot send 1xx).
//! - [`h2client`]: HTTP/2 to upstreams on the h2 crate (hyper's client drops 1xx).
//! - [`interim`]: 1xx responses forwarded to clients ([`Informational`]); to HTTP/1.1
//!   clients through the socket hyper owns ([`Interim`]).
//! - [`incoming`]: a client's request body, from either server ([`Incoming`]).
//! - [`tunnel`]: the client side of a tunnel (WebSocket over HTTP/1.1 or RFC 8441).
//! - [`linger`], [`minor_version`]: what the HTTP/1.1 server's socket is wrapped in
//!   (a lingering close; `HTTP/1.2`+ request lines read as 1.1).
//!
//! What this layer relies on in hyper and h2 that they do not document, and the tests
//! that fail when an upgrade breaks it: `src/wire/README.md` (the tests are in
//! `reliance`).
//!
//! Imports: the files of this module import each other in one direction only
//! (`handler`, `incoming` and `interim` are leaves; `h2server` uses them; `alpn` uses
//! `h2server`), and of the crate only [`crate::http`]'s hop-by-hop rules.

pub(crate) mod alpn;
pub mod h2client;
pub(crate) mod h2server;
pub(crate) mod handler;
pub mod incoming;
pub mod interim;
pub(crate) mod linger;
pub(crate) mod minor_version;
#[cfg(test)]
mod reliance;
pub mod tunnel;

pub use incoming::{BodyError, Incoming};
pub use interim::{Informational, Interim};
pub use tunnel::{client_upgrade, ClientSide, TunnelIo};
