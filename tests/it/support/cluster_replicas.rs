//! A Redis Cluster for failover tests: `masters` masters, each with
//! `replicas_per_master` replicas, on 127.0.0.1, with a short `cluster-node-timeout`
//! ([`NODE_TIMEOUT_MS`]) so that a killed master is failed over in about two seconds,
//! and `cluster-require-full-coverage no`, so that the masters still serve their own
//! slots while another master is down. Processes are stopped by PID when dropped;
//! every wait is bounded and panics with what did not happen.

use super::redis::RedisServer;
use super::topology::{owns_slot, parse_info_field, start_cluster, try_cmd, wait_for};
use std::time::Duration;
use tempfile::TempDir;

/// `cluster-node-timeout` of every node, ms: a master that does not answer for this
/// long is marked failed and its replica elected (about 0.5–1.5 s more).
pub const NODE_TIMEOUT_MS: u64 = 1000;

/// How long the helpers wait for the cluster to reach a state.
const WAIT: Duration = Duration::from_secs(15);

/// See the module documentation.
pub struct ReplicatedCluster {
    /// Every node, in start order (roles change with failovers: ask [`Self::role`]).
    pub nodes: Vec<RedisServer>,
    _dir: TempDir,
}

impl ReplicatedCluster {
    /// Start the nodes, join them with `redis-cli --cluster create
    /// --cluster-replicas N`, and wait until every node reports `cluster_state:ok`,
    /// knows every other node, and every replica's link to its master is up.
    pub fn start(masters: usize, replicas_per_master: usize) -> ReplicatedCluster {
        assert!(masters >= 3, "a Redis Cluster needs at least 3 masters");
        let total = masters * (1 + replicas_per_master);
        let dir = tempfile::tempdir().expect("tempdir for cluster nodes");
        let info = |n: &RedisServer, field: &str| {
            let info = try_cmd::<String>(n.port, &["INFO", "replication"]).ok()?;
            parse_info_field(&info, field)
        };
        let nodes = start_cluster(
            dir.path(),
            total,
            replicas_per_master,
            NODE_TIMEOUT_MS,
            &[
                "--cluster-require-full-coverage",
                "no",
                "--repl-diskless-sync-delay",
                "0",
            ],
            WAIT,
            |n| {
                info(n, "role").as_deref() == Some("master")
                    || info(n, "master_link_status").as_deref() == Some("up")
            },
        );
        ReplicatedCluster { nodes, _dir: dir }
    }

    /// Every node's URL, in start order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// One field of `INFO replication` of node `i` (`None` when it does not answer).
    pub fn info(&self, i: usize, field: &str) -> Option<String> {
        let info = try_cmd::<String>(self.nodes[i].port, &["INFO", "replication"]).ok()?;
        parse_info_field(&info, field)
    }

    /// Node `i`'s `role` (`master` or `slave`), `None` when it does not answer.
    pub fn role(&self, i: usize) -> Option<String> {
        self.info(i, "role")
    }

    /// The hash slot of a key (`CLUSTER KEYSLOT`, asked of the first node that answers).
    pub fn slot(&self, key: &str) -> u16 {
        self.nodes
            .iter()
            .find_map(|n| try_cmd::<u16>(n.port, &["CLUSTER", "KEYSLOT", key]).ok())
            .expect("no cluster node answers CLUSTER KEYSLOT")
    }

    /// The index of the node that serves `slot` as master, by that node's own
    /// (`myself`) line of `CLUSTER NODES`.
    pub fn master_of_slot(&self, slot: u16) -> usize {
        (0..self.nodes.len())
            .find(|&i| {
                let Ok(nodes) = try_cmd::<String>(self.nodes[i].port, &["CLUSTER", "NODES"]) else {
                    return false;
                };
                nodes.lines().any(|l| {
                    let flags = l.split_whitespace().nth(2).unwrap_or("");
                    flags.contains("myself") && flags.contains("master") && owns_slot(l, slot)
                })
            })
            .unwrap_or_else(|| panic!("no cluster node serves slot {slot} as master"))
    }

    /// The slot ranges (`first`, `last`) node `i` serves as master, from its own
    /// (`myself`) line of `CLUSTER NODES`.
    pub fn slots_of(&self, i: usize) -> Vec<(u16, u16)> {
        let nodes: String = self.nodes[i].cmd(&["CLUSTER", "NODES"]);
        let line = nodes
            .lines()
            .find(|l| {
                l.split_whitespace()
                    .nth(2)
                    .is_some_and(|f| f.contains("myself"))
            })
            .unwrap_or("");
        line.split_whitespace()
            .skip(8)
            .filter(|r| !r.starts_with('['))
            .filter_map(|r| match r.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => r.parse().ok().map(|a| (a, a)),
            })
            .collect()
    }

    /// The index of the master that serves `key`.
    pub fn master_for_key(&self, key: &str) -> usize {
        self.master_of_slot(self.slot(key))
    }

    /// The indices of node `master`'s replicas (by their `master_port`).
    pub fn replicas_of(&self, master: usize) -> Vec<usize> {
        let port = self.nodes[master].port.to_string();
        (0..self.nodes.len())
            .filter(|&i| {
                self.role(i).as_deref() == Some("slave")
                    && self.info(i, "master_port").as_deref() == Some(port.as_str())
            })
            .collect()
    }

    /// Wait until node `i` reports `role:master`; panics after `timeout`.
    pub fn wait_master(&self, i: usize, timeout: Duration) {
        wait_for(
            timeout,
            || (self.role(i).as_deref() == Some("master")).then_some(()),
            || {
                format!(
                    "node on port {} never became master (role {:?})",
                    self.nodes[i].port,
                    self.role(i)
                )
            },
        );
    }

    /// `WAIT 1 timeout_ms` on master `i`: returns once a replica has acknowledged every
    /// write so far; panics otherwise.
    pub fn wait_replicated(&self, i: usize) {
        let acked: i64 = self.nodes[i].cmd(&["WAIT", "1", "5000"]);
        assert!(
            acked >= 1,
            "no replica of port {} acknowledged its writes",
            self.nodes[i].port
        );
    }

    /// Kill node `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }
}
