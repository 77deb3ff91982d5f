//! The request id, the access log line and the request metrics of one request.
//!
//! One line per request on the `tollgate::access` target: method, path, route, status,
//! client (the IP, its keyed hash, or nothing: `log.client_ip`), caller id (`anonymous`
//! without a key, `-` for a key that matched no client; never a raw key), tier, decision,
//! limit, remaining, cost (units charged), uncharged (why a forwarded request was not
//! charged), upstream ms, total ms and request id, and with `[tracing]` on, the trace
//! and server span ids. The
//! subscriber's timestamp is when the line is written (the response's end), so the
//! request began `total_ms` before it: `tollgate replay` reads these lines.

use super::Body;
use crate::limiter::Usage;
use crate::metrics::{Metrics, RequestCounts};
use crate::otel::context::Hex;
use http::{HeaderName, HeaderValue, Method, Request, Response};
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// The header that carries the request id, in both directions.
pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The limiting decision of a request, as logged and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Every limit admitted it (or none applied).
    Allowed,
    /// A limit rejected it (429).
    Rejected,
    /// A limit in shadow mode (or outside its `enforce_percent`) would have rejected it;
    /// it was let through.
    ShadowRejected,
    /// Answered by the rate-limit endpoint (`rate_limit_endpoint.path`).
    RateLimitStatus,
    /// The store failed and `on_error = "allow"` let it through unlimited.
    StoreErrorAllowed,
    /// The store failed and `on_error = "deny"` answered 503.
    StoreErrorDenied,
    /// The limits' Redis shard failed and `on_error = "local"` decided it (admitted or
    /// 429) in this gateway's memory, by its share of each quota.
    Local,
    /// An unknown API key (401).
    Unauthenticated,
    /// No route matched (404).
    NoRoute,
    /// The request body was larger than the route allows (413); not charged.
    TooLarge,
    /// A malformed request (400: bad path escape, bad Host), answered before anything
    /// else.
    BadRequest,
    /// A TLS request whose host another certificate than its connection's is for (421),
    /// answered before anything else.
    Misdirected,
    /// An `OPTIONS` or `TRACE` with `Max-Forwards: 0`, answered by the gateway as the
    /// last hop (RFC 9110 §7.6.2); not forwarded, not charged.
    LastHop,
}

impl Decision {
    /// The label value.
    pub fn as_str(&self) -> &'static str {
        match self {
            Decision::Allowed => "allowed",
            Decision::Rejected => "rejected",
            Decision::ShadowRejected => "shadow_rejected",
            Decision::RateLimitStatus => "rate_limit_status",
            Decision::StoreErrorAllowed => "store_error_allowed",
            Decision::StoreErrorDenied => "store_error_denied",
            Decision::Local => "local",
            Decision::Unauthenticated => "unauthenticated",
            Decision::NoRoute => "no_route",
            Decision::TooLarge => "too_large",
            Decision::BadRequest => "bad_request",
            Decision::Misdirected => "misdirected",
            Decision::LastHop => "last_hop",
        }
    }
}

