//! The TOML schema: plain serde types, one per section of the contract, with their defaults.
//!
//! Unknown keys are errors everywhere (`deny_unknown_fields`); string choices are enums
//! ([`super::choices`]). Rules that are not types (ranges, keys that depend on each
//! other) live in [`super::validate`].

use super::choices::{ChargeAt, LimitBy, LimitMode, OnLimit, PathMatch, WindowAlign};
use super::duration::Dur;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The whole config file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[server]`: listeners and shutdown.
    #[serde(default)]
    pub server: ServerConfig,
    /// `[log]`: level and format of the logs on stderr.
    #[serde(default)]
    pub log: LogConfig,
    /// `[store]`: where windows are kept.
    #[serde(default)]
    pub store: StoreConfig,
    /// `[identity]`: API keys, tiers, trusted proxies.
    #[serde(default)]
    pub identity: IdentityConfig,
    /// `[[upstreams]]`: named pools of targets.
    #[serde(default)]
    pub upstreams: Vec<UpstreamConfig>,
    /// `[[limits]]`: named quotas.
    #[serde(default)]
    pub limits: Vec<LimitConfig>,
    /// `[[routes]]`: host and path prefix → upstream and limits.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// `[headers]`: which rate-limit header fields responses carry.
    #[serde(default)]
    pub headers: HeadersConfig,
    /// `[rate_limit_endpoint]`: where callers read their own limits (off by default).
    #[serde(default)]
    pub rate_limit_endpoint: RateLimitEndpointConfig,
    /// `[tracing]`: OpenTelemetry traces over OTLP/HTTP (off by default).
    #[serde(default)]
    pub tracing: super::trace::TracingConfig,
}

/// `[rate_limit_endpoint]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimitEndpointConfig {
    /// The path on the proxy listener where a `GET` answers the caller's state of every
    /// limit that applies to it, as JSON (like GitHub's `GET /rate_limit`); never
    /// charged, never forwarded. `None`: off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// `[server]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// The proxy listener, `HOST:PORT`. Default `127.0.0.1:8080`.
    pub listen: String,
    /// Optional admin listener: `GET /healthz`, `/readyz`, `/metrics`, `/config`.
    /// Default: none.
    pub admin_listen: Option<String>,
    /// SHA-256 of the Bearer token that the admin listener's write endpoints (`POST
    /// /callers/{id}/reset`) require, 64 hex characters. Default: none, and write
    /// endpoints are off (403). Applied on reload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_token_sha256: Option<String>,
    /// How long in-flight requests may run after SIGTERM/SIGINT. Default 30 s.
    pub shutdown_grace: Dur,
    /// An HTTP/1 client must send its request headers within this time. Default 10 s.
    pub header_read_timeout: Dur,
    /// Reload when the config file changes (its directory is watched, so editors'
    /// rename-replace and Kubernetes ConfigMap symlink swaps are seen). Default true.
    pub watch_config: bool,
    /// `[server.tls]`: TLS on the proxy listener. Default: none (plain HTTP/1.1 and
    /// cleartext HTTP/2). Whether the listener speaks TLS is decided at start; the
    /// certificates reload.
    pub tls: Option<TlsConfig>,
    /// Worker threads of the async runtime (`multi_thread`), or runtimes with a listener
    /// each (`per_core`). Default: one per CPU the process may use. Read at start only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<usize>,
    /// How the proxy listener's connections are served: `workers` single-threaded
    /// runtimes, each with its own listener, upstream pools and Redis batchers
    /// (`per_core`, the default: measured 1.34x the req/s of `multi_thread` on the memory
    /// store and 1.15x on Redis, BENCHMARKS.md), or one work-stealing runtime
    /// (`multi_thread`). Read at start only.
    pub runtime: RuntimeShape,
    /// A client connection with no request being handled for this long is closed
    /// (gracefully). Default 60 s.
    pub idle_timeout: Dur,
    /// A client connection whose response has waited this long for the client to take
    /// more of it (a full TCP send buffer, or a spent HTTP/2 flow-control window) is
    /// closed. Default 60 s.
    pub send_timeout: Dur,
    /// Client connections open at once on the proxy listener; more are answered 503
    /// and closed. The admin listener is not counted. Default 10000.
    pub max_connections: usize,
    /// Client connections one client address may have open at once on the proxy
    /// listener (IPv6 peers counted by their `identity.ipv6_prefix_len` network; peers in
    /// `identity.trusted_proxies` are not counted); more are answered like
    /// `max_connections`. At least 1. Default 256.
    pub max_connections_per_ip: usize,
    /// Percentage (1 to 100) of the descriptor budget one client address may hold with
    /// its connections and its requests in flight (each HTTP/1.1 request or HTTP/2 stream
    /// counts one, for the upstream socket it may hold); past it a new connection gets
    /// 503 and a new request 429. Peers in `identity.trusted_proxies` are not counted.
    /// Default 50. Read at start only.
    pub descriptor_share_per_ip: u8,
    /// Largest request head (request line and headers), in bytes; larger ones get 431.
    /// Default 32768 (at least 8192).
    pub max_header_bytes: usize,
    /// HTTP/2 streams a client may have open at once on one connection. Default 100.
    pub http2_max_streams: u32,
    /// Requests held by `on_limit = "delay"` at once on this gateway, over every limit
    /// and subject; a request that would be held past it gets 429 at once. Each held
    /// request costs about 33 KB, so the default 1000 bounds them to about 33 MB.
    pub max_delayed: usize,
    /// Forward request headers with `_` in their name. Default false: they are dropped,
    /// as nginx does. Either way, one whose name with `_` read as `-` is a header tollgate
    /// reads, sets or strips (`X_Consumer_Id`) is always dropped.
    pub underscores_in_headers: bool,
    /// Tunnels (WebSockets) open at once; an upgrade past it is answered 503 before it
    /// is forwarded. 0 refuses every upgrade. Default 1000.
    pub max_tunnels: usize,
    /// An open tunnel that moves no byte either way for this long is closed. Default:
    /// `idle_timeout`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tunnel_idle_timeout: Option<Dur>,
    /// A request body that stops arriving for this long (no byte while the gateway
    /// waits for one) ends the request with 408, charged like a request whose client
    /// went away. Default 30 s.
    pub body_timeout: Dur,
    /// The `Via` header tollgate adds to every request it forwards and every response it
    /// passes back (RFC 9110 §7.6.3): `true` (default) names the gateway `tollgate`,
    /// a string names it by that pseudonym (a token, e.g. `"edge-1"`), `false` adds none
    /// (to hide the gateway). Read at start only.
    pub via: Via,
}

