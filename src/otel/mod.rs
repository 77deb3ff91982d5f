//! OpenTelemetry tracing (issue 49, `[tracing]`, off by default): a server span per
//! request, with child spans for the store's check and charge and the upstream call,
//! exported over OTLP/HTTP (protobuf) off the request path.
//!
//! - **Propagation** ([`context`]): W3C Trace Context Level 1. A `traceparent` (and its
//!   `tracestate`) is continued only from peers `tracing.trust_incoming` trusts;
//!   anyone else's is dropped at the edge (never forwarded) and a new trace starts.
//!   The request sent upstream carries tollgate's `traceparent`, whose parent is the
//!   upstream call's span (a child of the server span).
//! - **Sampling**: parent-based; a new trace is sampled when its id falls within
//!   `tracing.sample_ratio` (the id's last 8 bytes against the ratio, as OpenTelemetry's
//!   `TraceIdRatioBased`). With `tracing.sample_refusals`, a request refused with 429 is
//!   exported even when not sampled: what the upstream sees cannot disagree, since a
//!   refused request never reaches it.
//! - **Export** ([`export`]): finished spans go into a bounded queue with `try_send`
//!   (full: dropped and counted in `tollgate_trace_spans_dropped_total`); one task
//!   batches and POSTs them.
//!
//! With tracing off the request path pays one branch on an `Option` per hook.

pub mod context;
pub mod encode;
pub mod export;
pub mod span;

use crate::config::{Config, Files, Problems, TracingConfig, TrustIncoming};
use crate::proxy::access::{AccessLog, Decision};
use http::{HeaderName, HeaderValue, Request, Uri};
use prometheus_client::metrics::counter::Counter;
use span::{Recording, SpanData};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::mpsc;

/// The tracing of one config: its settings, its queue and (once started) its exporter.
#[derive(Debug)]
pub struct Tracer {
    /// The config it was built from, its header values and CA file as read: a reload
    /// with the same ones keeps this tracer (its queue and connection).
    source: (TracingConfig, Vec<(String, String)>, Option<Vec<u8>>),
    /// New traces are sampled when the last 8 bytes of their id are below this;
    /// `u64::MAX` with a ratio of 1 (then every one is).
    threshold: u64,
    sample_refusals: bool,
    trust: TrustIncoming,
    queue: mpsc::Sender<SpanData>,
    /// The queue's other end and the exporter, until [`Tracer::start`] runs them.
    pending: Mutex<Option<(mpsc::Receiver<SpanData>, Arc<export::Exporter>)>>,
    /// `tollgate_trace_spans_dropped_total{reason="queue_full"}`, set by
    /// [`Tracer::start`].
    dropped: OnceLock<Counter>,
}