/// What is known about a request as it passes; logged and counted at the end.
#[derive(Debug)]
pub struct AccessLog {
    /// When the request started, for the line's `total_ms`; `None` when access lines
    /// were off as it started, so that what only they need is not kept (nor the clock
    /// read: 25 to 35 ns on the VMs measured here, about 1% of the gateway's own work
    /// per request).
    started: Option<Instant>,
    method: Method,
    path: String,
    request_id: HeaderValue,
    /// The client as logged (`log.client_ip`); `None` when not logged.
    pub client: Option<String>,
    /// The matched route's path prefix.
    pub route: Option<Arc<str>>,
    /// The client id; `None` for anonymous callers.
    pub caller: Option<Arc<str>>,
    /// The caller's tier, when known and lines are written ([`AccessLog::set_tier`]).
    tier: Option<Arc<str>>,
    /// Units charged to the request's limits (the route's `cost` or the upstream's cost
    /// header); 0 when nothing was charged.
    pub cost: u64,
    /// Why a forwarded request was not charged (`None`: charged, or not forwarded).
    pub uncharged: Option<Uncharged>,
    /// The label of the API key presented (keys file `"label"`), never the key.
    pub key_label: Option<Arc<str>>,
    /// The decision.
    pub decision: Decision,
    /// The usage reported in the headers.
    pub usage: Option<Usage>,
    upstream_ms: Option<f64>,
    /// `tollgate_requests_total`, where the request is counted when it ends.
    requests: RequestCounts,
    /// Finished ([`AccessLog::finish`]): counted, and its line written or not wanted.
    done: bool,
    /// The request's trace (`[tracing]`); `None` when tracing is off. Its ids are
    /// logged as `trace_id` and `span_id`.
    pub trace: Option<Box<crate::otel::span::Recording>>,
}

/// The status logged and counted for a request whose client went away before the
/// response (closed the connection, or reset its HTTP/2 stream): nginx's 499.
pub const CLIENT_CLOSED: u16 = 499;

impl Drop for AccessLog {
    /// A request dropped before [`AccessLog::finish`]: its client went away. Count it
    /// and log it with status 499, so that no forwarded request goes unseen.
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let route = self.count(CLIENT_CLOSED);
        if enabled() {
            write_line(self, &route, CLIENT_CLOSED);
        }
    }
}

impl AccessLog {
    /// Start timing `req`; give it a request id (kept from the client when it sent a
    /// sane one, else a new UUID) that is forwarded upstream.
    pub fn start<B>(req: &mut Request<B>, metrics: &Metrics) -> Self {
        let sane = |v: &HeaderValue| {
            !v.is_empty() && v.len() <= 200 && v.as_bytes().iter().all(|b| b.is_ascii_graphic())
        };
        // One lookup for both the client's id and ours; the request keeps one value.
        let request_id = match req.headers_mut().entry(&REQUEST_ID) {
            http::header::Entry::Occupied(mut o) => {
                let id = Some(o.get().clone())
                    .filter(sane)
                    .unwrap_or_else(new_request_id);
                o.insert(id.clone());
                id
            }
            http::header::Entry::Vacant(v) => v.insert(new_request_id()).clone(),
        };
        // The path only (a query string may carry secrets), and only when the line is
        // written at all.
        let lines = enabled();
        let path = if lines {
            req.uri().path().to_string()
        } else {
            String::new()
        };
        Self {
            started: lines.then(Instant::now),
            method: req.method().clone(),
            path,
            request_id,
            client: None,
            route: None,
            caller: None,
            tier: None,
            cost: 0,
            uncharged: None,
            key_label: None,
            decision: Decision::Allowed,
            usage: None,
            upstream_ms: None,
            requests: metrics.requests.clone(),
            done: false,
            trace: None,
        }
    }

    /// Log the caller's `tier` (kept only when lines are written: no shared reference
    /// count touched per request otherwise).
    pub fn set_tier(&mut self, tier: &Arc<str>) {
        if self.started.is_some() {
            self.tier = Some(tier.clone());
        }
    }

    /// The request id, as sent upstream and returned.
    pub fn request_id(&self) -> &HeaderValue {
        &self.request_id
    }

    /// The upstream call that began at `started` has answered (or failed): time it into
    /// the upstream latency histogram and the log line. (Not a wrapper around the call's
    /// future: that would move the large forwarding future once more per request.)
    pub fn upstream_took(&mut self, upstream: &Arc<str>, metrics: &Metrics, started: Instant) {
        let elapsed = started.elapsed();
        metrics
            .upstream_latency
            .observe(upstream, elapsed.as_secs_f64());
        self.upstream_ms = Some(elapsed.as_secs_f64() * 1000.0);
    }