/// `server.via`: whether and by which name tollgate adds itself to `Via`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Via {
    /// `true`: `Via: 1.1 tollgate`; `false`: no `Via` is added.
    On(bool),
    /// The pseudonym the gateway goes by in `Via` (an RFC 9110 token).
    Named(String),
}

impl Default for Via {
    fn default() -> Self {
        Via::On(true)
    }
}

impl Via {
    /// The name tollgate goes by in `Via`, or `None` when it adds none.
    pub fn pseudonym(&self) -> Option<&str> {
        match self {
            Via::On(true) => Some("tollgate"),
            Via::On(false) => None,
            Via::Named(name) => Some(name),
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            admin_listen: None,
            admin_token_sha256: None,
            shutdown_grace: Dur::from_secs(30),
            header_read_timeout: Dur::from_secs(10),
            watch_config: true,
            tls: None,
            workers: None,
            runtime: RuntimeShape::PerCore,
            idle_timeout: Dur::from_secs(60),
            send_timeout: Dur::from_secs(60),
            max_connections: 10_000,
            max_connections_per_ip: 256,
            descriptor_share_per_ip: 50,
            max_header_bytes: 32 * 1024,
            http2_max_streams: 100,
            max_delayed: 1_000,
            underscores_in_headers: false,
            max_tunnels: 1000,
            tunnel_idle_timeout: None,
            body_timeout: Dur::from_secs(30),
            via: Via::default(),
        }
    }
}

/// `[server.tls]`: TLS on the proxy listener (rustls with the ring provider; TLS 1.2
/// and 1.3; ALPN `h2` and `http/1.1`). Relative paths are relative to the config
/// file's directory. Certificates are read when the config is loaded, and again on
/// every reload (SIGHUP, or a change to the config file or to one of these files).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain (leaf first): the default certificate, presented when the
    /// client sends no SNI or a name no `[[server.tls.sni]]` entry has.
    pub cert: String,
    /// PEM private key of `cert` (PKCS#8, PKCS#1 or SEC1).
    pub key: String,
    /// `[[server.tls.sni]]`: more certificates, chosen by the SNI host name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sni: Vec<SniCertConfig>,
    /// The TLS handshake of a new connection must finish within this time, or the
    /// connection is closed. Default 10 s.
    #[serde(default = "default_handshake_timeout")]
    pub handshake_timeout: Dur,
    /// PEM file of the CA certificates that client certificates must chain to. Without
    /// it, clients are not asked for a certificate. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<String>,
    /// With `client_ca`: `"optional"` (default: a client may present no certificate,
    /// but one it presents must verify) or `"required"` (no verified certificate, no
    /// connection).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_auth: Option<ClientAuth>,
    /// DER file of an OCSP response for `cert` (e.g. from `openssl ocsp -respout`),
    /// stapled to every handshake that asks for it; read again with the certificates on
    /// every reload. Default: none (no stapling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ocsp: Option<String>,
    /// File of session-ticket keys shared by several gateways (one a line, 64 hex
    /// digits; the first encrypts, all decrypt), so that a client resumes with any of
    /// them. Default: none (each process makes its own keys, rotated every 6 hours).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ticket_keys: Option<String>,
}

fn default_handshake_timeout() -> Dur {
    Dur::from_secs(10)
}

/// `[[server.tls.sni]]`: one certificate for one host name.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SniCertConfig {
    /// The host name, matched exactly (case-insensitive) against the client's SNI.
    pub host: String,
    /// PEM certificate chain for `host`.
    pub cert: String,
    /// PEM private key of `cert`.
    pub key: String,
}

/// `server.tls.client_auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    /// A client certificate is asked for, not required.
    #[default]
    Optional,
    /// A verified client certificate is required to connect.
    Required,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// A `tracing` filter such as `"info"` or `"tollgate=debug"`; `RUST_LOG` overrides it.
    pub level: String,
    /// `"text"` (default) or `"json"`.
    pub format: LogFormat,
    /// How the access log shows the client IP: `"hash"` (default: the keyed digest that
    /// also names the caller's by-IP Redis keys), `"ip"`, or `"none"`.
    pub client_ip: LogClientIp,
}

/// `log.client_ip`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogClientIp {
    /// The first 16 bytes of HMAC-SHA256 of `ip:ADDRESS` (keyed like storage keys), hex.
    #[default]
    Hash,
    /// The address itself.
    Ip,
    /// Not logged.
    None,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: LogFormat::Text,
            client_ip: LogClientIp::Hash,
        }
    }
}

