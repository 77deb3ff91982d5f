//! Opening one connection to one Redis address: TCP (the host name resolved anew on
//! every connect, so a failover behind a DNS name is followed), then TLS for
//! `rediss://` nodes (rustls with ring, configured from `[store.tls]`), then the
//! connection's setup (`AUTH` with the node's user and password, `SELECT`) by redis-rs.
//!
//! The credentials and TLS settings live in a [`Dialer`] shared by every node of a store;
//! a reload that keeps the store swaps new ones in ([`Dialer::replace`]), and the next
//! connection uses them: a rotated password or certificate needs no new store.

use crate::config::secrets::secret;
use crate::config::{Files, Problems, StoreConfig};
use arc_swap::ArcSwap;
use redis::aio::{MultiplexedConnection, PubSub};
use redis::{AsyncConnectionConfig, RedisConnectionInfo, RedisError, RedisResult};
use rustls::pki_types::ServerName;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// One Redis address as written in the config (`redis://` or `rediss://`) or announced
/// by Sentinel or Cluster, with the credentials its URL carries.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// Host name or IP address (IPv6 without brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Dialled with TLS (`rediss://`).
    pub tls: bool,
    /// The database `SELECT`ed after connecting (the URL's `/DB`; 0 by default).
    pub db: i64,
    /// The URL's user, if any.
    pub username: Option<String>,
    /// The URL's password, if any.
    pub password: Option<String>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("addr", &self.addr())
            .field("tls", &self.tls)
            .field("db", &self.db)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Parse `redis://[USER[:PASSWORD]@]HOST[:PORT][/DB]` or the same with `rediss://`
    /// (TLS). Errors: another scheme, a Unix socket, or a URL redis-rs cannot read.
    pub(crate) fn parse(url: &str) -> Result<Endpoint, String> {
        let (tls, rest) = if let Some(rest) = url.strip_prefix("rediss://") {
            (true, rest)
        } else if let Some(rest) = url.strip_prefix("redis://") {
            (false, rest)
        } else {
            return Err("the URL must start with redis:// or rediss:// (TLS)".into());
        };
        // redis-rs (built without its TLS features) reads the rest; TLS is ours.
        let info = redis::IntoConnectionInfo::into_connection_info(format!("redis://{rest}"))
            .map_err(|e| e.to_string())?;
        let (host, port) = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
            _ => return Err("only TCP addresses are supported".into()),
        };
        let settings = info.redis_settings();
        Ok(Endpoint {
            db: settings.db(),
            username: settings.username().map(str::to_string),
            password: settings.password().map(str::to_string),
            ..Endpoint::announced(&host, port, tls)
        })
    }

    /// An address announced by Sentinel or Cluster (`HOST:PORT`, or `HOST` and `PORT`),
    /// dialled with TLS when `tls`, with no credentials of its own.
    pub(crate) fn announced(host: &str, port: u16, tls: bool) -> Endpoint {
        Endpoint {
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port,
            tls,
            db: 0,
            username: None,
            password: None,
        }
    }

    /// `HOST:PORT` (`[V6]:PORT` for an IPv6 address).
    pub(crate) fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Whose credentials a connection uses when its URL carries none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DialAs {
    /// A primary or replica: `store.username` / `store.password`.
    Data,
    /// A Sentinel: `store.sentinel_username` / `store.sentinel_password`.
    Sentinel,
}

/// What every new connection of a store is made with, as last loaded.
#[derive(Default)]
pub(crate) struct DialSettings {
    /// The rustls configuration for `rediss://` nodes (`None`: no URL asks for TLS).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// `store.tls.server_name`: the name verified instead of the dialled host.
    pub server_name: Option<ServerName<'static>>,
    /// `store.username`.
    pub username: Option<String>,
    /// `store.password` (or the contents of `store.password_file`).
    pub password: Option<String>,
    /// `store.sentinel_username`.
    pub sentinel_username: Option<String>,
    /// `store.sentinel_password` (or the contents of `store.sentinel_password_file`).
    pub sentinel_password: Option<String>,
}

impl std::fmt::Debug for DialSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DialSettings")
            .field("tls", &self.tls.is_some())
            .field("server_name", &self.server_name)
            .field("username", &self.username)
            .field("sentinel_username", &self.sentinel_username)
            .finish_non_exhaustive()
    }
}

