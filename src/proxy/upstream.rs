//! The upstreams: named sets of targets used round robin, each target with its
//! connection pool and its passive health (a target that refuses connections is
//! ejected for a while, doubling per refusal in a row), and the cost header an
//! upstream may answer with.

use super::error::ForwardError;
use super::pool::{Connector, Pool};
use crate::config::{Files, Problems, UpstreamConfig, UpstreamProtocol};
use crate::http::always_hop_by_hop;
use http::header::{HeaderMap, HeaderName};
use http::uri::{Authority, Scheme};
use http::Uri;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// One `http[s]://HOST:PORT[/BASE]` target.
#[derive(Debug, Clone)]
pub(super) struct Target {
    /// `http` or `https`.
    pub(super) scheme: Scheme,
    /// `HOST:PORT`.
    pub(super) authority: Authority,
    /// Path prepended to the request's path, without a trailing `/` ("" for none).
    pub(super) base_path: String,
}

/// A target with its connections and its passive health.
#[derive(Debug)]
pub(super) struct Member {
    /// Where it is.
    pub(super) target: Target,
    /// Its connections.
    pub(super) pool: Arc<Pool>,
    /// Consecutive refused connections (reset by any response).
    failures: AtomicU32,
    /// Skipped until this time, in milliseconds since [`epoch`] (0: not ejected).
    ejected_until_ms: AtomicU64,
}

/// The longest a target is ejected for, however many times in a row it refused.
pub const MAX_EJECTION: Duration = Duration::from_secs(300);

/// The process's reference instant for ejection times.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    u64::try_from(epoch().elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Member {
    fn ejected(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }
}

/// A named set of targets, used round robin (skipping ejected ones), each with its
/// connections.
#[derive(Debug)]
pub struct Upstream {
    /// The `[[upstreams]]` name (an `Arc` so that metric labels share it).
    pub name: Arc<str>,
    /// Its targets, in config order.
    pub(super) targets: Vec<Member>,
    next: AtomicUsize,
    /// `upstreams.response_timeout`: from handing the request over to its response
    /// head, over every attempt.
    pub(super) response_timeout: Duration,
    /// The HTTP version spoken to its targets.
    pub(super) protocol: UpstreamProtocol,
    /// `upstreams.eject_for`: the first ejection of a target that refused a connection.
    eject_for: Duration,
    /// `upstreams.cost_header` (lowercase): the response header in which the upstream
    /// says what a request cost, in cost units. `None`: off.
    pub cost_header: Option<HeaderName>,
    /// Warnings about invalid cost headers: at most one per [`COST_WARN_INTERVAL_MS`].
    cost_warnings: crate::logging::Throttle,
    /// `upstreams.max_response_header_bytes`: a larger response head gives 502.
    pub(super) max_response_header_bytes: usize,
}

/// Idle keep-alive connections kept per target.
const MAX_IDLE_PER_TARGET: usize = 256;
/// How long an idle connection is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Milliseconds between two warnings about an upstream's invalid cost headers.
pub const COST_WARN_INTERVAL_MS: u64 = 10_000;

