//! The test harness itself: the Redis topologies the tests start (a replicated shard, a
//! Sentinel failover and a Redis Cluster, each from real `redis-server` processes), and
//! the message a test run without `redis-server` fails with.

use crate::support::topology::*;
use crate::support::{alone_in_process, RedisServer};
use std::time::{Duration, Instant};

#[test]
fn replicated_shard_copies_writes_to_replicas() {
    let t = Instant::now();
    let shard = ReplicatedShard::start(2);
    assert_eq!(shard.replicas.len(), 2);
    for r in &shard.replicas {
        assert_eq!(
            info_field(r, "replication", "role").as_deref(),
            Some("slave")
        );
    }
    assert_eq!(
        info_field(&shard.primary, "replication", "connected_slaves").as_deref(),
        Some("2")
    );

    let _: () = shard.primary.cmd(&["SET", "k", "v1"]);
    let _: i64 = shard.primary.cmd(&["INCR", "n"]);
    shard.wait_replicated();
    for r in &shard.replicas {
        assert_eq!(
            r.cmd::<Option<String>>(&["GET", "k"]).as_deref(),
            Some("v1")
        );
        assert_eq!(r.cmd::<i64>(&["GET", "n"]), 1);
        assert_eq!(r.keys(), vec!["k".to_string(), "n".to_string()]);
    }

    // Command statistics: EVALSHA after SCRIPT LOAD is counted on the primary.
    assert_eq!(evalsha_calls(&shard.primary), 0);
    let sha: String = shard.primary.cmd(&["SCRIPT", "LOAD", "return 7"]);
    let seven: i64 = shard.primary.cmd(&["EVALSHA", &sha, "0"]);
    assert_eq!(seven, 7);
    let _: i64 = shard.primary.cmd(&["EVALSHA", &sha, "0"]);
    assert_eq!(evalsha_calls(&shard.primary), 2);
    assert_eq!(cmd_calls(&shard.primary, "script|load"), 1);
    assert_eq!(cmd_calls(&shard.primary, "EVAL"), 0);
    eprintln!("replicated shard: {:?}", t.elapsed());
}

#[test]
fn sentinel_fails_over_to_the_replica() {
    let t = Instant::now();
    let mut s = Sentinels::start("tollgate-test", 3, 1);
    let old = s.shard.primary.port;
    let replica = s.shard.replicas[0].port;
    assert_eq!(s.current_primary_port(), old);
    assert_eq!(s.urls().len(), 3);
    assert!(s.sentinels[0].url().starts_with("redis://127.0.0.1:"));

    let _: () = s.shard.primary.cmd(&["SET", "before", "failover"]);
    s.shard.wait_replicated();
    let ready = t.elapsed();

    let killed = Instant::now();
    s.shard.primary.kill();
    let new = s.wait_failover(old, Duration::from_secs(15));
    let took = killed.elapsed();
    assert_eq!(new, replica);
    assert_eq!(s.current_primary_port(), replica);

    // The promoted replica is the same process, still owned by the shard.
    let promoted = &s.shard.replicas[0];
    assert_eq!(
        info_field(promoted, "replication", "role").as_deref(),
        Some("master")
    );
    assert_eq!(
        promoted
            .cmd::<Option<String>>(&["GET", "before"])
            .as_deref(),
        Some("failover")
    );
    let _: () = promoted.cmd(&["SET", "after", "failover"]);
    eprintln!(
        "sentinel: ready in {ready:?}, failover in {took:?}, total {:?}",
        t.elapsed()
    );
}

#[test]
fn cluster_routes_keys_by_slot() {
    let t = Instant::now();
    let cluster = Cluster::start(3);
    assert_eq!(cluster.urls().len(), 3);
    for n in &cluster.nodes {
        let info: String = n.cmd(&["CLUSTER", "INFO"]);
        assert!(info.contains("cluster_state:ok"), "{info}");
    }

    // Same hash tag, same slot, same node.
    assert_eq!(cluster.slot("a{x}"), cluster.slot("b{x}"));
    let keys = [
        "a{x}", "b{x}", "alpha", "beta", "gamma", "delta", "k1", "k2", "k3", "k4",
    ];
    for k in keys {
        let node = cluster.node_for_key(k);
        let _: () = node.cmd(&["SET", k, k]);
    }
    assert_eq!(
        cluster.node_for_key("a{x}").port,
        cluster.node_for_key("b{x}").port
    );
    for k in keys {
        let node = cluster.node_for_key(k);
        assert_eq!(node.cmd::<Option<String>>(&["GET", k]).as_deref(), Some(k));
        // Any other node redirects instead of answering.
        for other in cluster.nodes.iter().filter(|n| n.port != node.port) {
            let mut c = other.conn().unwrap();
            let err = redis::cmd("GET").arg(k).query::<Option<String>>(&mut c);
            assert!(err.is_err(), "node {} answered for {k}", other.port);
        }
    }
    let mut want: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    want.sort();
    assert_eq!(cluster.all_keys(), want);
    // The keys are spread over more than one node.
    let used = cluster
        .nodes
        .iter()
        .filter(|n| !n.keys().is_empty())
        .count();
    assert!(used >= 2, "all keys on one node");
    eprintln!("cluster: {:?}", t.elapsed());
}

/// A test run without `redis-server` fails with a message that names the path it tried,
/// how to install Redis, and how to point the tests at one (`REDIS_SERVER=`). It runs in a
/// process of its own, started with `REDIS_SERVER` set to a path that does not exist, so
/// that no other test of this binary sees that setting.
#[test]
fn a_missing_redis_server_fails_with_how_to_install_it() {
    if !alone_in_process(
        "harness::a_missing_redis_server_fails_with_how_to_install_it",
        &[("REDIS_SERVER", "/nonexistent/redis-server")],
    ) {
        return;
    }
    let Err(panic) = std::panic::catch_unwind(RedisServer::start) else {
        panic!("redis-server must not start from a path that does not exist");
    };
    let message = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(
        message.contains("/nonexistent/redis-server")
            && message.contains("apt-get install redis-server")
            && message.contains("REDIS_SERVER="),
        "{message}"
    );
}
