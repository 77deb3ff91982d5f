//! Real Redis topologies on 127.0.0.1 for the integration tests: a primary with
//! replicas, Sentinel processes watching one, and a Redis Cluster. Every process is
//! stopped by PID when its owner is dropped; every wait is bounded and panics with a
//! message that says what did not happen.

use super::redis::{find_bin, free_port, spawn_sentinel, Process, RedisServer};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// How long the topology helpers wait for Redis to reach a state before panicking.
const WAIT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(25);

/// The path of `redis-cli`, or a panic that says how to get it. Tests never skip.
pub fn redis_cli_bin() -> String {
    find_bin("redis-cli", "REDIS_CLI").unwrap_or_else(|| {
        panic!("redis-cli not found on PATH: these tests need it to create a Redis Cluster. Install it (Debian: apt-get install redis-tools or redis-server) or set REDIS_CLI=/path/to/redis-cli")
    })
}

/// A synchronous connection to any port on 127.0.0.1, with short timeouts.
fn conn_port(port: u16) -> redis::RedisResult<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let c = client.get_connection_with_timeout(Duration::from_secs(1))?;
    c.set_read_timeout(Some(Duration::from_secs(2)))?;
    c.set_write_timeout(Some(Duration::from_secs(2)))?;
    Ok(c)
}

/// Run a command on a port; errors (refused, loading, ...) come back as `Err`.
pub fn try_cmd<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> redis::RedisResult<T> {
    super::redis::query(&mut conn_port(port)?, args)
}

/// Poll `check` until it returns `Some`, or panic with `what()` after `timeout`.
pub fn wait_for<T>(
    timeout: Duration,
    mut check: impl FnMut() -> Option<T>,
    what: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: {}",
            what()
        );
        std::thread::sleep(POLL);
    }
}

/// One `field:value` of an `INFO` text.
pub fn parse_info_field(info: &str, field: &str) -> Option<String> {
    info.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == field).then(|| v.trim().to_string())
    })
}

/// `INFO section` of whatever listens on `port`, or `None` if it does not answer.
fn info_port(port: u16, section: &str) -> Option<String> {
    try_cmd::<String>(port, &["INFO", section]).ok()
}

/// One field of `INFO section` on a server (`None` if absent or the server is down).
pub fn info_field(server: &RedisServer, section: &str, field: &str) -> Option<String> {
    parse_info_field(&info_port(server.port, section)?, field)
}

/// How many times the server has run a command, from `INFO commandstats`:
/// `name` as Redis spells it there, e.g. `"evalsha"`, `"eval"`, `"script|load"`
/// (case-insensitive). 0 if the command was never called.
pub fn cmd_calls(server: &RedisServer, name: &str) -> u64 {
    let field = format!("cmdstat_{}", name.to_ascii_lowercase());
    let Some(stat) = info_field(server, "commandstats", &field) else {
        return 0;
    };
    stat.split(',')
        .find_map(|kv| kv.strip_prefix("calls="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// `cmd_calls(server, "evalsha")`.
pub fn evalsha_calls(server: &RedisServer) -> u64 {
    cmd_calls(server, "evalsha")
}

// ---------------------------------------------------------------------------------
// Primary + replicas
// ---------------------------------------------------------------------------------

/// A primary and its replicas (`--replicaof 127.0.0.1 PRIMARY_PORT`).
pub struct ReplicatedShard {
    pub primary: RedisServer,
    pub replicas: Vec<RedisServer>,
}

impl ReplicatedShard {
    /// Start a primary and `n_replicas` replicas (all with
    /// `--repl-diskless-sync-delay 0`), and wait (≤ 10 s each) until every
    /// replica reports `master_link_status:up`.
    pub fn start(n_replicas: usize) -> ReplicatedShard {
        // Redis 7 waits `repl-diskless-sync-delay` (5 s) before a full sync to batch
        // replicas; every node gets 0 (any replica may be promoted later).
        const NO_DELAY: [&str; 2] = ["--repl-diskless-sync-delay", "0"];
        let primary = RedisServer::start_with(&NO_DELAY);
        let pport = primary.port.to_string();
        let replicas: Vec<RedisServer> = (0..n_replicas)
            .map(|_| {
                RedisServer::start_with(&[
                    NO_DELAY[0],
                    NO_DELAY[1],
                    "--replicaof",
                    "127.0.0.1",
                    &pport,
                ])
            })
            .collect();
        for r in &replicas {
            wait_for(
                WAIT,
                || {
                    (info_field(r, "replication", "master_link_status").as_deref() == Some("up"))
                        .then_some(())
                },
                || {
                    format!(
                        "replica on port {} never reached master_link_status:up with primary on port {}",
                        r.port, primary.port
                    )
                },
            );
        }
        ReplicatedShard { primary, replicas }
    }

    /// Wait (≤ 10 s) until every replica has processed everything the primary had
    /// written when this was called (`master_repl_offset` caught up).
    pub fn wait_replicated(&self) {
        let target: u64 = info_field(&self.primary, "replication", "master_repl_offset")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "primary on port {} has no master_repl_offset",
                    self.primary.port
                )
            });
        for r in &self.replicas {
            let offset = || -> Option<u64> {
                info_field(r, "replication", "master_repl_offset")?
                    .parse()
                    .ok()
            };
            wait_for(
                WAIT,
                || offset().filter(|o| *o >= target).map(|_| ()),
                || {
                    format!(
                        "replica on port {} stuck at master_repl_offset {:?}, primary at {target}",
                        r.port,
                        offset()
                    )
                },
            );
        }
    }

    /// The replicas' ports, in start order.
    pub fn replica_ports(&self) -> Vec<u16> {
        self.replicas.iter().map(|r| r.port).collect()
    }
}