impl Tracer {
    /// Validate `[tracing]` and build its tracer (`None` when tracing is off or the
    /// section has errors, recorded in `problems`). `previous`: the running tracer,
    /// kept when nothing changed.
    pub fn build(
        cfg: &Config,
        files: &Files,
        previous: Option<&Arc<Tracer>>,
        problems: &mut Problems,
    ) -> Option<Arc<Tracer>> {
        let t = &cfg.tracing;
        if !t.enabled {
            return None;
        }
        let before = problems.errors.len();
        if !(0.0..=1.0).contains(&t.sample_ratio) {
            problems.error("tracing.sample_ratio", "must be between 0.0 and 1.0");
        }
        if !(1..=1_000_000).contains(&t.queue_size) {
            problems.error("tracing.queue_size", "must be between 1 and 1000000");
        }
        if t.batch_size == 0 {
            problems.error("tracing.batch_size", "must be at least 1");
        }
        for (key, d) in [
            ("batch_timeout", t.batch_timeout),
            ("export_timeout", t.export_timeout),
        ] {
            if d.0.is_zero() {
                problems.error(format!("tracing.{key}"), "must be more than 0");
            }
        }
        if t.service_name.is_empty() {
            problems.error("tracing.service_name", "must not be empty");
        }
        if t.trust_incoming == TrustIncoming::TrustedProxies
            && cfg.identity.trusted_proxies.is_empty()
        {
            problems.warn(
                "tracing.trust_incoming",
                "identity.trusted_proxies is empty: no incoming trace is continued",
            );
        }
        let endpoint = endpoint(&t.endpoint, problems);
        let mut raw = Vec::new();
        for (name, value) in &t.headers {
            if t.headers_file.contains_key(name) {
                problems.error(
                    format!("tracing.headers_file.{name}"),
                    format!("{name:?} is also in tracing.headers: give one or the other"),
                );
            }
            raw.push((
                format!("tracing.headers.{name}"),
                name.clone(),
                value.clone(),
            ));
        }
        for name in t.headers_file.keys() {
            let at = format!("tracing.headers_file.{name}");
            if let Some(value) = crate::config::secrets::file_text(&at, files, problems) {
                raw.push((at, name.clone(), value));
            }
        }
        let mut headers = Vec::new();
        for (at, name, value) in &raw {
            match (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) {
                (Ok(n), Ok(mut v)) => {
                    v.set_sensitive(true);
                    headers.push((n, v));
                }
                (Err(_), _) => problems.error(at, format!("{name:?} is not a header name")),
                (_, Err(_)) => problems.error(at, "is not a valid header value"),
            }
        }
        let ca =
            t.ca.as_ref()
                .and_then(|_| files.bytes("tracing.ca", problems))
                .map(|(_, b)| b.to_vec());
        let tls = match &endpoint {
            Some((uri, _)) if uri.scheme_str() == Some("https") => {
                let named = crate::proxy::tls::ClientTlsFiles {
                    ca: t.ca.as_deref(),
                    roots: crate::config::TlsRoots::Webpki,
                    roots_key: "ca",
                    client_cert: None,
                    client_key: None,
                };
                named
                    .client_config("tracing", files, problems)
                    .map(|mut c| {
                        c.alpn_protocols = vec![b"http/1.1".to_vec()];
                        Arc::new(c)
                    })
            }
            _ => None,
        };
        if problems.errors.len() > before {
            return None;
        }
        let (uri, path) = endpoint?;
        let source = (
            t.clone(),
            raw.into_iter().map(|(_, n, v)| (n, v)).collect(),
            ca,
        );
        if let Some(prev) = previous.filter(|p| p.source == source) {
            return Some(prev.clone());
        }
        let authority = uri.authority()?;
        let exporter = export::Exporter {
            path,
            authority: HeaderValue::from_str(authority.as_str()).ok()?,
            host: authority.host().trim_matches(['[', ']']).to_string(),
            port: authority.port_u16().unwrap_or(match tls {
                Some(_) => 443,
                None => 80,
            }),
            tls,
            headers,
            service_name: t.service_name.clone(),
            batch_size: t.batch_size,
            batch_timeout: t.batch_timeout.0,
            export_timeout: t.export_timeout.0,
        };
        let (queue, rx) = mpsc::channel(t.queue_size);
        Some(Arc::new(Tracer {
            threshold: if t.sample_ratio >= 1.0 {
                u64::MAX
            } else {
                (t.sample_ratio * u64::MAX as f64) as u64
            },
            sample_refusals: t.sample_refusals,
            trust: t.trust_incoming,
            queue,
            pending: Mutex::new(Some((rx, Arc::new(exporter)))),
            dropped: OnceLock::new(),
            source,
        }))
    }

    /// Start the exporter's task on the current Tokio runtime (once; a tracer kept by
    /// a reload is running already). Outside a runtime nothing starts.
    pub fn start(&self, metrics: &crate::metrics::Metrics) {
        let _ = self.dropped.set(metrics.trace_spans_dropped("queue_full"));
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pending = self.pending.lock().ok().and_then(|mut p| p.take());
        if let Some((rx, exporter)) = pending {
            let counts = export::Counts {
                exported: metrics.trace_spans_exported.clone(),
                failed: metrics.trace_spans_dropped("export_failed"),
            };
            rt.spawn(export::run(exporter, rx, counts));
        }
    }

