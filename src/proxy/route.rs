//! Step 2 of the request path: host and longest path prefix → route.

use super::access::Uncharged;
use crate::config::{ChargeAt, PathMatch, Problems, RouteConfig};
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
    /// Response statuses that are not charged (`uncharged_statuses`, `[304]` by
    /// default; empty when `charged_statuses` is set).
    pub uncharged_statuses: Vec<u16>,
    /// `charged_statuses`: when set, the only response statuses that are charged.
    pub charged_statuses: Option<Vec<u16>>,
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
        self.uncharged_by(status).is_none()
    }

    /// Why a response with `status` is not charged, as the access log's `uncharged`
    /// field says it: [`Uncharged::StatusNotCharged`] when `charged_statuses` is set
    /// and does not list it, [`Uncharged::StatusUncharged`] when `uncharged_statuses`
    /// lists it; `None` when it is charged.
    pub fn uncharged_by(&self, status: http::StatusCode) -> Option<Uncharged> {
        let status = status.as_u16();
        match &self.charged_statuses {
            Some(charged) => (!charged.contains(&status)).then_some(Uncharged::StatusNotCharged),
            None => self
                .uncharged_statuses
                .contains(&status)
                .then_some(Uncharged::StatusUncharged),
        }
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
        let segments = cfg.path_match == PathMatch::Segments;
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
        for (key, list) in [
            ("uncharged_statuses", &cfg.uncharged_statuses),
            ("charged_statuses", &cfg.charged_statuses),
        ] {
            for (j, s) in list.iter().flatten().enumerate() {
                if !(100..=599).contains(s) {
                    problems.error(
                        format!("{at}.{key}[{j}]"),
                        format!("{s} is not an HTTP status (100-599)"),
                    );
                }
            }
        }
        if cfg.charged_statuses.is_some() && cfg.uncharged_statuses.is_some() {
            problems.error(
                format!("{at}.charged_statuses"),
                format!(
                    "charged_statuses and uncharged_statuses cannot both be set on a route: \
                     with charged_statuses only its statuses are charged, so remove \
                     {at}.uncharged_statuses"
                ),
            );
        }
        let mut upgrades = Vec::new();
        for (j, u) in cfg.upgrades.iter().enumerate() {
            match crate::http::upgrade::Protocol::parse(u) {
                Ok(p) => upgrades.push(p),
                Err(msg) => problems.error(format!("{at}.upgrades[{j}]"), msg),
            }
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
            uncharged_statuses: match (&cfg.uncharged_statuses, &cfg.charged_statuses) {
                (Some(listed), _) => listed.clone(),
                (None, Some(_)) => Vec::new(),
                (None, None) => crate::config::DEFAULT_UNCHARGED.to_vec(),
            },
            charged_statuses: cfg.charged_statuses.clone(),
            on_request: cfg.charge == ChargeAt::OnRequest,
            upgrades,
            trust_method_override: cfg.trust_method_override,
        })
    }
}

/// All routes of a snapshot, indexed for matching in time that does not grow with their
/// number (issue 46): host-specific routes in a hash map by host name, each host's routes
/// and the host-less routes in a radix tree of path prefixes ([`Prefixes`]). A lookup
/// costs one hash of the host and one walk down the path's bytes, whether the config has
/// one route or 100,000.
///
/// The rules are those of a walk over every route sorted longer prefix first, then
/// host-specific before host-less, then routes for some methods before routes for any,
/// then config order (the first that matches wins); `tests::matches_a_linear_scan`
/// checks the two against each other on random route sets and paths.
#[derive(Debug, Default)]
pub struct Router {
    /// Every route, in the matching order above (kept for [`Router::len`] and the tests).
    routes: Vec<Arc<Route>>,
    /// Routes with a `host`, by that host (lowercase, as in [`Route::host`]).
    hosts: foldhash::HashMap<Box<str>, Prefixes>,
    /// Routes without a `host`.
    any_host: Prefixes,
}

impl Router {
    /// A router over `routes`, in any order: see [`Router`] for the order they match in.
    pub fn new(mut routes: Vec<Arc<Route>>) -> Self {
        routes.sort_by(|a, b| {
            b.path_prefix
                .len()
                .cmp(&a.path_prefix.len())
                .then(b.host.is_some().cmp(&a.host.is_some()))
                .then(a.methods.is_empty().cmp(&b.methods.is_empty()))
        });
        let mut hosts: foldhash::HashMap<Box<str>, Prefixes> = foldhash::HashMap::default();
        let mut any_host = Prefixes::default();
        // In the sorted order, so that each tree node keeps its routes with those for
        // some methods first, then config order (the sort is stable).
        for route in &routes {
            match route.host.as_deref() {
                Some(h) => hosts.entry(h.into()).or_default().insert(route.clone()),
                None => any_host.insert(route.clone()),
            }
        }
        Self {
            routes,
            hosts,
            any_host,
        }
    }

