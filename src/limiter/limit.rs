//! A `[[limits]]` entry ready to use ([`Limit`], built and checked from config), the
//! subject it counts for a caller ([`By`]), and one limit applied to one request
//! ([`Applied`]: the storage key of its state and the policy for the caller's tier).

use super::algorithm::{Algorithm, Align, Policy};
use super::key::LimitKey;
use crate::config::{LimitBy, LimitConfig, LimitMode, OnLimit, Problems, WindowAlign};
use crate::identity::Caller;
use http::{HeaderMap, HeaderName};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// What a limit's windows count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum By {
    /// The client id for callers with a key, else the client IP.
    Caller,
    /// The client IP, key or no key.
    Ip,
    /// One window shared by every caller.
    Global,
    /// The value of a request header; callers without it count as `Caller`.
    Header(HeaderName),
    /// `trusted_only = true`: the value of a request header, believed only when the
    /// socket peer is a trusted proxy (callers without it count as `Caller`); from any
    /// other peer, the client IP.
    TrustedHeader(HeaderName),
}

/// Quotas (cost units per window) by tier name. Looked up once per limit per request, by
/// tier names that come from the config (never from the network): foldhash, not
/// SipHash, whose DoS resistance buys nothing here (about 170 instructions per request,
/// issue 16).
pub type TierQuotas = HashMap<Arc<str>, u64, foldhash::fast::RandomState>;

/// A `[[limits]]` entry, ready to use.
#[derive(Debug)]
pub struct Limit {
    /// Name, reported as `X-RateLimit-Resource`.
    pub name: Arc<str>,
    /// Window length in milliseconds.
    pub window_ms: u64,
    /// Quota (cost units per window) by tier; a tier absent here is not limited by this limit.
    pub quota: TierQuotas,
    /// What the windows count.
    pub by: By,
    /// Lease mode: units taken from the store at a time and admitted locally (0: off,
    /// every request is checked and charged in the store).
    pub lease: u64,
    /// Lease mode: how long the store keeps a gateway's unused leased units without
    /// hearing from it, in milliseconds (`lease_ttl`).
    pub lease_ttl_ms: u64,
    /// The algorithm.
    pub algorithm: Algorithm,
    /// GCRA bucket size in units; `None`: the tier's quota.
    pub burst: Option<u64>,
    /// Where fixed windows start.
    pub align: Align,
    /// The name in storage keys: the limit's name, plus `:ALGORITHM` for every algorithm
    /// but the fixed window (so a changed algorithm starts from fresh state).
    pub key_name: Arc<str>,
    /// Percent of subjects (0-100) for whom a refusal is enforced; the others are
    /// shadowed: reported, never refused. `mode = "shadow"` is 0.
    pub enforce_percent: u8,
    /// `on_limit = "delay"`: hold a refused request up to this many milliseconds until
    /// the limit admits it (0: refuse at once).
    pub max_delay_ms: u64,
    /// `on_limit = "delay"`: requests of one subject held at once on this gateway.
    pub max_waiting: u32,
    /// `block_for` in milliseconds: how long a caller this limit refused stays refused
    /// (0: off).
    pub block_ms: u64,
}

/// `block_for` in milliseconds (0 when not set), recording its problems under `at`:
/// between 1s and a year, and not for concurrency limits (a slot frees when a request
/// ends, so a refusal there says nothing about the caller) nor lease mode (leased units
/// are admitted without the store, where the block is kept).
fn block_ms(at: &str, cfg: &LimitConfig, algorithm: Algorithm, problems: &mut Problems) -> u64 {
    let Some(block_for) = cfg.block_for else {
        return 0;
    };
    let ms = block_for.as_millis();
    if !(1_000..=366 * 86_400_000).contains(&ms) {
        problems.error(
            format!("{at}.block_for"),
            "must be between 1s and 1 year (\"366d\")",
        );
    } else if algorithm == Algorithm::Concurrency {
        problems.error(
            format!("{at}.block_for"),
            "is not for concurrency limits (a slot frees when a request ends, so a refusal says nothing about the caller): use a rate limit with block_for",
        );
    } else if cfg.lease.is_some() {
        problems.error(
            format!("{at}.block_for"),
            "is not for lease mode (leased units are admitted without the store, where blocks are kept): remove lease or block_for",
        );
    }
    ms
}

