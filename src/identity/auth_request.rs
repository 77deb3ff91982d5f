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

use super::auth_cache::AnswerCache;
use super::Client;
use crate::budget::{Budget, Descriptor, Sockets};
use crate::config::{AuthOnError, AuthRequestConfig, Problems};
use crate::metrics::{AuthLabels, Metrics};
use bytes::Bytes;
use futures_util::future::{BoxFuture, FutureExt, Shared};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::gauge::Gauge;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Idle connections to the auth service kept for the next callouts; more are closed
/// when their callout ends.
pub const MAX_IDLE: usize = 16;

/// How long an idle connection to the auth service is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest body of an answer read, in bytes (the rest is not read).
const MAX_BODY: usize = 64 * 1024;

/// Largest body of a 401/403 answer passed on to the client (and cached), in bytes. A
/// longer body (or one whose `Content-Type` is longer than 256 bytes) is replaced by the
/// gateway's own JSON refusal: `{"message":"Bad credentials"}` for a 401,
/// `{"message":"Forbidden"}` for a 403.
pub const MAX_REFUSAL_BODY: usize = 4 * 1024;

/// Largest `Content-Type` of a refusal passed on, in bytes.
const MAX_CONTENT_TYPE: usize = 256;

/// How often expired answers are dropped from the cache (their memory given back).
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// What the auth service said about one credential.
#[derive(Debug, Clone)]
pub enum Answer {
    /// A 2xx naming the caller.
    Caller(Arc<Client>),
    /// A 401 or 403, passed to the client as it is.
    Refused {
        /// 401 or 403.
        status: u16,
        /// Its `Content-Type`, if any.
        content_type: Option<HeaderValue>,
        /// Its body (at most [`MAX_REFUSAL_BODY`] bytes).
        body: Bytes,
    },
    /// Another 4xx (its status): the service could not judge this request (e.g. 431 for
    /// a long `X-Original-URI`). Answers this request only: not cached, and not a
    /// failure of the service (the breaker does not count it).
    Rejected(u16),
    /// No usable answer (`on_error` decides): why, for the logs and the metric.
    Failed(&'static str),
    /// No callout was made: `max_concurrent` callouts are under way, or
    /// `max_concurrent_per_ip` for the request's client address (`per_address`).
    Busy {
        /// Whether the client address's own bound was the one reached.
        per_address: bool,
    },
}

/// What the callout would forward is larger than its bound: the request gets this
/// status without a callout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Oversize {
    /// The URI (sent as `X-Original-URI`) is longer than `max_uri_bytes` (the bound,
    /// bytes): 414.
    Uri(usize),
    /// The credential and forwarded headers (names and values) are larger than
    /// `max_header_bytes` (the bound, bytes): 431.
    Headers(usize),
}

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

fn header(key: &str, name: &str, problems: &mut Problems) -> Option<HeaderName> {
    match HeaderName::from_bytes(name.trim().to_ascii_lowercase().as_bytes()) {
        Ok(h) => Some(h),
        Err(_) => {
            problems.error(key, format!("{name:?} is not a valid header name"));
            None
        }
    }
}

