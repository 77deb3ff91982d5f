//! The label sets of the metric families recorded as requests pass.

use prometheus_client::encoding::EncodeLabelSet;
use std::sync::Arc;

/// Labels of `tollgate_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The route's path prefix (`"none"` when no route matched).
    pub route: Arc<str>,
    /// The response status.
    pub status: u16,
    /// `allowed`, `rejected`, `shadow_rejected`, `store_error_allowed`,
    /// `store_error_denied`, `unauthenticated` (401) or `no_route` (404).
    pub decision: &'static str,
}

/// Labels of per-upstream metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    /// The upstream's name.
    pub upstream: Arc<str>,
}

/// Labels of `tollgate_rejections_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectionLabels {
    /// The limit that refused (`X-RateLimit-Resource`).
    pub limit: Arc<str>,
    /// The caller's tier.
    pub tier: Arc<str>,
}

/// Labels of `tollgate_delays_refused_total` (and `tollgate_trace_spans_dropped_total`,
/// whose reasons are `queue_full` and `export_failed`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DelayRefusalLabels {
    /// `max_delayed` (the gateway held `server.max_delayed` requests) or `max_waiting`
    /// (the limit held `max_waiting` requests of the same subject).
    pub reason: &'static str,
}

/// Labels of `tollgate_reloads_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    /// `ok` or `failed`.
    pub result: &'static str,
}

/// Labels of `tollgate_auth_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AuthLabels {
    /// `allowed` (a 2xx naming a caller), `refused` (401/403), `rejected` (another 4xx:
    /// this request could not be judged), `error` (another status, an unusable answer,
    /// or no connection), `timeout`, or `breaker_open` (not called).
    pub result: &'static str,
}

/// Labels of `tollgate_overload_refusals_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    /// What was spent: `max_connections` (a client connection answered 503),
    /// `max_connections_per_ip` (a client connection from an address that has
    /// `server.max_connections_per_ip` open: 503),
    /// `descriptors` (a client connection or an upstream socket that did not fit the
    /// descriptor budget: 503), `max_tunnels` (an upgrade answered 503) or
    /// `descriptor_share_per_ip` (a client connection, 503, or a request, 429, from an
    /// address that holds its share of the descriptor budget).
    pub limit: &'static str,
}

/// Labels of `tollgate_worker_connections_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    /// The `per_core` worker's index, from 0 to `server.workers` - 1.
    pub worker: u32,
}

/// Labels of `tollgate_tls_cert_not_after_seconds`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TlsCertLabels {
    /// The certificate file, resolved against the config file's directory.
    pub cert: String,
    /// `default` (`server.tls.cert`) or the `[[server.tls.sni]]` host.
    pub sni: String,
}
