//! `[identity.auth_request]`: for a credential no local key matches, ask an auth service.
//!
//! The callout is an HTTP request to `url` carrying the request's credential header (and
//! `X-Original-Method` / `X-Original-URI`, and the configured `forward_headers`), each
//! bounded (`max_uri_bytes`, `max_header_bytes`: a larger request gets 414 / 431 without
//! a callout). A 2xx answer names the caller (`caller_header`), its tier (`tier_header`)
//! and its own quotas (`quota_header_prefix` + limit name); a 401 or 403 is passed to the
//! client with its body (at most [`MAX_REFUSAL_BODY`] bytes); another 4xx answers that
//! request only; anything else, a timeout or a refused connection is a failure, handled by
//! `on_error`. Answers are cached per credential and forwarded header values
//! ([`AuthRequest::cache_key`]; `cache_ttl`, `negative_ttl`, at most `cache_size` entries
//! and `cache_max_bytes` bytes); concurrent requests with one uncached key share one
//! callout; consecutive failures of the service itself (no connection, a timeout, a
//! 5xx) open a breaker for `breaker_cooloff`.
//!
//! A callout runs in a task of its own, to its end (at most `timeout`) even when every
//! request waiting for it went away, so that its answer is cached and its connection goes
//! back to the pool (at most [`MAX_IDLE`] idle ones, each for [`IDLE_TIMEOUT`]) or is
//! closed; it never lingers half-done. Callouts under way are bounded in all
//! (`max_concurrent`: past it, [`Answer::Busy`], 503) and per client address
//! (`max_concurrent_per_ip`: 429), and every socket to the service is counted in the
//! descriptor budget ([`crate::budget::Budget::sockets`],
//! `tollgate_auth_request_connections`).

mod build;

use crate::budget::{Budget, Sockets};
use crate::config::{AuthOnError, AuthRequestConfig};
use crate::identity::answer::Parsed;
use crate::identity::auth_cache::AnswerCache;
use crate::identity::auth_conn::{is_no_descriptor, CountedConnector};
use crate::metrics::{AuthLabels, Metrics};
use bytes::Bytes;
use futures_util::future::{BoxFuture, FutureExt, Shared};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client as HttpClient;
use prometheus_client::metrics::gauge::Gauge;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Idle connections to the auth service kept for the next callouts; more are closed
/// when their callout ends.
pub const MAX_IDLE: usize = 16;

/// How long an idle connection to the auth service is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest body of an answer read, in bytes (the rest is not read).
const MAX_BODY: usize = 64 * 1024;

pub use crate::identity::answer::{Answer, Oversize, MAX_REFUSAL_BODY};

/// How often expired answers are dropped from the cache (their memory given back).
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The callout of one config; its cache, breaker and connections are kept across
/// reloads that do not change `[identity.auth_request]`.
#[derive(Debug)]
pub struct AuthRequest {
    cfg: AuthRequestConfig,
    url: Uri,
    method: Method,
    credential: HeaderName,
    forward: Vec<HeaderName>,
    caller_header: HeaderName,
    tier_header: HeaderName,
    quota_prefix: String,
    /// Tiers an answer may name.
    tiers: BTreeSet<Arc<str>>,
    /// Limit names, lowercase → as configured.
    limits: HashMap<String, Arc<str>>,
    state: Arc<State>,
}

struct State {
    client: HttpClient<CountedConnector, Empty<Bytes>>,
    /// Where the connector counts its sockets: the gateway's descriptor budget, set by
    /// the first [`AuthRequest::ask`] (one budget per process, read at start).
    sockets: Arc<OnceLock<Sockets>>,
    /// Callouts under way (`max_concurrent`).
    callouts: Arc<Semaphore>,
    /// Callouts under way per client address (`max_concurrent_per_ip`); addresses with
    /// none under way have no entry.
    per_address: Arc<Mutex<HashMap<IpAddr, usize>>>,
    cache: Mutex<AnswerCache>,
    /// `tollgate_auth_cache_bytes`, once a request has asked (the sweep sets it too).
    cache_bytes: OnceLock<Gauge>,
    inflight: Mutex<HashMap<[u8; 32], Shared<BoxFuture<'static, Answer>>>>,
    /// Consecutive failures, and until when the breaker is open.
    breaker: Mutex<(u32, Option<Instant>)>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State").finish_non_exhaustive()
    }
}

