//! `[identity.auth_request]`: for a credential no local key matches, ask an auth service.
//!
//! The callout is an HTTP request to `url` carrying the request's credential header (and
//! `X-Original-Method` / `X-Original-URI`, and the configured `forward_headers`). A 2xx
//! answer names the caller (`caller_header`), its tier (`tier_header`) and its own
//! quotas (`quota_header_prefix` + limit name); a 401 or 403 is passed to the client with
//! its body; anything else, a timeout or a refused connection is a failure, handled by
//! `on_error`. Answers are cached per credential hash (`cache_ttl`, `negative_ttl`,
//! at most `cache_size` entries); concurrent requests with one uncached credential share
//! one callout; consecutive failures open a breaker for `breaker_cooloff`.
//!
//! A callout runs in a task of its own, to its end (at most `timeout`) even when every
//! request waiting for it went away, so that its answer is cached and its connection goes
//! back to the pool (at most [`MAX_IDLE`] idle ones, each for [`IDLE_TIMEOUT`]) or is
//! closed; it never lingers half-done. Callouts under way are bounded in all
//! (`max_concurrent`: past it, [`Answer::Busy`], 503) and per client address
//! (`max_concurrent_per_ip`: 429), and every socket to the service is counted in the
//! descriptor budget ([`crate::budget::Budget::sockets`],
//! `tollgate_auth_request_connections`).

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
use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Idle connections to the auth service kept for the next callouts; more are closed
/// when their callout ends.
pub const MAX_IDLE: usize = 16;

/// How long an idle connection to the auth service is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest body of a 401/403 answer passed on to the client, in bytes.
const MAX_BODY: usize = 64 * 1024;

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
        /// Its body (at most 64 KB).
        body: Bytes,
    },
    /// No usable answer (`on_error` decides): why, for the logs and the metric.
    Failed(&'static str),
    /// No callout was made: `max_concurrent` callouts are under way, or
    /// `max_concurrent_per_ip` for the request's client address (`per_address`).
    Busy {
        /// Whether the client address's own bound was the one reached.
        per_address: bool,
    },
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
    cache: Mutex<HashMap<[u8; 32], (Instant, Answer)>>,
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
                Arc::new(State {
                    client: HttpClient::builder(hyper_util::rt::TokioExecutor::new())
                        .pool_idle_timeout(IDLE_TIMEOUT)
                        .pool_max_idle_per_host(MAX_IDLE)
                        .build(connector),
                    sockets,
                    callouts: Arc::new(Semaphore::new(
                        cfg.max_concurrent.clamp(1, Semaphore::MAX_PERMITS),
                    )),
                    per_address: Arc::default(),
                    cache: Mutex::new(HashMap::new()),
                    inflight: Mutex::new(HashMap::new()),
                    breaker: Mutex::new((0, None)),
                })
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

    /// The answer for the credential whose SHA-256 is `digest`: from the cache, from a
    /// callout in flight for it, or from a new callout with `headers` (the request's),
    /// `method` and `uri`, made for the client address `client.0` (its key), whose
    /// sockets count in the descriptor budget `client.1`. A new callout past
    /// `max_concurrent` (or `max_concurrent_per_ip` for that address) is not made:
    /// [`Answer::Busy`]. Counted in `tollgate_auth_requests_total{result}` (callouts,
    /// and requests answered `Busy`) and `tollgate_auth_request_duration_seconds`.
    pub async fn ask(
        &self,
        digest: [u8; 32],
        headers: &HeaderMap,
        method: &Method,
        uri: &Uri,
        client: (IpAddr, &Budget),
        metrics: &Metrics,
    ) -> Answer {
        let now = Instant::now();
        if let Some((until, answer)) = lock(&self.state.cache).get(&digest) {
            if *until > now {
                return answer.clone();
            }
        }
        let (address, budget) = client;
        self.state.sockets.get_or_init(|| budget.sockets());
        let (shared, leader) = {
            let mut inflight = lock(&self.state.inflight);
            match inflight.get(&digest) {
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
                        let callout = self.callout(digest, headers, method, uri);
                        let task = tokio::spawn(async move {
                            let answer = callout.await;
                            drop(slot);
                            answer
                        });
                        let f = task
                            .map(|joined| joined.unwrap_or(Answer::Failed("error")))
                            .boxed()
                            .shared();
                        inflight.insert(digest, f.clone());
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
                Answer::Failed(why) => why,
                Answer::Busy { .. } => "max_concurrent",
            };
            metrics
                .auth_requests
                .get_or_create(&AuthLabels { result })
                .inc();
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
        digest: [u8; 32],
        headers: &HeaderMap,
        method: &Method,
        uri: &Uri,
    ) -> impl std::future::Future<Output = Answer> + Send + 'static {
        let mut req = http::Request::builder()
            .method(self.method.clone())
            .uri(self.url.clone());
        for name in std::iter::once(&self.credential).chain(&self.forward) {
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
            let answer = match (open, req) {
                (true, _) => Answer::Failed("breaker_open"),
                (false, Err(_)) => Answer::Failed("error"),
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
                        let body = Limited::new(body, MAX_BODY)
                            .collect()
                            .await
                            .map_err(|_| "error")?
                            .to_bytes();
                        Ok::<_, &'static str>((parts, body))
                    };
                    match tokio::time::timeout(cfg.timeout.0, call).await {
                        Err(_) => Answer::Failed("timeout"),
                        Ok(Err(why)) => Answer::Failed(why),
                        Ok(Ok((parts, body))) => this.answer(parts, body),
                    }
                }
            };
            {
                let mut breaker = lock(&state.breaker);
                match &answer {
                    // Not the service's failure: the gateway had no descriptor for it.
                    Answer::Failed("breaker_open" | "no_descriptor") => {}
                    Answer::Failed(_) => {
                        breaker.0 += 1;
                        // A failure right after a cool-off opens it again at once.
                        if breaker.0 >= cfg.breaker_failures || breaker.1.is_some() {
                            breaker.1 = Some(Instant::now() + cfg.breaker_cooloff.0);
                            breaker.0 = 0;
                        }
                    }
                    _ => *breaker = (0, None),
                }
            }
            let ttl = match &answer {
                Answer::Caller(_) => Some(cfg.cache_ttl.0),
                Answer::Refused { .. } => Some(cfg.negative_ttl.0),
                Answer::Failed(_) | Answer::Busy { .. } => None,
            };
            if let Some(ttl) = ttl.filter(|t| !t.is_zero()) {
                let mut cache = lock(&state.cache);
                if cache.len() >= cfg.cache_size {
                    let now = Instant::now();
                    cache.retain(|_, (until, _)| *until > now);
                    if cache.len() >= cfg.cache_size {
                        // Still full of live answers: drop an eighth, arbitrarily.
                        let drop: Vec<[u8; 32]> =
                            cache.keys().take(cfg.cache_size / 8 + 1).copied().collect();
                        for k in drop {
                            cache.remove(&k);
                        }
                    }
                }
                cache.insert(digest, (Instant::now() + ttl, answer.clone()));
            }
            lock(&state.inflight).remove(&digest);
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
    fn answer(&self, parts: http::response::Parts, body: Bytes) -> Answer {
        let status = parts.status.as_u16();
        if status == 401 || status == 403 {
            return Answer::Refused {
                status,
                content_type: parts.headers.get(http::header::CONTENT_TYPE).cloned(),
                body,
            };
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