// ---------------------------------------------------------------------------------
// Sentinel
// ---------------------------------------------------------------------------------

/// One `redis-server <conf> --sentinel` process on 127.0.0.1, killed when dropped.
pub struct SentinelProcess {
    pub port: u16,
    pub conf: PathBuf,
    child: Process,
}

impl SentinelProcess {
    /// Write `conf` (port, bind, `dir`, plus `body`) and start a sentinel on it;
    /// waits (≤ 10 s) until it answers PING.
    fn start(dir: &Path, body: &str) -> SentinelProcess {
        let port = free_port();
        let (conf, child) = spawn_sentinel(dir, port, body);
        let mut s = SentinelProcess { port, conf, child };
        wait_for(
            WAIT,
            || {
                if let Some(status) = s.child.exited() {
                    panic!("sentinel on port {port} exited at startup: {status}");
                }
                try_cmd::<String>(port, &["PING"]).ok().map(|_| ())
            },
            || format!("sentinel on port {port} did not start"),
        );
        s
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.pid()
    }

    /// Run a command on this sentinel; errors come back as `Err`.
    pub fn try_cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        try_cmd(self.port, args)
    }

    /// Run a command on this sentinel and return its reply (panics on error).
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        self.try_cmd(args)
            .unwrap_or_else(|e| panic!("sentinel {}: {args:?}: {e}", self.port))
    }

    /// The port this sentinel gives for `master_name`, if it answers.
    pub fn master_port(&self, master_name: &str) -> Option<u16> {
        let addr: Option<(String, String)> = self
            .try_cmd(&["SENTINEL", "get-master-addr-by-name", master_name])
            .ok()?;
        addr?.1.parse().ok()
    }

    /// Kill the process (SIGKILL) and wait for it.
    pub fn kill(&mut self) {
        self.child.kill();
    }
}

/// A replicated shard watched by Sentinel processes (quorum 1,
/// `down-after-milliseconds 500`, `failover-timeout 3000`).
pub struct Sentinels {
    pub shard: ReplicatedShard,
    pub sentinels: Vec<SentinelProcess>,
    pub master_name: String,
    _dir: TempDir,
}