impl AuthRequest {
    /// `default_tier`: a tier limits may give a quota.
    pub fn default_tier(&self) -> Arc<str> {
        self.cfg.default_tier.as_str().into()
    }

    /// `on_error`.
    pub fn on_error(&self) -> AuthOnError {
        self.cfg.on_error
    }

    /// Whether what a callout for this request would send fits its bounds: the URI
    /// (when `send_request_line`) within `max_uri_bytes`, the credential and forwarded
    /// headers (names and values summed) within `max_header_bytes`. Checked before the
    /// cache too, so that the answer does not depend on what is cached.
    ///
    /// Errors: the bound exceeded ([`Oversize`]).
    pub fn fits(&self, headers: &HeaderMap, uri: &Uri) -> Result<(), Oversize> {
        if self.cfg.send_request_line && original_uri_len(uri) > self.cfg.max_uri_bytes {
            return Err(Oversize::Uri(self.cfg.max_uri_bytes));
        }
        let mut total = 0usize;
        for name in self.sent_headers() {
            for v in headers.get_all(name) {
                total = total.saturating_add(name.as_str().len() + v.len());
            }
        }
        if total > self.cfg.max_header_bytes {
            return Err(Oversize::Headers(self.cfg.max_header_bytes));
        }
        Ok(())
    }

    /// The cache key of a request: the SHA-256 of every header value the callout sends
    /// that can change its answer: the credential header as sent and each of
    /// `forward_headers` (each value, in order, and how many there are, so that an
    /// absent header differs from an empty one). `X-Original-Method` and
    /// `X-Original-URI` are not part of it: they change with nearly every request, and
    /// keying on them would make nearly every request a callout (a service that decides
    /// by path needs `cache_ttl` and `negative_ttl` of `"0s"`).
    pub fn cache_key(&self, headers: &HeaderMap) -> [u8; 32] {
        let mut h = Sha256::new();
        for name in self.sent_headers() {
            let values = headers.get_all(name);
            h.update((name.as_str().len() as u64).to_le_bytes());
            h.update(name.as_str());
            h.update((values.iter().count() as u64).to_le_bytes());
            for v in values {
                h.update((v.len() as u64).to_le_bytes());
                h.update(v.as_bytes());
            }
        }
        h.finalize().into()
    }

    /// The request headers a callout copies: the credential header, then
    /// `forward_headers`.
    fn sent_headers(&self) -> impl Iterator<Item = &HeaderName> {
        std::iter::once(&self.credential).chain(&self.forward)
    }

