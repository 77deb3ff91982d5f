//! Building the callout of `[identity.auth_request]` from its config: every setting
//! checked (problems under `identity.auth_request.*`), the previous callout kept with
//! its cache when its config is unchanged.

use super::{sweep, AuthRequest, State, IDLE_TIMEOUT, MAX_IDLE};
use crate::config::{AuthRequestConfig, Problems};
use crate::identity::auth_cache::AnswerCache;
use crate::identity::auth_conn::CountedConnector;
use http::{HeaderName, Method, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HttpClient;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::Semaphore;

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
}
