//! A config snapshot: everything one request needs, built from a [`Config`] in one go.
//!
//! Building is validation: each part records its problems against key paths, and a
//! snapshot exists only when there are none. Building reads no file: every file the
//! config names (certificates and keys, the keys file, JWT keys, secret files, and the
//! system's trusted roots when a key asks for them) is read first, in one loading step
//! ([`Loaded::load`]; [`crate::config::files::named`] lists them all), and the builders
//! take their contents from what it read. Redis connections are opened by
//! [`crate::server::Gateway`] when a new store is first used. (The one question asked of
//! the system is how many CPUs the process may use, for the `per_core` pool parts when
//! `server.workers` is not set.) So `tollgate check` builds exactly what the gateway
//! would run, and a missing file is an error at the key that names it. A request holds
//! the `Arc<Snapshot>` it started with; a reload swaps in a whole new one.

use crate::config::{
    validate, Backend, Config, ConfigFile, ConfigReport, Files, LogConfig, Problems, ServerConfig,
    StoreClock, StoreConfig,
};
use crate::identity::Identities;
use crate::limiter::cache::OverLimitCache;
use crate::limiter::key::KeyScheme;
use crate::limiter::lease::LeaseTable;
use crate::limiter::store::memory::MemoryStore;
use crate::limiter::store::redis::RedisStore;
use crate::limiter::store::AnyStore;
use crate::limiter::{Limit, Limiter};
use crate::load::Loaded;
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
    /// `[tracing]`: the tracer, when tracing is on (kept by a reload that changes
    /// nothing of it; its exporter is started by the gateway).
    pub tracer: Option<Arc<crate::otel::Tracer>>,
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
            headers: crate::proxy::headers::Styles::of(&self.config.headers),
            tracer: self.tracer.as_ref(),
        }
    }

    /// Build and validate a snapshot from `file` and `loaded`, the files it names as
    /// [`Loaded::load`] read them (with the same `previous`); no I/O. When `previous` runs
    /// with the same `[store]`, its store (and its Redis connections) is reused;
    /// otherwise a new store is built, not yet started.
    ///
    /// Errors: a [`ConfigReport`] with every problem found, each tied to a key path (a
    /// file that could not be read is a problem at the key that names it).
    pub fn build(
        file: &ConfigFile,
        loaded: &Loaded,
        previous: Option<&Snapshot>,
    ) -> Result<Snapshot, ConfigReport> {
        let cfg = &file.config;
        let files = &loaded.files;
        // Unknown keys found (and skipped) while parsing come first.
        let mut problems = file.problems.clone();

        let listen = validate::addr("server.listen", &cfg.server.listen, &mut problems);
        let admin_listen = cfg
            .server
            .admin_listen
            .as_ref()
            .and_then(|a| validate::addr("server.admin_listen", a, &mut problems));
        validate::server_and_log(cfg, &mut problems);
        let tls = load_tls(file, files, previous, &mut problems);

        let identities = Identities::build_for(
            cfg,
            &crate::tls::base_dir(&file.path),
            files,
            loaded.keys.as_ref(),
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
            } else if let Some(up) = Upstream::build(i, u, files, pool_parts, &mut problems) {
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

        validate::headers_and_endpoint(cfg, &mut problems);

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
        validate::routes(cfg, &file.text, previous.is_some(), &mut problems);

        // Keep the store (and its connections, or the memory store's windows) and the
        // over-limit cache when [store] is unchanged, or when both are memory stores;
        // drop cached rejections of limits whose definition changed. The new [store] is
        // validated either way.
        // Secrets and certificates named in [store] were read by the loading step, on
        // every load and reload: a kept store takes the newly read ones for its next
        // connections.
        let hash_key = crate::config::secrets::secret(
            "store.hash_key",
            cfg.store.hash_key.as_deref(),
            cfg.store.hash_key_file.as_deref(),
            files,
            &mut problems,
        );
        let fresh = build_store(&cfg.store, files, &mut problems);
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
            let warning = validate::reshard_warning(&prev.config.store, &cfg.store)
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
        let tracer = crate::otel::Tracer::build(
            cfg,
            files,
            previous.and_then(|p| p.tracer.as_ref()),
            &mut problems,
        );

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
                )
                .with_blocks_started(
                    previous
                        .map(|p| p.limiter.blocks_started().clone())
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
            tracer,
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
    let read = validate::read_headers(cfg, underscores, problems);
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

/// Build `[server.tls]` from the files the loading step read. With no `[server.tls]` in
/// a reload of a gateway that runs TLS, the previous certificates stay (with a warning).
fn load_tls(
    file: &ConfigFile,
    files: &Files,
    previous: Option<&Snapshot>,
    problems: &mut Problems,
) -> Option<Arc<crate::tls::Tls>> {
    let cfg = &file.config;
    match (&cfg.server.tls, previous) {
        (Some(tls), _) => {
            let base = crate::tls::base_dir(&file.path);
            crate::tls::Tls::build(tls, &base, files, problems).map(Arc::new)
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

/// SHA-256 of a config file's text, hex.
pub fn content_hash(text: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// Validate `[store]` and build the store it describes (its files taken from `files`).
fn build_store(cfg: &StoreConfig, files: &Files, problems: &mut Problems) -> Option<AnyStore> {
    validate::store(cfg, problems);
    match cfg.backend {
        Backend::Memory => Some(AnyStore::Memory(MemoryStore::with_max_callers(
            cfg.max_callers,
        ))),
        Backend::Redis => RedisStore::from_loaded(cfg, files, problems).map(AnyStore::Redis),
    }
}
