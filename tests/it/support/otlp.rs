//! A real OTLP/HTTP receiver for the tracing tests: a hyper HTTP/1.1 server that decodes
//! each `POST /v1/traces` body with the official protobuf definitions (the
//! `opentelemetry-proto` crate's messages, decoded by prost) and keeps the spans, or one
//! that accepts requests and never answers them (a collector that hangs).

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

/// One export request as received.
#[derive(Debug, Clone)]
pub struct Export {
    pub path: String,
    pub content_type: String,
    pub authorization: Option<String>,
    pub service_name: Option<String>,
    pub spans: Vec<Span>,
}

pub struct Receiver {
    pub addr: SocketAddr,
    exports: Arc<Mutex<Vec<Export>>>,
    /// Requests that arrived (answered or not).
    arrived: Arc<Mutex<usize>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Receiver {
    /// A receiver that answers every export 200 (`answer`), or never answers.
    pub async fn start(answer: bool) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let exports: Arc<Mutex<Vec<Export>>> = Arc::default();
        let arrived: Arc<Mutex<usize>> = Arc::default();
        let (e, a) = (exports.clone(), arrived.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (e, a) = (e.clone(), a.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let (e, a) = (e.clone(), a.clone());
                        async move {
                            *a.lock().unwrap() += 1;
                            if !answer {
                                std::future::pending::<()>().await;
                            }
                            let header = |n: &str| {
                                req.headers()
                                    .get(n)
                                    .map(|v| v.to_str().unwrap().to_string())
                            };
                            let path = req.uri().path().to_string();
                            let content_type = header("content-type").unwrap_or_default();
                            let authorization = header("authorization");
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let decoded = ExportTraceServiceRequest::decode(body).unwrap();
                            let mut service_name = None;
                            let mut spans = Vec::new();
                            for rs in decoded.resource_spans {
                                if let Some(r) = &rs.resource {
                                    for kv in &r.attributes {
                                        if kv.key == "service.name" {
                                            service_name = text(kv.value.as_ref());
                                        }
                                    }
                                }
                                for ss in rs.scope_spans {
                                    spans.extend(ss.spans);
                                }
                            }
                            e.lock().unwrap().push(Export {
                                path,
                                content_type,
                                authorization,
                                service_name,
                                spans,
                            });
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(StatusCode::OK)
                                    .header("content-type", "application/x-protobuf")
                                    .body(Full::new(Bytes::new()))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Receiver {
            addr,
            exports,
            arrived,
            task,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn exports(&self) -> Vec<Export> {
        self.exports.lock().unwrap().clone()
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.exports().into_iter().flat_map(|e| e.spans).collect()
    }

    /// Export requests that arrived, answered or not.
    pub fn arrived(&self) -> usize {
        *self.arrived.lock().unwrap()
    }

    /// Wait (≤ 10 s) until at least `n` spans named or not have arrived; all of them.
    pub async fn wait_spans(&self, n: usize) -> Vec<Span> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let spans = self.spans();
            if spans.len() >= n {
                return spans;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} span(s) received, waited for {n}: {spans:?}",
                spans.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A string attribute's value.
pub fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> Option<String> {
    match v?.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// The attribute `key` of `span` as text (integers written in decimal).
pub fn attr(span: &Span, key: &str) -> Option<String> {
    attr_of(&span.attributes, key)
}

/// The attribute `key` of `attributes` (a span's or an event's) as text.
pub fn attr_of(
    attributes: &[opentelemetry_proto::tonic::common::v1::KeyValue],
    key: &str,
) -> Option<String> {
    let kv = attributes.iter().find(|kv| kv.key == key)?;
    match kv.value.as_ref()?.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        Value::BoolValue(b) => Some(b.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Lowercase hex of an id.
pub fn hex(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}
