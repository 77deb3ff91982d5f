//! The Redis store over TLS (`rediss://`), against a real `redis-server --tls-port` with
//! a CA and certificates made by the test: limits counted through a private CA, mutual
//! TLS, a certificate whose name does not match the address unless
//! `store.tls.server_name` names it, and `tollgate check` on `[store.tls]`.

use crate::support;
use crate::support::tls_redis::{CertFiles, TestCa, TlsCluster, TlsRedis};
use crate::support::{check, get, TestGateway, Upstream};
use std::path::Path;
use std::time::{Duration, Instant};
use tollgate::limiter::key::KeyScheme;

/// A gateway on `url` with `tls` as its `[store.tls]` body; `core` allows anonymous
/// callers 3 requests an hour; store errors give 503 (`on_error = "deny"`).
fn config(url: &str, tls: &str, up: &Upstream) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[store]
backend = "redis"
timeout = "2s"
on_error = "deny"

[[store.shards]]
primary = "{url}"

[store.tls]
{tls}

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 3 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        up = up.url()
    )
}

/// `toml` with `store.timeout = "200ms"`: a gateway that cannot connect answers 503
/// after 200 ms instead of 2 s.
fn short_timeout(toml: String) -> String {
    toml.replace("timeout = \"2s\"", "timeout = \"200ms\"")
}

fn toml_path(p: &Path) -> String {
    p.display().to_string()
}

/// The Redis key of `core` for the anonymous caller at 127.0.0.1.
fn core_key() -> String {
    KeyScheme::new("tollgate:", None)
        .key("core", "ip:127.0.0.1")
        .key
        .to_string()
}

/// Wait (≤ 5 s) until `core`'s count in `redis` is `want` (a charge is sent after the
/// response), and assert it.
async fn assert_count(redis: &TlsRedis, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let count = || redis.cli(&["HGET", &core_key(), "count"]);

    while count() != want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(count(), want);
}

