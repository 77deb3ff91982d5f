//! Prometheus metrics (`GET /metrics` on the admin listener), all named `tollgate_*`.
//!
//! Request-path metrics are recorded as requests pass. Store metrics (per shard and node:
//! calls, errors, timeouts, breaker state, latency; replica fallbacks; over-limit cache
//! hits) are read from the live store at scrape time by [`StoreCollector`], so nodes that
//! come and go (Sentinel replicas, a reload's new store) need no registration.

use crate::limiter::store::StoreStatus;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::sync::Arc;

pub use crate::limiter::store::redis::stats::{latency_histogram, LATENCY_BUCKETS};

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

/// Labels of `tollgate_delays_refused_total`.
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

/// `tollgate_requests_total`, counted through a per-thread memo of its rows
/// ([`RequestCounts::inc`]). Cloning it is cloning a reference to the same rows.
#[derive(Debug, Clone)]
pub struct RequestCounts {
    /// Which [`Metrics`] these rows belong to (unique in the process), for the memo.
    id: u64,
    family: Family<RequestLabels, Counter>,
}

/// How many rows of each memoised family a thread keeps handles to.
const MEMO_ROWS: usize = 32;

impl RequestCounts {
    /// Count one request of `route` answered with `status` after `decision`.
    ///
    /// A thread keeps handles to the last [`MEMO_ROWS`] rows it counted, found by
    /// comparing the labels (no hashing, no lock); a row it does not hold is looked up in
    /// the family (SipHash of the labels under the family's read lock) and kept.
    pub fn inc(&self, route: &Arc<str>, status: u16, decision: &'static str) {
        thread_local! {
            static ROWS: MemoRows<RequestLabels, Counter> = const { std::cell::RefCell::new(Vec::new()) };
        }
        count(
            &ROWS,
            self.id,
            &self.family,
            |l| l.status == status && l.decision == decision && l.route == *route,
            || RequestLabels {
                route: route.clone(),
                status,
                decision,
            },
        );
    }
}

/// `tollgate_upstream_latency_seconds`, observed through a per-thread memo of its rows
/// (as [`RequestCounts`]).
#[derive(Debug, Clone)]
pub struct UpstreamLatency {
    /// Which [`Metrics`] these rows belong to (unique in the process), for the memo.
    id: u64,
    family: Family<UpstreamLabels, Histogram, fn() -> Histogram>,
}

impl UpstreamLatency {
    /// Record that `upstream` took `seconds` to answer with its response head.
    pub fn observe(&self, upstream: &Arc<str>, seconds: f64) {
        thread_local! {
            static ROWS: std::cell::RefCell<Vec<(u64, Arc<str>, Histogram)>> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        ROWS.with(|rows| {
            held(
                &mut rows.borrow_mut(),
                self.id,
                |name| name == upstream,
                || {
                    let labels = UpstreamLabels {
                        upstream: upstream.clone(),
                    };
                    (upstream.clone(), self.family.get_or_create_owned(&labels))
                },
            )
            .observe(seconds);
        })
    }
}

/// `tollgate_rejections_total`, counted through a per-thread memo of its rows (as
/// [`RequestCounts`]): a 429 costs no hashing and no lock.
#[derive(Debug, Clone)]
pub struct RejectionCounts {
    /// Which [`Metrics`] these rows belong to (unique in the process), for the memo.
    id: u64,
    family: Family<RejectionLabels, Counter>,
}

impl RejectionCounts {
    /// Count one request refused with 429 by `limit` for a caller of `tier`.
    pub fn inc(&self, limit: &Arc<str>, tier: &Arc<str>) {
        thread_local! {
            static ROWS: MemoRows<RejectionLabels, Counter> = const { std::cell::RefCell::new(Vec::new()) };
        }
        count(
            &ROWS,
            self.id,
            &self.family,
            |l| l.limit == *limit && l.tier == *tier,
            || RejectionLabels {
                limit: limit.clone(),
                tier: tier.clone(),
            },
        );
    }
}

/// A thread's memo of one family's rows: per row, the gateway's id, the labels and the
/// row's handle.
type MemoRows<L, M> = std::cell::RefCell<Vec<(u64, L, M)>>;

/// Count one in the row of `family` (of gateway `id`) whose labels `matches`, through
/// the thread's memo `rows` ([`held`]); a row it does not hold is made from `labels`.
fn count<L>(
    rows: &'static std::thread::LocalKey<MemoRows<L, Counter>>,
    id: u64,
    family: &Family<L, Counter>,
    matches: impl Fn(&L) -> bool,
    labels: impl FnOnce() -> L,
) where
    L: Clone + std::hash::Hash + Eq,
{
    rows.with(|rows| {
        held(&mut rows.borrow_mut(), id, matches, || {
            let labels = labels();
            let counter = family.get_or_create_owned(&labels);
            (labels, counter)
        })
        .inc();
    })
}

/// The handle to the row of gateway `id` whose labels `matches` in a thread's memo
/// `rows`, or a new one from `make` (looked up in the family), kept in place of the
/// oldest when the memo holds [`MEMO_ROWS`].
fn held<L, M>(
    rows: &mut Vec<(u64, L, M)>,
    id: u64,
    matches: impl Fn(&L) -> bool,
    make: impl FnOnce() -> (L, M),
) -> &M {
    if let Some(i) = rows.iter().position(|(i, l, _)| *i == id && matches(l)) {
        return &rows[i].2;
    }
    let (labels, m) = make();
    if rows.len() == MEMO_ROWS {
        rows.remove(0);
    }
    rows.push((id, labels, m));
    &rows[rows.len() - 1].2
}

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
            tls_certs_shown: std::sync::Mutex::default(),
        })
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