impl Upstream {
    /// Build from config, recording problems under `upstreams[index]`. No I/O: the PEM
    /// files of `https://` targets (`ca`, `client_cert`, `client_key`) and the system's
    /// roots come from `files`, read by the loading step.
    /// `pool_parts`: the parts of each target's connection pool (one per `per_core`
    /// worker, see [`Pool::new`]).
    pub fn build(
        index: usize,
        cfg: &UpstreamConfig,
        files: &Files,
        pool_parts: usize,
        problems: &mut Problems,
    ) -> Option<Self> {
        let at = format!("upstreams[{index}]");
        let before = problems.errors.len();
        if cfg.name.trim().is_empty() {
            problems.error(format!("{at}.name"), "must not be empty");
        }
        if cfg.targets.is_empty() {
            problems.error(
                format!("{at}.targets"),
                "needs at least one target, e.g. \"http://127.0.0.1:9000\"",
            );
        }
        let mut targets = Vec::new();
        for (j, t) in cfg.targets.iter().enumerate() {
            match parse_target(t) {
                Ok(target) => targets.push(target),
                Err(msg) => problems.error(format!("{at}.targets[{j}]"), msg),
            }
        }
        if cfg.connect_timeout.0.is_zero() {
            problems.error(format!("{at}.connect_timeout"), "must be more than 0");
        }
        if cfg.response_timeout.0.is_zero() {
            problems.error(format!("{at}.response_timeout"), "must be more than 0");
        }
        if cfg.eject_for.0.is_zero() {
            problems.error(format!("{at}.eject_for"), "must be more than 0");
        }
        if cfg.max_response_header_bytes < 1024 {
            problems.error(
                format!("{at}.max_response_header_bytes"),
                "must be at least 1024 (bytes)",
            );
        }
        let any_tls = targets.iter().any(|t: &Target| t.scheme == Scheme::HTTPS);
        let tls_keys = [
            ("ca", cfg.ca.is_some()),
            ("client_cert", cfg.client_cert.is_some()),
            ("client_key", cfg.client_key.is_some()),
        ];
        let tls = if any_tls {
            super::tls::client_config(&at, cfg, files, problems)
        } else {
            for (key, set) in tls_keys {
                if set && !targets.is_empty() {
                    problems.error(
                        format!("{at}.{key}"),
                        "applies to https:// targets only, and this upstream has none",
                    );
                }
            }
            None
        };
        let cost_header = cfg.cost_header.as_ref().and_then(|h| {
            match HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()) {
                Ok(name) if always_hop_by_hop(&name) => {
                    problems.error(
                        format!("{at}.cost_header"),
                        format!("{h:?} is a hop-by-hop header, which is never passed on: pick another name, e.g. \"x-tollgate-cost\""),
                    );
                    None
                }
                Ok(name) => Some(name),
                Err(_) => {
                    problems.error(
                        format!("{at}.cost_header"),
                        format!("{h:?} is not a valid header name (e.g. \"x-tollgate-cost\")"),
                    );
                    None
                }
            }
        });
        if problems.errors.len() != before {
            return None;
        }
        let name: Arc<str> = cfg.name.as_str().into();
        let mut members = Vec::with_capacity(targets.len());
        for (j, t) in targets.into_iter().enumerate() {
            let tls = match (&tls, t.scheme == Scheme::HTTPS) {
                (Some(config), true) => {
                    let host = t
                        .authority
                        .host()
                        .trim_start_matches('[')
                        .trim_end_matches(']');
                    match rustls::pki_types::ServerName::try_from(host.to_string()) {
                        Ok(name) => Some((tokio_rustls::TlsConnector::from(config.clone()), name)),
                        Err(e) => {
                            problems.error(
                                format!("{at}.targets[{j}]"),
                                format!("{host:?} cannot be a TLS server name: {e}"),
                            );
                            return None;
                        }
                    }
                }
                _ => None,
            };
            let connector = Connector {
                upstream: name.clone(),
                authority: t.authority.clone(),
                connect_timeout: cfg.connect_timeout.0,
                tls,
                protocol: cfg.protocol,
                max_response_header_bytes: cfg.max_response_header_bytes,
            };
            members.push(Member {
                target: t,
                pool: Pool::new(connector, MAX_IDLE_PER_TARGET, IDLE_TIMEOUT, pool_parts),
                failures: AtomicU32::new(0),
                ejected_until_ms: AtomicU64::new(0),
            });
        }
        Some(Self {
            name,
            targets: members,
            next: AtomicUsize::new(0),
            response_timeout: cfg.response_timeout.0,
            protocol: cfg.protocol,
            eject_for: cfg.eject_for.0,
            cost_header,
            cost_warnings: crate::logging::Throttle::default(),
            max_response_header_bytes: cfg.max_response_header_bytes,
        })
    }

    /// Remove the cost header (`upstreams.cost_header`) from a response of this upstream
    /// and return the cost it gives, in cost units: `Some` for one value that is a
    /// non-negative integer; `None` when the upstream has no cost header, or the response
    /// none, or an invalid one (several values, not an integer), which is logged at warn
    /// (at most once per [`COST_WARN_INTERVAL_MS`] per upstream). The header is removed
    /// whatever it holds.
    pub fn take_cost(&self, headers: &mut HeaderMap) -> Option<u64> {
        let name = self.cost_header.as_ref()?;
        let mut values = headers.get_all(name).iter();
        let value = values.next()?;
        let cost = match values.next() {
            None => parse_cost(value.as_bytes()),
            Some(_) => None,
        };
        if cost.is_none() {
            if let Some(suppressed) = self.cost_warnings.due(COST_WARN_INTERVAL_MS) {
                let shown = &value.as_bytes()[..value.len().min(64)];
                tracing::warn!(
                    upstream = %self.name,
                    header = %name,
                    value = %String::from_utf8_lossy(shown),
                    suppressed,
                    "invalid cost header (expected one non-negative integer); charging the route's cost"
                );
            }
        }
        headers.remove(name);
        cost
    }

    /// The next target round robin, skipping ejected ones and `not` while any other is
    /// available; when all are ejected, the next one anyway. A one-target upstream is never
    /// asked to skip its target (requests are retried only with several targets).
    pub(super) fn pick(&self, not: Option<usize>) -> usize {
        let n = self.targets.len();
        if n == 1 {
            // One target: nothing to skip to (and no clock read on the hot path).
            return 0;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let now = now_ms();
        let candidates = (0..n).map(|k| (start + k) % n).filter(|&i| Some(i) != not);
        let mut fallback = None;
        for i in candidates {
            if !self.targets[i].ejected(now) {
                return i;
            }
            fallback.get_or_insert(i);
        }
        // At least one of several targets is not `not`.
        fallback.unwrap_or(start)
    }

    /// Record that target `i` refused a connection (`refusal`: see
    /// [`ForwardError::is_refusal`]): eject it for `eject_for`, doubled per earlier
    /// consecutive refusal, at most [`MAX_EJECTION`].
    pub(super) fn eject(&self, i: usize, refusal: &ForwardError) {
        let m = &self.targets[i];
        let failures = m.failures.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        let back_off = back_off(self.eject_for, failures);
        let until =
            now_ms().saturating_add(u64::try_from(back_off.as_millis()).unwrap_or(u64::MAX));
        m.ejected_until_ms.store(until, Ordering::Relaxed);
        tracing::warn!(
            upstream = %self.name,
            target = %m.target.authority,
            failures,
            eject_ms = u64::try_from(back_off.as_millis()).unwrap_or(u64::MAX),
            error = %refusal.detail(),
            "upstream target ejected"
        );
    }

    /// Record that target `i` answered: it is healthy again.
    pub(super) fn healthy(&self, i: usize) {
        let m = &self.targets[i];
        if m.failures.load(Ordering::Relaxed) != 0 {
            m.failures.store(0, Ordering::Relaxed);
            m.ejected_until_ms.store(0, Ordering::Relaxed);
        }
    }
}

