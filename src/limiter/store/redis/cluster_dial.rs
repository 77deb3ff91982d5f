//! The connection type of `store.mode = "cluster"`: redis-rs's cluster client opens each
//! node's connection through [`Connect::connect_with_config`], a function with no
//! state of its own, so the dial settings (TLS, `store.username` / `store.password`)
//! come from a process-wide slot ([`use_for_cluster`]) that the running cluster store
//! fills. The nodes the cluster announces are dialled like the seed nodes: with TLS
//! when the seeds are `rediss://`.

use super::dial::{Dialer, Endpoint, Role};
use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::Connect;
use redis::{AsyncConnectionConfig, Cmd, IntoConnectionInfo, Pipeline, RedisFuture, Value};
use std::sync::Arc;
use std::time::Duration;

/// How the cluster's connections are opened now.
#[derive(Debug)]
struct ClusterDial {
    dialer: Arc<Dialer>,
    tls: bool,
    timeout: Duration,
}

static CLUSTER_DIAL: ArcSwapOption<ClusterDial> = ArcSwapOption::const_empty();

/// Open the cluster's connections through `dialer` from now on, with TLS when `tls`
/// (the seed URLs are `rediss://`), each within `timeout`. The last cluster store
/// started in the process sets it (a gateway runs one store at a time).
pub(super) fn use_for_cluster(dialer: Arc<Dialer>, tls: bool, timeout: Duration) {
    CLUSTER_DIAL.store(Some(Arc::new(ClusterDial {
        dialer,
        tls,
        timeout,
    })));
}

/// A multiplexed connection to one cluster node, opened through the store's
/// [`Dialer`].
#[derive(Clone)]
pub(crate) struct Dialed(MultiplexedConnection);

impl ConnectionLike for Dialed {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.0.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.0.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.0.get_db()
    }
}

impl Connect for Dialed {
    fn connect_with_config<'a, T>(info: T, config: AsyncConnectionConfig) -> RedisFuture<'a, Self>
    where
        T: IntoConnectionInfo + Send + 'a,
    {
        Box::pin(async move {
            let info = info.into_connection_info()?;
            let Some(dial) = CLUSTER_DIAL.load_full() else {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "no cluster store started",
                )));
            };
            let redis::ConnectionAddr::Tcp(host, port) = info.addr() else {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "cluster node is not a TCP address",
                )));
            };
            let settings = info.redis_settings();
            let mut ep = Endpoint::announced(host, *port, dial.tls);
            ep.db = settings.db();
            ep.username = settings.username().map(str::to_string);
            ep.password = settings.password().map(str::to_string);
            let conn = dial
                .dialer
                .connect(&ep, Role::Data, config, dial.timeout)
                .await?;
            Ok(Dialed(conn))
        })
    }
}
