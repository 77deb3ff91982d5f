//! A config snapshot: everything one request needs, built from a [`Config`] in one go.
//!
//! Building is validation: each part records its problems against key paths, and a
//! snapshot exists only when there are none. The only I/O of building is reading the
//! TLS certificate files of `[server.tls]` (Redis connections are opened by
//! [`crate::server::Gateway`] when a new store is first used), so `tollgate check`
//! builds exactly what the gateway would run. A request holds the
//! `Arc<Snapshot>` it started with; a reload swaps in a whole new one.

use crate::config::{
    Backend, Config, ConfigFile, ConfigReport, LogConfig, Problems, ServerConfig, StoreClock,
    StoreConfig,
};
use crate::identity::Identities;
use crate::limiter::cache::OverLimitCache;
use crate::limiter::key::KeyScheme;
use crate::limiter::lease::LeaseTable;
use crate::limiter::store::memory::MemoryStore;
use crate::limiter::store::redis::RedisStore;
use crate::limiter::store::AnyStore;
use crate::limiter::{Limit, Limiter};
use crate::proxy::forward::Upstream;
use crate::proxy::route::{Route, Router};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

/// The runtime form of one config file.
#[derive(Debug)]
pub struct Snapshot {
    /// The config it was built from.
    pub config: Config,
    /// Step 0: the header rules of the edge (`server.underscores_in_headers`, and the
    /// configured headers tollgate reads or sets).
    pub edge: crate::http::Edge,
    /// Step 1: API keys, tiers, trusted proxies.
    pub identities: Identities,
    /// Every `[[limits]]` entry, in config order (for `GET /rate_limit`).
    pub limits: Vec<Arc<Limit>>,
    /// Step 2: routes.
    pub router: Router,
    /// Steps 3 and 5: the store and its policy.
    pub limiter: Limiter,
    /// `server.listen`, parsed.
    pub listen: SocketAddr,
    /// `server.admin_listen`, parsed.
    pub admin_listen: Option<SocketAddr>,
    /// `[server.tls]`, loaded: the certificates new handshakes use. Kept from the
    /// previous snapshot when a reload removes `[server.tls]` (the listener keeps TLS
    /// until a restart).
    pub tls: Option<Arc<crate::tls::Tls>>,
    /// Warnings found while building (already rendered).
    pub warnings: Vec<String>,
    /// SHA-256 of the file's text, hex: tells whether a file really changed.
    pub content_hash: String,
    /// SHA-256 of the `store.hash_key` in use (written inline or read from
    /// `store.hash_key_file`), hex; empty without one. A reload compares it to warn
    /// when the file's contents changed (every caller moves to new keys).
    pub hash_key_digest: String,
    /// 1 for the config the gateway started with, +1 per successful reload (set by the
    /// gateway when it swaps the snapshot in).
    pub generation: u64,
    /// The `[server]` and `[log]` the process runs with: read at start only, so a reload
    /// carries them over from the snapshot it replaces (`config` has the file's).
    pub running: Arc<(ServerConfig, LogConfig)>,
}