/// The log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// `[store]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `"memory"` (this process only, the default) or `"redis"`.
    pub backend: Backend,
    /// With `backend = "redis"`: `"sharded"` (client-side shards, the default) or
    /// `"cluster"` (a Redis Cluster reached through `nodes`).
    pub mode: StoreMode,
    /// Whose clock the limit rules read "now" from: `"gateway"` (the default: each
    /// gateway's own clock, in milliseconds since the Unix epoch) or `"redis"` (the
    /// Redis scripts read `TIME` on the node that runs them; `backend = "redis"` only).
    pub clock: StoreClock,
    /// Budget for one store call; past it the call counts as failed. Default 50 ms.
    pub timeout: Dur,
    /// What to do when the store fails or is slow: fail open, fail closed, or enforce
    /// the failing shard's limits in this gateway's memory (`"local"`).
    pub on_error: OnError,
    /// With `on_error = "local"`: how many gateways share the store, the divisor of each
    /// quota while a shard is enforced locally; a count (>= 1) or `"auto"` (counted from
    /// the gateways' heartbeats in Redis). Default: `"auto"` when `on_error = "local"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet_size: Option<FleetSize>,
    /// With `fleet_size = "auto"`: how often each gateway writes its heartbeat to every
    /// shard's primary (and reads the count of gateways alive); a gateway unheard of for
    /// three of these is no longer counted. Default 1 s.
    pub fleet_heartbeat: Dur,
    /// Prefix of every Redis key. Default `"tollgate:"`.
    pub key_prefix: String,
    /// Secret for the keyed hash of caller identities (Redis keys and shard choice).
    /// Every gateway of a fleet must use the same value. Default: none (the hash is
    /// keyed with the key prefix only).
    pub hash_key: Option<String>,
    /// Path of a file holding `hash_key` instead (one trailing newline stripped), read at
    /// every load and reload. A relative path is looked up in `$CREDENTIALS_DIRECTORY`
    /// first (systemd's `LoadCredential=`), then relative to the config file's
    /// directory. Not together with `hash_key`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hash_key_file: Option<String>,
    /// Redis ACL user name for every data node (primaries, replicas, nodes found through
    /// Sentinel or Cluster) whose URL carries none. Default: none (`default` user).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// Redis password for every data node whose URL carries none. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// Path of a file holding `password` instead (resolved like `hash_key_file`), read
    /// at every load and reload: the next connection uses a rotated password. Not
    /// together with `password`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_file: Option<String>,
    /// ACL user name for the Sentinels whose URL carries none. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sentinel_username: Option<String>,
    /// Password for the Sentinels whose URL carries none. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sentinel_password: Option<String>,
    /// Path of a file holding `sentinel_password` instead (resolved like
    /// `hash_key_file`). Not together with `sentinel_password`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sentinel_password_file: Option<String>,
    /// `[store.tls]`: how `rediss://` nodes are verified, and the client certificate
    /// presented to them. Default: none (public roots, no client certificate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<StoreTlsConfig>,
    /// Where CHECKs go: `"replica"` (default when a shard lists replicas) or `"primary"`.
    /// CHARGEs always go to the primary.
    pub read_from: Option<ReadFrom>,
    /// How often the memory store drops expired windows. Default 5 s.
    pub sweep_interval: Dur,
    /// Reserve the units of limits charged after the response at the check, on the
    /// shard's primary, and refund them when the response is not charged: exact
    /// across a fleet, at the price of a write (not a replica read) per check.
    /// Default false.
    pub reserve_in_flight: bool,
    /// Answer a CHECK of a limit charged after the response from this gateway's own last
    /// CHARGE reply for that window while the reply is younger than this, without a
    /// store call (see `limiter::recent`). `"0s"` (the default) turns it off.
    pub check_from_charge: Dur,
    /// Memory store only: the most limit states it holds (one per caller and limit);
    /// a new caller past it is a store error, handled as `on_error` says. Default
    /// 1000000 (about 150 to 300 MB).
    pub max_callers: usize,
    /// Consecutive failures (errors or timeouts) of one Redis node that open its
    /// circuit breaker. Default 3.
    pub breaker_failures: u32,
    /// How long an open breaker stays open before one probe call is let through.
    /// Default 1 s.
    pub breaker_cooloff: Dur,
    /// Entries of the in-process over-limit cache (callers known to be over a limit
    /// until their reset, answered without calling Redis). 0 turns it off. Default 10000.
    pub local_cache_size: usize,
    /// `[[store.shards]]`: one entry per Redis primary/replica group (`mode = "sharded"`).
    pub shards: Vec<ShardConfig>,
    /// Seed nodes of a Redis Cluster (`mode = "cluster"`), e.g. `["redis://10.0.0.1:7000"]`.
    pub nodes: Vec<String>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            backend: Backend::Memory,
            mode: StoreMode::Sharded,
            clock: StoreClock::Gateway,
            timeout: Dur::from_millis(50),
            on_error: OnError::Allow,
            fleet_size: None,
            fleet_heartbeat: Dur::from_secs(1),
            key_prefix: "tollgate:".into(),
            hash_key: None,
            hash_key_file: None,
            username: None,
            password: None,
            password_file: None,
            sentinel_username: None,
            sentinel_password: None,
            sentinel_password_file: None,
            tls: None,
            read_from: None,
            sweep_interval: Dur::from_secs(5),
            max_callers: 1_000_000,
            reserve_in_flight: false,
            check_from_charge: Dur::from_millis(0),
            breaker_failures: 3,
            breaker_cooloff: Dur::from_secs(1),
            local_cache_size: 10_000,
            shards: Vec::new(),
            nodes: Vec::new(),
        }
    }
}