/// Where the store metrics come from at scrape time: the over-limit cache's hits and
/// the current store (`None` once the gateway is gone).
pub type StoreSource = Box<dyn Fn() -> Option<(u64, Arc<dyn StoreStatus>)> + Send + Sync>;

/// Reads the store's counters at scrape time.
struct StoreCollector {
    store: StoreSource,
}

impl std::fmt::Debug for StoreCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreCollector").finish_non_exhaustive()
    }
}

type Labels = Vec<(&'static str, String)>;

fn counter_family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, u64)],
) -> std::fmt::Result {
    let mut me = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        if labels.is_empty() {
            // No `{}` after the name.
            ConstCounter::new(*v).encode(me)?;
            return Ok(());
        }
        ConstCounter::new(*v).encode(me.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauge_family(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, i64)],
) -> std::fmt::Result {
    let mut me = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(me.encode_family(labels)?)?;
    }
    Ok(())
}

impl prometheus_client::collector::Collector for StoreCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let Some((cache_hits, store)) = (self.store)() else {
            return Ok(());
        };
        counter_family(
            &mut enc,
            "local_cache_hits",
            "Requests answered 429 from the over-limit cache without a store call",
            &[(vec![], cache_hits)],
        )?;
        let report = store.report();
        if report.is_empty() {
            return Ok(());
        }
        let node_labels = |s: usize, n: &crate::limiter::store::redis::NodeReport| {
            vec![
                ("shard", s.to_string()),
                ("role", n.role.to_string()),
                ("node", n.addr.clone()),
            ]
        };
        let mut calls = Vec::new();
        let mut errors = Vec::new();
        let mut timeouts = Vec::new();
        let mut fast_fails = Vec::new();
        let mut changes = Vec::new();
        let mut state = Vec::new();
        let mut up = Vec::new();
        let mut serving = Vec::new();
        let mut fallbacks = Vec::new();
        let mut writable = Vec::new();
        for shard in &report {
            fallbacks.push((
                vec![("shard", shard.index.to_string())],
                shard.replica_fallbacks,
            ));
            writable.push((
                vec![("shard", shard.index.to_string())],
                i64::from(shard.writable),
            ));
            for n in &shard.nodes {
                let l = node_labels(shard.index, n);
                calls.push((l.clone(), n.counts.calls));
                errors.push((l.clone(), n.counts.errors));
                timeouts.push((l.clone(), n.counts.timeouts));
                fast_fails.push((l.clone(), n.counts.rejected_by_breaker));
                changes.push((l.clone(), n.counts.breaker_changes));
                let s = match n.breaker {
                    crate::limiter::store::redis::BreakerState::Closed => 0,
                    crate::limiter::store::redis::BreakerState::HalfOpen => 1,
                    crate::limiter::store::redis::BreakerState::Open => 2,
                };
                state.push((l.clone(), s));
                serving.push((l.clone(), i64::from(n.serving)));
                up.push((l, i64::from(n.connected)));
            }
        }
        counter_family(
            &mut enc,
            "store_calls",
            "Store calls per Redis node",
            &calls,
        )?;
        counter_family(
            &mut enc,
            "store_errors",
            "Store calls that failed with an error",
            &errors,
        )?;
        counter_family(
            &mut enc,
            "store_timeouts",
            "Store calls that exceeded store.timeout",
            &timeouts,
        )?;
        counter_family(
            &mut enc,
            "store_breaker_rejections",
            "Store calls refused by an open breaker",
            &fast_fails,
        )?;
        counter_family(
            &mut enc,
            "store_breaker_changes",
            "Circuit breaker state changes",
            &changes,
        )?;
        counter_family(
            &mut enc,
            "store_replica_fallbacks",
            "Checks meant for a replica answered by the primary",
            &fallbacks,
        )?;
        gauge_family(
            &mut enc,
            "store_breaker_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open",
            &state,
        )?;
        gauge_family(
            &mut enc,
            "store_connected",
            "1 when the node has a live connection",
            &up,
        )?;
        gauge_family(
            &mut enc,
            "store_serving",
            "0 while the node answers LOADING or MASTERDOWN (a replica is then skipped for reads)",
            &serving,
        )?;
        gauge_family(
            &mut enc,
            "store_shard_writable",
            "0 while writes to the shard's primary fail (its checks then follow store.on_error)",
            &writable,
        )?;
        let mut me = enc.encode_descriptor(
            "store_latency_seconds",
            "Store call latency per Redis node",
            None,
            MetricType::Histogram,
        )?;
        for shard in &report {
            for n in &shard.nodes {
                n.latency
                    .encode(me.encode_family(&node_labels(shard.index, n))?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count_of(m: &Metrics, route: &str, status: u16) -> Option<String> {
        let line = format!("tollgate_requests_total{{route=\"{route}\",status=\"{status}\",decision=\"allowed\"}} ");
        m.render()
            .lines()
            .find_map(|l| l.strip_prefix(&line).map(str::to_string))
    }

    #[test]
    fn memoised_rows_count_into_their_own_gateway() {
        let (a, b) = (
            Metrics::new(Box::new(|| None)),
            Metrics::new(Box::new(|| None)),
        );
        let routes: Vec<Arc<str>> = (0..MEMO_ROWS + 8)
            .map(|i| format!("/r{i}").into())
            .collect();
        // More rows than the memo holds, each counted twice on `a`, once on `b`, and
        // interleaved so that rows leave the memo and come back.
        for _ in 0..2 {
            for r in &routes {
                a.requests.inc(r, 200, "allowed");
            }
        }
        for r in &routes {
            b.requests.inc(r, 200, "allowed");
        }
        a.requests.inc(&routes[0], 404, "allowed");
        for (i, r) in routes.iter().enumerate() {
            assert_eq!(count_of(&a, r, 200).as_deref(), Some("2"), "route {i} on a");
            assert_eq!(count_of(&b, r, 200).as_deref(), Some("1"), "route {i} on b");
        }
        assert_eq!(count_of(&a, "/r0", 404).as_deref(), Some("1"));
        assert_eq!(count_of(&b, "/r0", 404), None);

        let up: Arc<str> = "api".into();
        a.upstream_latency.observe(&up, 0.002);
        a.upstream_latency.observe(&up, 0.004);
        b.upstream_latency.observe(&up, 0.002);
        let count = |m: &Metrics| {
            m.render().lines().find_map(|l| {
                l.strip_prefix("tollgate_upstream_latency_seconds_count{upstream=\"api\"} ")
                    .map(str::to_string)
            })
        };
        assert_eq!(count(&a).as_deref(), Some("2"));
        assert_eq!(count(&b).as_deref(), Some("1"));
    }
}