impl AuthRequest {
    /// Build from `[identity.auth_request]`, recording problems under
    /// `identity.auth_request.*`. `credential` is `identity.api_key_header`; `tiers` and
    /// `limits` are what answers may name. `previous` is kept (with its cache) when its
    /// config is the same.
    pub fn build(
        cfg: &AuthRequestConfig,
        credential: &HeaderName,
        tiers: BTreeSet<Arc<str>>,
        limits: &[String],
        previous: Option<&Arc<AuthRequest>>,
        problems: &mut Problems,
    ) -> Option<Arc<AuthRequest>> {
        let at = "identity.auth_request";
        let url = match cfg.url.parse::<Uri>() {
            Ok(u) if u.scheme_str() == Some("http") && u.authority().is_some() => Some(u),
            _ => {
                problems.error(
                    format!("{at}.url"),
                    format!(
                        "{:?} is not an http:// URL (e.g. \"http://127.0.0.1:9100/auth\")",
                        cfg.url
                    ),
                );
                None
            }
        };
        let method = match Method::from_bytes(cfg.method.as_bytes()) {
            Ok(m) => Some(m),
            Err(_) => {
                problems.error(
                    format!("{at}.method"),
                    format!("{:?} is not an HTTP method", cfg.method),
                );
                None
            }
        };
        let forward: Vec<HeaderName> = cfg
            .forward_headers
            .iter()
            .enumerate()
            .filter_map(|(i, h)| header(&format!("{at}.forward_headers[{i}]"), h, problems))
            .collect();
        let caller_header = header(&format!("{at}.caller_header"), &cfg.caller_header, problems);
        let tier_header = header(&format!("{at}.tier_header"), &cfg.tier_header, problems);
        if cfg.quota_header_prefix.trim().is_empty() {
            problems.error(format!("{at}.quota_header_prefix"), "must not be empty");
        }
        if cfg.default_tier.trim().is_empty() {
            problems.error(format!("{at}.default_tier"), "must not be empty");
        }
        let mut tiers = tiers;
        tiers.insert(cfg.default_tier.as_str().into());
        if cfg.cache_size == 0 {
            problems.error(format!("{at}.cache_size"), "must be at least 1");
        }
        if cfg.timeout.0.is_zero() {
            problems.error(format!("{at}.timeout"), "must be more than 0");
        }
        if cfg.breaker_failures == 0 {
            problems.error(format!("{at}.breaker_failures"), "must be at least 1");
        }
        if cfg.max_concurrent == 0 {
            problems.error(format!("{at}.max_concurrent"), "must be at least 1");
        }
        if cfg.max_concurrent_per_ip == 0 {
            problems.error(format!("{at}.max_concurrent_per_ip"), "must be at least 1");
        }
        if cfg.max_uri_bytes == 0 {
            problems.error(format!("{at}.max_uri_bytes"), "must be at least 1");
        }
        if cfg.max_header_bytes == 0 {
            problems.error(format!("{at}.max_header_bytes"), "must be at least 1");
        }
        if cfg.cache_max_bytes == 0 {
            problems.error(format!("{at}.cache_max_bytes"), "must be at least 1");
        }
        let (url, method, caller_header, tier_header) =
            (url?, method?, caller_header?, tier_header?);
        let state = match previous {
            Some(p) if p.cfg == *cfg => p.state.clone(),
            _ => {
                let mut http = HttpConnector::new();
                http.set_connect_timeout(Some(cfg.timeout.0));
                http.set_nodelay(true);
                let sockets = Arc::new(OnceLock::new());
                let connector = CountedConnector {
                    http,
                    sockets: sockets.clone(),
                };
                let state = Arc::new(State {
                    client: HttpClient::builder(hyper_util::rt::TokioExecutor::new())
                        .pool_idle_timeout(IDLE_TIMEOUT)
                        .pool_max_idle_per_host(MAX_IDLE)
                        .build(connector),
                    sockets,
                    callouts: Arc::new(Semaphore::new(
                        cfg.max_concurrent.clamp(1, Semaphore::MAX_PERMITS),
                    )),
                    per_address: Arc::default(),
                    cache: Mutex::new(AnswerCache::default()),
                    cache_bytes: OnceLock::new(),
                    inflight: Mutex::new(HashMap::new()),
                    breaker: Mutex::new((0, None)),
                });
                // Expired answers are dropped once a second while the callout is in use
                // (not in `tollgate check`, which has no runtime to run it).
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(sweep(Arc::downgrade(&state)));
                }
                state
            }
        };
        Some(Arc::new(AuthRequest {
            url,
            method,
            credential: credential.clone(),
            forward,
            caller_header,
            tier_header,
            quota_prefix: cfg.quota_header_prefix.trim().to_ascii_lowercase(),
            tiers,
            limits: limits
                .iter()
                .map(|l| (l.to_ascii_lowercase(), Arc::from(l.as_str())))
                .collect(),
            state,
            cfg: cfg.clone(),
        }))
    }

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

/// What reading an answer needs (owned, for the callout's future).
struct Parsed {
    caller_header: HeaderName,
    tier_header: HeaderName,
    quota_prefix: String,
    default_tier: String,
    tiers: BTreeSet<Arc<str>>,
    limits: HashMap<String, Arc<str>>,
}