impl Sentinels {
    /// Start a [`ReplicatedShard`] with `n_replicas` replicas and `n_sentinels`
    /// sentinels monitoring it as `master_name`. Waits until every sentinel reports
    /// the primary, knows all the replicas and (with more than one) all the other
    /// sentinels, so a failover can be elected right away.
    pub fn start(master_name: &str, n_sentinels: usize, n_replicas: usize) -> Sentinels {
        assert!(
            n_sentinels > 0,
            "Sentinels::start needs at least one sentinel"
        );
        let shard = ReplicatedShard::start(n_replicas);
        let dir = tempfile::tempdir().expect("tempdir for sentinel configs");
        let pport = shard.primary.port;
        let body = format!(
            "sentinel monitor {master_name} 127.0.0.1 {pport} 1\n\
             sentinel down-after-milliseconds {master_name} 500\n\
             sentinel failover-timeout {master_name} 3000\n\
             sentinel parallel-syncs {master_name} 1\n"
        );
        let sentinels: Vec<SentinelProcess> = (0..n_sentinels)
            .map(|_| SentinelProcess::start(dir.path(), &body))
            .collect();
        let me = Sentinels {
            shard,
            sentinels,
            master_name: master_name.to_string(),
            _dir: dir,
        };
        for s in &me.sentinels {
            let state = || -> (Option<u16>, usize, usize) {
                let replicas = s
                    .try_cmd::<Vec<redis::Value>>(&["SENTINEL", "replicas", master_name])
                    .map(|v| v.len())
                    .unwrap_or(0);
                let others = s
                    .try_cmd::<std::collections::HashMap<String, String>>(&[
                        "SENTINEL",
                        "master",
                        master_name,
                    ])
                    .ok()
                    .and_then(|m| m.get("num-other-sentinels")?.parse().ok())
                    .unwrap_or(0);
                (s.master_port(master_name), replicas, others)
            };
            wait_for(
                WAIT,
                || {
                    let (port, replicas, others) = state();
                    (port == Some(pport) && replicas >= n_replicas && others + 1 >= n_sentinels)
                        .then_some(())
                },
                || {
                    let (port, replicas, others) = state();
                    format!(
                        "sentinel on port {} not ready: master port {port:?} (want {pport}), \
                         {replicas} replicas known (want {n_replicas}), \
                         {others} other sentinels known (want {})",
                        s.port,
                        n_sentinels - 1
                    )
                },
            );
        }
        me
    }

    /// The primary's port as the first answering sentinel reports it.
    pub fn current_primary_port(&self) -> u16 {
        self.sentinels
            .iter()
            .find_map(|s| s.master_port(&self.master_name))
            .unwrap_or_else(|| panic!("no sentinel knows master {:?}", self.master_name))
    }

    /// The sentinels' URLs (`redis://127.0.0.1:PORT`).
    pub fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(SentinelProcess::url).collect()
    }

    /// Poll until the sentinels report a primary other than `old_port` — every
    /// sentinel that answers agreeing on it, so [`Self::current_primary_port`] gives
    /// it too — and that server says `role:master`; returns its port. Panics after
    /// `timeout`.
    pub fn wait_failover(&self, old_port: u16, timeout: Duration) -> u16 {
        wait_for(
            timeout,
            || {
                let seen: Vec<u16> = self
                    .sentinels
                    .iter()
                    .filter_map(|s| s.master_port(&self.master_name))
                    .collect();
                let new = *seen.first()?;
                if new == old_port || seen.iter().any(|p| *p != new) {
                    return None;
                }
                let role = parse_info_field(&info_port(new, "replication")?, "role")?;
                (role == "master").then_some(new)
            },
            || {
                let seen: Vec<Option<u16>> = self
                    .sentinels
                    .iter()
                    .map(|s| s.master_port(&self.master_name))
                    .collect();
                format!(
                    "no failover away from port {old_port} for {:?}; sentinels report {seen:?}",
                    self.master_name
                )
            },
        )
    }
}

// ---------------------------------------------------------------------------------
// Cluster
// ---------------------------------------------------------------------------------

/// A Redis Cluster of primaries only (no replicas), on 127.0.0.1.
pub struct Cluster {
    pub nodes: Vec<RedisServer>,
    _dir: TempDir,
}

impl Cluster {
    /// Start `n_primaries` (≥ 3, as `redis-cli --cluster create` requires)
    /// cluster-enabled servers, join them with `redis-cli --cluster create`, and wait
    /// (≤ 10 s) until every node reports `cluster_state:ok` and knows every other
    /// ([`start_cluster`]).
    pub fn start(n_primaries: usize) -> Cluster {
        assert!(
            n_primaries >= 3,
            "a Redis Cluster needs at least 3 primaries"
        );
        let dir = tempfile::tempdir().expect("tempdir for cluster nodes");
        let nodes = start_cluster(dir.path(), n_primaries, 0, 2000, &[], WAIT, |_| true);
        Cluster { nodes, _dir: dir }
    }

    /// Every node's URL, in start order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The hash slot of a key (`CLUSTER KEYSLOT`).
    pub fn slot(&self, key: &str) -> u16 {
        self.nodes[0].cmd::<u16>(&["CLUSTER", "KEYSLOT", key])
    }

