//! The exporter: one task per tracer that takes finished spans from the bounded queue,
//! batches them (at most `tracing.batch_size`, at most `tracing.batch_timeout` after
//! the first) and POSTs each batch as OTLP/HTTP protobuf to `tracing.endpoint` over one
//! kept-alive HTTP/1.1 connection (TLS with rustls' ring provider for `https://`). No
//! request waits for it: a batch that fails or takes longer than
//! `tracing.export_timeout` is dropped and counted.

use super::span::SpanData;
use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::mpsc::Receiver;

/// Where and how batches are sent.
#[derive(Debug)]
pub struct Exporter {
    /// The path (and query) POSTed to.
    pub path: Uri,
    /// `Host` of the requests.
    pub authority: HeaderValue,
    /// Host name or address to connect to (no brackets).
    pub host: String,
    /// Port to connect to.
    pub port: u16,
    /// The TLS client for an `https://` endpoint.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// `tracing.headers` and `tracing.headers_file`, resolved.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// `service.name`.
    pub service_name: String,
    /// `tracing.batch_size`.
    pub batch_size: usize,
    /// `tracing.batch_timeout`.
    pub batch_timeout: Duration,
    /// `tracing.export_timeout`.
    pub export_timeout: Duration,
}

/// The counters the task keeps: spans exported, spans dropped because their batch
/// failed.
#[derive(Debug, Clone)]
pub struct Counts {
    /// `tollgate_trace_spans_exported_total`.
    pub exported: Counter,
    /// `tollgate_trace_spans_dropped_total{reason="export_failed"}`.
    pub failed: Counter,
}

/// Run until every sender of `queue` is gone (the tracer's snapshot replaced and its
/// requests finished), exporting what is left first.
pub async fn run(ex: Arc<Exporter>, mut queue: Receiver<SpanData>, counts: Counts) {
    static WARN: crate::logging::Throttle = crate::logging::Throttle::new();
    let mut conn: Option<SendRequest<Full<Bytes>>> = None;
    let mut batch: Vec<SpanData> = Vec::with_capacity(ex.batch_size.min(4096));
    let mut open = true;
    while open {
        match queue.recv().await {
            Some(span) => batch.push(span),
            None => break,
        }
        let due = tokio::time::Instant::now() + ex.batch_timeout;
        while batch.len() < ex.batch_size {
            match tokio::time::timeout_at(due, queue.recv()).await {
                Ok(Some(span)) => batch.push(span),
                Ok(None) => {
                    open = false;
                    break;
                }
                Err(_) => break,
            }
        }
        let n: u64 = batch.iter().map(SpanData::count).sum();
        let body = super::encode::request(&ex.service_name, batch.drain(..));
        let sent = tokio::time::timeout(ex.export_timeout, ex.post(&mut conn, body)).await;
        let failure = match sent {
            Ok(Ok(())) => {
                counts.exported.inc_by(n);
                continue;
            }
            Ok(Err(e)) => e,
            Err(_) => format!("no answer within {:?}", ex.export_timeout),
        };
        conn = None;
        counts.failed.inc_by(n);
        if let Some(suppressed) = WARN.due(10_000) {
            tracing::warn!(
                spans = n,
                error = %failure,
                suppressed,
                "trace export failed; its spans are dropped"
            );
        }
    }
}

impl Exporter {
    /// POST `body` on `conn` (opened first when there is none or it closed).
    async fn post(
        &self,
        conn: &mut Option<SendRequest<Full<Bytes>>>,
        body: Vec<u8>,
    ) -> Result<(), String> {
        if conn.as_ref().is_none_or(|c| c.is_closed()) {
            *conn = Some(self.connect().await?);
        }
        let Some(sender) = conn.as_mut() else {
            return Err("no connection".into());
        };
        sender.ready().await.map_err(|e| e.to_string())?;
        let mut request = Request::post(self.path.clone())
            .header(header::HOST, self.authority.clone())
            .header(header::CONTENT_TYPE, "application/x-protobuf")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        for (name, value) in &self.headers {
            request.headers_mut().insert(name, value.clone());
        }
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        // Read the answer (a few bytes) so the connection can carry the next batch.
        let _ = http_body_util::Limited::new(response.into_body(), 64 * 1024)
            .collect()
            .await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("the collector answered {status}"))
        }
    }

    /// A new HTTP/1.1 connection to the collector, driven by its own task.
    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, String> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("connect to {}:{}: {e}", self.host, self.port))?;
        let _ = tcp.set_nodelay(true);
        let handshake = |e: hyper::Error| format!("HTTP handshake: {e}");
        match &self.tls {
            Some(tls) => {
                let name = rustls::pki_types::ServerName::try_from(self.host.clone())
                    .map_err(|e| format!("server name {}: {e}", self.host))?;
                let stream = tokio_rustls::TlsConnector::from(tls.clone())
                    .connect(name, tcp)
                    .await
                    .map_err(|e| format!("TLS handshake: {e}"))?;
                let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(handshake)?;
                tokio::spawn(conn);
                Ok(sender)
            }
            None => {
                let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                    .await
                    .map_err(handshake)?;
                tokio::spawn(conn);
                Ok(sender)
            }
        }
    }
}