impl Snapshot {
    /// The parts the request path reads, borrowed: see [`crate::proxy::Gate`].
    pub fn gate(&self) -> crate::proxy::Gate<'_> {
        crate::proxy::Gate {
            edge: &self.edge,
            identities: &self.identities,
            router: &self.router,
            limiter: &self.limiter,
            limits: &self.limits,
            rate_limit_path: self.config.rate_limit_endpoint.path.as_deref(),
            log_client_ip: self.config.log.client_ip,
            headers: crate::proxy::headers::Styles::new(&self.config.headers.style),
        }
    }

    /// Build and validate a snapshot from `file`. When `previous` runs with the same
    /// `[store]`, its store (and its Redis connections) is reused; otherwise a new store
    /// is built, not yet started.
    ///
    /// Errors: a [`ConfigReport`] with every problem found, each tied to a key path.
    pub fn build(file: &ConfigFile, previous: Option<&Snapshot>) -> Result<Snapshot, ConfigReport> {
        let cfg = &file.config;
        // Unknown keys found (and skipped) while parsing come first.
        let mut problems = file.problems.clone();

        let listen = parse_addr("server.listen", &cfg.server.listen, &mut problems);
        let admin_listen = cfg
            .server
            .admin_listen
            .as_ref()
            .and_then(|a| parse_addr("server.admin_listen", a, &mut problems));
        let tls = load_tls(file, previous, &mut problems);
        if cfg.identity.failed_auth_limit.window.as_millis() < 1_000 {
            problems.error("identity.failed_auth_limit.window", "must be at least 1s");
        }
        if let Some(token) = &cfg.server.admin_token_sha256 {
            if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
                problems.error(
                    "server.admin_token_sha256",
                    "must be 64 hex characters: the SHA-256 of the admin token (e.g. `printf %s \"$TOKEN\" | sha256sum`)",
                );
            }
        }
        if cfg.server.workers == Some(0) {
            problems.error(
                "server.workers",
                "must be at least 1 (leave it out for one per CPU)",
            );
        }
        if cfg.server.header_read_timeout.0.is_zero() {
            problems.error("server.header_read_timeout", "must be more than 0");
        }
        if !(1..=1_000_000).contains(&cfg.server.max_delayed) {
            problems.error(
                "server.max_delayed",
                "must be between 1 and 1000000 (about 33 KB each); limits that must not delay use on_limit = \"reject\"",
            );
        }
        if cfg.server.max_connections_per_ip == 0 {
            problems.error(
                "server.max_connections_per_ip",
                "must be at least 1 (to not cap one address below the whole listener, set it to server.max_connections)",
            );
        }
        if !(1..=100).contains(&cfg.server.descriptor_share_per_ip) {
            problems.error(
                "server.descriptor_share_per_ip",
                "must be between 1 and 100 (a percentage of the descriptor budget; 100 turns the share off)",
            );
        }
        if cfg.server.send_timeout.0.is_zero() {
            problems.error("server.send_timeout", "must be more than 0");
        }
        if cfg.server.body_timeout.0.is_zero() {
            problems.error("server.body_timeout", "must be more than 0");
        }
        if cfg
            .server
            .tunnel_idle_timeout
            .is_some_and(|t| t.0.is_zero())
        {
            problems.error(
                "server.tunnel_idle_timeout",
                "must be more than 0 (leave it out to use server.idle_timeout)",
            );
        }
        if !["trace", "debug", "info", "warn", "error", "off"].contains(&cfg.log.level.as_str())
            && tracing_subscriber::EnvFilter::try_new(&cfg.log.level).is_err()
        {
            problems.error(
                "log.level",
                format!(
                    "{:?} is not a level (trace, debug, info, warn, error) or a filter",
                    cfg.log.level
                ),
            );
        }

        let base_dir = crate::tls::base_dir(&file.path);
        let identities = Identities::build_for(
            cfg,
            &base_dir,
            previous.map(|p| &p.identities),
            &mut problems,
        );
        let mut tiers = identities.tiers();
        if cfg.identity.clients_file.is_some() {
            // The keys file may give any tier a limit names, now or after a reload.
            tiers.extend(
                cfg.limits
                    .iter()
                    .flat_map(|l| l.quota.keys().map(|t| std::sync::Arc::from(t.as_str()))),
            );
        }

        // PEM paths in the config are relative to the config file's directory. Not
        // `tls::base_dir`: for a bare file name this base is "", not ".", so error
        // messages name "ca.pem" rather than "./ca.pem".
        let base_dir = file
            .path
            .parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or_default();
        let mut upstreams = HashMap::new();
        // One pool part per worker of the runtime that runs ([server] is read at start).
        let running = previous.map_or(&cfg.server, |p| &p.running.0);
        let pool_parts = crate::worker::parts(
            running.runtime == crate::config::RuntimeShape::PerCore,
            running.workers,
        );
        for (i, u) in cfg.upstreams.iter().enumerate() {
            if upstreams.contains_key(&u.name) {
                problems.error(
                    format!("upstreams[{i}].name"),
                    format!("duplicate upstream name {:?}", u.name),
                );
            } else if let Some(up) = Upstream::build(i, u, &base_dir, pool_parts, &mut problems) {
                upstreams.insert(u.name.clone(), Arc::new(up));
            }
        }

        let mut limits = HashMap::new();
        for (i, l) in cfg.limits.iter().enumerate() {
            if limits.contains_key(&l.name) {
                problems.error(
                    format!("limits[{i}].name"),
                    format!("duplicate limit name {:?}", l.name),
                );
            } else if l.name == crate::limiter::FAILED_AUTH {
                problems.error(
                    format!("limits[{i}].name"),
                    "\"failed_auth\" is reserved for identity.failed_auth_limit",
                );
            } else if let Some(limit) = Limit::build(i, l, &tiers, &mut problems) {
                limits.insert(l.name.clone(), Arc::new(limit));
            }
        }

        if cfg.identity.trusted_proxies.is_empty() {
            for (i, l) in cfg.limits.iter().enumerate() {
                if l.trusted_only {
                    problems.warn(
                        format!("limits[{i}].trusted_only"),
                        "identity.trusted_proxies is empty: the header is never believed, so this limit counts client IPs",
                    );
                }
            }
        }
        check_headers(cfg, &mut problems);
        if let Some(path) = &cfg.rate_limit_endpoint.path {
            if !path.starts_with('/') {
                problems.error(
                    "rate_limit_endpoint.path",
                    "must start with `/`, e.g. \"/rate_limit\"",
                );
            }
        }

        let declared: HashSet<&str> = cfg
            .upstreams
            .iter()
            .map(|u| u.name.as_str())
            .chain(cfg.limits.iter().map(|l| l.name.as_str()))
            .collect();
        let mut routes = Vec::new();
        let mut seen = HashMap::new();
        for (i, r) in cfg.routes.iter().enumerate() {
            let mut methods = r.methods.clone();
            methods.sort();
            methods.dedup();
            let id = (
                r.host.as_ref().map(|h| h.to_ascii_lowercase()),
                r.path_prefix.to_string(),
                methods,
            );
            if let Some(first) = seen.insert(id, i) {
                problems.error(
                    format!("routes[{i}].path_prefix"),
                    format!("routes[{first}] already has this host, path_prefix and methods"),
                );
                continue;
            }
            if let Some(route) = Route::build(i, r, &upstreams, &limits, &declared, &mut problems) {
                routes.push(Arc::new(route));
            }
        }
        if previous.is_some() && file.text.trim().is_empty() {
            // An editor or a deploy that truncated the file before writing it.
            problems.error("", "the file is empty; a reload needs a complete config");
        } else if cfg.routes.is_empty() && previous.is_some() {
            // Applying it would answer every request 404: most likely a half-written or
            // wrong file, so a reload refuses it (a restart accepts it, with a warning).
            problems.error(
                "routes",
                "no [[routes]]: a reload would answer every request 404, so it is refused",
            );
        } else if cfg.routes.is_empty() {
            problems.warn("routes", "no [[routes]]: every request will get 404");
        }

        // Keep the store (and its connections, or the memory store's windows) and the
        // over-limit cache when [store] is unchanged, or when both are memory stores;
        // drop cached rejections of limits whose definition changed. The new [store] is
        // validated either way.
        // Secrets and certificates named in [store] are read now, on every load and
        // reload: a kept store takes the newly read ones for its next connections.
        let store_dir = crate::tls::base_dir(&file.path);
        let hash_key = crate::config::secrets::secret(
            "store.hash_key",
            cfg.store.hash_key.as_deref(),
            cfg.store.hash_key_file.as_deref(),
            &store_dir,
            &mut problems,
        );
        let fresh = build_store(&cfg.store, &store_dir, &mut problems);
        let keep = previous.filter(|prev| {
            prev.config.store == cfg.store
                || (prev.config.store.backend == Backend::Memory
                    && cfg.store.backend == Backend::Memory)
        });
        let (store, cache, leases) = match keep {
            Some(prev) => {
                if let (AnyStore::Redis(kept), Some(AnyStore::Redis(fresh))) =
                    (&**prev.limiter.store(), &fresh)
                {
                    kept.take_dial_settings(fresh);
                }
                let cache = prev.limiter.cache().clone();
                // By name, so that a reload of 10,000 limits is not 10,000² comparisons.
                let now: HashMap<&str, &crate::config::LimitConfig> =
                    cfg.limits.iter().map(|l| (l.name.as_str(), l)).collect();
                for old in &prev.config.limits {
                    if now.get(old.name.as_str()) != Some(&old) {
                        cache.forget_limit(&old.name);
                    }
                }
                (
                    Some(prev.limiter.store().clone()),
                    cache,
                    prev.limiter.leases().clone(),
                )
            }
            None => (
                fresh.map(Arc::new),
                Arc::new(OverLimitCache::new(cfg.store.local_cache_size)),
                Arc::new(LeaseTable::new()),
            ),
        };
        let hash_key_digest = hash_key.as_deref().map(content_hash).unwrap_or_default();
        if let Some(prev) = previous {
            let warning = reshard_warning(&prev.config.store, &cfg.store)
                // Moving the same key from `hash_key` to `hash_key_file` (or back)
                // moves nobody.
                .filter(|(key, _)| {
                    *key != "store.hash_key" || prev.hash_key_digest != hash_key_digest
                });
            if let Some((key, warning)) = warning {
                problems.warn(key, warning);
            } else if prev.hash_key_digest != hash_key_digest
                && cfg.store.backend == Backend::Redis
                && prev.config.store.backend == Backend::Redis
            {
                problems.warn(
                    "store.hash_key_file",
                    "the hash key read from the file changed: every caller gets new keys and starts a fresh window",
                );
            }
        }

        // [server] is read at start only: a reload keeps the running one.
        let running = previous
            .map(|p| p.running.clone())
            .unwrap_or_else(|| Arc::new((cfg.server.clone(), cfg.log.clone())));
        let edge = edge_rules(cfg, &running.0, &mut problems);

        let report = ConfigReport {
            path: file.path.clone(),
            text: file.text.clone(),
            problems,
        };
        if !report.problems.is_ok() {
            return Err(report);
        }
        let (Some(listen), Some(store)) = (listen, store) else {
            return Err(report);
        };
        let keys = KeyScheme::new(&cfg.store.key_prefix, hash_key.as_deref());
        Ok(Snapshot {
            config: cfg.clone(),
            identities,
            router: Router::new(routes),
            limits: cfg
                .limits
                .iter()
                .filter_map(|l| limits.get(&l.name).cloned())
                .collect(),
            limiter: Limiter::new(store, cache, leases, keys, cfg.store.on_error)
                .with_failed_auth_limit(
                    cfg.identity.failed_auth_limit.quota,
                    cfg.identity.failed_auth_limit.window.as_millis(),
                )
                .with_reserve_in_flight(cfg.store.reserve_in_flight)
                .with_check_from_charge(
                    cfg.store.check_from_charge.as_millis(),
                    cfg.store.local_cache_size,
                )
                .with_top(
                    previous
                        .map(|p| p.limiter.top().clone())
                        .unwrap_or_default(),
                )
                .with_blocked(
                    previous
                        .map(|p| p.limiter.blocked().clone())
                        .unwrap_or_default(),
                ),
            listen,
            admin_listen,
            tls,
            warnings: report.warning_lines(),
            content_hash: content_hash(&file.text),
            hash_key_digest,
            generation: 0,
            running,
            edge,
        })
    }

    /// A one-line summary, as printed by `tollgate check`.
    pub fn summary(&self) -> String {
        let c = &self.config;
        let store = match c.store.backend {
            Backend::Memory => "memory store".to_string(),
            Backend::Redis if c.store.mode == crate::config::StoreMode::Cluster => {
                format!(
                    "redis cluster store with {} seed node(s)",
                    c.store.nodes.len()
                )
            }
            Backend::Redis => format!("redis store with {} shard(s)", c.store.shards.len()),
        };
        let store = match c.store.clock {
            StoreClock::Gateway => store,
            StoreClock::Redis => format!("{store}, {} clock", StoreClock::Redis.name()),
        };
        let listen = match &c.server.tls {
            Some(tls) => format!(
                "{} (TLS, {} certificate(s))",
                self.listen,
                1 + tls.sni.len()
            ),
            None => self.listen.to_string(),
        };
        format!(
            "ok: listen {}, {} route(s), {} upstream(s), {} limit(s), {} client(s), {}",
            listen,
            self.router.len(),
            c.upstreams.len(),
            c.limits.len(),
            self.identities.keys().clients(),
            store
        )
    }
}

