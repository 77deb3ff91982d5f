//! The config rules that are not types: ranges, formats and keys that depend on each
//! other, each recorded against its key path (located to `LINE:COLUMN` when reported).
//!
//! These checks read only the [`Config`]: no file, no network. Rules that need what is
//! built from a section (a limit's tiers, a route's upstream, a certificate) are made
//! where that is built, during [`crate::snapshot::Snapshot::build`].

use super::{Config, Problems, StoreConfig};
use std::net::SocketAddr;

/// `[server]` and `[log]`, and the keys of `[identity]` that depend on `[server]`.
pub fn server_and_log(cfg: &Config, problems: &mut Problems) {
    let server = &cfg.server;
    let client_ca = server.tls.as_ref().and_then(|t| t.client_ca.as_ref());
    if cfg.identity.client_cert_subject_as_caller && client_ca.is_none() {
        problems.error(
            "identity.client_cert_subject_as_caller",
            "needs server.tls.client_ca (only verified client certificates name callers)",
        );
    }
    if cfg.identity.failed_auth_limit.window.as_millis() < 1_000 {
        problems.error("identity.failed_auth_limit.window", "must be at least 1s");
    }
    if let Some(token) = &server.admin_token_sha256 {
        if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
            problems.error(
                "server.admin_token_sha256",
                "must be 64 hex characters: the SHA-256 of the admin token (e.g. `printf %s \"$TOKEN\" | sha256sum`)",
            );
        }
    }
    if server.workers == Some(0) {
        problems.error(
            "server.workers",
            "must be at least 1 (leave it out for one per CPU)",
        );
    }
    if server.header_read_timeout.0.is_zero() {
        problems.error("server.header_read_timeout", "must be more than 0");
    }
    if !(1..=1_000_000).contains(&server.max_delayed) {
        problems.error(
            "server.max_delayed",
            "must be between 1 and 1000000 (about 33 KB each); limits that must not delay use on_limit = \"reject\"",
        );
    }
    if server.max_connections_per_ip == 0 {
        problems.error(
            "server.max_connections_per_ip",
            "must be at least 1 (to not cap one address below the whole listener, set it to server.max_connections)",
        );
    }
    if !(1..=100).contains(&server.descriptor_share_per_ip) {
        problems.error(
            "server.descriptor_share_per_ip",
            "must be between 1 and 100 (a percentage of the descriptor budget; 100 turns the share off)",
        );
    }
    if server.send_timeout.0.is_zero() {
        problems.error("server.send_timeout", "must be more than 0");
    }
    if server.body_timeout.0.is_zero() {
        problems.error("server.body_timeout", "must be more than 0");
    }
    if server.tunnel_idle_timeout.is_some_and(|t| t.0.is_zero()) {
        problems.error(
            "server.tunnel_idle_timeout",
            "must be more than 0 (leave it out to use server.idle_timeout)",
        );
    }
    let level = &cfg.log.level;
    if !["trace", "debug", "info", "warn", "error", "off"].contains(&level.as_str())
        && tracing_subscriber::EnvFilter::try_new(level).is_err()
    {
        problems.error(
            "log.level",
            format!("{level:?} is not a level (trace, debug, info, warn, error) or a filter"),
        );
    }
}

