//! What the proxy and the admin listener both answer with: the response body type and
//! JSON responses.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};

/// The body of every response the gateway sends: streamed from the upstream, or JSON.
/// Its error (an upstream body that failed mid-way) only ends the response early.
pub type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// A response with a JSON body and `Content-Type: application/json`.
pub fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<Body> {
    json_bytes_response(status, body.to_string().into_bytes())
}

/// `bytes` as a whole response body.
pub fn bytes_body(bytes: Vec<u8>) -> Body {
    Full::new(Bytes::from(bytes))
        .map_err(|never| match never {})
        .boxed()
}

/// A response with `bytes` (JSON) as body and `Content-Type: application/json`.
pub fn json_bytes_response(status: StatusCode, bytes: Vec<u8>) -> Response<Body> {
    let mut r = Response::new(bytes_body(bytes));
    *r.status_mut() = status;
    // Room for the rate-limit headers, Retry-After and the request id a 429 carries:
    // one allocation, no growth.
    *r.headers_mut() = http::HeaderMap::with_capacity(12);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// `body`, holding `guard` until the body is dropped: when it has been sent in full,
/// failed, or the client went away. (Used to give back concurrency slots when the
/// response ends, not when its headers are sent.)
pub fn with_guard<G: Send + Sync + Unpin + 'static>(body: Body, guard: G) -> Body {
    Guarded {
        body,
        _guard: guard,
    }
    .boxed()
}

/// A body that holds a value until it is dropped.
struct Guarded<G> {
    body: Body,
    _guard: G,
}

impl<G: Send + Sync + Unpin + 'static> hyper::body::Body for Guarded<G> {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        // `Body` is Unpin (a boxed body), so the guarded body is too.
        std::pin::Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// A response passed on as another service gave it: `status`, its `Content-Type` and
/// `body` (an auth service's 401 or 403).
pub fn passed_on(
    status: u16,
    content_type: Option<http::HeaderValue>,
    body: Bytes,
) -> Response<Body> {
    let mut response = Response::new(
        http_body_util::Full::new(body)
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::UNAUTHORIZED);
    if let Some(ct) = content_type {
        response
            .headers_mut()
            .insert(http::header::CONTENT_TYPE, ct);
    }
    response
}