    /// Put the request id on the response and count the request; the log line is
    /// written when the returned [`AccessLine`] is dropped (with the response body, so
    /// that `total_ms` covers the whole response). `None` when access lines are off, or
    /// were when the request started.
    pub fn finish(mut self, response: &mut Response<Body>) -> Option<AccessLine> {
        self.done = true;
        response
            .headers_mut()
            .insert(REQUEST_ID.clone(), self.request_id.clone());
        let status = response.status().as_u16();
        let route = self.count(status);
        (self.started.is_some() && enabled()).then(|| AccessLine {
            log: self,
            route,
            status,
        })
    }

    /// Note something on the request's trace (`[tracing]`); nothing when it has none.
    #[inline]
    pub fn traced(&mut self, note: impl FnOnce(&mut crate::otel::span::Recording)) {
        if let Some(trace) = self.trace.as_deref_mut() {
            note(trace);
        }
    }

    /// The span of this request, answered with `status`, for `tracer` to export when
    /// it is sampled (or a refusal it exports): see [`crate::otel::Tracer::finish`].
    pub fn trace_end(
        &mut self,
        tracer: &Arc<crate::otel::Tracer>,
        snap: &super::Gate<'_>,
        status: u16,
    ) -> Option<Box<crate::otel::Finishing>> {
        let mut rec = self.trace.take()?;
        let span = tracer.finish(&mut rec, snap, self, status);
        self.trace = Some(rec);
        span
    }

    /// Count the request in `tollgate_requests_total`, answered with `status`; return its
    /// `route` label (`none` when no route matched).
    fn count(&self, status: u16) -> Arc<str> {
        let route = self
            .route
            .clone()
            .unwrap_or_else(|| NO_ROUTE.with(Arc::clone));
        self.requests.inc(&route, status, self.decision.as_str());
        route
    }
}

/// A finished request's access line, written when dropped: when its response body has
/// been sent, has failed, or the client went away.
#[derive(Debug)]
pub struct AccessLine {
    log: AccessLog,
    route: Arc<str>,
    status: u16,
}

impl Drop for AccessLine {
    fn drop(&mut self) {
        write_line(&self.log, &self.route, self.status);
    }
}

/// Access lines written per second for each kind of request refused before it reached
/// an upstream (401, 400, 404, 413, 429): past it, lines of that kind are held back and
/// counted, and the next one written says how many were (`held_back`). Metrics count
/// every request.
pub const REFUSED_LINES_PER_SECOND: u64 = 100;

/// The line budget of a decision that refuses a request before the upstream; `None` for
/// requests that were forwarded (or answered by the gateway on purpose).
fn refused_budget(decision: Decision) -> Option<&'static crate::logging::Budget> {
    use crate::logging::Budget;
    static BUDGETS: [Budget; 5] = [
        Budget::new(),
        Budget::new(),
        Budget::new(),
        Budget::new(),
        Budget::new(),
    ];
    let i = match decision {
        Decision::Unauthenticated => 0,
        Decision::BadRequest => 1,
        Decision::NoRoute => 2,
        Decision::TooLarge => 3,
        Decision::Rejected => 4,
        _ => return None,
    };
    Some(&BUDGETS[i])
}