/// A listen address at `path` (`server.listen`, `server.admin_listen`), parsed.
pub fn addr(path: &str, value: &str, problems: &mut Problems) -> Option<SocketAddr> {
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

/// `limits.trusted_only` without `identity.trusted_proxies` (a warning), `[headers]` (each
/// style at most once; with the IETF style, limit names must be printable ASCII, as
/// `RateLimit` headers carry them as structured-field strings) and
/// `[rate_limit_endpoint]`.
pub fn headers_and_endpoint(cfg: &Config, problems: &mut Problems) {
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
    let styles = &cfg.headers.style;
    for (i, style) in styles.iter().enumerate() {
        if styles[..i].contains(style) {
            problems.error(
                format!("headers.style[{i}]"),
                format!("{:?} is listed twice", style.name()),
            );
        }
    }
    if styles.contains(&super::HeaderStyle::Ietf) {
        for (i, l) in cfg.limits.iter().enumerate() {
            // An RFC 8941 sf-string holds printable ASCII only.
            if !l.name.bytes().all(|b| (b' '..=b'~').contains(&b)) {
                problems.error(
                    format!("limits[{i}].name"),
                    "must be printable ASCII with headers.style \"ietf\" (RateLimit headers carry it as a structured-field string)",
                );
            }
        }
    }
    if let Some(path) = &cfg.rate_limit_endpoint.path {
        if !path.starts_with('/') {
            problems.error(
                "rate_limit_endpoint.path",
                "must start with `/`, e.g. \"/rate_limit\"",
            );
        }
    }
}

/// `[[routes]]` as a whole: on a reload (`reload`), an empty file or one without routes
/// is refused (an editor or a deploy that truncated the file, or a half-written one,
/// would answer every request 404); at start, no routes is a warning.
pub fn routes(cfg: &Config, text: &str, reload: bool, problems: &mut Problems) {
    if reload && text.trim().is_empty() {
        problems.error("", "the file is empty; a reload needs a complete config");
    } else if cfg.routes.is_empty() && reload {
        problems.error(
            "routes",
            "no [[routes]]: a reload would answer every request 404, so it is refused",
        );
    } else if cfg.routes.is_empty() {
        problems.warn("routes", "no [[routes]]: every request will get 404");
    }
}

/// The keys of `[store]` that hold for every backend, and those of the memory store.
pub fn store(cfg: &StoreConfig, problems: &mut Problems) {
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
    fleet(cfg, problems);
    if cfg.backend == super::Backend::Memory {
        if !cfg.shards.is_empty() {
            problems.warn("store.shards", "ignored: backend is \"memory\"");
        }
        if cfg.clock == super::StoreClock::Redis {
            problems.error(
                "store.clock",
                "\"redis\" needs backend = \"redis\" (the memory store has only the gateway's clock); use \"gateway\"",
            );
        }
        if cfg.max_callers == 0 {
            problems.error("store.max_callers", "must be at least 1");
        }
    }
}

/// `store.fleet_size` and `store.fleet_heartbeat` (`on_error = "local"`).
fn fleet(cfg: &StoreConfig, problems: &mut Problems) {
    match &cfg.fleet_size {
        Some(super::FleetSize::Count(n)) if *n < 1 => problems.error(
            "store.fleet_size",
            format!("{n} gateways: must be at least 1, or \"auto\""),
        ),
        Some(super::FleetSize::Named(s)) if s != "auto" => problems.error(
            "store.fleet_size",
            format!("{s:?}: must be a number of gateways (at least 1) or \"auto\""),
        ),
        Some(super::FleetSize::Named(_)) if cfg.backend == super::Backend::Memory => problems
            .error(
                "store.fleet_size",
                "\"auto\" counts gateways in Redis: it needs backend = \"redis\"",
            ),
        Some(_) if cfg.on_error != super::OnError::Local => problems.warn(
            "store.fleet_size",
            "ignored: it divides quotas only with on_error = \"local\"",
        ),
        _ => {}
    }
    if cfg.fleet_heartbeat.0 < std::time::Duration::from_millis(10) {
        problems.error("store.fleet_heartbeat", "must be at least 10ms");
    }
}

/// The headers tollgate must read (`identity.api_key_header`, `limits.by =
/// "header:NAME"`), each with its key path: with `server.underscores_in_headers` off,
/// one with `_` in its name would be dropped before it is read, an error at its key.
pub fn read_headers<'a>(
    cfg: &'a Config,
    underscores: bool,
    problems: &mut Problems,
) -> Vec<(String, &'a str)> {
    let mut read = vec![(
        "identity.api_key_header".to_string(),
        cfg.identity.api_key_header.as_str(),
    )];
    for (i, l) in cfg.limits.iter().enumerate() {
        if let Some(name) = l.by.header() {
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
    read
}

/// A warning when a reload moves callers to other shards or other keys, where they start
/// a fresh window: the shard list (its primaries or Sentinel masters, in order) changed,
/// or `mode`, `key_prefix` or `hash_key` did. Replica changes move nobody.
pub fn reshard_warning(old: &StoreConfig, new: &StoreConfig) -> Option<(&'static str, String)> {
    if old.backend != super::Backend::Redis || new.backend != super::Backend::Redis {
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
    use crate::config::{Backend, ShardConfig};

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