/// `[store.tls]`: TLS to Redis nodes reached through `rediss://` URLs (and the nodes
/// Sentinel and Cluster announce for them). rustls with the ring provider. The files are
/// read at every load and reload; the next connection uses what was read last.
/// Relative paths are relative to the config file's directory.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StoreTlsConfig {
    /// PEM file of the CA certificate(s) that sign the Redis servers' certificates (a
    /// private CA); replaces `roots`. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    /// Trusted roots when `ca` is not set: `"webpki"` (default, Mozilla's roots built in)
    /// or `"system"` (the operating system's store, read at every load).
    #[serde(default)]
    pub roots: TlsRoots,
    /// PEM file of the client certificate (chain) presented to Redis (mutual TLS,
    /// `tls-auth-clients yes`); needs `client_key`. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<String>,
    /// PEM file of the private key of `client_cert`. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<String>,
    /// The name sent as SNI and verified in every Redis server's certificate, instead of
    /// the host of the address dialled (needed when nodes are announced by IP, as
    /// Cluster and Sentinel do, and the certificate names a DNS name). Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

/// The kind of store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Windows held in this process only.
    Memory,
    /// Windows held in (sharded) Redis, shared by a fleet of gateways.
    Redis,
}

/// How Redis is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreMode {
    /// Client-side sharding over `[[store.shards]]` (jump consistent hash).
    Sharded,
    /// A Redis Cluster; the cluster shards by key slot.
    Cluster,
}

/// Whose clock gives "now" to the limit rules (`store.clock`). Either way, times are
/// milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreClock {
    /// The gateway's clock: each gateway passes its own time to the store (default).
    /// Works with every backend and with Redis services that forbid `TIME` in scripts.
    #[default]
    Gateway,
    /// Redis's clock: the scripts read `TIME` on the node that runs them, once per call
    /// (seconds and microseconds, floored to milliseconds), so every gateway's window
    /// arithmetic on a key uses one clock. `backend = "redis"` only.
    Redis,
}

impl StoreClock {
    /// The name in the config file: `"gateway"` or `"redis"`.
    pub fn name(self) -> &'static str {
        match self {
            StoreClock::Gateway => "gateway",
            StoreClock::Redis => "redis",
        }
    }
}

/// Where CHECKs (reads) go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadFrom {
    /// A healthy replica of the caller's shard, else its primary.
    Replica,
    /// Always the primary.
    Primary,
}

/// Behaviour when the store cannot answer within `store.timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Fail open: forward the request without limiting it, log a rate-limited warning.
    Allow,
    /// Fail closed: answer 503.
    Deny,
    /// Enforce the limits of a shard whose store calls fail in this gateway's memory,
    /// each quota divided by `store.fleet_size`, until the shard answers again.
    Local,
}

/// `store.fleet_size`: a count of gateways, or `"auto"` (as written: validated later).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum FleetSize {
    /// This many gateways share the store (must be at least 1).
    Count(i64),
    /// `"auto"`: counted from heartbeats (any other text is an error).
    Named(String),
}

/// `[[store.shards]]`: one Redis primary and its replicas, given directly or found
/// through Sentinel.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ShardConfig {
    /// `redis://HOST:PORT[/DB]` of the primary; CHARGEs go here. Required unless
    /// `sentinel` is given.
    #[serde(default)]
    pub primary: Option<String>,
    /// Replica URLs; CHECKs go here when `store.read_from = "replica"`.
    #[serde(default)]
    pub replicas: Vec<String>,
    /// Find the primary and replicas through Sentinel instead.
    #[serde(default)]
    pub sentinel: Option<SentinelConfig>,
}

/// `sentinel = { master = "NAME", nodes = ["redis://HOST:26379", ...] }`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SentinelConfig {
    /// The master name Sentinel monitors.
    pub master: String,
    /// Sentinel addresses, `redis://HOST:PORT`.
    pub nodes: Vec<String>,
}

