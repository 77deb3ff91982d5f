//! Prometheus metrics (`GET /metrics` on the admin listener), all named `tollgate_*`.
//!
//! Request-path metrics are recorded as requests pass (the busiest through per-thread
//! memos of their rows, [`RequestCounts`]). Store metrics (over-limit cache hits, and the
//! store's own families: per shard and node calls, errors, timeouts, breaker state,
//! latency, replica fallbacks) are read from the live store at scrape time by
//! [`StoreCollector`], so nodes that come and go (Sentinel replicas, a reload's new
//! store) need no registration.

mod labels;
mod rows;

pub use crate::limiter::store::status::{latency_histogram, LATENCY_BUCKETS};
pub use labels::{
    AuthLabels, DelayRefusalLabels, RefusalLabels, RejectionLabels, ReloadLabels, RequestLabels,
    TlsCertLabels, UpstreamLabels, WorkerLabels,
};
pub use rows::{RejectionCounts, RequestCounts, UpstreamLatency};

use crate::limiter::store::StoreStatus;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// Every metric of one gateway.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests by route, status and decision.
    pub requests: RequestCounts,
    /// Time from forwarding a request until the upstream's response headers, seconds.
    pub upstream_latency: UpstreamLatency,
    /// Config reloads by result.
    pub reloads: Family<ReloadLabels, Counter>,
    /// `tollgate_auth_requests_total{result}`: callouts to `[identity.auth_request]`.
    pub auth_requests: Family<AuthLabels, Counter>,
    /// `tollgate_auth_request_duration_seconds`: how long callouts took (as the request
    /// that made one waited), seconds.
    pub auth_latency: Histogram,
    /// `tollgate_auth_cache_bytes`: what the answers cached by `[identity.auth_request]`
    /// are counted as (`identity.auth_request.cache_max_bytes`), bytes; set as callouts
    /// are asked.
    pub auth_cache_bytes: Gauge,
    /// 429s by limit and tier.
    pub rejections: RejectionCounts,
    /// `tollgate_shadow_rejections_total{limit, tier}`: requests a limit in shadow mode
    /// (or outside its `enforce_percent`) would have refused, and let through.
    pub shadow_rejections: Family<RejectionLabels, Counter>,
    /// Generation of the active config (1 at start, +1 per successful reload).
    pub config_generation: Gauge,
    /// Requests being served now.
    pub in_flight: Gauge,
    /// Open client connections on the proxy listener, tunnelled ones included.
    pub open_connections: Gauge,
    /// `tollgate_delayed_requests`: requests held by `on_limit = "delay"` now.
    pub delayed_requests: Gauge,
    /// `tollgate_delays_refused_total{reason}`: requests a limit would have delayed that
    /// got 429 at once, because `server.max_delayed` or the limit's `max_waiting`
    /// requests were already held.
    pub delays_refused: Family<DelayRefusalLabels, Counter>,
    /// Open upstream sockets: in use, idle in a pool, or one end of a tunnel.
    pub upstream_connections: Gauge,
    /// Open tunnels (WebSockets), at most `server.max_tunnels`.
    pub open_tunnels: Gauge,
    /// `tollgate_auth_request_connections`: open sockets to `[identity.auth_request]`'s
    /// service (carrying a callout or idle for the next), counted in the descriptor budget.
    pub auth_connections: Gauge,
    /// `tollgate_auth_request_callouts`: callouts to `[identity.auth_request]` under way
    /// (abandoned ones included until they end), at most
    /// `identity.auth_request.max_concurrent`.
    pub auth_callouts: Gauge,
    /// Connections, upstream sockets and upgrades refused with 503 because a budget was
    /// spent, by what was spent.
    pub overload_refusals: Family<RefusalLabels, Counter>,
    /// `tollgate_worker_connections_total{worker}`: client connections each `per_core`
    /// worker accepted from its listener (refused ones included); none with the
    /// `multi_thread` runtime.
    pub worker_connections: Family<WorkerLabels, Counter>,
    /// `tollgate_tls_cert_not_after_seconds{cert, sni}`: when each certificate the proxy
    /// listener serves expires, UTC epoch seconds; set at start and by every reload (see
    /// [`Metrics::set_tls_certs`]). No rows without `[server.tls]`.
    pub tls_cert_not_after: Family<TlsCertLabels, Gauge>,
    /// `tollgate_trace_spans_exported_total`: spans the collector accepted (`[tracing]`).
    pub trace_spans_exported: Counter,
    /// `tollgate_trace_spans_dropped_total{reason}`: spans not exported, because the
    /// queue was full (`queue_full`) or their batch failed (`export_failed`).
    trace_spans_dropped: Family<DelayRefusalLabels, Counter>,
    /// The rows [`Metrics::set_tls_certs`] set last.
    tls_certs_shown: std::sync::Mutex<Vec<TlsCertLabels>>,
}

