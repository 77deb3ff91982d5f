//! Building the identity part of a snapshot from `[identity]`: the credential header,
//! trusted proxies, the key set (kept from the previous snapshot when its sources are
//! unchanged, else the one the loading step read from the keys file: [`read_keys`]),
//! `[identity.jwt]` and `[identity.auth_request]`, every problem recorded under
//! `identity.*`.

use super::keys::{KeyErrors, KeyProblem, KeySet, KeySource};
use super::{auth_request, Identities, JwtVerifier};
use crate::config::{Config, Files, IdentityConfig, Problems};
use arc_swap::ArcSwap;
use http::HeaderName;
use ipnet::IpNet;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

/// The loading step's part for the keys (`crate::load::Loaded::load`): the keys file
/// of `source` read into its key set, line by line under its size cap (never held
/// whole: it can hold millions of keys). Clients that `previous`'s set has unchanged
/// are shared with it. `None` without a keys file, and when `previous` was built from
/// the same source: it keeps its set (the file reloads on its own), so the file is not
/// read.
///
/// Errors: the problems of the keys, as [`KeySource::build`] finds them.
pub fn read_keys(
    source: &KeySource,
    previous: Option<&Identities>,
) -> Option<Result<Arc<KeySet>, KeyErrors>> {
    source.file.as_ref()?;
    if previous.is_some_and(|p| *p.key_source == *source) {
        return None;
    }
    let running = previous.map(|p| p.keys.load_full());
    Some(source.build(running.as_deref()).map(Arc::new))
}

impl Identities {
    /// Build from `[identity]`, recording problems under `identity.*`; the files it
    /// names (the keys file, `[identity.jwt]`'s) are read now, relative to the working
    /// directory. Tier and limit names in the keys file are not checked (see
    /// [`Identities::build_for`]).
    pub fn build(cfg: &IdentityConfig, problems: &mut Problems) -> Self {
        let dir = Path::new(".");
        let source = KeySource::of_identity(cfg, dir);
        let files = Files::read(crate::config::files::identity(cfg, dir));
        let keys = read_keys(&source, None);
        Self::build_with(cfg, source, &files, keys.as_ref(), None, problems)
    }

    /// Build the identity part of a whole config, without I/O: the keys file's set and
    /// `[identity.jwt]`'s key files come from `files` (the loading step's, made with the
    /// same `previous`; `base_dir`, the config file's directory, resolves the keys
    /// file's path). The keys file's tiers and quota overrides are checked against its
    /// limits. When `previous` was built from the same keys (inline list, keys file
    /// path and the names they are checked against), its key set is kept, and so is the
    /// cell the keys file's reloads swap.
    pub fn build_for(
        cfg: &Config,
        base_dir: &Path,
        files: &Files,
        keys: Option<&Result<Arc<KeySet>, KeyErrors>>,
        previous: Option<&Identities>,
        problems: &mut Problems,
    ) -> Self {
        let source = KeySource::of_config(cfg, base_dir);
        Self::build_with(&cfg.identity, source, files, keys, previous, problems)
    }

