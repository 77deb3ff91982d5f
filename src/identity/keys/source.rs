//! What a key set is built from ([`KeySource`]: the inline clients, the keys file and
//! the names they may use).

use super::table::KeySet;
use crate::config::{ClientConfig, Config, IdentityConfig};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a key set is built from; two equal sources build the same set (from the same
/// file content).
#[derive(Debug, Clone, PartialEq)]
pub struct KeySource {
    /// `[[identity.clients]]`.
    pub inline: Vec<ClientConfig>,
    /// `identity.clients_file`, resolved against the config file's directory.
    pub file: Option<PathBuf>,
    /// Limit names quota overrides may name; `None`: not checked.
    pub limits: Option<BTreeSet<String>>,
    /// Tiers the keys file may use (those some limit gives a quota, the inline
    /// clients', `[identity.jwt]`'s and the anonymous tier); `None`: any.
    pub tiers: Option<BTreeSet<String>>,
    /// Keep clients by id (`identity.client_cert_subject_as_caller`).
    pub by_id: bool,
    /// The largest keys file read, in bytes (`identity.clients_file_max_bytes`).
    pub max_bytes: u64,
}

impl KeySource {
    /// The source of `[identity]` alone: names of limits and tiers are not checked.
    pub fn of_identity(cfg: &IdentityConfig, base_dir: &Path) -> Self {
        Self {
            inline: cfg.clients.clone(),
            file: cfg.clients_file.as_ref().map(|f| base_dir.join(f)),
            limits: None,
            tiers: None,
            by_id: cfg.client_cert_subject_as_caller,
            max_bytes: cfg.clients_file_max_bytes,
        }
    }

    /// The source of a whole config: quota overrides must name its limits, and tiers in
    /// the keys file must be ones its limits or clients know.
    pub fn of_config(cfg: &Config, base_dir: &Path) -> Self {
        let mut tiers: BTreeSet<String> = cfg
            .limits
            .iter()
            .flat_map(|l| l.quota.keys().cloned())
            .collect();
        tiers.extend(cfg.identity.clients.iter().map(|c| c.tier.clone()));
        tiers.insert(cfg.identity.anonymous_tier.clone());
        if let Some(jwt) = &cfg.identity.jwt {
            tiers.insert(jwt.default_tier.clone());
            tiers.extend(jwt.tiers.iter().cloned());
        }
        Self {
            limits: Some(cfg.limits.iter().map(|l| l.name.clone()).collect()),
            tiers: Some(tiers),
            ..Self::of_identity(&cfg.identity, base_dir)
        }
    }
}

impl KeySet {
    /// An empty set that still knows `source`'s inline tiers (stands in for a set that
    /// failed to build, so that its errors are not followed by "unknown tier" ones).
    pub fn failed(source: &KeySource) -> Self {
        Self {
            tiers: source
                .inline
                .iter()
                .map(|c| Arc::from(c.tier.as_str()))
                .collect(),
            ..Self::default()
        }
    }
}