/// `window = "1mo"` in milliseconds (humantime's month: 30.44 days).
const MONTH_MS: u64 = 2_630_016_000;

impl Limit {
    /// Build from config, recording problems under `limits[index]`. `tiers` are the tiers
    /// a caller can have (quota keys must name one of them).
    pub fn build(
        index: usize,
        cfg: &LimitConfig,
        tiers: &BTreeSet<Arc<str>>,
        problems: &mut Problems,
    ) -> Option<Self> {
        let at = format!("limits[{index}]");
        let before = problems.errors.len();
        if cfg.name.trim().is_empty() {
            problems.error(format!("{at}.name"), "must not be empty");
        } else if cfg.name.contains(['{', '}', ':']) || cfg.name.contains(char::is_whitespace) {
            problems.error(
                format!("{at}.name"),
                "must not contain white space, `:` or braces (it is part of Redis keys)",
            );
        }
        let algorithm = cfg.algorithm;
        // At most a year: longer durations would also overflow epoch milliseconds.
        let year = std::time::Duration::from_secs(366 * 86_400);
        let window_ms = cfg.window.0.min(year).as_millis() as u64;
        if window_ms < 1_000 {
            problems.error(format!("{at}.window"), "must be at least 1s");
        }
        if cfg.window.0 > year {
            problems.error(format!("{at}.window"), "must be at most 1 year (\"366d\")");
        }
        let align = match cfg.align {
            WindowAlign::FirstRequest => Align::FirstRequest,
            WindowAlign::Calendar if algorithm != Algorithm::FixedWindow => {
                problems.error(
                    format!("{at}.align"),
                    "align = \"calendar\" is for fixed windows only (algorithm = \"fixed_window\")",
                );
                Align::FirstRequest
            }
            WindowAlign::Calendar if window_ms == MONTH_MS => Align::Month,
            WindowAlign::Calendar if window_ms > 0 && 86_400_000 % window_ms == 0 => Align::Epoch,
            WindowAlign::Calendar => {
                problems.error(
                    format!("{at}.align"),
                    "a calendar window must divide a day (e.g. \"1h\", \"1d\") or be \"1mo\"",
                );
                Align::FirstRequest
            }
        };
        match cfg.burst {
            Some(_) if algorithm != Algorithm::Gcra => problems.error(
                format!("{at}.burst"),
                "burst is for algorithm = \"gcra\" only",
            ),
            Some(0) => problems.error(format!("{at}.burst"), "must be at least 1"),
            _ => {}
        }
        let enforce_percent = match cfg.mode {
            LimitMode::Enforce => cfg.enforce_percent,
            LimitMode::Shadow => 0,
        };
        if cfg.enforce_percent > 100 {
            problems.error(format!("{at}.enforce_percent"), "must be between 0 and 100");
        } else if cfg.mode == LimitMode::Shadow && cfg.enforce_percent != 100 {
            problems.error(
                format!("{at}.enforce_percent"),
                "a limit in mode = \"shadow\" enforces for nobody: leave enforce_percent out",
            );
        }
        let max_delay_ms = match cfg.on_limit {
            OnLimit::Reject => 0,
            OnLimit::Delay
                if cfg.max_delay.as_millis() == 0 || cfg.max_delay.as_millis() > 60_000 =>
            {
                problems.error(
                    format!("{at}.max_delay"),
                    "must be more than 0 and at most 1m",
                );
                0
            }
            OnLimit::Delay if algorithm == Algorithm::Concurrency => {
                problems.error(
                    format!("{at}.on_limit"),
                    "a concurrency limit cannot delay (when a slot frees is unknown)",
                );
                0
            }
            OnLimit::Delay => cfg.max_delay.as_millis(),
        };
        if cfg.max_waiting == 0 {
            problems.error(format!("{at}.max_waiting"), "must be at least 1");
        }
        if cfg.lease.is_some() && algorithm != Algorithm::FixedWindow {
            problems.error(
                format!("{at}.lease"),
                "lease mode is for fixed windows only (algorithm = \"fixed_window\")",
            );
        }
        if cfg.quota.is_empty() {
            problems.error(
                format!("{at}.quota"),
                "is empty: give a quota for at least one tier, e.g. { anonymous = 60 }",
            );
        }
        let mut quota = TierQuotas::default();
        for (tier, n) in &cfg.quota {
            if !tiers.contains(tier.as_str()) {
                let known: Vec<&str> = tiers.iter().map(|t| &**t).collect();
                problems.error(
                    format!("{at}.quota.{tier}"),
                    format!("unknown tier {tier:?}; known tiers: {}", known.join(", ")),
                );
            }
            if *n == 0 {
                problems.error(format!("{at}.quota.{tier}"), "must be at least 1");
            }
            if algorithm == Algorithm::Gcra && *n > window_ms {
                problems.error(
                    format!("{at}.quota.{tier}"),
                    format!("GCRA spaces units at least 1 ms apart: at most {window_ms} per window of {window_ms} ms"),
                );
            }
            quota.insert(Arc::from(tier.as_str()), *n);
        }
        for tier in tiers {
            if !cfg.quota.is_empty() && !cfg.quota.contains_key(&**tier) {
                problems.warn(
                    format!("{at}.quota"),
                    format!(
                        "tier {tier:?} has no quota here: its callers are not limited by {:?}",
                        cfg.name
                    ),
                );
            }
        }
        let header_by = |h: HeaderName| {
            if cfg.trusted_only {
                By::TrustedHeader(h)
            } else {
                By::Header(h)
            }
        };
        let by = match &cfg.by {
            LimitBy::Caller => By::Caller,
            LimitBy::Ip => By::Ip,
            LimitBy::Global => By::Global,
            // The name was checked when the file was read.
            LimitBy::Header(h) => {
                match HeaderName::from_bytes(h.trim().to_ascii_lowercase().as_bytes()) {
                    Ok(h) => header_by(h),
                    Err(_) => By::Caller,
                }
            }
        };
        let lease_ttl_ms = cfg.lease_ttl.as_millis();
        if !(2_000..=3_600_000).contains(&lease_ttl_ms) {
            problems.error(format!("{at}.lease_ttl"), "must be between 2s and 1h");
        } else if cfg.lease.is_none()
            && cfg.lease_ttl != crate::config::LimitConfig::DEFAULT_LEASE_TTL
        {
            problems.error(
                format!("{at}.lease_ttl"),
                "applies to lease mode only: set `lease` too, or remove lease_ttl",
            );
        }
        if cfg.trusted_only && !matches!(by, By::TrustedHeader(_)) {
            problems.error(
                format!("{at}.trusted_only"),
                "is for limits with by = \"header:NAME\" only",
            );
        }
        let block_ms = block_ms(&at, cfg, algorithm, problems);
        if cfg.lease == Some(0) {
            problems.error(
                format!("{at}.lease"),
                "must be at least 1 (leave it out to turn lease mode off)",
            );
        }
        (problems.errors.len() == before).then(|| Self {
            name: cfg.name.as_str().into(),
            window_ms,
            quota,
            by,
            lease: cfg.lease.unwrap_or(0),
            lease_ttl_ms,
            algorithm,
            burst: cfg.burst,
            align,
            enforce_percent,
            max_delay_ms,
            max_waiting: cfg.max_waiting,
            block_ms,
            key_name: match algorithm {
                Algorithm::FixedWindow => cfg.name.as_str().into(),
                other => format!("{}:{}", cfg.name, other.name()).into(),
            },
        })
    }