impl Parsed {
    /// The answer of `parts` and `body` (`None`: longer than was read).
    fn answer(&self, parts: http::response::Parts, body: Option<Bytes>) -> Answer {
        let status = parts.status.as_u16();
        if status == 401 || status == 403 {
            return refusal(status, parts.headers.get(http::header::CONTENT_TYPE), body);
        }
        if parts.status.is_client_error() {
            return Answer::Rejected(status);
        }
        if !parts.status.is_success() {
            return Answer::Failed("error");
        }
        let Some(id) = parts
            .headers
            .get(&self.caller_header)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|id| {
                !id.is_empty()
                    && id.len() <= 256
                    && !id.contains(',')
                    && !id.chars().any(char::is_control)
            })
        else {
            return Answer::Failed("error");
        };
        let tier = parts
            .headers
            .get(&self.tier_header)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .unwrap_or(&self.default_tier);
        let Some(tier) = self.tiers.get(tier).cloned() else {
            return Answer::Failed("error");
        };
        let mut quotas = Vec::new();
        for (name, v) in &parts.headers {
            let Some(limit) = name.as_str().strip_prefix(self.quota_prefix.as_str()) else {
                continue;
            };
            let (Some(limit), Some(n)) = (
                self.limits.get(limit),
                v.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()),
            ) else {
                continue;
            };
            if n > 0 {
                quotas.push((limit.clone(), n));
            }
        }
        let mut client = Client::new(id.into(), tier);
        if !quotas.is_empty() {
            client.quotas = Some(Box::new(quotas.into_boxed_slice()));
        }
        Answer::Caller(Arc::new(client))
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

/// The descriptor budget had no room for a socket to the auth service.
#[derive(Debug, thiserror::Error)]
#[error("no descriptor left for a connection to the auth service (the open-file limit is spent)")]
struct NoDescriptor;

/// Whether the callout failed for want of a descriptor ([`NoDescriptor`]).
fn is_no_descriptor(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<NoDescriptor>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// hyper-util's connector, each socket counted in the descriptor budget (see
/// [`State::sockets`]): no socket is opened when the budget is spent.
#[derive(Clone)]
struct CountedConnector {
    http: HttpConnector,
    sockets: Arc<OnceLock<Sockets>>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for CountedConnector {
    type Response = CountedSocket;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<CountedSocket, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        // Taken before connecting; `None` only before the first `ask` set the budget.
        let descriptor = match self.sockets.get() {
            Some(sockets) => match sockets.take() {
                Some(d) => Some(d),
                None => return Box::pin(async { Err(Box::new(NoDescriptor) as BoxError) }),
            },
            None => None,
        };
        let connecting = self.http.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            Ok(CountedSocket {
                io,
                _descriptor: descriptor,
            })
        })
    }
}

/// A socket to the auth service with its place in the descriptor budget.
struct CountedSocket {
    io: TokioIo<TcpStream>,
    _descriptor: Option<Descriptor>,
}

impl Connection for CountedSocket {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

impl hyper::rt::Read for CountedSocket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for CountedSocket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A 401/403 answer as kept and passed on: its body and `Content-Type` when they fit
/// their bounds (copied, so that the read buffer is not kept), else the gateway's own
/// JSON refusal.
fn refusal(status: u16, content_type: Option<&HeaderValue>, body: Option<Bytes>) -> Answer {
    match body {
        Some(body)
            if body.len() <= MAX_REFUSAL_BODY
                && content_type.is_none_or(|c| c.len() <= MAX_CONTENT_TYPE) =>
        {
            Answer::Refused {
                status,
                content_type: content_type.cloned(),
                body: Bytes::copy_from_slice(&body),
            }
        }
        _ => Answer::Refused {
            status,
            content_type: Some(HeaderValue::from_static("application/json")),
            body: Bytes::from_static(if status == 403 {
                b"{\"message\":\"Forbidden\"}"
            } else {
                b"{\"message\":\"Bad credentials\"}"
            }),
        },
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
