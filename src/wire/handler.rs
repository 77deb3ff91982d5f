//! What answers a connection's requests ([`Handler`]), shared by the two servers that
//! read them: hyper's for HTTP/1.1 ([`super::alpn`]) and the h2 crate's for HTTP/2
//! ([`super::h2server`]).

use super::incoming::Incoming;
use std::convert::Infallible;
use std::future::Future;

/// The error of a connection or a response body.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What answers a connection's requests, whichever server read them (hyper's for
/// HTTP/1.1, the h2 crate's for HTTP/2).
pub(crate) trait Handler: Clone + Send + Sync + Unpin + 'static {
    /// The response's body.
    type Body: http_body::Body<Data = bytes::Bytes, Error = BoxError> + Send + 'static;
    /// The answer being made.
    type Future: Future<Output = Result<http::Response<Self::Body>, Infallible>> + Send + 'static;
    /// Answer `req`.
    fn call(&self, req: http::Request<Incoming>) -> Self::Future;
}

impl<F, Fut, B> Handler for F
where
    F: Fn(http::Request<Incoming>) -> Fut + Clone + Send + Sync + Unpin + 'static,
    Fut: Future<Output = Result<http::Response<B>, Infallible>> + Send + 'static,
    B: http_body::Body<Data = bytes::Bytes, Error = BoxError> + Send + 'static,
{
    type Body = B;
    type Future = Fut;

    fn call(&self, req: http::Request<Incoming>) -> Fut {
        self(req)
    }
}
