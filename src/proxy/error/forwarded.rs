//! How a forwarded request failed ([`ForwardError`]): what failed ([`Fault`], which
//! decides the answer), the step of the exchange ([`Step`]), whether it may be sent
//! again, and to which upstream and target it went. Built once where those facts are
//! known (see the module documentation of [`super`]).

use super::Origin;
use crate::proxy::body::BodyFailure;
use http::uri::Authority;
use http::StatusCode;
use std::fmt;
use std::sync::Arc;

/// What was wrong with an upstream's response head that made it a 502
/// ([`Fault::BadResponse`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadResponse {
    /// Its length cannot be known: `Content-Length` values that disagree or are no
    /// number, a transfer coding that is not `chunked`, and the like.
    #[error("invalid response framing")]
    Framing,
    /// Its head is past `upstreams.max_response_header_bytes` (or hyper's buffer).
    #[error("response headers too large")]
    HeadersTooLarge,
    /// Its head is malformed otherwise (a bad status line, header name or value).
    #[error("malformed response head")]
    Malformed,
    /// An HTTP/2 upstream's head that the h2 crate refused, which it does alike (a
    /// stream reset with `PROTOCOL_ERROR`) for a header list past the limit and for a
    /// malformed one (a `Content-Length` that is no number, a connection header).
    #[error("response headers too large or malformed")]
    TooLargeOrMalformed,
}

impl BadResponse {
    /// What an HTTP/1.1 exchange's failure says was wrong with the response head, if it
    /// was the response head (hyper's parse errors); `None` for everything else.
    pub fn of_h1(error: &hyper::Error) -> Option<BadResponse> {
        if error.is_parse_too_large() {
            return Some(BadResponse::HeadersTooLarge);
        }
        if error.is_parse() || error.is_parse_status() {
            // hyper names the header in its message ("invalid content-length parsed",
            // "unexpected transfer-encoding parsed"); no predicate does.
            let text = error.to_string();
            let framing = text.contains("content-length") || text.contains("transfer-encoding");
            return Some(if framing {
                BadResponse::Framing
            } else {
                BadResponse::Malformed
            });
        }
        None
    }

    /// What an HTTP/2 exchange's failure says was wrong with the response head: the h2
    /// crate's own reset of the stream (`PROTOCOL_ERROR`, for a header list past the
    /// limit or a malformed head); `None` for everything else (refused, reset by the
    /// upstream, closed early).
    pub fn of_h2(error: &h2::Error) -> Option<BadResponse> {
        (error.is_reset()
            && error.is_library()
            && error.reason() == Some(h2::Reason::PROTOCOL_ERROR))
        .then_some(BadResponse::TooLargeOrMalformed)
    }
}

/// What failed in an exchange with an upstream (the kind of a [`ForwardError`]), read
/// once where it failed: it decides the status ([`Fault::status`]) and who is to blame
/// ([`Fault::origin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Connecting, or the exchange, timed out (its I/O, or no response head within
    /// `upstreams.response_timeout`): 504.
    Timeout,
    /// The upstream answered with a head that cannot be passed on: 502.
    BadResponse(BadResponse),
    /// The request body failed (the client's doing): 413, 408 or 400.
    Body(BodyFailure),
    /// No descriptor was left for a connection: 503.
    NoDescriptor,
    /// Refused, reset, closed early, a TLS handshake that failed: 502.
    Failed,
}

