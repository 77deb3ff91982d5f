//! Step 2 of the request path: host and longest path prefix → route.

use crate::config::{Problems, RouteConfig};
use crate::limiter::{Limit, LimitSet};
use crate::proxy::forward::Upstream;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// A `[[routes]]` entry, ready to use.
#[derive(Debug)]
pub struct Route {
    /// Host this route is for (lowercase, no port); `None` matches any host.
    pub host: Option<String>,
    /// Path prefix; the longest matching prefix wins.
    pub path_prefix: Arc<str>,
    /// `path_match = "segments"`: the prefix matches whole path segments only.
    pub segments: bool,
    /// Methods this route is for; empty: any.
    pub methods: Vec<http::Method>,
    /// `max_request_bytes`: the largest request body forwarded, in bytes.
    pub max_request_bytes: Option<u64>,
    /// Where matching requests go.
    pub upstream: Arc<Upstream>,
    /// Limits that must all admit a request, in the order of `limits` in the config.
    pub limits: LimitSet,
    /// Units charged per request.
    pub cost: u64,
    /// Response statuses that are not charged.
    pub uncharged_statuses: Vec<u16>,
    /// `charge = "on_request"`: reserve `cost` (check and add in one step) before
    /// forwarding and refund it when the status is uncharged or the upstream failed.
    /// Otherwise (`"after_response"`) check first and charge once the status is known.
    pub on_request: bool,
    /// `upgrades`: the protocols a request on this route may upgrade to.
    pub upgrades: Vec<crate::http::upgrade::Protocol>,
    /// `trust_method_override`: method and URL override headers are believed (routed
    /// and limited on, and forwarded) when they select this route.
    pub trust_method_override: bool,
}

impl Route {
    /// Whether this route is for a request with `path` and `method` (its host is
    /// matched by the router).
    pub fn matches(&self, path: &str, method: &http::Method) -> bool {
        let prefix = &*self.path_prefix;
        let path_ok = match path.strip_prefix(prefix) {
            None => false,
            Some(rest) => {
                !self.segments || rest.is_empty() || rest.starts_with('/') || prefix.ends_with('/')
            }
        };
        path_ok && (self.methods.is_empty() || self.methods.contains(method))
    }

    /// Whether a response with `status` is charged.
    pub fn charges(&self, status: http::StatusCode) -> bool {
        !self.uncharged_statuses.contains(&status.as_u16())
    }