/// `[identity]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdentityConfig {
    /// Header that carries the API key. For `authorization`, the value is `Bearer KEY` or
    /// `token KEY`; for any other header the whole value is the key.
    pub api_key_header: String,
    /// CIDRs of proxies whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<String>,
    /// The network prefix, in bits, that keys an IPv6 client in every per-IP count
    /// (anonymous callers, `by = "ip"` limits, `failed_auth_limit`, the access log's
    /// client hash, `server.max_connections_per_ip`): one subscriber usually holds a
    /// whole /64. 1 to 128; 128 keys each address (inside a cluster or a LAN). Default
    /// 64.
    pub ipv6_prefix_len: u32,
    /// Tier of callers that present no key.
    pub anonymous_tier: String,
    /// `[[identity.clients]]`: known API keys.
    pub clients: Vec<ClientConfig>,
    /// A file of further API keys, one JSON object a line (`{"id": "acme",
    /// "key_sha256": "…", "tier": "gold"}`, see [`crate::identity::keys`]); relative to
    /// the config file's directory. Reloaded on its own when it changes, and on SIGHUP.
    /// Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clients_file: Option<String>,
    /// The largest `clients_file` read, in bytes: a bigger file is refused before a byte
    /// of it is read (at start and by `tollgate check`: an error naming this key; on a
    /// reload: logged, and the running keys stay). Default 268435456 (256 MiB, about 2.5
    /// million keys).
    pub clients_file_max_bytes: u64,
    /// How long a changed `clients_file` must keep the same size and modification time
    /// (with no new file event) before the watcher applies it. Default 1 s.
    pub clients_file_settle: Dur,
    /// A change of `clients_file` seen by the watcher that would remove more than this
    /// percent of the keys in use (and more than 10 keys), or that leaves the file with
    /// no key while some were in use, is held (logged at warn) until SIGHUP confirms it or
    /// the file changes again. 0 to 100; 100 holds only a file left with no key. Default
    /// 10.
    pub clients_file_max_removed_percent: u32,
    /// Failed authentications (unknown API keys) allowed per client IP and window, in
    /// the same store as the limits; past it, 429 instead of 401. Default 30 a minute.
    pub failed_auth_limit: FailedAuthLimit,
    /// With `server.tls.client_ca`: a verified client certificate whose subject common
    /// name (CN) is the `id` of an `[[identity.clients]]` entry identifies the caller as
    /// that client (its tier), when the request presents no API key (a key wins).
    /// Default false.
    pub client_cert_subject_as_caller: bool,
    /// `[identity.jwt]`: callers that present a signed JWT instead of an API key.
    /// Default: none (bearer tokens are API keys only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jwt: Option<JwtConfig>,
    /// `[identity.auth_request]`: an auth service asked about credentials no local key
    /// matches. Default: none (unknown keys get 401).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth_request: Option<AuthRequestConfig>,
    /// Request header set to the caller id before forwarding (e.g. `"x-consumer-id"`),
    /// or removed for anonymous callers; the client's own value is always removed first.
    /// Default: none (off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_caller_header: Option<String>,
    /// Request header set to the caller's tier before forwarding (e.g.
    /// `"x-consumer-tier"`), or removed for anonymous callers; the client's own value is
    /// always removed first. Default: none (off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_tier_header: Option<String>,
    /// Remove the credential header (`api_key_header`) before forwarding when the
    /// gateway identified the caller from it. Default false.
    pub strip_credentials: bool,
}

/// `[identity.jwt]`: how bearer tokens shaped like JWTs are verified. Exactly one of
/// `secret`, `secret_env`, `secret_file`, `public_key` and `jwks` gives the key(s).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// HMAC secret (HS256/HS384/HS512), as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    /// Name of an environment variable holding the HMAC secret (read at each load).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_env: Option<String>,
    /// Path of a file holding the HMAC secret (one trailing newline stripped; read at
    /// each load). A relative path is looked up in `$CREDENTIALS_DIRECTORY` first, then
    /// relative to the config file's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<String>,
    /// Path of a PEM public key (RSA or EC; relative paths are relative to the config
    /// file's directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    /// Path of a JWKS file (`{"keys": [...]}`): the token's `kid` selects the key. Read
    /// again on every reload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwks: Option<String>,
    /// Signature algorithms accepted, e.g. `["RS256"]`. Required; `none` is never
    /// accepted.
    #[serde(default)]
    pub algorithms: Vec<String>,
    /// Tolerance for `exp` and `nbf` against this gateway's clock (whole seconds are
    /// used). Default 30 s.
    #[serde(default = "default_jwt_leeway")]
    pub leeway: Dur,
    /// Required `iss` claim. Default: none (not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
    /// Required `aud` claim value. Default: none (a token carrying `aud` is accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
    /// Claim holding the caller id (a string or an integer). Default `"sub"`.
    #[serde(default = "default_id_claim")]
    pub id_claim: String,
    /// Claim holding the caller's tier. Default: none (every JWT caller gets
    /// `default_tier`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier_claim: Option<String>,
    /// Tier of JWT callers whose token has no tier claim. Default `"default"`.
    #[serde(default = "default_tier")]
    pub default_tier: String,
    /// Further tiers a token's tier claim may name (besides `default_tier` and the
    /// tiers of `[[identity.clients]]`); limits' quotas may use them. Default: none.
    #[serde(default)]
    pub tiers: Vec<String>,
}

fn default_jwt_leeway() -> Dur {
    Dur::from_secs(30)
}

fn default_id_claim() -> String {
    "sub".into()
}

impl Default for IdentityConfig {
    fn default() -> Self {
        Self {
            api_key_header: "authorization".into(),
            trusted_proxies: Vec::new(),
            ipv6_prefix_len: 64,
            anonymous_tier: "anonymous".into(),
            clients: Vec::new(),
            clients_file: None,
            clients_file_max_bytes: 256 << 20,
            clients_file_settle: Dur::from_secs(1),
            clients_file_max_removed_percent: 10,
            failed_auth_limit: FailedAuthLimit::default(),
            client_cert_subject_as_caller: false,
            jwt: None,
            auth_request: None,
            forward_caller_header: None,
            forward_tier_header: None,
            strip_credentials: false,
        }
    }
}