/// Requests to `gw`, one every 250 ms, until a check has reached `replica` (for up to
/// 10 s), after the `first` already admitted: checks go to a replica once the gateway
/// has it as a serving replica and has seen it catch up with this gateway's last charge
/// (docs/redis.md, "Reading your own writes from replicas"), which a loaded machine may
/// take a while to see. How many requests were admitted in all.
async fn until_a_check_reaches(replica: &TlsRedis, gw: &TestGateway, first: u64) -> u64 {
    let answered = || {
        replica
            .cli(&["INFO", "commandstats"])
            .contains("cmdstat_evalsha:calls=")
    };
    let mut admitted = first;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !answered() {
        assert!(
            Instant::now() < deadline,
            "no check went to the replica: {}",
            replica.cli(&["INFO", "commandstats"])
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(get(&gw.url("/")).await.status, 200);
        admitted += 1;
    }
    admitted
}

/// The rest of a quota of 60 (`admitted` so far), counted once on `primary` and
/// replicated to `replica`, then a 429.
async fn the_rest_then_429(
    primary: &TlsRedis,
    replica: &TlsRedis,
    gw: &TestGateway,
    mut admitted: u64,
) {
    while admitted < 60 {
        assert_eq!(get(&gw.url("/")).await.status, 200);
        admitted += 1;
    }
    assert_count(primary, "60").await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while replica.cli(&["HGET", &core_key(), "count"]) != "60" {
        assert!(
            Instant::now() < deadline,
            "the count never reached the replica"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get(&gw.url("/")).await.status, 429);
}

/// GET `/` until it is not 503 (the store's connection is still opening), for at most
/// 10 s; that answer.
async fn first_answer(gw: &TestGateway) -> support::client::Reply {
    support::first_answer(gw, "/", &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_counted_over_tls_with_a_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "redis");
    let cert = ca.issue("server", "redis", &["localhost", "127.0.0.1"]);
    let redis = TlsRedis::start(&ca, &cert, false, &[]);
    let up = Upstream::start().await;
    let tls = format!("ca = \"{}\"", toml_path(&ca.pem));
    let gw = TestGateway::start(&config(&redis.url(), &tls, &up)).await;

    let first = first_answer(&gw).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.num("x-ratelimit-limit"), 3);
    assert_eq!(first.num("x-ratelimit-remaining"), 2);
    for remaining in [1, 0] {
        let r = get(&gw.url("/")).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.num("x-ratelimit-remaining"), remaining);
    }
    let refused = get(&gw.url("/")).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.num("x-ratelimit-remaining"), 0);
    // What the gateway wrote, read back over TLS.
    let key = core_key();
    assert_eq!(redis.keys(), vec![key.clone()]);
    assert_eq!(redis.cli(&["HGET", &key, "count"]), "3");
    // The gateway's connection is a TLS one (the server has no plaintext port).
    let clients = redis.cli(&["CLIENT", "LIST"]);
    assert!(clients.contains("name=tollgate"), "{clients}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_the_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "redis");
    let cert = ca.issue("server", "redis", &["127.0.0.1"]);
    let client = ca.issue("gateway", "tollgate", &["tollgate"]);
    let redis = TlsRedis::start(&ca, &cert, true, &[]);
    let up = Upstream::start().await;

    // Without a client certificate the handshake is refused: on_error = "deny" → 503.
    let without = TestGateway::start(&short_timeout(config(
        &redis.url(),
        &format!("ca = \"{}\"", toml_path(&ca.pem)),
        &up,
    )))
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..3 {
        assert_eq!(get(&without.url("/")).await.status, 503);
    }
    assert!(redis.keys().is_empty(), "{:?}", redis.keys());

    let with = TestGateway::start(&config(
        &redis.url(),
        &format!(
            "ca = \"{}\"\nclient_cert = \"{}\"\nclient_key = \"{}\"",
            toml_path(&ca.pem),
            toml_path(&client.cert),
            toml_path(&client.key)
        ),
        &up,
    ))
    .await;
    let r = first_answer(&with).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-remaining"), 2);
    assert_count(&redis, "1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_name_needs_server_name() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "redis");
    // Names a DNS name only, as a managed Redis behind an announced IP would.
    let cert = ca.issue("server", "redis.internal", &["redis.internal"]);
    let redis = TlsRedis::start(&ca, &cert, false, &[]);
    let up = Upstream::start().await;

    let mismatch = TestGateway::start(&short_timeout(config(
        &redis.url(),
        &format!("ca = \"{}\"", toml_path(&ca.pem)),
        &up,
    )))
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(get(&mismatch.url("/")).await.status, 503);
    assert!(redis.keys().is_empty());

    let named = TestGateway::start(&config(
        &redis.url(),
        &format!(
            "ca = \"{}\"\nserver_name = \"redis.internal\"",
            toml_path(&ca.pem)
        ),
        &up,
    ))
    .await;
    let r = first_answer(&named).await;
    assert_eq!(r.status, 200);
    assert_count(&redis, "1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_ca_file_is_used_by_the_next_connection_after_a_reload() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "redis");
    let other = TestCa::new(dir.path(), "other");
    let cert = ca.issue("server", "redis", &["127.0.0.1"]);
    let redis = TlsRedis::start(&ca, &cert, false, &[]);
    let up = Upstream::start().await;
    // The file the config names holds the wrong CA at first: no connection.
    let ca_file = dir.path().join("store-ca.pem");
    std::fs::copy(&other.pem, &ca_file).unwrap();
    let toml = short_timeout(config(
        &redis.url(),
        &format!("ca = \"{}\"", toml_path(&ca_file)),
        &up,
    ));
    let gw = TestGateway::start(&toml).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(get(&gw.url("/")).await.status, 503);

    // The right CA in the same file, the same config text: a reload reads it, and the
    // store (kept: [store] is unchanged) dials with it.
    std::fs::copy(&ca.pem, &ca_file).unwrap();
    gw.reload(&toml).expect("reload");
    let r = first_answer(&gw).await;
    assert_eq!(r.status, 200);
    assert_count(&redis, "1").await;
}

#[test]
fn check_accepts_rediss_and_names_a_missing_ca_file() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "redis");
    let write = |name: &str, tls: &str| {
        let path = dir.path().join(name);
        let text = format!(
            "[store]\nbackend = \"redis\"\n\n[[store.shards]]\nprimary = \"rediss://redis.example:6380\"\nreplicas = [\"rediss://user:pw@replica.example:6380/0\"]\n\n[store.tls]\n{tls}\n"
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    // A relative path: the config file's directory.
    std::fs::copy(&ca.pem, dir.path().join("ca.pem")).unwrap();
    let good = write(
        "good.toml",
        "ca = \"ca.pem\"\nserver_name = \"redis.example\"",
    );
    let (code, out, err) = check(&good);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");

    let missing = write("missing.toml", "ca = \"nowhere/ca.pem\"");
    let (code, _, err) = check(&missing);
    assert_ne!(code, 0);
    assert!(
        err.contains("missing.toml:9:1: store.tls.ca: ") && err.contains("nowhere/ca.pem"),
        "{err}"
    );

    let half = write("half.toml", "client_cert = \"ca.pem\"");
    let (code, _, err) = check(&half);
    assert_ne!(code, 0);
    assert!(err.contains("store.tls.client_key: is required"), "{err}");
}

/// A TLS primary and a TLS replica of it (`--tls-replication yes`), both with `cert`,
/// linked (`master_link_status:up`, waited for ≤ 10 s) when this returns.
async fn tls_primary_and_replica(ca: &TestCa, cert: &CertFiles) -> (TlsRedis, TlsRedis) {
    let primary = TlsRedis::start(ca, cert, false, &["--repl-diskless-sync-delay", "0"]);
    let port = primary.port.to_string();
    let replica = TlsRedis::start(
        ca,
        cert,
        false,
        &[
            "--tls-replication",
            "yes",
            "--replicaof",
            "127.0.0.1",
            &port,
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replica
        .cli(&["INFO", "replication"])
        .contains("master_link_status:up")
    {
        assert!(Instant::now() < deadline, "the TLS replica never linked up");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    (primary, replica)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_go_to_a_replica_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "redis");
    let cert = ca.issue("server", "redis", &["127.0.0.1"]);
    let (primary, replica) = tls_primary_and_replica(&ca, &cert).await;
    let up = Upstream::start().await;
    let toml = config(
        &primary.url(),
        &format!("ca = \"{}\"", toml_path(&ca.pem)),
        &up,
    )
    .replace(
        &format!("primary = \"{}\"", primary.url()),
        &format!(
            "primary = \"{}\"\nreplicas = [\"{}\"]",
            primary.url(),
            replica.url()
        ),
    )
    .replace("anonymous = 3", "anonymous = 60");
    let gw = TestGateway::start(&toml).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replica.cli(&["CLIENT", "LIST"]).contains("name=tollgate") {
        assert!(
            Instant::now() < deadline,
            "the gateway never connected to the replica"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(first_answer(&gw).await.status, 200);
    // Replicated over TLS: the replica holds the primary's count, and answers checks.
    let admitted = until_a_check_reaches(&replica, &gw, 1).await;
    the_rest_then_429(&primary, &replica, &gw, admitted).await;
}

/// A Redis Cluster over TLS with a password: the seed is `rediss://`, the nodes the
/// cluster announces (by IP) are dialled with TLS and `store.password_file`'s password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_over_tls_with_a_password() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "redis");
    let cert = ca.issue("server", "redis.internal", &["redis.internal"]);
    let cluster = TlsCluster::start(&ca, &cert, "cluster-pw");
    let pw = dir.path().join("redis-password");
    std::fs::write(&pw, "cluster-pw\n").unwrap();
    let up = Upstream::start().await;
    let toml = config("unused", "", &up)
        .replace(
            "[[store.shards]]\nprimary = \"unused\"\n",
            &format!(
                "mode = \"cluster\"\nnodes = [\"rediss://127.0.0.1:{}\"]\npassword_file = \"{}\"\n",
                cluster.nodes[0].port,
                toml_path(&pw)
            ),
        )
        .replace(
            "[store.tls]\n",
            &format!(
                "[store.tls]\nca = \"{}\"\nserver_name = \"redis.internal\"\n",
                toml_path(&ca.pem)
            ),
        );
    let gw = TestGateway::start(&toml).await;
    let first = first_answer(&gw).await;
    assert_eq!(first.status, 200);
    for _ in 0..2 {
        assert_eq!(get(&gw.url("/")).await.status, 200);
    }
    let refused = get(&gw.url("/")).await;
    assert_eq!(refused.status, 429);
    let key = core_key();
    assert_eq!(cluster.all_keys(), vec![key.clone()]);
    let node = cluster.node_with(&key).expect("a node holds the key");
    assert_eq!(node.cli(&["HGET", &key, "count"]), "3");
}

/// A refused handshake (mutual TLS without a client certificate) is logged, and
/// `store.on_error = "allow"` forwards the requests unlimited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_handshake_is_logged_and_on_error_applies() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "redis");
    let cert = ca.issue("server", "redis", &["127.0.0.1"]);
    let redis = TlsRedis::start(&ca, &cert, true, &[]);
    let up = Upstream::start().await;
    let port = support::redis::free_port();
    let path = dir.path().join("tollgate.toml");
    let toml = short_timeout(config(
        &redis.url(),
        &format!("ca = \"{}\"", toml_path(&ca.pem)),
        &up,
    ))
    .replace("on_error = \"deny\"", "on_error = \"allow\"")
    .replace(
        "listen = \"127.0.0.1:0\"",
        &format!("listen = \"127.0.0.1:{port}\""),
    );
    std::fs::write(&path, toml).unwrap();
    let gw = support::Binary::spawn(&path, port, &[]);
    let url = format!("http://127.0.0.1:{port}/");
    for _ in 0..5 {
        assert_eq!(get(&url).await.status, 200);
    }
    assert!(redis.keys().is_empty());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !gw.logs().contains("redis node unreachable") {
        assert!(Instant::now() < deadline, "no log line:\n{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sentinel over TLS: `rediss://` Sentinel URLs, and the primary and replica Sentinel
/// announces (by IP) dialled with TLS too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_and_the_nodes_they_announce_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "redis");
    let cert = ca.issue("server", "redis", &["127.0.0.1"]);
    let (primary, replica) = tls_primary_and_replica(&ca, &cert).await;
    let port = primary.port.to_string();
    let sentinel = TlsRedis::sentinel(
        &ca,
        &cert,
        &format!("sentinel monitor m 127.0.0.1 {port} 1\nsentinel down-after-milliseconds m 500\n"),
    );
    // Known and reported linked (what the gateway asks for before using a replica).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sentinel
        .try_cli(&["SENTINEL", "replicas", "m"])
        .is_ok_and(|r| r.contains("master-link-status\nok"))
    {
        assert!(
            Instant::now() < deadline,
            "the sentinel never saw the replica linked"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let up = Upstream::start().await;
    // A quota of 60: checks go to the replica only once it has caught up with this
    // gateway's last charge (docs/redis.md, "Reading your own writes from replicas"),
    // which a loaded machine may take a while to see.
    let toml = config("unused", &format!("ca = \"{}\"", toml_path(&ca.pem)), &up)
        .replace(
            "primary = \"unused\"",
            &format!(
                "sentinel = {{ master = \"m\", nodes = [\"{}\"] }}",
                sentinel.url()
            ),
        )
        .replace("anonymous = 3", "anonymous = 60");
    let gw = TestGateway::start(&toml).await;
    assert_eq!(first_answer(&gw).await.status, 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replica.cli(&["CLIENT", "LIST"]).contains("name=tollgate") {
        assert!(
            Instant::now() < deadline,
            "the gateway never connected to the replica"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let admitted = until_a_check_reaches(&replica, &gw, 1).await;
    the_rest_then_429(&primary, &replica, &gw, admitted).await;
}