    fn build_with(
        cfg: &IdentityConfig,
        source: KeySource,
        files: &Files,
        keys: Option<&Result<Arc<KeySet>, KeyErrors>>,
        previous: Option<&Identities>,
        problems: &mut Problems,
    ) -> Self {
        let header =
            match HeaderName::from_bytes(cfg.api_key_header.to_ascii_lowercase().as_bytes()) {
                Ok(h) => h,
                Err(_) => {
                    problems.error(
                        "identity.api_key_header",
                        format!("{:?} is not a valid header name", cfg.api_key_header),
                    );
                    http::header::AUTHORIZATION
                }
            };
        let scheme_prefixed = header == http::header::AUTHORIZATION;
        if cfg.anonymous_tier.trim().is_empty() {
            problems.error("identity.anonymous_tier", "must not be empty");
        }

        let mut trusted_proxies = Vec::new();
        for (i, cidr) in cfg.trusted_proxies.iter().enumerate() {
            match parse_cidr(cidr) {
                Some(net) => trusted_proxies.push(net),
                None => problems.error(
                    format!("identity.trusted_proxies[{i}]"),
                    format!("{cidr:?} is not a CIDR (e.g. \"10.0.0.0/8\") or an IP address"),
                ),
            }
        }

        if !(1..=128).contains(&cfg.ipv6_prefix_len) {
            problems.error(
                "identity.ipv6_prefix_len",
                format!(
                    "{} is not a prefix length: must be between 1 and 128 (64 keys a subscriber's /64; 128 keys each address, for callers inside a cluster or a LAN)",
                    cfg.ipv6_prefix_len
                ),
            );
        }
        let ipv6_prefix_len = cfg.ipv6_prefix_len.clamp(1, 128) as u8;
        if cfg.clients_file_max_removed_percent > 100 {
            problems.error(
                "identity.clients_file_max_removed_percent",
                format!(
                    "{} is not a percentage: must be between 0 and 100",
                    cfg.clients_file_max_removed_percent
                ),
            );
        }

        let kept = previous.filter(|p| *p.key_source == source);
        let keys = match kept {
            Some(p) => p.keys.clone(),
            None => {
                let built = match (keys, &source.file) {
                    (Some(read), _) => read.clone(),
                    // Inline entries only: building them reads nothing.
                    (None, None) => {
                        let running = previous.map(|p| p.keys.load_full());
                        source.build(running.as_deref()).map(Arc::new)
                    }
                    (None, Some(path)) => Err(KeyErrors::not_read(path)),
                };
                match built {
                    Ok(set) => Arc::new(ArcSwap::new(set)),
                    Err(errors) => {
                        record_key_errors(&errors, problems);
                        Arc::new(ArcSwap::from_pointee(KeySet::failed(&source)))
                    }
                }
            }
        };
        if cfg
            .clients_file
            .as_ref()
            .is_some_and(|f| f.trim().is_empty())
        {
            problems.error(
                "identity.clients_file",
                "must not be empty (leave it out for none)",
            );
        }

        let jwt = cfg
            .jwt
            .as_ref()
            .and_then(|j| JwtVerifier::build(j, files, problems));
        let forward_caller = upstream_header(
            "identity.forward_caller_header",
            cfg.forward_caller_header.as_deref(),
            &header,
            problems,
        );
        let forward_tier = upstream_header(
            "identity.forward_tier_header",
            cfg.forward_tier_header.as_deref(),
            &header,
            problems,
        );
        if forward_caller.is_some() && forward_caller == forward_tier {
            problems.error(
                "identity.forward_tier_header",
                "must differ from identity.forward_caller_header",
            );
        }

        let mut identities = Self {
            auth_request: None,
            header,
            scheme_prefixed,
            keys,
            key_source: Arc::new(source),
            trusted_proxies,
            ipv6_prefix_len,
            anonymous_tier: cfg.anonymous_tier.as_str().into(),
            jwt,
            forward_caller,
            forward_tier,
            strip_credentials: cfg.strip_credentials,
        };
        let tiers = identities.tiers();
        if let Some(jwt) = &mut identities.jwt {
            jwt.known_tiers = tiers.clone();
        }
        if let Some(a) = &cfg.auth_request {
            let mut tiers = tiers;
            let source = &identities.key_source;
            tiers.extend(source.tiers.iter().flatten().map(|t| Arc::from(t.as_str())));
            let limits: Vec<String> = source.limits.iter().flatten().cloned().collect();
            identities.auth_request = auth_request::AuthRequest::build(
                a,
                &identities.header,
                tiers,
                &limits,
                previous.and_then(|p| p.auth_request.as_ref()),
                problems,
            );
        }
        identities
    }
}

/// Validate a `forward_*_header` name: a valid header name that is not hop-by-hop,
/// `host`, framing, or the credential header itself.
fn upstream_header(
    key: &str,
    name: Option<&str>,
    credential: &HeaderName,
    problems: &mut Problems,
) -> Option<HeaderName> {
    let name = name?;
    let Ok(h) = HeaderName::from_bytes(name.trim().to_ascii_lowercase().as_bytes()) else {
        problems.error(
            key,
            format!("{name:?} is not a valid header name (e.g. \"x-consumer-id\")"),
        );
        return None;
    };
    let reserved = [
        "host",
        "content-length",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
    ];
    if crate::http::always_hop_by_hop(&h) || reserved.contains(&h.as_str()) || h == *credential {
        problems.error(
            key,
            format!("{name:?} is a header the gateway manages otherwise; pick another name, e.g. \"x-consumer-id\""),
        );
        return None;
    }
    Some(h)
}

/// Record the problems of the keys in a config report: inline entries at their key
/// path, lines of the keys file as `PATH:LINE: what is wrong` at
/// `identity.clients_file`.
fn record_key_errors(errors: &KeyErrors, problems: &mut Problems) {
    for p in &errors.problems {
        match p {
            KeyProblem::Config { path, message } => problems.error(path.clone(), message.clone()),
            KeyProblem::File { line, message } => {
                problems.error("identity.clients_file", errors.file_line(*line, message))
            }
        }
    }
    if let Some(more) = errors.more_line() {
        problems.error("identity.clients_file", more);
    }
}

/// A CIDR, or one IP address as its own network.
fn parse_cidr(s: &str) -> Option<IpNet> {
    let s = s.trim();
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<IpAddr>().ok().map(IpNet::from))
}