    /// Build from config, recording problems under `routes[index]`. `declared` holds the
    /// names of every upstream and limit in the file, valid or not, so that a route does
    /// not repeat an error already reported for them.
    pub fn build(
        index: usize,
        cfg: &RouteConfig,
        upstreams: &HashMap<String, Arc<Upstream>>,
        limits: &HashMap<String, Arc<Limit>>,
        declared: &HashSet<&str>,
        problems: &mut Problems,
    ) -> Option<Self> {
        let at = format!("routes[{index}]");
        let before = problems.errors.len();
        if !cfg.path_prefix.starts_with('/') {
            problems.error(
                format!("{at}.path_prefix"),
                format!("{:?} must start with \"/\"", cfg.path_prefix),
            );
        }
        let segments = match cfg.path_match.as_str() {
            "prefix" => false,
            "segments" => true,
            other => {
                problems.error(
                    format!("{at}.path_match"),
                    format!("{other:?}: expected \"prefix\" or \"segments\""),
                );
                false
            }
        };
        let mut methods = Vec::new();
        for (j, m) in cfg.methods.iter().enumerate() {
            match http::Method::from_bytes(m.as_bytes()) {
                Ok(method) if m.bytes().all(|b| b.is_ascii_uppercase()) => {
                    if !methods.contains(&method) {
                        methods.push(method);
                    }
                }
                _ => problems.error(
                    format!("{at}.methods[{j}]"),
                    format!("{m:?} is not an HTTP method in capitals, e.g. \"GET\" or \"POST\""),
                ),
            }
        }
        let host = cfg.host.as_ref().map(|h| h.trim().to_ascii_lowercase());
        if host.as_deref() == Some("") {
            problems.error(
                format!("{at}.host"),
                "must not be empty (leave it out to match any host)",
            );
        }
        let upstream = upstreams.get(&cfg.upstream).cloned();
        if upstream.is_none() && !declared.contains(cfg.upstream.as_str()) {
            problems.error(
                format!("{at}.upstream"),
                format!("no [[upstreams]] entry is named {:?}", cfg.upstream),
            );
        }
        let mut route_limits = Vec::new();
        let mut seen = HashSet::new();
        for (j, name) in cfg.limits.iter().enumerate() {
            match limits.get(name) {
                Some(l) if seen.insert(name) => route_limits.push(l.clone()),
                Some(_) => problems.error(
                    format!("{at}.limits[{j}]"),
                    format!("limit {name:?} is listed twice"),
                ),
                // A declared but invalid limit has its own error already.
                None if declared.contains(name.as_str()) => problems.error(
                    format!("{at}.limits[{j}]"),
                    format!("limit {name:?} is invalid (see its errors)"),
                ),
                None => problems.error(
                    format!("{at}.limits[{j}]"),
                    format!("no [[limits]] entry is named {name:?}"),
                ),
            }
        }
        if cfg.cost == 0 {
            problems.error(format!("{at}.cost"), "must be at least 1");
        }
        for (j, s) in cfg.uncharged_statuses.iter().enumerate() {
            if !(100..=599).contains(s) {
                problems.error(
                    format!("{at}.uncharged_statuses[{j}]"),
                    format!("{s} is not an HTTP status (100-599)"),
                );
            }
        }
        let mut upgrades = Vec::new();
        for (j, u) in cfg.upgrades.iter().enumerate() {
            match crate::http::upgrade::Protocol::parse(u) {
                Ok(p) => upgrades.push(p),
                Err(msg) => problems.error(format!("{at}.upgrades[{j}]"), msg),
            }
        }
        match cfg.charge.as_str() {
            "after_response" | "on_request" => {}
            other => problems.error(
                format!("{at}.charge"),
                format!("{other:?}: expected \"after_response\" or \"on_request\""),
            ),
        }
        if problems.errors.len() != before {
            return None;
        }
        Some(Self {
            host,
            path_prefix: cfg.path_prefix.as_str().into(),
            segments,
            methods,
            max_request_bytes: cfg.max_request_bytes,
            upstream: upstream?,
            limits: LimitSet::new(route_limits),
            cost: cfg.cost,
            uncharged_statuses: cfg.uncharged_statuses.clone(),
            on_request: cfg.charge == "on_request",
            upgrades,
            trust_method_override: cfg.trust_method_override,
        })
    }
}

/// All routes of a snapshot, ordered for matching.
#[derive(Debug, Default)]
pub struct Router {
    routes: Vec<Arc<Route>>,
}

impl Router {
    /// A router over `routes`: longer prefixes first; for equal prefixes host-specific
    /// routes before host-less ones, then routes for some methods before routes for any.
    pub fn new(mut routes: Vec<Arc<Route>>) -> Self {
        routes.sort_by(|a, b| {
            b.path_prefix
                .len()
                .cmp(&a.path_prefix.len())
                .then(b.host.is_some().cmp(&a.host.is_some()))
                .then(a.methods.is_empty().cmp(&b.methods.is_empty()))
        });
        Self { routes }
    }

    /// The route for a `method` request to `host` (any case, port ignored) and `path`:
    /// the first in the order of [`Router::new`] that matches.
    pub fn find(
        &self,
        host: Option<&str>,
        path: &str,
        method: &http::Method,
    ) -> Option<&Arc<Route>> {
        let host = host.map(strip_port);
        self.routes.iter().find(|r| {
            r.matches(path, method)
                && r.host
                    .as_deref()
                    .is_none_or(|h| host.is_some_and(|req| req.eq_ignore_ascii_case(h)))
        })
    }

    /// Number of routes.
    pub fn len(&self) -> usize {
        self.routes.len()
    }

    /// True when there are no routes.
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

/// `example.com:8080` → `example.com`; `[::1]:80` → `[::1]`.
fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_inclusive(']').next().unwrap_or(host);
    }
    // A byte scan: `:` is ASCII, so its index is a char boundary.
    match host.bytes().rposition(|b| b == b':') {
        Some(i) if host.as_bytes()[i + 1..].iter().all(u8::is_ascii_digit) => &host[..i],
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_ports() {
        assert_eq!(strip_port("api.example.com:8080"), "api.example.com");
        assert_eq!(strip_port("api.example.com"), "api.example.com");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
    }
}