/// The edge's header rules: `underscores` (`server.underscores_in_headers`) and the
/// headers the config makes tollgate read or set (the credential header, the caller and
/// tier headers, `by = "header:NAME"`), whose other spellings are always dropped. A
/// header tollgate must read that has `_` in its name needs `underscores`, or it would
/// be dropped before it is read: an error at its key.
fn edge_rules(
    cfg: &Config,
    server: &crate::config::ServerConfig,
    problems: &mut Problems,
) -> crate::http::Edge {
    let underscores = server.underscores_in_headers;
    let via = server
        .via
        .pseudonym()
        .and_then(|name| match crate::http::via::Via::new(name) {
            Ok(via) => Some(via),
            Err(e) => {
                problems.error("server.via", e);
                None
            }
        });
    let id = &cfg.identity;
    let mut read = vec![(
        "identity.api_key_header".to_string(),
        id.api_key_header.as_str(),
    )];
    for (i, l) in cfg.limits.iter().enumerate() {
        if let Some(name) = l.by.strip_prefix("header:") {
            read.push((format!("limits[{i}].by"), name));
        }
    }
    if !underscores {
        for (key, name) in &read {
            if name.contains('_') {
                problems.error(
                    key.clone(),
                    format!("{name:?} has `_` in its name, and such request headers are dropped unless server.underscores_in_headers = true: use `-` (or set that key)"),
                );
            }
        }
    }
    let set = [
        id.forward_caller_header.as_deref(),
        id.forward_tier_header.as_deref(),
    ];
    crate::http::Edge::new(
        underscores,
        read.iter()
            .map(|(_, n)| *n)
            .chain(set.into_iter().flatten()),
    )
    .with_via(via)
}

