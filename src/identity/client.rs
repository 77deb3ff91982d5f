//! Who a request's caller is: a known [`Client`] (its id, tier and own quotas) and the
//! [`Caller`] of one request.

use super::keys;
use std::net::IpAddr;
use std::sync::Arc;

/// A known API client (all its keys share it, and so share its windows).
#[derive(Debug, Clone)]
pub struct Client {
    /// Caller id (from config, the keys file, or a JWT claim).
    pub id: Arc<str>,
    /// Tier, which selects the quota of each limit.
    pub tier: Arc<str>,
    /// Per-client quotas by limit name (cost units per window), which win over the
    /// tier's quota (`"quotas"` in the keys file).
    pub(super) quotas: Option<Box<keys::Quotas>>,
    /// Every key of a disabled client is refused (401).
    pub(super) disabled: bool,
}

impl Client {
    /// A client with no quota overrides (JWT callers).
    pub fn new(id: Arc<str>, tier: Arc<str>) -> Self {
        Self {
            id,
            tier,
            quotas: None,
            disabled: false,
        }
    }

    /// This client's own quota for the limit `name` (cost units per window), if it has
    /// one; otherwise its tier's applies.
    pub fn quota_for(&self, name: &str) -> Option<u64> {
        self.quotas
            .as_deref()?
            .iter()
            .find(|(n, _)| &**n == name)
            .map(|(_, q)| *q)
    }

    /// Whether limits count this client and `other` alike: the same id and tier, and
    /// neither with quotas of its own (which a disabled client never reaches).
    pub fn limits_alike(&self, other: &Client) -> bool {
        self.quotas.is_none()
            && other.quotas.is_none()
            && self.id == other.id
            && self.tier == other.tier
    }
}

/// The caller of one request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The client, when a valid API key was presented; `None` for anonymous callers.
    pub client: Option<Arc<Client>>,
    /// Tier for quota lookups: the client's, or `identity.anonymous_tier`.
    pub tier: Arc<str>,
    /// Client IP: the socket peer, or the right-most untrusted `X-Forwarded-For` hop when
    /// the peer is a trusted proxy. Logged and forwarded as it is.
    pub ip: IpAddr,
    /// What per-IP limits count for this caller: `ip`'s network of
    /// `identity.ipv6_prefix_len` bits for IPv6, `ip` itself for IPv4 (see
    /// [`super::Identities::ip_key`]).
    pub ip_key: IpAddr,
    /// Whether the socket peer is one of `identity.trusted_proxies` (limits with
    /// `trusted_only = true` believe its headers).
    pub peer_trusted: bool,
    /// The label of the key presented (`"label"` in the keys file), for logs and
    /// `/top`; never the key.
    pub key_label: Option<Arc<str>>,
}

impl Caller {
    /// The id to show in logs and messages: the client id, else the client IP.
    pub fn label(&self) -> String {
        match &self.client {
            Some(c) => c.id.to_string(),
            None => self.ip.to_string(),
        }
    }
}