    /// Begin the trace of `req` from `peer`: continue the incoming context when the
    /// peer is trusted with it (`peer_trusted`: in `identity.trusted_proxies`), else
    /// start a new one; remove the incoming `traceparent` and `tracestate` (tollgate
    /// sends its own upstream).
    pub fn begin<B>(
        &self,
        req: &mut Request<B>,
        peer_trusted: impl FnOnce() -> bool,
    ) -> Box<Recording> {
        let continued = match self.trust {
            TrustIncoming::All => true,
            TrustIncoming::TrustedProxies => peer_trusted(),
            TrustIncoming::None => false,
        };
        let parent = context::take(req.headers_mut(), continued);
        let (trace_id, parent_id, sampled, state) = match parent {
            Some(p) => (p.trace_id, Some(p.span_id), p.sampled, p.state),
            None => {
                let id = context::new_trace_id();
                let low = u64::from_be_bytes(id[8..].try_into().unwrap_or([0; 8]));
                let sampled = self.threshold == u64::MAX || low < self.threshold;
                (id, None, sampled, None)
            }
        };
        let refusal_watch = !sampled && self.sample_refusals;
        Box::new(Recording {
            trace_id,
            span_id: context::new_span_id(),
            parent: parent_id,
            state,
            sampled,
            refusal_watch,
            start_ns: if sampled || refusal_watch {
                span::now_ns()
            } else {
                0
            },
            details: sampled.then(|| span::Details::of(req)),
        })
    }

    /// The span of a request that ended with `status`, as `log` saw it, when it is to be
    /// exported (sampled, or a refusal with `sample_refusals`): sent when the returned
    /// [`Finishing`] is dropped, with the response body.
    pub fn finish(
        self: &Arc<Self>,
        rec: &mut Recording,
        snap: &crate::proxy::Gate<'_>,
        log: &AccessLog,
        status: u16,
    ) -> Option<Box<Finishing>> {
        let refused = log.decision == Decision::Rejected;
        // A watched request's details exist only once the check refused it.
        if !(rec.sampled || refused) {
            return None;
        }
        let d = rec.details.take()?;
        let (client, tier, caller_hash) = match d.caller {
            Some(c) => (
                snap.log_client(c.ip),
                Some(c.tier),
                Some(snap.limiter.caller_hash(c.id.as_deref(), c.ip_key)),
            ),
            None => (None, None, None),
        };
        Some(Box::new(Finishing {
            span: Some(SpanData {
                trace_id: rec.trace_id,
                span_id: rec.span_id,
                parent: rec.parent,
                state: rec.state.take(),
                start_ns: rec.start_ns,
                end_ns: 0,
                method: d.method,
                uri: d.uri,
                host: d.host,
                route: log.route.clone(),
                status,
                client,
                decision: log.decision.as_str(),
                usage: log.usage.clone(),
                tier,
                caller_hash,
                cost: log.cost,
                check: d.check,
                charge: d.charge,
                upstream: d.upstream,
            }),
            tracer: self.clone(),
        }))
    }

    /// Queue `span` for export, or drop it and count its spans (the server span and its
    /// children) when the queue is full.
    fn send(&self, span: SpanData) {
        use mpsc::error::TrySendError;
        if let Err(TrySendError::Full(span) | TrySendError::Closed(span)) =
            self.queue.try_send(span)
        {
            if let Some(c) = self.dropped.get() {
                c.inc_by(span.count());
            }
        }
    }
}

/// A finished request's span, queued for export when dropped (kept with the response
/// body, so that the span ends when the response has been sent).
#[derive(Debug)]
pub struct Finishing {
    span: Option<SpanData>,
    tracer: Arc<Tracer>,
}

impl Drop for Finishing {
    fn drop(&mut self) {
        if let Some(mut span) = self.span.take() {
            span.end_ns = span::now_ns();
            self.tracer.send(span);
        }
    }
}

/// `tracing.endpoint` as a URI and the path POSTed to (`/v1/traces` for a URL
/// without one); errors recorded at `tracing.endpoint`.
fn endpoint(text: &str, problems: &mut Problems) -> Option<(Uri, Uri)> {
    let at = "tracing.endpoint";
    let uri: Uri = match text.parse() {
        Ok(u) => u,
        Err(e) => {
            problems.error(at, format!("{text:?} is not a URL: {e}"));
            return None;
        }
    };
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        problems.error(
            at,
            format!("{text:?}: expected an http:// or https:// URL with a host"),
        );
        return None;
    }
    let path = match uri.path_and_query().map(|p| p.as_str()) {
        None | Some("" | "/") => "/v1/traces",
        Some(p) => p,
    };
    Some((uri.clone(), path.parse().ok()?))
}