/// Load `[server.tls]` (relative paths against the config file's directory), and check
/// the keys that depend on it. With no `[server.tls]` in a reload of a gateway that
/// runs TLS, the previous certificates stay (with a warning).
fn load_tls(
    file: &ConfigFile,
    previous: Option<&Snapshot>,
    problems: &mut Problems,
) -> Option<Arc<crate::tls::Tls>> {
    let cfg = &file.config;
    let client_ca = cfg.server.tls.as_ref().and_then(|t| t.client_ca.as_ref());
    if cfg.identity.client_cert_subject_as_caller && client_ca.is_none() {
        problems.error(
            "identity.client_cert_subject_as_caller",
            "needs server.tls.client_ca (only verified client certificates name callers)",
        );
    }
    match (&cfg.server.tls, previous) {
        (Some(tls), _) => {
            let base = crate::tls::base_dir(&file.path);
            crate::tls::Tls::build(tls, &base, problems).map(Arc::new)
        }
        (None, Some(prev)) if prev.tls.is_some() => {
            problems.warn(
                "server.tls",
                "removed: the listener keeps TLS, with the current certificates, until a restart",
            );
            prev.tls.clone()
        }
        (None, _) => None,
    }
}

/// The digest of the TLS files `file` names (see [`crate::tls::files_digest`]); empty
/// without `[server.tls]`. A reload whose config text and TLS files are both unchanged
/// has nothing to do.
pub fn tls_digest(file: &ConfigFile) -> String {
    match &file.config.server.tls {
        Some(tls) => {
            crate::tls::files_digest(&crate::tls::files(tls, &crate::tls::base_dir(&file.path)))
        }
        None => String::new(),
    }
}