    /// The policy this limit applies to a caller whose tier has `quota`.
    pub fn policy(&self, quota: u64) -> Policy {
        Policy {
            algorithm: self.algorithm,
            quota,
            window_ms: self.window_ms,
            burst: self.burst.unwrap_or(quota),
            align: self.align,
            block_ms: self.block_ms,
        }
    }

    /// Write the subject this limit counts for a caller into `out` (cleared first): e.g.
    /// `client:acme`, `ip:192.0.2.7`, `global`, `header:x-tenant:t1`. It is hashed
    /// before it reaches a store.
    pub(super) fn subject_into(&self, caller: &Caller, headers: &HeaderMap, out: &mut Vec<u8>) {
        out.clear();
        let by_caller = |out: &mut Vec<u8>| match &caller.client {
            Some(c) => client_subject(&c.id, out),
            None => ip_subject(caller.ip_key, out),
        };
        match &self.by {
            By::Caller => by_caller(out),
            By::Ip => ip_subject(caller.ip_key, out),
            By::Global => out.extend_from_slice(b"global"),
            By::TrustedHeader(_) if !caller.peer_trusted => ip_subject(caller.ip_key, out),
            By::Header(h) | By::TrustedHeader(h) => match headers.get(h) {
                Some(v) => {
                    out.extend_from_slice(b"header:");
                    out.extend_from_slice(h.as_str().as_bytes());
                    out.push(b':');
                    // As before: invalid UTF-8 hashes as its lossy form.
                    match std::str::from_utf8(v.as_bytes()) {
                        Ok(s) => out.extend_from_slice(s.as_bytes()),
                        Err(_) => {
                            out.extend_from_slice(String::from_utf8_lossy(v.as_bytes()).as_bytes())
                        }
                    }
                }
                None => by_caller(out),
            },
        }
    }
}