/// `[identity.auth_request]`: the auth callout (like nginx's `auth_request`, Traefik's
/// `ForwardAuth`, Envoy's `ext_authz`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthRequestConfig {
    /// The auth service, `http://HOST:PORT/PATH`. Required.
    pub url: String,
    /// The HTTP method of the callout. Default `"GET"`.
    pub method: String,
    /// Further request headers copied to the callout besides the credential header
    /// (e.g. `["x-tenant"]`). Default: none.
    pub forward_headers: Vec<String>,
    /// Send the request's method and path as `X-Original-Method` and `X-Original-URI`.
    /// Default true.
    pub send_request_line: bool,
    /// Longest URI sent as `X-Original-URI`, bytes: a request with a longer one (when
    /// `send_request_line`) gets 414 without a callout. Default 8192.
    pub max_uri_bytes: usize,
    /// Largest credential and forwarded headers sent (names and values summed), bytes:
    /// a request with larger ones gets 431 without a callout. Default 4096.
    pub max_header_bytes: usize,
    /// Response header of a 2xx answer naming the caller id. Default `"x-caller-id"`.
    pub caller_header: String,
    /// Response header naming the caller's tier. Default `"x-caller-tier"`; absent:
    /// `default_tier`.
    pub tier_header: String,
    /// Tier of callers whose answer names none. Default `"default"`.
    pub default_tier: String,
    /// Prefix of response headers carrying per-limit quotas, e.g.
    /// `X-Caller-Quota-core: 10000`. Default `"x-caller-quota-"`.
    pub quota_header_prefix: String,
    /// How long an answer that names a caller is cached, per credential. Default 60 s.
    pub cache_ttl: Dur,
    /// How long a 401/403 answer is cached, per credential. Default 10 s.
    pub negative_ttl: Dur,
    /// Most credentials cached at once. Default 100000.
    pub cache_size: usize,
    /// Most bytes the cached answers may take (bodies of refusals and caller ids
    /// included). Default 64 MiB.
    pub cache_max_bytes: usize,
    /// Budget for one callout (connect, answer and body). Default 500 ms.
    pub timeout: Dur,
    /// What a request gets when the service fails, is slow or its breaker is open:
    /// `"deny"` (503, the default) or `"anonymous"` (served as an anonymous caller).
    pub on_error: AuthOnError,
    /// Consecutive failed callouts that open the breaker. Default 5.
    pub breaker_failures: u32,
    /// How long an open breaker skips the service before trying it again. Default 5 s.
    pub breaker_cooloff: Dur,
    /// Callouts under way at once (a callout whose client went away runs to its end, at
    /// most `timeout`, and counts until then); a request that needs one more gets 503
    /// without a callout. At least 1. Default 256.
    pub max_concurrent: usize,
    /// Callouts under way at once for requests from one client address (keyed like
    /// `identity.failed_auth_limit`); a request that needs one more gets 429 without a
    /// callout. At least 1. Default 32.
    pub max_concurrent_per_ip: usize,
}

impl Default for AuthRequestConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            method: "GET".into(),
            forward_headers: Vec::new(),
            send_request_line: true,
            max_uri_bytes: 8192,
            max_header_bytes: 4096,
            caller_header: "x-caller-id".into(),
            tier_header: "x-caller-tier".into(),
            default_tier: "default".into(),
            quota_header_prefix: "x-caller-quota-".into(),
            cache_ttl: Dur::from_secs(60),
            negative_ttl: Dur::from_secs(10),
            cache_size: 100_000,
            cache_max_bytes: 64 * 1024 * 1024,
            timeout: Dur::from_millis(500),
            on_error: AuthOnError::Deny,
            breaker_failures: 5,
            breaker_cooloff: Dur::from_secs(5),
            max_concurrent: 256,
            max_concurrent_per_ip: 32,
        }
    }
}

/// `identity.auth_request.on_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AuthOnError {
    /// 503.
    Deny,
    /// Served as an anonymous caller.
    Anonymous,
}

/// `identity.failed_auth_limit`: `{ quota = 30, window = "1m" }`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailedAuthLimit {
    /// Failed authentications per client IP and window; 0 turns the limit off.
    pub quota: u64,
    /// Window length.
    pub window: Dur,
}

impl Default for FailedAuthLimit {
    fn default() -> Self {
        Self {
            quota: 30,
            window: Dur::from_secs(60),
        }
    }
}

/// `[[identity.clients]]`: one client and its API key(s).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    /// Caller id, used in limit keys (hashed), logs and error messages. Several entries
    /// (here or in `identity.clients_file`) may share an id: they are keys of one client
    /// and share its windows.
    pub id: String,
    /// SHA-256 of the API key, 64 hex characters, or an array of them (several keys of
    /// one client, e.g. while rotating).
    pub key_sha256: KeyHashes,
    /// The client's tier. Default `"default"`.
    #[serde(default = "default_tier")]
    pub tier: String,
}

/// `key_sha256`: one hex SHA-256, or an array of them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum KeyHashes {
    /// One key.
    One(String),
    /// Several keys of one client.
    Many(Vec<String>),
}

impl KeyHashes {
    /// The hashes, in order.
    pub fn as_slice(&self) -> &[String] {
        match self {
            Self::One(s) => std::slice::from_ref(s),
            Self::Many(v) => v,
        }
    }
}

impl From<String> for KeyHashes {
    fn from(s: String) -> Self {
        Self::One(s)
    }
}

fn default_tier() -> String {
    "default".into()
}