    /// The answer for the request whose cache key is `key` ([`AuthRequest::cache_key`]):
    /// from the cache, from a callout in flight for it, or from a new callout with
    /// `headers` (the request's), `method` and `uri`, made for the client address
    /// `client.0` (its key), whose sockets count in the descriptor budget `client.1`. A
    /// new callout past `max_concurrent` (or `max_concurrent_per_ip` for that address) is
    /// not made: [`Answer::Busy`]. Counted in `tollgate_auth_requests_total{result}`
    /// (callouts, and requests answered `Busy`) and
    /// `tollgate_auth_request_duration_seconds`.
    pub async fn ask(
        &self,
        key: [u8; 32],
        headers: &HeaderMap,
        method: &Method,
        uri: &Uri,
        client: (IpAddr, &Budget),
        metrics: &Metrics,
    ) -> Answer {
        let now = Instant::now();
        let (cached, bytes) = {
            let mut cache = lock(&self.state.cache);
            (cache.get(&key, now), cache.bytes())
        };
        self.state
            .cache_bytes
            .get_or_init(|| metrics.auth_cache_bytes.clone())
            .set(bytes as i64);
        if let Some(answer) = cached {
            return answer;
        }
        let (address, budget) = client;
        self.state.sockets.get_or_init(|| budget.sockets());
        let (shared, leader) = {
            let mut inflight = lock(&self.state.inflight);
            match inflight.get(&key) {
                Some(f) => (f.clone(), false),
                None => match self.slot(address, metrics) {
                    Err(busy) => {
                        drop(inflight);
                        let result = match busy {
                            Answer::Busy { per_address: true } => "max_concurrent_per_ip",
                            _ => "max_concurrent",
                        };
                        metrics
                            .auth_requests
                            .get_or_create(&AuthLabels { result })
                            .inc();
                        return busy;
                    }
                    Ok(slot) => {
                        // In a task of its own: it ends (caches its answer, leaves the
                        // in-flight map, gives its connection back or closes it) whether
                        // or not anyone still waits for it.
                        let callout = self.callout(key, headers, method, uri);
                        let task = tokio::spawn(async move {
                            let answer = callout.await;
                            drop(slot);
                            answer
                        });
                        let f = task
                            .map(|joined| joined.unwrap_or(Answer::Failed("error")))
                            .boxed()
                            .shared();
                        inflight.insert(key, f.clone());
                        (f, true)
                    }
                },
            }
        };
        let answer = shared.await;
        if leader {
            // The request that started the callout counts it, once for its waiters.
            let result = match &answer {
                Answer::Caller(_) => "allowed",
                Answer::Refused { .. } => "refused",
                Answer::Rejected(_) => "rejected",
                Answer::Failed(why) => why,
                Answer::Busy { .. } => "max_concurrent",
            };
            metrics
                .auth_requests
                .get_or_create(&AuthLabels { result })
                .inc();
            metrics
                .auth_cache_bytes
                .set(lock(&self.state.cache).bytes() as i64);
            if result != "breaker_open" {
                metrics.auth_latency.observe(now.elapsed().as_secs_f64());
            }
        }
        answer
    }

    /// A place for one more callout, for the client address `address`.
    ///
    /// Errors: [`Answer::Busy`] when `max_concurrent` callouts are under way, or
    /// `max_concurrent_per_ip` for `address`.
    fn slot(&self, address: IpAddr, metrics: &Metrics) -> Result<CalloutSlot, Answer> {
        let Ok(permit) = self.state.callouts.clone().try_acquire_owned() else {
            return Err(Answer::Busy { per_address: false });
        };
        {
            let mut per_address = lock(&self.state.per_address);
            let count = per_address.entry(address).or_insert(0);
            if *count >= self.cfg.max_concurrent_per_ip {
                if *count == 0 {
                    per_address.remove(&address);
                }
                return Err(Answer::Busy { per_address: true });
            }
            *count += 1;
        }
        metrics.auth_callouts.inc();
        Ok(CalloutSlot {
            _permit: permit,
            table: self.state.per_address.clone(),
            address,
            gauge: metrics.auth_callouts.clone(),
        })
    }