    /// The node that owns a key's slot, by each node's own (`myself`) line of
    /// `CLUSTER NODES`.
    pub fn node_for_key(&self, key: &str) -> &RedisServer {
        let slot = self.slot(key);
        self.nodes
            .iter()
            .find(|n| {
                let nodes: String = n.cmd(&["CLUSTER", "NODES"]);
                nodes
                    .lines()
                    .find(|l| {
                        l.split_whitespace()
                            .nth(2)
                            .is_some_and(|f| f.contains("myself"))
                    })
                    .is_some_and(|l| owns_slot(l, slot))
            })
            .unwrap_or_else(|| panic!("no cluster node owns slot {slot} (key {key:?})"))
    }

    /// Every key on every node, sorted.
    pub fn all_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.nodes.iter().flat_map(RedisServer::keys).collect();
        keys.sort();
        keys
    }
}

/// The arguments that make a `redis-server` a cluster node keeping its state in `dir`
/// (`cluster-enabled`, a unique `cluster-config-file`, `cluster-node-timeout` in ms, and
/// an explicit `cluster-port` from `free_port()`: the default bus port is PORT+10000,
/// which is out of range for ephemeral ports above 55535).
pub fn cluster_node_args(dir: &Path, node_timeout_ms: u64) -> Vec<String> {
    // The config file is named after a fresh free port, not the node's (RedisServer
    // picks its port itself); it only has to be unique.
    let conf = dir.join(format!("nodes-{}.conf", free_port()));
    vec![
        "--cluster-enabled".into(),
        "yes".into(),
        "--cluster-config-file".into(),
        conf.display().to_string(),
        "--cluster-node-timeout".into(),
        node_timeout_ms.to_string(),
        "--cluster-port".into(),
        free_port().to_string(),
    ]
}

/// Run `cli` (a `redis-cli` command with its connection options) as `--cluster create
/// ADDRS --cluster-replicas N --cluster-yes`; panics with its output if it fails.
pub fn create_cluster(mut cli: Command, addrs: &[String], replicas_per_master: usize) {
    let out = cli
        .args(["--cluster", "create"])
        .args(addrs)
        .args([
            "--cluster-replicas",
            &replicas_per_master.to_string(),
            "--cluster-yes",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run redis-cli --cluster create");
    assert!(
        out.status.success(),
        "redis-cli --cluster create {addrs:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Start `total` cluster nodes in `dir` ([`cluster_node_args`] with `node_timeout_ms`,
/// then `node_args`), join them with `redis-cli --cluster create` with
/// `replicas_per_master`, and wait (≤ `wait` for each) until every node reports
/// `cluster_state:ok`, knows every other, and passes `ready`.
pub fn start_cluster(
    dir: &Path,
    total: usize,
    replicas_per_master: usize,
    node_timeout_ms: u64,
    node_args: &[&str],
    wait: Duration,
    ready: impl Fn(&RedisServer) -> bool,
) -> Vec<RedisServer> {
    let d = dir.display().to_string();
    let nodes: Vec<RedisServer> = (0..total)
        .map(|_| {
            let cluster = cluster_node_args(dir, node_timeout_ms);
            let mut args: Vec<&str> = cluster.iter().map(String::as_str).collect();
            args.extend_from_slice(node_args);
            args.extend_from_slice(&["--dir", &d]);
            RedisServer::start_with(&args)
        })
        .collect();
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    create_cluster(Command::new(redis_cli_bin()), &addrs, replicas_per_master);
    for n in &nodes {
        let info = || try_cmd::<String>(n.port, &["CLUSTER", "INFO"]).ok();
        wait_for(
            wait,
            || {
                let info = info()?;
                let ok = parse_info_field(&info, "cluster_state")? == "ok";
                let known: usize = parse_info_field(&info, "cluster_known_nodes")?
                    .parse()
                    .ok()?;
                (ok && known == total && ready(n)).then_some(())
            },
            || format!("cluster node on port {} not ready:\n{:?}", n.port, info()),
        );
    }
    nodes
}

/// Whether a `CLUSTER NODES` line lists `slot` among its ranges (fields 9 and on:
/// `N` or `A-B`; `[..]` migrating/importing entries are skipped).
pub fn owns_slot(line: &str, slot: u16) -> bool {
    line.split_whitespace().skip(8).any(|r| {
        if r.starts_with('[') {
            return false;
        }
        match r.split_once('-') {
            Some((a, b)) => match (a.parse::<u16>(), b.parse::<u16>()) {
                (Ok(a), Ok(b)) => (a..=b).contains(&slot),
                _ => false,
            },
            None => r.parse::<u16>() == Ok(slot),
        }
    })
}
