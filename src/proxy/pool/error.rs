//! How an exchange with an upstream target failed, read once here into the
//! [`ForwardError`] the request path answers with ([`SendError`]): from the typed errors
//! of the connect, rustls, hyper and h2 ([`PoolError`]; an HTTP/1.1 connection whose I/O
//! timed out from hyper's error's causes, in [`io_timed_out`], the one place that looks
//! there), and from the request body's own state.

use super::super::body::BodyError;
use super::super::body::{BodyFailure, RequestBody};
use super::super::error::{BadResponse, Fault, ForwardError, Step};
use super::Pool;
use crate::wire::h2client;
use http::uri::Authority;
use http::Request;

/// Why a request could not be sent or answered, as the connection or the parser said
/// (the cause of a [`ForwardError`], which the log lines print).
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
    /// The HTTP/1.1 exchange (or handshake) failed (reset, closed early, bad response,
    /// ...); `timed_out`: the connection's socket had a read or write time out, which
    /// hyper's error keeps only as an untyped cause (read once, by [`PoolError::http`]).
    #[error("{error}")]
    Http {
        /// hyper's error.
        #[source]
        error: hyper::Error,
        /// Whether the connection's I/O timed out.
        timed_out: bool,
    },
    /// The HTTP/2 exchange (or handshake) failed (stream reset, connection error,
    /// GOAWAY, a response head past the header-list limit, ...).
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
    /// An HTTP/1.1 exchange (or handshake) that failed with `error`, with whether its
    /// connection's I/O timed out ([`io_timed_out`]).
    pub(super) fn http(error: hyper::Error) -> Self {
        let timed_out = io_timed_out(&error);
        PoolError::Http { error, timed_out }
    }

    /// What the failure says about the exchange, read from its typed parts: a timeout
    /// (the connect, or an HTTP/1.1 exchange whose I/O timed out), a response head that
    /// cannot be passed on ([`BadResponse`]), no descriptor, or another failure (a
    /// refused or failed connect or TLS handshake, a reset, a connection closed early).
    /// A request body's own failure is not here but in its state
    /// ([`super::super::body::BodyState::failure`]), which comes first.
    pub fn fault(&self) -> Fault {
        match self {
            PoolError::ConnectTimeout(_) => Fault::Timeout,
            PoolError::Connect(..) | PoolError::Tls(..) | PoolError::Body(_) => Fault::Failed,
            PoolError::Http {
                timed_out: true, ..
            } => Fault::Timeout,
            PoolError::Http { error, .. } => {
                BadResponse::of_h1(error).map_or(Fault::Failed, Fault::BadResponse)
            }
            PoolError::H2(e) => BadResponse::of_h2(e).map_or(Fault::Failed, Fault::BadResponse),
            PoolError::NoDescriptor(_) => Fault::NoDescriptor,
        }
    }

    /// The step of making a connection that failed with this error (TCP, TLS, the HTTP
    /// handshake: what [`Pool::connect_h1`] and [`Pool::connect_h2`] fail with).
    fn connect_step(&self) -> Step {
        match self {
            PoolError::ConnectTimeout(_) | PoolError::Connect(..) | PoolError::NoDescriptor(_) => {
                Step::Connect
            }
            PoolError::Tls(..) => Step::TlsHandshake,
            PoolError::Http { .. } | PoolError::H2(_) | PoolError::Body(_) => Step::Handshake,
        }
    }
}

/// Whether an HTTP/1.1 exchange failed because its connection's I/O timed out: an
/// `io::Error` of kind `TimedOut` among the causes of hyper's error (the kernel's
/// `ETIMEDOUT`, its retransmissions or keep-alive probes unanswered; nothing of the
/// gateway's times out an upstream socket's I/O).
///
/// The one place the request path looks into an error's causes by their type, kept
/// because hyper leaves no other way to know: it keeps the `io::Error` its connection's
/// socket returned only as the untyped cause of its own error (`hyper::Error::is_timeout`
/// is about hyper's own timers, which a client connection does not run). Noting the fact
/// where it happens means watching every read and write of every upstream connection,
/// which the request path pays for: tried in issue 47 as a wrapper of the upstream
/// socket that noted an `ETIMEDOUT` (its OS error number, checked inline), the check
/// alone tipped hyper's read path over the inliner's threshold, about +150 instructions
/// per proxied request (callgrind, `--profile quick`), and the note carried with each
/// pooled connection about 30 more. A failed exchange is rare: read here, once, where the
/// error is mapped ([`PoolError::http`]), the fact is typed from then on
/// ([`PoolError::Http`]'s `timed_out`, which [`PoolError::fault`] reads).
fn io_timed_out(error: &hyper::Error) -> bool {
    super::super::error::causes(error).any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    })
}

/// A failed [`Pool::send`]: what failed, where, and whether it is safe to send again
/// (`failure`); and the request, back untouched when nothing of it was sent, so that it
/// may go to another target.
#[derive(Debug)]
pub struct SendError {
    /// The failure, as the request path answers it.
    pub failure: ForwardError,
    /// The request, back untouched, when the failure came before sending it (then
    /// [`ForwardError::retry_safe`]).
    pub unsent: Option<Request<RequestBody>>,
}

impl Pool {
    /// The failure of this pool's target with `fault` at `step`, which `cause` said.
    fn failure(&self, fault: Fault, step: Step, cause: PoolError) -> ForwardError {
        let c = &self.connector;
        ForwardError::new(fault, step, &c.upstream, &c.authority).caused_by(cause)
    }

    /// A connection (`connected`) to send `req` on, or the failure to make one (at the
    /// step its error says), with `req` handed back unsent.
    #[allow(clippy::result_large_err)] // as large as `send`'s own error; moved at once
    pub(super) fn connected<T>(
        &self,
        connected: Result<T, PoolError>,
        req: Request<RequestBody>,
    ) -> Result<(T, Request<RequestBody>), SendError> {
        match connected {
            Ok(conn) => Ok((conn, req)),
            Err(error) => Err(SendError {
                failure: self
                    .failure(error.fault(), error.connect_step(), error)
                    .unsent(),
                unsent: Some(req),
            }),
        }
    }

    /// An exchange that failed with `error` once its request was handed to a
    /// connection; `body`: how the request body failed, if it did (the client's doing,
    /// whatever the connection reports); `unsent`: the request, when the upstream did
    /// not process it (HTTP/2) and it may be sent again.
    pub(super) fn exchange_failed(
        &self,
        error: PoolError,
        body: Option<BodyFailure>,
        unsent: Option<Request<RequestBody>>,
    ) -> SendError {
        let (fault, step) = match body {
            Some(body) => (Fault::Body(body), Step::RequestBody),
            None => match error.fault() {
                bad @ Fault::BadResponse(_) => (bad, Step::ResponseHead),
                fault => (fault, Step::Send),
            },
        };
        let failure = self.failure(fault, step, error);
        SendError {
            failure: if unsent.is_some() {
                failure.unsent()
            } else {
                failure
            },
            unsent,
        }
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
