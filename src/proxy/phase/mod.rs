//! The phases of the request path, one file each, in the order [`super::serve`] runs
//! them:
//!
//! | phase | file | what it does | answers itself with |
//! |---|---|---|---|
//! | edge | [`edge`] | one spelling per path, only the headers that may cross, one Host, TLS host | 400, 421, 501 |
//! | identify | [`identify`] | API key, JWT, client certificate or auth service → caller | 401, 429, 503, … |
//! | route | [`route`] | the rate-limit endpoint; host and path prefix → route | 200, 404, 413, … |
//! | check | [`check`] | every limit of the route, read or reserved | 429, 503 |
//! | forward | [`forward`] | the request to the upstream, streaming both bodies | 502, 504, … |
//! | settle | [`settle`] | charge (or release) once the status is known | |
//! | headers | [`headers`] | rate-limit headers, concurrency slots held by the body | |
//!
//! Each phase returns `Result<T, Answer>`: `T` for the next phase, or the [`Answer`]
//! that ends the request (its response and its access-log decision). The log phase is
//! [`super::handle`]'s: it writes the access line when the response ends.

pub mod check;
pub mod edge;
pub mod forward;
pub mod headers;
pub mod identify;
pub mod route;
pub mod settle;

use super::access::{AccessLog, Decision};
use super::error::ProxyError;
use super::Body;
use http::Response;

/// A response the gateway gives instead of going on with the request, and the
/// decision the access log and the request metrics show for it.
///
/// The response is boxed: every phase returns `Result<T, Answer>`, and a response held
/// inline (136 bytes) made each phase's result that large, copied on every return of
/// every request, answered or not.
#[derive(Debug)]
pub struct Answer {
    /// What the client gets.
    pub response: Box<Response<Body>>,
    /// The logged decision; `None`: the one made so far stands (a request that failed
    /// once forwarded keeps its check's decision: allowed, shadow rejected, …).
    pub decision: Option<Decision>,
}

impl Answer {
    /// `response`, logged as `decision`.
    #[inline]
    pub fn new(response: Response<Body>, decision: Decision) -> Self {
        Self {
            response: Box::new(response),
            decision: Some(decision),
        }
    }

    /// `response`, logged with the decision made so far.
    #[inline]
    pub fn keeping_decision(response: Response<Body>) -> Self {
        Self {
            response: Box::new(response),
            decision: None,
        }
    }

    /// The response, with its decision noted in `log`.
    #[inline]
    pub fn logged(self, log: &mut AccessLog) -> Response<Body> {
        if let Some(decision) = self.decision {
            log.decision = decision;
        }
        *self.response
    }
}

impl From<ProxyError> for Answer {
    /// The error's response, logged with [`ProxyError::decision`].
    #[inline]
    fn from(error: ProxyError) -> Self {
        let decision = error.decision();
        Self {
            response: Box::new(error.into_response()),
            decision,
        }
    }
}
