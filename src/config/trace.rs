//! `[tracing]`: OpenTelemetry traces of every request, exported over OTLP/HTTP
//! (protobuf) to a collector (issue 49). Off by default; a reload applies every key.

use super::Dur;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `[tracing]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// Record and export a span per request. Default false: no header is read, added or
    /// removed for tracing, and nothing is recorded.
    pub enabled: bool,
    /// The collector's OTLP/HTTP endpoint, `http://` or `https://`. A URL without a
    /// path gets `/v1/traces`; one with a path is used as written. Default
    /// `http://127.0.0.1:4318`.
    pub endpoint: String,
    /// The share of new traces (those tollgate starts) that are sampled, 0.0 to 1.0
    /// (parent-based: a continued trace keeps its parent's sampled flag). Default 0.01.
    pub sample_ratio: f64,
    /// Export the span of every request refused with 429, sampled or not. Default true.
    pub sample_refusals: bool,
    /// Whose `traceparent` is continued: `"all"`, `"trusted_proxies"` (the peers in
    /// `identity.trusted_proxies`, the default) or `"none"`. Anyone else's is dropped and
    /// a new trace starts.
    pub trust_incoming: TrustIncoming,
    /// `service.name` of the spans. Default `"tollgate"`.
    pub service_name: String,
    /// Headers sent with every export (the collector's credentials), name → value.
    /// Default none.
    pub headers: BTreeMap<String, String>,
    /// Headers whose value is read from a file (name → path; resolved like other
    /// secret files, at every load and reload). A name may not also be in `headers`.
    pub headers_file: BTreeMap<String, String>,
    /// PEM file of the CA certificates an `https://` endpoint is verified with; default:
    /// the compiled-in Mozilla roots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    /// Finished spans waiting for export, at most; past it a span is dropped and counted
    /// in `tollgate_trace_spans_dropped_total` (a request never waits). Default 2048.
    pub queue_size: usize,
    /// Spans per export request, at most. Default 512.
    pub batch_size: usize,
    /// A batch is sent at the latest this long after its first span. Default 1 s.
    pub batch_timeout: Dur,
    /// One export request may take this long; a batch that fails is dropped and
    /// counted. Default 10 s.
    pub export_timeout: Dur,
}

impl Default for TracingConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            endpoint: "http://127.0.0.1:4318".into(),
            sample_ratio: 0.01,
            sample_refusals: true,
            trust_incoming: TrustIncoming::TrustedProxies,
            service_name: "tollgate".into(),
            headers: BTreeMap::new(),
            headers_file: BTreeMap::new(),
            ca: None,
            queue_size: 2048,
            batch_size: 512,
            batch_timeout: Dur::from_secs(1),
            export_timeout: Dur::from_secs(10),
        }
    }
}

/// `tracing.trust_incoming`: whose W3C trace context a request may continue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TrustIncoming {
    /// Every client's.
    All,
    /// The socket peers in `identity.trusted_proxies` (the default).
    #[default]
    TrustedProxies,
    /// Nobody's: every request starts a new trace.
    None,
}