/// SHA-256 of a config file's text, hex.
pub fn content_hash(text: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

fn parse_addr(path: &str, value: &str, problems: &mut Problems) -> Option<SocketAddr> {
    match value.parse() {
        Ok(a) => Some(a),
        Err(_) => {
            problems.error(
                path,
                format!("{value:?} is not an address like \"127.0.0.1:8080\""),
            );
            None
        }
    }
}

/// Validate `[headers]`: each style at most once; with the IETF style, limit names must
/// be printable ASCII (`RateLimit` headers carry them as structured-field strings).
fn check_headers(cfg: &Config, problems: &mut Problems) {
    let styles = &cfg.headers.style;
    for (i, style) in styles.iter().enumerate() {
        if styles[..i].contains(style) {
            problems.error(
                format!("headers.style[{i}]"),
                format!("{:?} is listed twice", style.name()),
            );
        }
    }
    if styles.contains(&crate::config::HeaderStyle::Ietf) {
        for (i, l) in cfg.limits.iter().enumerate() {
            if !crate::proxy::headers::is_sf_string(&l.name) {
                problems.error(
                    format!("limits[{i}].name"),
                    "must be printable ASCII with headers.style \"ietf\" (RateLimit headers carry it as a structured-field string)",
                );
            }
        }
    }
}

/// Validate `[store]` and build the store it describes (no I/O).
fn build_store(
    cfg: &StoreConfig,
    base_dir: &std::path::Path,
    problems: &mut Problems,
) -> Option<AnyStore> {
    if cfg.timeout.0.is_zero() {
        problems.error("store.timeout", "must be more than 0");
    }
    if cfg.key_prefix.contains(char::is_whitespace) || cfg.key_prefix.contains(['{', '}']) {
        problems.error(
            "store.key_prefix",
            "must not contain white space or braces (braces mark the Redis Cluster hash tag)",
        );
    }
    if cfg.sweep_interval.0.is_zero() {
        problems.error("store.sweep_interval", "must be more than 0");
    }
    match cfg.backend {
        Backend::Memory => {
            if !cfg.shards.is_empty() {
                problems.warn("store.shards", "ignored: backend is \"memory\"");
            }
            if cfg.clock == StoreClock::Redis {
                problems.error(
                    "store.clock",
                    "\"redis\" needs backend = \"redis\" (the memory store has only the gateway's clock); use \"gateway\"",
                );
            }
            if cfg.max_callers == 0 {
                problems.error("store.max_callers", "must be at least 1");
            }
            Some(AnyStore::Memory(MemoryStore::with_max_callers(
                cfg.max_callers,
            )))
        }
        Backend::Redis => RedisStore::from_config_in(cfg, base_dir, problems).map(AnyStore::Redis),
    }
}

/// A warning when a reload moves callers to other shards or other keys, where they start
/// a fresh window: the shard list (its primaries or Sentinel masters, in order) changed,
/// or `mode`, `key_prefix` or `hash_key` did. Replica changes move nobody.
pub fn reshard_warning(old: &StoreConfig, new: &StoreConfig) -> Option<(&'static str, String)> {
    if old.backend != Backend::Redis || new.backend != Backend::Redis {
        return None;
    }
    let changed = if old.mode != new.mode {
        Some("store.mode")
    } else if old.key_prefix != new.key_prefix {
        Some("store.key_prefix")
    } else if old.hash_key != new.hash_key {
        Some("store.hash_key")
    } else {
        None
    };
    if let Some(key) = changed {
        return Some((
            key,
            format!("{key} changed: every caller gets new keys and starts a fresh window"),
        ));
    }
    let identity = |c: &StoreConfig| -> Vec<String> {
        c.shards
            .iter()
            .map(|s| match (&s.primary, &s.sentinel) {
                (Some(p), _) => p.clone(),
                (None, Some(sen)) => format!("sentinel:{}", sen.master),
                (None, None) => String::new(),
            })
            .collect()
    };
    let (old_ids, new_ids) = (identity(old), identity(new));
    if old_ids == new_ids {
        return None;
    }
    let (n, m) = (old_ids.len(), new_ids.len());
    let moved = if m > n && new_ids.starts_with(&old_ids) {
        format!("about {:.0}% of callers", 100.0 * (m - n) as f64 / m as f64)
    } else if n > m && old_ids.starts_with(&new_ids) {
        format!("about {:.0}% of callers", 100.0 * (n - m) as f64 / n as f64)
    } else {
        "callers of every changed or reordered shard (possibly most callers)".to_string()
    };
    Some((
        "store.shards",
        format!(
            "the shard list changed ({n} -> {m} shards): {moved} move to another shard and start a fresh window there; add or remove shards only at the end of the list"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ShardConfig;

    fn redis(n: usize) -> StoreConfig {
        StoreConfig {
            backend: Backend::Redis,
            shards: (0..n)
                .map(|i| ShardConfig {
                    primary: Some(format!("redis://10.0.0.{i}:6379")),
                    replicas: vec![],
                    sentinel: None,
                })
                .collect(),
            ..StoreConfig::default()
        }
    }

    #[test]
    fn reshard_warning_says_how_many_callers_move() {
        assert_eq!(reshard_warning(&redis(2), &redis(2)), None);
        let (key, w) = reshard_warning(&redis(3), &redis(4)).unwrap();
        assert_eq!(key, "store.shards");
        assert!(
            w.contains("3 -> 4 shards") && w.contains("about 25% of callers"),
            "{w}"
        );
        let mut reordered = redis(3);
        reordered.shards.swap(0, 2);
        assert!(reshard_warning(&redis(3), &reordered)
            .unwrap()
            .1
            .contains("possibly most callers"));
    }

    #[test]
    fn reshard_warning_names_the_key_that_changed() {
        let mut keyed = redis(2);
        keyed.hash_key = Some("new-secret".into());
        let (key, w) = reshard_warning(&redis(2), &keyed).unwrap();
        assert_eq!(key, "store.hash_key");
        assert!(w.starts_with("store.hash_key changed"), "{w}");
        let mut prefixed = redis(2);
        prefixed.key_prefix = "other:".into();
        assert_eq!(
            reshard_warning(&redis(2), &prefixed).unwrap().0,
            "store.key_prefix"
        );
    }
}
