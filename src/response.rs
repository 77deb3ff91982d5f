//! What the proxy and the admin listener both answer with: the response body type and
//! JSON responses.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};

/// The body of every response the gateway sends: streamed from the upstream, or JSON.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// A response with a JSON body and `Content-Type: application/json`.
pub fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<Body> {
    json_bytes_response(status, body.to_string().into_bytes())
}

/// A response with `bytes` (JSON) as body and `Content-Type: application/json`.
pub fn json_bytes_response(status: StatusCode, bytes: Vec<u8>) -> Response<Body> {
    let bytes = Bytes::from(bytes);
    let mut r = Response::new(Full::new(bytes).map_err(|never| match never {}).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}