    /// One callout, as a future that owns what it needs; it caches its answer and
    /// leaves the in-flight map itself, so that it does so once for every waiter.
    fn callout(
        &self,
        key: [u8; 32],
        headers: &HeaderMap,
        method: &Method,
        uri: &Uri,
    ) -> impl std::future::Future<Output = Answer> + Send + 'static {
        let mut req = http::Request::builder()
            .method(self.method.clone())
            .uri(self.url.clone());
        for name in self.sent_headers() {
            for v in headers.get_all(name) {
                req = req.header(name, v);
            }
        }
        if self.cfg.send_request_line {
            req = req.header("x-original-method", method.as_str());
            if let Ok(v) = HeaderValue::from_str(&uri.to_string()) {
                req = req.header("x-original-uri", v);
            }
        }
        let req = req.body(Empty::<Bytes>::new());
        let open = {
            let breaker = lock(&self.state.breaker);
            breaker.1.is_some_and(|until| until > Instant::now())
        };
        let this = Parsed {
            caller_header: self.caller_header.clone(),
            tier_header: self.tier_header.clone(),
            quota_prefix: self.quota_prefix.clone(),
            default_tier: self.cfg.default_tier.clone(),
            tiers: self.tiers.clone(),
            limits: self.limits.clone(),
        };
        let state = self.state.clone();
        let cfg = self.cfg.clone();
        async move {
            // Whether the answer says the service itself is unavailable (no connection,
            // a timeout, a 5xx): only that counts toward the breaker.
            let (answer, unavailable) = match (open, req) {
                (true, _) => (Answer::Failed("breaker_open"), false),
                (false, Err(_)) => (Answer::Failed("error"), false),
                (false, Ok(req)) => {
                    let call = async {
                        let resp = state.client.request(req).await.map_err(|e| {
                            if is_no_descriptor(&e) {
                                "no_descriptor"
                            } else {
                                "error"
                            }
                        })?;
                        let (parts, body) = resp.into_parts();
                        let body = match Limited::new(body, MAX_BODY).collect().await {
                            Ok(body) => Some(body.to_bytes()),
                            // Longer than we read: not a failure of the service.
                            Err(e) if e.is::<http_body_util::LengthLimitError>() => None,
                            Err(_) => return Err("error"),
                        };
                        Ok::<_, &'static str>((parts, body))
                    };
                    match tokio::time::timeout(cfg.timeout.0, call).await {
                        Err(_) => (Answer::Failed("timeout"), true),
                        Ok(Err(why)) => (Answer::Failed(why), true),
                        Ok(Ok((parts, body))) => {
                            let unavailable = parts.status.is_server_error();
                            (this.answer(parts, body), unavailable)
                        }
                    }
                }
            };
            {
                let mut breaker = lock(&state.breaker);
                match &answer {
                    // Not the service's failure: the gateway had no descriptor for it.
                    Answer::Failed("breaker_open" | "no_descriptor") => {}
                    _ if unavailable => {
                        breaker.0 += 1;
                        // A failure right after a cool-off opens it again at once.
                        if breaker.0 >= cfg.breaker_failures || breaker.1.is_some() {
                            breaker.1 = Some(Instant::now() + cfg.breaker_cooloff.0);
                            breaker.0 = 0;
                        }
                    }
                    // The service answered: it is up, whatever it said.
                    _ => *breaker = (0, None),
                }
            }
            let ttl = match &answer {
                Answer::Caller(_) => Some(cfg.cache_ttl.0),
                Answer::Refused { .. } => Some(cfg.negative_ttl.0),
                Answer::Rejected(_) | Answer::Failed(_) | Answer::Busy { .. } => None,
            };
            if let Some(ttl) = ttl.filter(|t| !t.is_zero()) {
                lock(&state.cache).insert(
                    key,
                    answer.clone(),
                    Instant::now() + ttl,
                    cfg.cache_size,
                    cfg.cache_max_bytes,
                );
            }
            lock(&state.inflight).remove(&key);
            answer
        }
    }
}

/// A callout's place among `max_concurrent` and its client address's
/// `max_concurrent_per_ip`, counted in `tollgate_auth_request_callouts`; given back when
/// the callout ends.
struct CalloutSlot {
    _permit: OwnedSemaphorePermit,
    table: Arc<Mutex<HashMap<IpAddr, usize>>>,
    address: IpAddr,
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for CalloutSlot {
    fn drop(&mut self) {
        self.gauge.dec();
        let mut table = lock(&self.table);
        if let Some(count) = table.get_mut(&self.address) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                table.remove(&self.address);
            }
        }
    }
}

/// The length of `uri` as `X-Original-URI` carries it, bytes.
fn original_uri_len(uri: &Uri) -> usize {
    let path = uri.path_and_query().map_or(0, |p| p.as_str().len());
    match (uri.scheme_str(), uri.authority()) {
        (Some(scheme), Some(authority)) => scheme.len() + 3 + authority.as_str().len() + path,
        _ => path,
    }
}

/// Drop expired answers from the cache of `state` every [`SWEEP_EVERY`], until the
/// state is dropped (its config replaced).
async fn sweep(state: Weak<State>) {
    loop {
        tokio::time::sleep(SWEEP_EVERY).await;
        let Some(state) = state.upgrade() else {
            return;
        };
        let bytes = {
            let mut cache = lock(&state.cache);
            cache.sweep(Instant::now());
            cache.bytes()
        };
        if let Some(gauge) = state.cache_bytes.get() {
            gauge.set(bytes as i64);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