impl DialSettings {
    /// `[store]`'s credentials and `[store.tls]`'s client configuration, from the secret
    /// and PEM files the loading step read (`files`), recording problems at their keys.
    /// `wants_tls`: some URL is `rediss://`, so a client configuration is built even
    /// without `[store.tls]` (with the default roots).
    pub(crate) fn load(
        cfg: &StoreConfig,
        wants_tls: bool,
        files: &Files,
        problems: &mut Problems,
    ) -> DialSettings {
        let password = secret(
            "store.password",
            cfg.password.as_deref(),
            cfg.password_file.as_deref(),
            files,
            problems,
        );
        let sentinel_password = secret(
            "store.sentinel_password",
            cfg.sentinel_password.as_deref(),
            cfg.sentinel_password_file.as_deref(),
            files,
            problems,
        );
        let tls_cfg = cfg.tls.clone().unwrap_or_default();
        if cfg.tls.is_some() && !wants_tls {
            problems.warn(
                "store.tls",
                "no Redis URL is rediss://, so these settings are not used (TLS is asked for per URL)",
            );
        }
        let server_name = tls_cfg
            .server_name
            .as_ref()
            .and_then(|name| match ServerName::try_from(name.clone()) {
                Ok(n) => Some(n),
                Err(e) => {
                    problems.error(
                        "store.tls.server_name",
                        format!("{name:?} is not a DNS name or IP address: {e}"),
                    );
                    None
                }
            });
        let tls = if wants_tls || cfg.tls.is_some() {
            let named = crate::proxy::tls::ClientTlsFiles {
                ca: tls_cfg.ca.as_deref(),
                roots: tls_cfg.roots,
                roots_key: "roots",
                client_cert: tls_cfg.client_cert.as_deref(),
                client_key: tls_cfg.client_key.as_deref(),
            };
            named
                .client_config("store.tls", files, problems)
                .map(Arc::new)
        } else {
            None
        };
        DialSettings {
            tls,
            server_name,
            username: cfg.username.clone(),
            password,
            sentinel_username: cfg.sentinel_username.clone(),
            sentinel_password,
        }
    }
}

/// The [`DialSettings`] every connection of one store reads when it opens.
#[derive(Debug, Default)]
pub(crate) struct Dialer {
    settings: ArcSwap<DialSettings>,
}

/// A connected byte stream to Redis, plain or TLS.
trait RedisStream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> RedisStream for T {}

impl Dialer {
    /// A dialer with `settings`.
    pub(crate) fn new(settings: DialSettings) -> Arc<Dialer> {
        Arc::new(Dialer {
            settings: ArcSwap::from_pointee(settings),
        })
    }

    /// Use `settings` for every connection opened from now on (a reload's newly read
    /// secrets and certificates); open connections are left alone.
    pub(crate) fn replace(&self, settings: Arc<DialSettings>) {
        self.settings.store(settings);
    }

    /// The settings in use now.
    pub(crate) fn settings(&self) -> Arc<DialSettings> {
        self.settings.load_full()
    }