    /// The route for a `method` request to `host` (any case, port ignored) and `path`:
    /// the route with the longest prefix that matches `path` (as a prefix, or on whole
    /// segments for `path_match = "segments"`) and `method`; at equal prefixes, one for
    /// this host before one for any host, and one for some methods before one for any.
    pub fn find(
        &self,
        host: Option<&str>,
        path: &str,
        method: &http::Method,
    ) -> Option<&Arc<Route>> {
        let own = match host {
            Some(h) if !self.hosts.is_empty() => self.host_prefixes(strip_port(h)),
            _ => None,
        };
        let path = path.as_bytes();
        let mut own = own.map(|p| p.walk(path)).into_iter().flatten();
        let mut any = self.any_host.walk(path);
        // Both walks yield their matching prefixes shortest first; a longer match
        // replaces a shorter one, and at one length the host's routes go first.
        let (mut h, mut a) = (own.next(), any.next());
        let mut best = None;
        loop {
            let found = match (h, a) {
                (None, None) => return best,
                (Some((hl, hr)), Some((al, ar))) if hl == al => {
                    (h, a) = (own.next(), any.next());
                    pick(hr, hl, path, method).or_else(|| pick(ar, al, path, method))
                }
                (Some((hl, hr)), Some((al, _))) if hl < al => {
                    h = own.next();
                    pick(hr, hl, path, method)
                }
                (Some((hl, hr)), None) => {
                    h = own.next();
                    pick(hr, hl, path, method)
                }
                (_, Some((al, ar))) => {
                    a = any.next();
                    pick(ar, al, path, method)
                }
            };
            if found.is_some() {
                best = found;
            }
        }
    }

    /// The prefix tree of `host`'s own routes (ASCII case ignored), if it has any.
    fn host_prefixes(&self, host: &str) -> Option<&Prefixes> {
        if host.bytes().any(|b| b.is_ascii_uppercase()) {
            self.hosts.get(host.to_ascii_lowercase().as_str())
        } else {
            self.hosts.get(host)
        }
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

/// Of `routes`, whose prefix is the first `len` bytes of `path`, the first that admits
/// the request: on whole segments when asked, and for its method.
fn pick<'r>(
    routes: &'r [Arc<Route>],
    len: usize,
    path: &[u8],
    method: &http::Method,
) -> Option<&'r Arc<Route>> {
    // The prefix matches whole segments when the path ends with it, goes on with `/`,
    // or the prefix itself ends with `/`.
    let on_segment = len == path.len() || path[len] == b'/' || (len > 0 && path[len - 1] == b'/');
    routes.iter().find(|r| {
        (!r.segments || on_segment) && (r.methods.is_empty() || r.methods.contains(method))
    })
}

/// Routes by path prefix, as a radix tree over the prefixes' bytes: each edge carries a
/// run of bytes, the edges out of a node start with distinct bytes (sorted, found by
/// binary search), and a node holds the routes whose prefix ends there. Finding every
/// prefix of a path takes one walk down the path's bytes.
#[derive(Debug, Default)]
struct Prefixes {
    root: Node,
}

#[derive(Debug, Default)]
struct Node {
    /// Routes whose prefix ends at this node, in matching order.
    routes: Vec<Arc<Route>>,
    /// Edges to longer prefixes, by their label's first byte.
    edges: Vec<Edge>,
}

#[derive(Debug)]
struct Edge {
    /// The bytes this edge adds to the prefix (never empty).
    label: Box<[u8]>,
    node: Node,
}

impl Prefixes {
    fn insert(&mut self, route: Arc<Route>) {
        let key = route.path_prefix.as_bytes().to_vec();
        self.root.insert(&key, route);
    }

    /// The nodes with routes along `path`: (prefix length in bytes, their routes),
    /// shortest prefix first.
    fn walk<'t, 'p>(&'t self, path: &'p [u8]) -> Walk<'t, 'p> {
        Walk {
            node: Some(&self.root),
            path,
            len: 0,
        }
    }
}

impl Node {
    fn insert(&mut self, key: &[u8], route: Arc<Route>) {
        let Some(&first) = key.first() else {
            self.routes.push(route);
            return;
        };
        match self.edges.binary_search_by_key(&first, |e| e.label[0]) {
            Ok(i) => {
                let edge = &mut self.edges[i];
                let common = edge
                    .label
                    .iter()
                    .zip(key)
                    .take_while(|(a, b)| a == b)
                    .count();
                if common < edge.label.len() {
                    // Split the edge where the new key leaves it.
                    let rest: Box<[u8]> = edge.label[common..].into();
                    let below = std::mem::take(&mut edge.node);
                    edge.node.edges.push(Edge {
                        label: rest,
                        node: below,
                    });
                    edge.label = key[..common].into();
                }
                edge.node.insert(&key[common..], route);
            }
            Err(i) => {
                let node = Node {
                    routes: vec![route],
                    edges: Vec::new(),
                };
                self.edges.insert(
                    i,
                    Edge {
                        label: key.into(),
                        node,
                    },
                );
            }
        }
    }
}

/// A walk down a [`Prefixes`] tree along a path (see [`Prefixes::walk`]).
struct Walk<'t, 'p> {
    node: Option<&'t Node>,
    path: &'p [u8],
    /// Bytes of the path matched to reach `node`.
    len: usize,
}

impl<'t> Iterator for Walk<'t, '_> {
    type Item = (usize, &'t [Arc<Route>]);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let node = self.node?;
            let here = (self.len, node.routes.as_slice());
            let rest = &self.path[self.len..];
            self.node = rest.first().and_then(|b| {
                let i = node.edges.binary_search_by_key(b, |e| e.label[0]).ok()?;
                let edge = &node.edges[i];
                rest.starts_with(&edge.label).then(|| {
                    self.len += edge.label.len();
                    &edge.node
                })
            });
            if !here.1.is_empty() {
                return Some(here);
            }
        }
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
mod tests;