impl Fault {
    /// The HTTP status of the gateway's answer.
    pub fn status(self) -> StatusCode {
        match self {
            Fault::Timeout => StatusCode::GATEWAY_TIMEOUT,
            Fault::BadResponse(_) | Fault::Failed => StatusCode::BAD_GATEWAY,
            Fault::Body(BodyFailure::TooLarge(_)) => StatusCode::PAYLOAD_TOO_LARGE,
            Fault::Body(BodyFailure::TimedOut(_)) => StatusCode::REQUEST_TIMEOUT,
            Fault::Body(BodyFailure::Unreadable) => StatusCode::BAD_REQUEST,
            Fault::NoDescriptor => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// Where the failure came from: the upstream, the client (its body), or the
    /// gateway (its descriptor budget).
    pub fn origin(self) -> Origin {
        match self {
            Fault::Timeout | Fault::BadResponse(_) | Fault::Failed => Origin::Upstream,
            Fault::Body(_) => Origin::Client,
            Fault::NoDescriptor => Origin::Internal,
        }
    }
}

/// The step of an exchange with an upstream that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Opening the TCP connection (and counting its descriptor).
    Connect,
    /// The TLS handshake with an `https://` target.
    TlsHandshake,
    /// The HTTP/1.1 or HTTP/2 handshake on a new connection.
    Handshake,
    /// Sending the request and waiting for the answer, once the request was handed to
    /// a connection: reset, closed early, its I/O timed out.
    Send,
    /// The response head: none came within `upstreams.response_timeout`, or it cannot
    /// be passed on.
    ResponseHead,
    /// The request body, on its way upstream (the client's doing).
    RequestBody,
}

/// The failure of a forwarded request: its [`Fault`] (which decides the status), the
/// [`Step`] that failed, whether it is safe to send the request again (nothing of it was
/// sent), and where it went (the upstream's name, the target's authority) with the error
/// the connection or the parser gave, if any (for the log lines).
///
/// Built once where the facts are known: by the pool for connecting, the TLS handshake
/// and the exchange (reading the request body's own failure, which the body noted where
/// it failed); by the forward loop for its response timer and a response head it will
/// not pass on. The answer is [`super::ProxyError::Forwarded`].
///
/// Small (the context is boxed): the success path never makes one, but its size is in
/// that of the pool's result.
#[derive(Debug)]
pub struct ForwardError {
    fault: Fault,
    step: Step,
    retry_safe: bool,
    context: Box<Context>,
}

/// Where a [`ForwardError`] happened, and what said so.
#[derive(Debug)]
struct Context {
    upstream: Arc<str>,
    authority: Authority,
    /// The pool's own error (a `PoolError`), kept as an error value: the pool maps its
    /// errors into this type, not the other way round.
    cause: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl ForwardError {
    /// A failure with `fault` at `step` of an exchange with `upstream`'s target
    /// `authority`, after which the request is not to be sent again (see
    /// [`ForwardError::unsent`]).
    pub fn new(fault: Fault, step: Step, upstream: &Arc<str>, authority: &Authority) -> Self {
        Self {
            fault,
            step,
            retry_safe: false,
            context: Box::new(Context {
                upstream: upstream.clone(),
                authority: authority.clone(),
                cause: None,
            }),
        }
    }

    /// This failure, which `cause` (the connection's or the parser's error) reported.
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.context.cause = Some(Box::new(cause));
        self
    }

    /// This failure, which came before a byte of the request was sent: it is safe to
    /// send the request again (to another target).
    pub fn unsent(mut self) -> Self {
        self.retry_safe = true;
        self
    }

    /// What failed.
    pub fn fault(&self) -> Fault {
        self.fault
    }

    /// The step of the exchange that failed.
    pub fn step(&self) -> Step {
        self.step
    }

    /// Whether nothing of the request was sent, so that it may be sent again.
    pub fn retry_safe(&self) -> bool {
        self.retry_safe
    }

    /// The status of the gateway's answer ([`Fault::status`]).
    pub fn status(&self) -> StatusCode {
        self.fault.status()
    }

    /// Where the failure came from ([`Fault::origin`]).
    pub fn origin(&self) -> Origin {
        self.fault.origin()
    }

    /// Whether the target refused the connection (the connect failed or timed out): the
    /// failures that eject a target for a while.
    pub fn is_refusal(&self) -> bool {
        self.step == Step::Connect && matches!(self.fault, Fault::Timeout | Fault::Failed)
    }

    /// The upstream's name.
    pub fn upstream(&self) -> &str {
        &self.context.upstream
    }

    /// The target tried.
    pub fn authority(&self) -> &Authority {
        &self.context.authority
    }

    /// The error the connection or the parser gave, if it came from there.
    pub fn cause(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.context.cause.as_deref()
    }

