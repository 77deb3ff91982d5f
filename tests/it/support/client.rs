//! A small HTTP/1.1 client for the tests (hyper-util's pooled client).

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// What a caller sees: status, headers, body.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// A header as a string ("" when absent).
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// A header as a number; panics when absent.
    pub fn num(&self, name: &str) -> u64 {
        self.header(name).parse().unwrap_or_else(|_| {
            panic!(
                "header {name} missing or not a number in {:?}",
                self.headers
            )
        })
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub async fn get(url: &str) -> Reply {
    get_with(url, &[]).await
}

/// GET `url` with extra headers.
pub async fn get_with(url: &str, headers: &[(&str, &str)]) -> Reply {
    send(http::Method::GET, url, headers).await
}

/// A request with `method` to `url` with extra headers and no body.
/// `method` to `url`, with `Authorization: Bearer TOKEN` when `token` is given.
pub async fn send_bearer(method: http::Method, url: &str, token: Option<&str>) -> Reply {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    send(method, url, &headers).await
}

pub async fn send(method: http::Method, url: &str, headers: &[(&str, &str)]) -> Reply {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client
        .request(req.body(Full::new(Bytes::new())).unwrap())
        .await
        .expect("request to gateway");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("response body").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// An HTTP/2-only client (prior knowledge), for bursts of concurrent requests on one
/// connection.
pub fn h2_client() -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Empty<bytes::Bytes>,
> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}