/// Append the subject of a client, `client:ID`, to `out`.
pub(super) fn client_subject(id: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(b"client:");
    out.extend_from_slice(id.as_bytes());
}

/// Append the subject of a client IP, `ip:ADDRESS`, to `out`.
pub(super) fn ip_subject(ip: std::net::IpAddr, out: &mut Vec<u8>) {
    out.extend_from_slice(b"ip:");
    match ip {
        // The dotted quad as `Display` writes it, without the formatting machinery.
        std::net::IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                if octet >= 100 {
                    out.push(b'0' + octet / 100);
                }
                if octet >= 10 {
                    out.push(b'0' + octet / 10 % 10);
                }
                out.push(b'0' + octet % 10);
            }
        }
        std::net::IpAddr::V6(_) => {
            use std::io::Write;
            let _ = write!(out, "{ip}");
        }
    }
}

/// One limit applied to one request: where its state is and what policy applies.
#[derive(Debug, Clone)]
pub struct Applied {
    pub(super) limit: Arc<Limit>,
    pub(super) key: LimitKey,
    pub(super) policy: Policy,
}

impl Applied {
    /// The storage key of this limit's state for this caller.
    pub fn key(&self) -> &LimitKey {
        &self.key
    }

    /// The limit applied (its name, window length in milliseconds, lease mode).
    pub fn limit(&self) -> &Arc<Limit> {
        &self.limit
    }

    /// The policy (algorithm, quota for the caller's tier, window, burst).
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The caller's quota in this limit: cost units per window.
    pub fn quota(&self) -> u64 {
        self.policy.quota
    }

    /// Whether a refusal of this limit is enforced for this subject (`enforce_percent`,
    /// by a stable hash of the subject, the same on every gateway); otherwise it is
    /// shadowed: reported, not refused.
    pub fn enforced(&self) -> bool {
        match self.limit.enforce_percent {
            100 => true,
            0 => false,
            p => self.key.shard_hash().rotate_right(32) % 100 < u64::from(p),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ip_subject;

    #[test]
    fn an_ip_subject_is_ip_and_the_address_as_display_writes_it() {
        let mut out = Vec::new();
        for ip in [
            "0.0.0.0",
            "1.2.3.4",
            "10.0.99.100",
            "127.0.0.1",
            "192.168.255.9",
            "255.255.255.255",
            "::1",
            "2001:db8::ff00:42:8329",
            "::ffff:1.2.3.4",
        ] {
            let ip: std::net::IpAddr = ip.parse().expect("ip");
            out.clear();
            ip_subject(ip, &mut out);
            assert_eq!(String::from_utf8_lossy(&out), format!("ip:{ip}"));
        }
        for n in 0..=255u8 {
            let ip = std::net::IpAddr::from([n, n / 3, n % 10, 255 - n]);
            out.clear();
            ip_subject(ip, &mut out);
            assert_eq!(String::from_utf8_lossy(&out), format!("ip:{ip}"));
        }
    }
}