    /// The cause and its sources as the log lines print them, `: ` between them (empty
    /// without a cause).
    pub fn detail(&self) -> String {
        self.cause()
            .map(|e| super::error_chain(e))
            .unwrap_or_default()
    }
}

impl fmt::Display for ForwardError {
    /// The message of the gateway's answer (its JSON body's `message`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let upstream = self.upstream();
        match self.fault {
            Fault::Timeout => write!(f, "upstream {upstream:?} timed out"),
            Fault::BadResponse(bad) => write!(f, "{bad} from upstream {upstream:?}"),
            Fault::Body(BodyFailure::TooLarge(max)) => {
                write!(f, "request body larger than {max} bytes")
            }
            Fault::Body(BodyFailure::TimedOut(after)) => {
                write!(f, "request body timed out: nothing arrived for {after:?}")
            }
            Fault::Body(BodyFailure::Unreadable) => {
                f.write_str("bad request: the request body could not be read")
            }
            Fault::NoDescriptor => f.write_str("too many open connections"),
            Fault::Failed => write!(f, "upstream {upstream:?} unreachable"),
        }
    }
}

impl std::error::Error for ForwardError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause().map(|e| e as _)
    }
}

#[cfg(test)]
mod tests {
    use super::super::ProxyError;
    use super::*;
    use crate::proxy::access::Decision;
    use std::time::Duration;

    fn failure(fault: Fault, step: Step) -> ForwardError {
        ForwardError::new(
            fault,
            step,
            &Arc::from("api"),
            &Authority::from_static("10.0.0.7:9000"),
        )
    }

    /// Each fault's answer: status, origin, the message of its JSON body, and
    /// `Retry-After` for the gateway's own overload; the access-log decision is the
    /// check's (`None`), whatever the fault.
    #[test]
    fn each_fault_maps_to_its_status_origin_and_message() {
        use BodyFailure::*;
        use Origin::*;
        let table = [
            (Fault::Timeout, 504, Upstream, r#"upstream "api" timed out"#),
            (
                Fault::Failed,
                502,
                Upstream,
                r#"upstream "api" unreachable"#,
            ),
            (
                Fault::BadResponse(BadResponse::Framing),
                502,
                Upstream,
                r#"invalid response framing from upstream "api""#,
            ),
            (
                Fault::BadResponse(BadResponse::TooLargeOrMalformed),
                502,
                Upstream,
                r#"response headers too large or malformed from upstream "api""#,
            ),
            (
                Fault::Body(TooLarge(10)),
                413,
                Client,
                "request body larger than 10 bytes",
            ),
            (
                Fault::Body(TimedOut(Duration::from_secs(3))),
                408,
                Client,
                "request body timed out: nothing arrived for 3s",
            ),
            (
                Fault::Body(Unreadable),
                400,
                Client,
                "bad request: the request body could not be read",
            ),
            (
                Fault::NoDescriptor,
                503,
                Internal,
                "too many open connections",
            ),
        ];
        for (fault, status, origin, message) in table {
            let e = ProxyError::Forwarded(failure(fault, Step::Send));
            assert_eq!(e.status().as_u16(), status, "{fault:?}");
            assert_eq!(e.origin(), origin, "{fault:?}");
            assert_eq!(e.decision(), None::<Decision>, "{fault:?}");
            assert!(!e.retry_safe(), "{fault:?}");
            let response = e.into_response();
            assert_eq!(response.status().as_u16(), status);
            assert_eq!(
                response.headers().contains_key(http::header::RETRY_AFTER),
                fault == Fault::NoDescriptor,
                "{fault:?}"
            );
            let body = futures_util::FutureExt::now_or_never(http_body_util::BodyExt::collect(
                response.into_body(),
            ))
            .expect("a full body")
            .expect("no error")
            .to_bytes();
            let json: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
            assert_eq!(json["message"], message, "{fault:?}");
        }
    }

    /// Retry-safe only when marked unsent; a refusal is a connect that failed or timed
    /// out, nothing else.
    #[test]
    fn retry_safety_and_refusal_follow_the_step_and_the_fault() {
        let sent = failure(Fault::Failed, Step::Send);
        assert!(!sent.retry_safe() && !sent.is_refusal());
        let refused = failure(Fault::Failed, Step::Connect).unsent();
        assert!(refused.retry_safe() && refused.is_refusal());
        assert!(ProxyError::Forwarded(refused).retry_safe());
        assert!(failure(Fault::Timeout, Step::Connect).is_refusal());
        assert!(!failure(Fault::NoDescriptor, Step::Connect).is_refusal());
        assert!(!failure(Fault::Failed, Step::TlsHandshake).is_refusal());
        assert!(!failure(Fault::Timeout, Step::ResponseHead).is_refusal());
        // An answer made before forwarding sent nothing.
        assert!(ProxyError::NoRoute.retry_safe());
    }
}