    /// TCP to `ep` (resolving its host now), then TLS when `ep.tls`.
    async fn stream(
        &self,
        ep: &Endpoint,
        settings: &DialSettings,
    ) -> RedisResult<Box<dyn RedisStream>> {
        let tcp = TcpStream::connect((ep.host.as_str(), ep.port)).await?;
        let _ = tcp.set_nodelay(true);
        if !ep.tls {
            return Ok(Box::new(tcp));
        }
        let Some(config) = settings.tls.clone() else {
            return Err(RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "rediss:// node but no TLS configuration loaded",
            )));
        };
        let name = match &settings.server_name {
            Some(n) => n.clone(),
            None => ServerName::try_from(ep.host.clone()).map_err(|e| {
                RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "host is not a valid TLS server name",
                    e.to_string(),
                ))
            })?,
        };
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await?;
        Ok(Box::new(tls))
    }

    /// The redis-rs connection info of `ep` dialled as `dial_as`: the URL's credentials, else the
    /// store's for that kind of node.
    fn info(ep: &Endpoint, dial_as: DialAs, settings: &DialSettings) -> RedisConnectionInfo {
        let (user, pass) = match dial_as {
            DialAs::Data => (&settings.username, &settings.password),
            DialAs::Sentinel => (&settings.sentinel_username, &settings.sentinel_password),
        };
        // No `CLIENT SETINFO` (Redis 7.2+ only, and one more command for the ACL): the
        // connection is named with `CLIENT SETNAME` instead.
        let mut info = RedisConnectionInfo::default()
            .set_db(ep.db)
            .set_skip_set_lib_name();
        if let Some(u) = ep.username.as_ref().or(user.as_ref()) {
            info = info.set_username(u);
        }
        // A URL that names its own user without a password gets no store password.
        let url_password = ep.password.as_ref();
        let pass = if ep.username.is_some() && url_password.is_none() {
            None
        } else {
            url_password.or(pass.as_ref())
        };
        if let Some(p) = pass {
            info = info.set_password(p);
        }
        info
    }

    /// A multiplexed connection to `ep` (its I/O task spawned on the current runtime),
    /// set up (`AUTH`, `SELECT`) within `timeout`.
    pub(crate) async fn connect(
        &self,
        ep: &Endpoint,
        dial_as: DialAs,
        config: AsyncConnectionConfig,
        timeout: Duration,
    ) -> RedisResult<MultiplexedConnection> {
        let settings = self.settings();
        let opened = async {
            let stream = self.stream(ep, &settings).await?;
            let info = Self::info(ep, dial_as, &settings);
            let (conn, driver) =
                MultiplexedConnection::new_with_config(&info, stream, config).await?;
            tokio::spawn(driver);
            Ok(conn)
        };
        match tokio::time::timeout(timeout, opened).await {
            Ok(r) => r,
            Err(_) => Err(timed_out()),
        }
    }

    /// A RESP2 pub/sub connection to `ep` (a Sentinel's `+switch-master`), set up within
    /// `timeout`.
    pub(crate) async fn pubsub(
        &self,
        ep: &Endpoint,
        dial_as: DialAs,
        timeout: Duration,
    ) -> RedisResult<PubSub> {
        let settings = self.settings();
        let opened = async {
            let stream = self.stream(ep, &settings).await?;
            PubSub::new(&Self::info(ep, dial_as, &settings), stream).await
        };
        match tokio::time::timeout(timeout, opened).await {
            Ok(r) => r,
            Err(_) => Err(timed_out()),
        }
    }
}

fn timed_out() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "connecting to redis timed out",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_give_host_port_tls_db_and_credentials() {
        let ep = Endpoint::parse("rediss://app:p%40ss@cache.example:6380/2").unwrap();
        assert_eq!(
            (ep.host.as_str(), ep.port, ep.tls, ep.db),
            ("cache.example", 6380, true, 2)
        );
        assert_eq!(ep.username.as_deref(), Some("app"));
        assert_eq!(ep.password.as_deref(), Some("p@ss"));
        let plain = Endpoint::parse("redis://127.0.0.1:7000").unwrap();
        assert!(!plain.tls);
        assert_eq!(plain.addr(), "127.0.0.1:7000");
        assert!(Endpoint::parse("http://h:1").is_err());
        assert!(Endpoint::parse("unix:///tmp/redis.sock").is_err());
    }

    #[test]
    fn a_url_without_credentials_takes_the_stores() {
        let settings = DialSettings {
            username: Some("tollgate".into()),
            password: Some("pw".into()),
            sentinel_password: Some("spw".into()),
            ..DialSettings::default()
        };
        let bare = Endpoint::parse("redis://h:1").unwrap();
        let data = Dialer::info(&bare, DialAs::Data, &settings);
        assert_eq!(
            (data.username(), data.password()),
            (Some("tollgate"), Some("pw"))
        );
        let sentinel = Dialer::info(&bare, DialAs::Sentinel, &settings);
        assert_eq!(
            (sentinel.username(), sentinel.password()),
            (None, Some("spw"))
        );
        let own = Endpoint::parse("redis://other:secret@h:1").unwrap();
        let data = Dialer::info(&own, DialAs::Data, &settings);
        assert_eq!(
            (data.username(), data.password()),
            (Some("other"), Some("secret"))
        );
    }
}