/// Write the access line of `this`, answered with `status` on `route` (within
/// [`REFUSED_LINES_PER_SECOND`] for refused requests).
fn write_line(this: &AccessLog, route: &str, status: u16) {
    // A 429 decided by `store.on_error = "local"` shares the 429s' budget.
    let refused = match this.decision {
        Decision::Local if status == 429 => Decision::Rejected,
        d => d,
    };
    if let Some(budget) = refused_budget(refused) {
        match budget.take(REFUSED_LINES_PER_SECOND) {
            None => return,
            Some(0) => {}
            Some(held_back) => tracing::warn!(
                target: "tollgate::access",
                decision = this.decision.as_str(),
                held_back,
                "access lines held back: more than {REFUSED_LINES_PER_SECOND} a second of this decision"
            ),
        }
    }
    let total_ms = this
        .started
        .map_or(0.0, |started| started.elapsed().as_secs_f64() * 1000.0);
    tracing::info!(
        target: "tollgate::access",
        method = %this.method,
        path = this.path.as_str(),
        route,
        status,
        client = this.client.as_deref().unwrap_or("-"),
        caller = match (this.decision, this.caller.as_deref()) {
            (Decision::Unauthenticated, _) => "-",
            (_, Some(id)) => id,
            (_, None) => "anonymous",
        },
        tier = this.tier.as_deref().unwrap_or("-"),
        key = this.key_label.as_deref().unwrap_or("-"),
        decision = this.decision.as_str(),
        limit = this.usage.as_ref().map(|u| &*u.resource).unwrap_or("-"),
        remaining = this.usage.as_ref().map(|u| u.remaining() as i64).unwrap_or(-1),
        cost = this.cost,
        uncharged = this.uncharged.map_or("-", |u| u.as_str()),
        upstream_ms = this.upstream_ms.map(|m| (m * 1000.0).round() / 1000.0).unwrap_or(-1.0),
        total_ms = (total_ms * 1000.0).round() / 1000.0,
        request_id = this.request_id.to_str().unwrap_or("-"),
        trace_id = this.trace.as_ref().map(|t| tracing::field::display(Hex(&t.trace_id))),
        span_id = this.trace.as_ref().map(|t| tracing::field::display(Hex(&t.span_id))),
        "request"
    );
}

/// Whether access lines are written (so that what only they need is not computed).
pub fn enabled() -> bool {
    tracing::enabled!(target: "tollgate::access", tracing::Level::INFO)
}

thread_local! {
    /// The `route` label of requests that matched no route, shared so that counting
    /// them allocates nothing.
    static NO_ROUTE: Arc<str> = Arc::from("none");
}

/// A new request id in UUID form (36 characters): the first 64 bits are random, drawn
/// once per process; the last 64 bits count requests. Unique within the process and, with
/// overwhelming probability, across a fleet; it costs no system call (a v4 UUID per
/// request read the kernel's random source on every request).
fn new_request_id() -> HeaderValue {
    static PREFIX: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let prefix = *PREFIX.get_or_init(|| uuid::Uuid::new_v4().as_u64_pair().0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
    uuid::Uuid::from_u64_pair(prefix, n)
        .hyphenated()
        .encode_lower(&mut buf);
    // Owned by the value itself: one allocation, and the clones that go upstream and onto
    // the response share it (a value copied from a slice is allocated again, to be
    // shared, at its first clone).
    HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(buf))
        .unwrap_or(HeaderValue::from_static("-"))
}

/// Counts a request in `tollgate_in_flight_requests` while it lives (kept with the
/// response body, so until the response has been sent).
#[derive(Debug)]
pub struct InFlight(Gauge);

impl InFlight {
    /// Increment the gauge now; decrement when dropped.
    pub fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Why a forwarded request was not charged, logged as the access line's `uncharged`
/// field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Uncharged {
    /// Its status is one of the route's `uncharged_statuses`.
    StatusUncharged,
    /// The route has `charged_statuses`, and its status is not one of them.
    StatusNotCharged,
    /// The upstream said it cost 0 (`upstreams.cost_header`).
    CostZero,
    /// Forwarding failed and the gateway answered itself: the upstream failed or timed
    /// out (502, 503, 504), or the request body was refused on the way (400, 413).
    ForwardFailed,
}

impl Uncharged {
    /// The access log's value.
    pub fn as_str(&self) -> &'static str {
        match self {
            Uncharged::StatusUncharged => "status_in_uncharged_statuses",
            Uncharged::StatusNotCharged => "status_not_in_charged_statuses",
            Uncharged::CostZero => "upstream_cost_0",
            Uncharged::ForwardFailed => "forward_failed",
        }
    }
}