/// How long a target is ejected after its `failures`-th consecutive refusal (from 1):
/// `eject_for`, doubled per earlier refusal, at most [`MAX_EJECTION`].
fn back_off(eject_for: Duration, failures: u32) -> Duration {
    let doubling = 1u32 << failures.saturating_sub(1).min(16);
    eject_for.saturating_mul(doubling).min(MAX_EJECTION)
}

/// A cost header's value: ASCII digits only (no sign, no space), fitting a `u64`.
fn parse_cost(value: &[u8]) -> Option<u64> {
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

fn parse_target(s: &str) -> Result<Target, String> {
    let uri: Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    let scheme = match uri.scheme() {
        Some(scheme) if *scheme == Scheme::HTTP || *scheme == Scheme::HTTPS => scheme.clone(),
        _ => {
            return Err(format!(
                "{s:?}: expected http://HOST:PORT or https://HOST:PORT"
            ))
        }
    };
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| format!("{s:?} has no host"))?;
    if uri.query().is_some() {
        return Err(format!("{s:?}: a target may not have a query string"));
    }
    let base_path = uri.path().trim_end_matches('/').to_string();
    Ok(Target {
        scheme,
        authority,
        base_path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_values_parse() {
        assert_eq!(parse_cost(b"0"), Some(0));
        assert_eq!(parse_cost(b"17"), Some(17));
        assert_eq!(parse_cost(b"007"), Some(7));
        for bad in [
            &b""[..],
            b"-1",
            b"+1",
            b"1.5",
            b" 1",
            b"1e3",
            b"abc",
            b"99999999999999999999",
        ] {
            assert_eq!(parse_cost(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn ejection_doubles_up_to_five_minutes() {
        let ten = Duration::from_secs(10);
        let secs: Vec<u64> = (1..=7).map(|n| back_off(ten, n).as_secs()).collect();
        assert_eq!(secs, [10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(back_off(ten, u32::MAX), MAX_EJECTION);
        assert_eq!(
            back_off(Duration::from_millis(100), 1),
            Duration::from_millis(100)
        );
    }

    #[test]
    fn targets_parse() {
        let t = parse_target("http://127.0.0.1:9000/base/").unwrap();
        assert_eq!(t.authority.as_str(), "127.0.0.1:9000");
        assert_eq!(t.base_path, "/base");
        let t = parse_target("https://api.example.com").unwrap();
        assert_eq!(t.scheme, Scheme::HTTPS);
        assert!(parse_target("ftp://x").is_err());
    }
}