/// `[[upstreams]]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Name that routes refer to.
    pub name: String,
    /// `http://HOST:PORT[/BASE]` targets, used round robin.
    pub targets: Vec<String>,
    /// TCP connect budget. Default 2 s; past it the caller gets 504.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: Dur,
    /// Budget from sending the request until the response headers arrive. Default 60 s;
    /// past it the caller gets 504.
    #[serde(default = "default_response_timeout")]
    pub response_timeout: Dur,
    /// Optional response header (e.g. `"x-tollgate-cost"`) in which the upstream says what
    /// a request cost, in cost units: a non-negative integer there is charged instead of
    /// the route's `cost`, and the header is removed before the client sees it. The check
    /// before forwarding still uses the route's `cost`. Default: none (off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_header: Option<String>,
    /// How requests reach the targets: `"http1"` (default) or `"http2"` (h2c with prior
    /// knowledge for `http://` targets, ALPN `h2` for `https://` ones; one multiplexed
    /// connection per target).
    #[serde(default)]
    pub protocol: UpstreamProtocol,
    /// Trusted roots for `https://` targets when `ca` is not set: `"webpki"` (default,
    /// Mozilla's roots built in) or `"system"` (the operating system's store, read when the
    /// config is loaded).
    #[serde(default)]
    pub tls_roots: TlsRoots,
    /// PEM file of the CA certificate(s) that sign the `https://` targets' certificates
    /// (a private CA); replaces `tls_roots`. Relative paths are relative to the config
    /// file's directory. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    /// PEM file of a client certificate (chain) presented to `https://` targets; needs
    /// `client_key`. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<String>,
    /// PEM file of the private key of `client_cert`. Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<String>,
    /// How long a target that refused a connection (connect error or connect timeout) is
    /// skipped; doubled for each further consecutive failure up to 5 minutes, reset by a
    /// success. Default 10 s.
    #[serde(default = "default_eject_for")]
    pub eject_for: Dur,
    /// Largest response head accepted from a target, in bytes, over HTTP/1.1 and HTTP/2
    /// alike (counted as HTTP/2 does: each field's name and value plus 32); a larger
    /// one gives the client 502. Default 65536. At least 1024.
    #[serde(default = "default_max_response_header_bytes")]
    pub max_response_header_bytes: usize,
}

fn default_max_response_header_bytes() -> usize {
    64 * 1024
}

/// How the proxy listener's connections are served (`server.runtime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeShape {
    /// One multi-threaded (work-stealing) Tokio runtime with `server.workers` threads
    /// serves every connection; a request may wake tasks on any of them.
    MultiThread,
    /// `server.workers` single-threaded runtimes, each on its own OS thread with its own
    /// listener on `server.listen` (`SO_REUSEPORT` on Linux; elsewhere one listener they
    /// share), its own upstream connection pools and its own Redis batchers: a request
    /// is served on the thread that accepted its connection. The default.
    #[default]
    PerCore,
}

/// The HTTP version spoken to an upstream's targets (`upstreams.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamProtocol {
    /// HTTP/1.1 with a pool of keep-alive connections per target.
    #[default]
    Http1,
    /// HTTP/2: one multiplexed connection per target.
    Http2,
}

/// Where trusted roots for `https://` targets come from (`upstreams.tls_roots`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsRoots {
    /// Mozilla's root certificates, compiled in (the webpki-roots crate).
    #[default]
    Webpki,
    /// The operating system's certificate store.
    System,
}

fn default_eject_for() -> Dur {
    Dur::from_secs(10)
}

fn default_connect_timeout() -> Dur {
    Dur::from_secs(2)
}

fn default_response_timeout() -> Dur {
    Dur::from_secs(60)
}

/// `[[limits]]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitConfig {
    /// Name, reported as `X-RateLimit-Resource`.
    pub name: String,
    /// `"fixed_window"` (default), `"sliding_window"`, `"sliding_log"`, `"gcra"` or
    /// `"concurrency"`; see docs/algorithms.md.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// GCRA only: the bucket size in units (how many requests may come at once).
    /// Default: the tier's quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// Fixed windows only: `"first_request"` (default: a window starts at the caller's
    /// first charge) or `"calendar"` (windows start at UTC boundaries: the hour, the
    /// day, the month for `window = "1mo"`).
    #[serde(default)]
    pub align: WindowAlign,
    /// `"enforce"` (default) or `"shadow"`: evaluate and report (log, metric, headers)
    /// but never refuse.
    #[serde(default)]
    pub mode: LimitMode,
    /// Percent of callers (0-100, chosen by a stable hash of what the limit counts) for
    /// whom an enforcing limit refuses; the others are shadowed. Default 100.
    #[serde(default = "default_enforce_percent")]
    pub enforce_percent: u8,
    /// `"reject"` (default: 429 at once) or `"delay"`: hold a refused request until this
    /// limit would admit it, at most `max_delay`, with at most `max_waiting` requests of
    /// one subject waiting on one gateway; beyond either, 429.
    #[serde(default)]
    pub on_limit: OnLimit,
    /// `on_limit = "delay"`: the longest a request is held. Default 1s.
    #[serde(default = "default_max_delay")]
    pub max_delay: Dur,
    /// `on_limit = "delay"`: requests of one subject held at once per gateway. Default 16.
    #[serde(default = "default_max_waiting")]
    pub max_waiting: u32,
    /// Window length.
    pub window: Dur,
    /// Cost units per window, by tier.
    pub quota: BTreeMap<String, u64>,
    /// What a window counts: `"caller"`, `"ip"`, `"global"` or `"header:NAME"`.
    #[serde(default)]
    pub by: LimitBy,
    /// `by = "header:NAME"` only: believe the header only when the socket peer is one of
    /// `identity.trusted_proxies`; from any other peer the limit counts the client IP.
    /// Default false (the header counts from anyone, so a client picks its window).
    #[serde(default)]
    pub trusted_only: bool,
    /// Lease mode: take this many units from the store at a time and admit from them
    /// locally (about one store call per `lease` requests of a hot caller). Units
    /// admitted by all gateways never exceed the quota. Default: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<u64>,
    /// Lease mode: how long the store keeps a gateway's leased units for it without
    /// hearing from it. Units a gateway has neither used nor given back by then (it
    /// crashed) go back to the window. At least 2s; default 5s.
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl: Dur,
    /// Once this limit refuses a caller, refuse every request of that caller on this
    /// limit for this long (from the refusal that started the block), whatever the
    /// window says; the block is kept in the store, so the whole fleet blocks. Between
    /// 1s and 1 year; not for `"concurrency"` nor lease mode. Default: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_for: Option<Dur>,
}