impl Metrics {
    /// A registry with every metric registered; store metrics are read at scrape time
    /// from what `store` answers (the over-limit cache's hits and the current store).
    pub fn new(store: StoreSource) -> Arc<Self> {
        let mut registry = Registry::with_prefix("tollgate");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests by route, status and limiting decision",
            requests.clone(),
        );
        let upstream_latency =
            Family::<UpstreamLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                latency_histogram,
            );
        registry.register(
            "upstream_latency_seconds",
            "Time until the upstream's response headers",
            upstream_latency.clone(),
        );
        let rejections = Family::<RejectionLabels, Counter>::default();
        registry.register(
            "rejections",
            "Requests refused with 429, by limit and caller tier",
            rejections.clone(),
        );
        let shadow_rejections = Family::<RejectionLabels, Counter>::default();
        registry.register(
            "shadow_rejections",
            "Requests a limit in shadow mode would have refused with 429 and let through, by limit and caller tier",
            shadow_rejections.clone(),
        );
        let reloads = Family::<ReloadLabels, Counter>::default();
        registry.register("reloads", "Config reloads by result", reloads.clone());
        let auth_requests = Family::<AuthLabels, Counter>::default();
        registry.register(
            "auth_requests",
            "Callouts to identity.auth_request, by result",
            auth_requests.clone(),
        );
        let auth_latency = latency_histogram();
        registry.register(
            "auth_request_duration_seconds",
            "How long callouts to identity.auth_request took",
            auth_latency.clone(),
        );
        let auth_cache_bytes = Gauge::default();
        registry.register(
            "auth_cache_bytes",
            "Bytes of the answers cached by identity.auth_request",
            auth_cache_bytes.clone(),
        );
        let config_generation = Gauge::default();
        registry.register(
            "config_generation",
            "Generation of the active config",
            config_generation.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "in_flight_requests",
            "Requests being served",
            in_flight.clone(),
        );
        let open_connections = Gauge::default();
        registry.register(
            "open_connections",
            "Open client connections, tunnelled ones included",
            open_connections.clone(),
        );
        let delayed_requests = Gauge::default();
        registry.register(
            "delayed_requests",
            "Requests held by on_limit = \"delay\" (at most server.max_delayed)",
            delayed_requests.clone(),
        );
        let delays_refused = Family::<DelayRefusalLabels, Counter>::default();
        for reason in ["max_delayed", "max_waiting"] {
            let _ = delays_refused.get_or_create(&DelayRefusalLabels { reason });
        }
        registry.register(
            "delays_refused",
            "Requests a limit would have delayed that got 429 at once, by the bound that was full",
            delays_refused.clone(),
        );
        let upstream_connections = Gauge::default();
        registry.register(
            "upstream_connections",
            "Open upstream sockets: in use, idle in a pool, or one end of a tunnel",
            upstream_connections.clone(),
        );
        let auth_connections = Gauge::default();
        registry.register(
            "auth_request_connections",
            "Open sockets to the auth service of identity.auth_request, in the descriptor budget",
            auth_connections.clone(),
        );
        let auth_callouts = Gauge::default();
        registry.register(
            "auth_request_callouts",
            "Callouts to the auth service of identity.auth_request under way",
            auth_callouts.clone(),
        );
        let open_tunnels = Gauge::default();
        registry.register(
            "open_tunnels",
            "Open tunnels (WebSockets)",
            open_tunnels.clone(),
        );
        let overload_refusals = Family::<RefusalLabels, Counter>::default();
        // Every budget's row from the start, at 0: an alert on its rate sees the first
        // refusal, and a dashboard shows the row before anything is refused.
        for limit in [
            "max_connections",
            "max_connections_per_ip",
            "descriptors",
            "max_tunnels",
            "descriptor_share_per_ip",
        ] {
            let _ = overload_refusals.get_or_create(&RefusalLabels { limit });
        }
        registry.register(
            "overload_refusals",
            "Connections, upstream sockets and upgrades refused with 503 because a budget was spent, by what was spent",
            overload_refusals.clone(),
        );
        let worker_connections = Family::<WorkerLabels, Counter>::default();
        registry.register(
            "worker_connections",
            "Client connections each per_core worker accepted from its listener, refused ones included",
            worker_connections.clone(),
        );
        let tls_cert_not_after = Family::<TlsCertLabels, Gauge>::default();
        registry.register(
            "tls_cert_not_after_seconds",
            "When each certificate the proxy listener serves expires (notAfter), UTC epoch seconds",
            tls_cert_not_after.clone(),
        );
        let trace_spans_exported = Counter::default();
        registry.register(
            "trace_spans_exported",
            "Trace spans the OpenTelemetry collector accepted",
            trace_spans_exported.clone(),
        );
        let trace_spans_dropped = Family::<DelayRefusalLabels, Counter>::default();
        for reason in ["queue_full", "export_failed"] {
            let _ = trace_spans_dropped.get_or_create(&DelayRefusalLabels { reason });
        }
        registry.register(
            "trace_spans_dropped",
            "Trace spans not exported: the export queue was full (queue_full) or their batch failed (export_failed)",
            trace_spans_dropped.clone(),
        );
        registry.register_collector(Box::new(StoreCollector { store }));
        // Unique per `Metrics` in the process (a test runs several gateways), so that
        // the per-thread memos never hand one gateway's rows to another.
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Arc::new(Self {
            registry,
            requests: RequestCounts {
                id,
                family: requests,
            },
            upstream_latency: UpstreamLatency {
                id,
                family: upstream_latency,
            },
            reloads,
            auth_requests,
            auth_latency,
            auth_cache_bytes,
            rejections: RejectionCounts {
                id,
                family: rejections,
            },
            shadow_rejections,
            config_generation,
            in_flight,
            open_connections,
            delayed_requests,
            delays_refused,
            upstream_connections,
            open_tunnels,
            auth_connections,
            auth_callouts,
            overload_refusals,
            worker_connections,
            tls_cert_not_after,
            trace_spans_exported,
            trace_spans_dropped,
            tls_certs_shown: std::sync::Mutex::default(),
        })
    }

    /// The row of `tollgate_trace_spans_dropped_total` for `reason` (`queue_full` or
    /// `export_failed`).
    pub fn trace_spans_dropped(&self, reason: &'static str) -> Counter {
        self.trace_spans_dropped
            .get_or_create(&DelayRefusalLabels { reason })
            .clone()
    }

    /// Make `tollgate_tls_cert_not_after_seconds` show the certificates of `tls` (the
    /// running snapshot's) and no others: called at start and after every reload that
    /// swapped a snapshot in.
    pub fn set_tls_certs(&self, tls: Option<&crate::tls::Tls>) {
        let rows = tls.map(|t| t.expiries()).unwrap_or_default();
        let wanted: Vec<TlsCertLabels> = rows
            .iter()
            .map(|e| TlsCertLabels {
                cert: e.cert.clone(),
                sni: e.sni.clone(),
            })
            .collect();
        // Set the rows served now, then drop those of certificates no longer served (a
        // scrape in between sees a kept row's old or new value, never a missing one).
        let mut shown = self
            .tls_certs_shown
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for (labels, e) in wanted.iter().zip(rows) {
            self.tls_cert_not_after
                .get_or_create(labels)
                .set(e.not_after);
        }
        for old in shown.iter().filter(|l| !wanted.contains(l)) {
            self.tls_cert_not_after.remove(old);
        }
        *shown = wanted;
    }

    /// The `server.max_delayed` budget of `max` held requests, counted in
    /// `tollgate_delayed_requests` and `tollgate_delays_refused_total`.
    pub fn delay_budget(&self, max: usize) -> crate::limiter::delayed::DelayBudget {
        crate::limiter::delayed::DelayBudget::new(max, self.delayed_requests.clone(), |why| {
            self.delays_refused
                .get_or_create(&DelayRefusalLabels {
                    reason: why.label(),
                })
                .clone()
        })
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Where the store metrics come from at scrape time (`None` once the gateway is gone).
pub type StoreSource = Box<dyn Fn() -> Option<StoreMetrics> + Send + Sync>;

/// What [`StoreSource`] answers at scrape time.
pub struct StoreMetrics {
    /// The over-limit cache's hits (`tollgate_local_cache_hits_total`).
    pub cache_hits: u64,
    /// Blocks started by this gateway's refusals, by limit (`tollgate_blocked_total`).
    pub blocks_started: Vec<(Arc<str>, u64)>,
    /// The current store.
    pub store: Arc<dyn StoreStatus>,
}

/// Reads the over-limit cache's hits, the blocks started and the store's own families
/// ([`StoreStatus::encode_metrics`]) at scrape time.
struct StoreCollector {
    store: StoreSource,
}

impl std::fmt::Debug for StoreCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreCollector").finish_non_exhaustive()
    }
}

impl prometheus_client::collector::Collector for StoreCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let Some(StoreMetrics {
            cache_hits,
            blocks_started,
            store,
        }) = (self.store)()
        else {
            return Ok(());
        };
        let me = enc.encode_descriptor(
            "local_cache_hits",
            "Requests answered 429 from the over-limit cache without a store call",
            None,
            MetricType::Counter,
        )?;
        // No labels: no `{}` after the name.
        ConstCounter::new(cache_hits).encode(me)?;
        let mut me = enc.encode_descriptor(
            "blocked",
            "Blocks started by this gateway's refusals of limits with block_for, by limit (a refusal while a block is on is not counted)",
            None,
            MetricType::Counter,
        )?;
        for (limit, n) in &blocks_started {
            let labels = [("limit", &**limit)];
            ConstCounter::new(*n).encode(me.encode_family(&labels)?)?;
        }
        store.encode_metrics(&mut enc)
    }
}
