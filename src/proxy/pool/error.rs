//! How an exchange with an upstream target failed ([`PoolError`], [`SendError`]), read
//! once here, from the typed errors of the connect, hyper and h2 and from the request
//! body's own state, into the [`Fault`] that decides the gateway's answer.

use super::super::body::BodyError;
use super::super::body::{BodyFailure, BodyState, RequestBody};
use super::super::error::{BadResponse, Fault};
use crate::wire::h2client;
use http::uri::Authority;
use http::Request;

/// Why a request could not be sent or answered.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The TCP connect took longer than the upstream's `connect_timeout`.
    #[error("connect to {0} timed out")]
    ConnectTimeout(Authority),
    /// The TCP connect failed (refused, unreachable, ...).
    #[error("connect to {0}: {1}")]
    Connect(Authority, std::io::Error),
    /// The TLS handshake with the target failed (untrusted certificate, wrong name, ...).
    #[error("TLS handshake with {0}: {1}")]
    Tls(Authority, std::io::Error),
    /// The HTTP exchange failed (reset, closed early, bad response, ...).
    #[error("{0}")]
    Http(#[from] hyper::Error),
    /// The HTTP/2 exchange failed (stream reset, connection error, GOAWAY, a response
    /// head past the header-list limit, ...).
    #[error("{0}")]
    H2(#[from] h2::Error),
    /// The request body failed while it was sent to an HTTP/2 upstream (too large,
    /// stopped arriving, unreadable: see [`super::body`]).
    #[error("request body: {0}")]
    Body(#[source] BodyError),
    /// No socket could be opened: the descriptor budget is spent.
    #[error("no descriptor left for a connection to {0} (the open-file limit is spent)")]
    NoDescriptor(Authority),
}

impl PoolError {
    /// Whether the target refused the connection (connect error or connect timeout): the
    /// failures that eject a target for a while.
    pub fn is_refusal(&self) -> bool {
        matches!(self, PoolError::ConnectTimeout(_) | PoolError::Connect(..))
    }

    /// What the failure says about the exchange, read from its typed parts: a timeout
    /// (the connect, or an HTTP/1.1 exchange whose I/O timed out), a response head that
    /// cannot be passed on ([`BadResponse`]), no descriptor, or another failure (a
    /// refused or failed connect or TLS handshake, a reset, a connection closed early).
    /// A request body's own failure is not here but in [`SendError::body`].
    pub fn fault(&self) -> Fault {
        match self {
            PoolError::ConnectTimeout(_) => Fault::Timeout,
            PoolError::Connect(..) | PoolError::Tls(..) | PoolError::Body(_) => Fault::Failed,
            PoolError::Http(e) if io_timed_out(e) => Fault::Timeout,
            PoolError::Http(e) => BadResponse::of_h1(e).map_or(Fault::Failed, Fault::BadResponse),
            PoolError::H2(e) => BadResponse::of_h2(e).map_or(Fault::Failed, Fault::BadResponse),
            PoolError::NoDescriptor(_) => Fault::NoDescriptor,
        }
    }
}

/// Whether an HTTP/1.1 exchange failed because its connection's I/O timed out (an
/// `io::Error` of kind `TimedOut` among the causes): hyper keeps that I/O error only as
/// a cause of its own error, with no accessor for it.
fn io_timed_out(error: &hyper::Error) -> bool {
    super::super::error::causes(error).any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    })
}

/// A failed [`Pool::send`]: the error, the request when not a byte of it was sent
/// (the connection could not be made), so that it may go to another target, and the
/// request body's own failure when it failed.
#[derive(Debug)]
pub struct SendError {
    /// What went wrong.
    pub error: PoolError,
    /// The request, back untouched, when the failure came before sending it.
    pub unsent: Option<Request<RequestBody>>,
    /// Why the request body failed, when it did: then the failure is the client's,
    /// whatever the connection reports.
    pub body: Option<BodyFailure>,
}

impl SendError {
    /// Whether the request may be sent again, to another target: nothing of it was sent
    /// (it is back in [`SendError::unsent`]).
    pub fn retry_safe(&self) -> bool {
        self.unsent.is_some()
    }

    /// What the failure says: the request body's failure, else the connection's
    /// ([`PoolError::fault`]).
    pub fn fault(&self) -> Fault {
        match self.body {
            Some(body) => Fault::Body(body),
            None => self.error.fault(),
        }
    }
}

/// A connection (`connected`) to send `req` on, or the failure to get one, with `req`
/// handed back unsent.
#[allow(clippy::result_large_err)] // as large as `send`'s own error; moved at once
pub(super) fn unsent_on_error<T>(
    connected: Result<T, PoolError>,
    req: Request<RequestBody>,
) -> Result<(T, Request<RequestBody>), SendError> {
    match connected {
        Ok(tx) => Ok((tx, req)),
        Err(error) => Err(SendError {
            error,
            unsent: Some(req),
            body: None,
        }),
    }
}

/// An HTTP/1.1 exchange that failed once its request was handed to the connection (so
/// not to be sent again), with the failure of its request body (`body`), if that failed.
pub(super) fn sent_and_failed(error: hyper::Error, body: &BodyState) -> SendError {
    SendError {
        error: PoolError::Http(error),
        unsent: None,
        body: body.failure(),
    }
}

impl From<h2client::StreamError<BodyError>> for PoolError {
    fn from(e: h2client::StreamError<BodyError>) -> Self {
        match e {
            h2client::StreamError::H2(e) => PoolError::H2(e),
            h2client::StreamError::Body(e) => PoolError::Body(e),
        }
    }
}

/// A request body the HTTP/2 client can send again (see [`h2client::REPLAY_BYTES`]).
impl h2client::Replay for RequestBody {
    fn replay(frames: Vec<http_body::Frame<bytes::Bytes>>) -> Self {
        RequestBody::replay(frames)
    }
}

impl From<PoolError> for SendError {
    fn from(error: PoolError) -> Self {
        SendError {
            error,
            unsent: None,
            body: None,
        }
    }
}