fn default_lease_ttl() -> Dur {
    LimitConfig::DEFAULT_LEASE_TTL
}

impl LimitConfig {
    /// `lease_ttl` when the file does not set it.
    pub const DEFAULT_LEASE_TTL: Dur = Dur(std::time::Duration::from_secs(5));
}

/// `[[limits]].algorithm`; the rules are in `crate::limiter::algorithm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Fixed window (default).
    #[default]
    FixedWindow,
    /// Two-counter sliding window estimate.
    SlidingWindow,
    /// Exact sliding log.
    SlidingLog,
    /// Generic cell rate algorithm.
    Gcra,
    /// Requests in flight.
    Concurrency,
}

fn default_max_delay() -> Dur {
    Dur::from_secs(1)
}

fn default_max_waiting() -> u32 {
    16
}

fn default_enforce_percent() -> u8 {
    100
}

/// `[[routes]]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Optional host (without port) this route is for; matched case-insensitively.
    #[serde(default)]
    pub host: Option<String>,
    /// Path prefix; the longest matching prefix wins.
    pub path_prefix: String,
    /// `"prefix"` (default: the path starts with `path_prefix`, so `/v1/orders` also
    /// matches `/v1/ordersummary`) or `"segments"` (whole path segments only:
    /// `/v1/orders` matches `/v1/orders` and `/v1/orders/7`, not `/v1/ordersummary`).
    #[serde(default)]
    pub path_match: PathMatch,
    /// Request methods this route is for (e.g. `["POST"]`); empty (default): any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// Largest request body forwarded, in bytes; larger ones get 413 (checked against
    /// `Content-Length` before forwarding, and counted while streaming). `None`: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_request_bytes: Option<u64>,
    /// Name of an `[[upstreams]]` entry.
    pub upstream: String,
    /// Names of `[[limits]]` entries; every one must admit the request.
    #[serde(default)]
    pub limits: Vec<String>,
    /// Units charged per request. Default 1.
    #[serde(default = "default_cost")]
    pub cost: u64,
    /// Responses with these statuses are not charged. Default (`None`): `[304]`, unless
    /// `charged_statuses` is set. Setting both is an error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncharged_statuses: Option<Vec<u16>>,
    /// Only responses with these statuses are charged (e.g. `[401, 403]` on a login
    /// route: failures count, successes never do); every other status is treated as an
    /// uncharged one. `None` (default): every status but `uncharged_statuses` is charged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charged_statuses: Option<Vec<u16>>,
    /// `"after_response"` (default): charged once the response status is known;
    /// `"on_request"`: reserved when the request is admitted (refunded for an uncharged
    /// status).
    #[serde(default)]
    pub charge: ChargeAt,
    /// Protocols a request on this route may upgrade to (`Upgrade`), e.g.
    /// `["websocket"]` (the default); any other upgrade is served as a plain request.
    /// `"h2c"` is an error.
    #[serde(default = "default_upgrades")]
    pub upgrades: Vec<String>,
    /// Believe `X-HTTP-Method-Override`, `X-Method-Override`, `X-HTTP-Method`,
    /// `X-Original-URL` and `X-Rewrite-URL` on this route: route and limit on the
    /// method and URL they name, and forward them. Default false: they are stripped.
    #[serde(default)]
    pub trust_method_override: bool,
}

fn default_upgrades() -> Vec<String> {
    vec!["websocket".into()]
}

fn default_cost() -> u64 {
    1
}

/// `uncharged_statuses` when a route sets neither it nor `charged_statuses`.
pub const DEFAULT_UNCHARGED: [u16; 1] = [304];

/// `[headers]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeadersConfig {
    /// The rate-limit header styles responses carry, each at most once. Default
    /// `["github"]`; an empty list sends no rate-limit headers.
    pub style: Vec<HeaderStyle>,
    /// Refusals as RFC 9457 problem details (`application/problem+json`, the problem
    /// types of draft-ietf-httpapi-ratelimit-headers): a caller's 429 as
    /// `quota-exceeded`, the 503 of a failed store as `temporary-reduced-capacity`.
    /// Default false: the GitHub-style JSON bodies.
    pub problem_details: bool,
    /// With `style = ["ietf"]`: `RateLimit-Policy` and `RateLimit` carry `pk`, each
    /// limit's partition key: the caller's keyed hash (the digest in its storage keys)
    /// as an sf-binary, never a raw key, id or address. Default false.
    pub partition_key: bool,
}

impl Default for HeadersConfig {
    fn default() -> Self {
        Self {
            style: vec![HeaderStyle::Github],
            problem_details: false,
            partition_key: false,
        }
    }
}

/// One style of rate-limit headers (`headers.style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HeaderStyle {
    /// GitHub's `X-RateLimit-Limit`, `-Remaining`, `-Used`, `-Reset` and `-Resource`.
    Github,
    /// The IETF draft's structured fields (draft-ietf-httpapi-ratelimit-headers):
    /// `RateLimit-Policy` (every limit that applied) and `RateLimit` (the most
    /// constrained one).
    Ietf,
}

impl HeaderStyle {
    /// The name in the config file: `"github"` or `"ietf"`.
    pub fn name(self) -> &'static str {
        match self {
            HeaderStyle::Github => "github",
            HeaderStyle::Ietf => "ietf",
        }
    }
}
