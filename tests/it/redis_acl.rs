//! The Redis store as operators run it: an ACL user with exactly the least-privilege
//! rule of docs/redis.md (the default user disabled), its password in a file
//! (`store.password_file`) that can be rotated, and Sentinels and data nodes that
//! require passwords.

use crate::support;
use crate::support::client::Reply;
use crate::support::tls_redis::AuthedRedis;
use crate::support::{get_with, send, sha256_hex, TestGateway, Upstream};
use http::Method;
use std::path::Path;
use std::time::{Duration, Instant};
use tollgate::limiter::key::KeyScheme;

const TOKEN: &str = "admin-token-for-acl-tests";
const ADMIN: (&str, &str) = ("admin", "admin-password");

/// The `ACL SETUSER tollgate ...` line of docs/redis.md, split into arguments, with
/// `password` in place of `PASSWORD`.
fn documented_acl(password: &str) -> Vec<String> {
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/redis.md"))
        .unwrap();
    let line = docs
        .lines()
        .find(|l| l.starts_with("ACL SETUSER tollgate "))
        .expect("docs/redis.md gives the ACL SETUSER line");
    line.split_whitespace()
        .map(|w| {
            if w == ">PASSWORD" {
                format!(">{password}")
            } else {
                w.to_string()
            }
        })
        .collect()
}

/// A Redis whose default user is off: only `admin` (the test's) and, once
/// [`least_privilege`] ran, `tollgate` can log in.
fn redis_without_default_user() -> AuthedRedis {
    AuthedRedis::start(
        &[
            "--user",
            "admin",
            "on",
            ">admin-password",
            "~*",
            "&*",
            "+@all",
            "--user",
            "default",
            "off",
        ],
        ADMIN,
    )
}

/// Create the `tollgate` user with the documented rule and `password`.
fn least_privilege(redis: &AuthedRedis, password: &str) {
    let args = documented_acl(password);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ok: String = redis.cmd(&args);
    assert_eq!(ok, "OK");
}

/// The gateway: `core` (fixed window, 3, reserved on request and refunded for a 304),
/// `log` (sliding log, 10) and `leased` (lease mode) for the client `acme`; store
/// errors give 503.
fn config(redis: &AuthedRedis, password_file: &Path, up: &Upstream) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
admin_token_sha256 = "{token}"

[store]
backend = "redis"
timeout = "2s"
on_error = "deny"
username = "tollgate"
password_file = "{pw}"

[[store.shards]]
primary = "{url}"

[[identity.clients]]
id = "acme"
key_sha256 = "{acme}"
tier = "gold"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ gold = 3 }}

[[limits]]
name = "log"
algorithm = "sliding_log"
window = "1h"
quota = {{ gold = 10 }}

[[limits]]
name = "leased"
window = "1h"
lease = 5
quota = {{ gold = 100 }}

[[routes]]
path_prefix = "/lease"
upstream = "api"
limits = ["leased"]

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core", "log"]
charge = "on_request"
"#,
        token = sha256_hex(TOKEN),
        pw = password_file.display(),
        url = redis.url(),
        acme = sha256_hex("acme-key"),
        up = up.url(),
    )
}

fn key(limit: &str) -> String {
    KeyScheme::new("tollgate:", None)
        .key(limit, "client:acme")
        .key
        .to_string()
}

async fn call(gw: &TestGateway, path: &str) -> Reply {
    get_with(&gw.url(path), &[("authorization", "Bearer acme-key")]).await
}

/// GET `path` as `acme` until it is not 503 (a connection is still opening), ≤ 10 s.
async fn first_answer(gw: &TestGateway, path: &str) -> Reply {
    support::first_answer(gw, path, &[("authorization", "Bearer acme-key")]).await
}

/// Redis's `ACL LOG`: every command refused by an ACL since start, as text.
fn acl_log(redis: &AuthedRedis) -> Vec<String> {
    let entries: Vec<redis::Value> = redis.cmd(&["ACL", "LOG"]);
    entries.iter().map(|e| format!("{e:?}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_least_privilege_user_runs_the_whole_request_path() {
    let redis = redis_without_default_user();
    least_privilege(&redis, "tollgate-pw-1");
    // The default user is off: nothing gets in without a password.
    let anonymous = redis::Client::open(redis.url())
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(1))
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
    assert!(anonymous.is_err(), "{anonymous:?}");

    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("redis-password");
    std::fs::write(&pw, "tollgate-pw-1\n").unwrap();
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(&redis, &pw, &up)).await;

    // Check and charge (reserved on request), then 429.
    let first = first_answer(&gw, "/x").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-ratelimit-resource"), "core");
    assert_eq!(first.num("x-ratelimit-remaining"), 2);
    assert_eq!(call(&gw, "/x").await.num("x-ratelimit-remaining"), 1);
    // A 304 is not charged: its reservation is refunded.
    let not_modified = call(&gw, "/status/304").await;
    assert_eq!(not_modified.status, 304);
    // (The refund is sent once the response is known: wait for it, ≤ 5 s.)
    let deadline = Instant::now() + Duration::from_secs(5);
    let count = || redis.cmd::<u64>(&["HGET", &key("core"), "count"]);
    while count() != 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(count(), 2);
    assert_eq!(call(&gw, "/x").await.status, 200);
    let refused = call(&gw, "/x").await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-ratelimit-resource"), "core");
    let count: u64 = redis.cmd(&["HGET", &key("core"), "count"]);
    assert_eq!(count, 3);
    // The sliding log's key names its algorithm.
    let log_key = key("log").replace("tollgate:log:", "tollgate:log:sliding_log:");
    let logged: u64 = redis.cmd(&["ZCARD", &log_key]);
    assert_eq!(logged, 3, "{:?}", redis.keys());

    // Lease mode: a lease of 5 taken from the window.
    let leased = first_answer(&gw, "/lease").await;
    assert_eq!(leased.status, 200);
    let granted: u64 = redis.cmd(&["HGET", &key("leased"), "count"]);
    assert_eq!(granted, 5);

    // The admin reset deletes the caller's windows.
    let admin = gw.gateway.admin_addr().unwrap();
    let reset = send(
        Method::POST,
        &format!("http://{admin}/callers/acme/reset?limit=core"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
    )
    .await;
    assert_eq!(reset.status, 200, "{}", reset.text());
    assert_eq!(reset.json()["windows_deleted"], 1);
    let exists: u64 = redis.cmd(&["EXISTS", &key("core")]);
    assert_eq!(exists, 0);
    let again = call(&gw, "/x").await;
    assert_eq!(again.status, 200);
    assert_eq!(again.num("x-ratelimit-remaining"), 2);

    // GET /config shows the password file's path, never the password.
    let shown = support::get(&format!("http://{admin}/config")).await;
    assert_eq!(shown.status, 200);
    assert_eq!(
        shown.json()["config"]["store"]["password_file"],
        pw.display().to_string()
    );
    assert!(!shown.text().contains("tollgate-pw-1"), "{}", shown.text());

    // store.clock = "redis": the scripts call TIME (`+time` in the rule).
    let redis_clock = TestGateway::start(&config(&redis, &pw, &up).replace(
        "timeout = \"2s\"",
        "timeout = \"2s\"\nclock = \"redis\"\nkey_prefix = \"tollgate:rc:\"",
    ))
    .await;
    let timed = first_answer(&redis_clock, "/x").await;
    assert_eq!(timed.status, 200);
    assert_eq!(timed.num("x-ratelimit-remaining"), 2);

    // Every key is tollgate's, and Redis refused nothing tollgate sent.
    let keys = redis.keys();
    assert!(!keys.is_empty());
    assert!(keys.iter().all(|k| k.starts_with("tollgate:")), "{keys:?}");
    assert_eq!(acl_log(&redis), Vec::<String>::new());
    let clients: String = redis.cmd(&["CLIENT", "LIST"]);
    assert!(
        clients
            .lines()
            .filter(|l| l.contains("name=tollgate"))
            .all(|l| l.contains("user=tollgate")),
        "{clients}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_password_file_is_used_by_the_next_connection() {
    let redis = redis_without_default_user();
    least_privilege(&redis, "old-password");
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("redis-password");
    std::fs::write(&pw, "old-password\n").unwrap();
    let up = Upstream::start().await;
    let toml = config(&redis, &pw, &up);
    let gw = TestGateway::start(&toml).await;
    assert_eq!(first_answer(&gw, "/x").await.status, 200);

    // Redis gets the new password only, and the gateway's connections are cut: it
    // cannot get back in with the old one.
    let _: String = redis.cmd(&["ACL", "SETUSER", "tollgate", "resetpass", ">new-password"]);
    let _: u64 = redis.cmd(&["CLIENT", "KILL", "USER", "tollgate"]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..3 {
        assert_eq!(call(&gw, "/x").await.status, 503);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The new password in the file, the config text unchanged: a reload reads it, and
    // the kept store's next connection uses it.
    std::fs::write(&pw, "new-password\n").unwrap();
    gw.reload(&toml).expect("reload");
    let r = first_answer(&gw, "/x").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-remaining"), 1);
    let count: u64 = redis.cmd(&["HGET", &key("core"), "count"]);
    assert_eq!(count, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_and_data_nodes_with_passwords() {
    const DATA_PW: &str = "data-password";
    const SENTINEL_PW: &str = "sentinel-password";
    let primary = AuthedRedis::start(
        &["--requirepass", DATA_PW, "--repl-diskless-sync-delay", "0"],
        ("default", DATA_PW),
    );
    let port = primary.port.to_string();
    let replica = AuthedRedis::start(
        &[
            "--requirepass",
            DATA_PW,
            "--masterauth",
            DATA_PW,
            "--replicaof",
            "127.0.0.1",
            &port,
        ],
        ("default", DATA_PW),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replica
        .cmd::<String>(&["INFO", "replication"])
        .contains("master_link_status:up")
    {
        assert!(Instant::now() < deadline, "the replica never linked up");
        std::thread::sleep(Duration::from_millis(25));
    }
    let sentinel = AuthedRedis::sentinel(
        &format!(
            "requirepass {SENTINEL_PW}\nsentinel monitor m 127.0.0.1 {port} 1\nsentinel auth-pass m {DATA_PW}\nsentinel down-after-milliseconds m 500\n"
        ),
        ("default", SENTINEL_PW),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    // Known, and reported linked (what the gateway asks for before using a replica).
    let linked = || {
        sentinel
            .try_cmd::<Vec<std::collections::HashMap<String, String>>>(&[
                "SENTINEL", "replicas", "m",
            ])
            .is_ok_and(|replicas| {
                replicas.iter().any(|r| {
                    r.get("flags").map(String::as_str) == Some("slave")
                        && r.get("master-link-status").map(String::as_str) == Some("ok")
                })
            })
    };
    while !linked() {
        assert!(
            Instant::now() < deadline,
            "the sentinel never saw the replica"
        );
        std::thread::sleep(Duration::from_millis(25));
    }

    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("data-password");
    std::fs::write(&pw, format!("{DATA_PW}\n")).unwrap();
    let up = Upstream::start().await;
    let toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"

[store]
backend = "redis"
timeout = "2s"
on_error = "deny"
password_file = "{pw}"
sentinel_password = "{SENTINEL_PW}"

[[store.shards]]
sentinel = {{ master = "m", nodes = ["{sentinel}"] }}

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 60 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        pw = pw.display(),
        sentinel = sentinel.url(),
        up = up.url(),
    );
    let gw = TestGateway::start(&toml).await;
    let r = support::first_answer(&gw, "/", &[]).await;
    assert_eq!(r.status, 200);
    // The replica Sentinel announced is logged into (with store.password_file's).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !replica
        .cmd::<String>(&["CLIENT", "LIST"])
        .contains("name=tollgate")
    {
        assert!(
            Instant::now() < deadline,
            "the gateway never connected to the replica"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // ... and reads go to it once the gateway has it as a serving replica, and the
    // replica has caught up with the first request's charge (until then this gateway
    // reads the window it charged on the primary: docs/redis.md, "Reading your own
    // writes from replicas").
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let serving = support::store_report(&gw)
            .iter()
            .all(|s| s.nodes.len() == 2 && s.nodes.iter().all(|n| n.connected && n.serving));
        if serving {
            break;
        }
        assert!(Instant::now() < deadline, "the replica never served");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // A check goes to the replica once the sampler has seen it catch up with this
    // gateway's last charge (about 10 ms plus the lag; allow a loaded machine 10 s).
    let answered_by_replica = || {
        replica
            .cmd::<String>(&["INFO", "commandstats"])
            .contains("cmdstat_evalsha:calls=")
    };
    let mut admitted = 1;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !answered_by_replica() {
        assert!(
            Instant::now() < deadline,
            "no check went to the replica: {}",
            replica.cmd::<String>(&["INFO", "commandstats"])
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(support::get(&gw.url("/")).await.status, 200);
        admitted += 1;
    }
    // The rest of the quota, then the 429, counted exactly once on the primary.
    while admitted < 60 {
        assert_eq!(support::get(&gw.url("/")).await.status, 200);
        admitted += 1;
    }
    let refused = support::get(&gw.url("/")).await;
    assert_eq!(refused.status, 429);
    let key = KeyScheme::new("tollgate:", None)
        .key("core", "ip:127.0.0.1")
        .key
        .to_string();
    let count: u64 = primary.cmd(&["HGET", &key, "count"]);
    assert_eq!(count, 60);
}

/// `tollgate check` with secret files: each missing one named at its key with its line
/// and column; found in `$CREDENTIALS_DIRECTORY` (systemd's `LoadCredential=`) before
/// the config file's directory; a key given both ways is an error.
#[test]
fn check_names_secret_files_at_their_keys_and_reads_the_credentials_directory() {
    let dir = tempfile::tempdir().unwrap();
    let creds = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    std::fs::write(
        &path,
        r#"[store]
backend = "redis"
username = "tollgate"
password_file = "redis-password"
hash_key_file = "hash-key"
sentinel_password_file = "sentinel-password"

[[store.shards]]
sentinel = { master = "m", nodes = ["redis://127.0.0.1:26379"] }

[identity.jwt]
secret_file = "jwt-secret"
algorithms = ["HS256"]
"#,
    )
    .unwrap();
    let run = |creds: Option<&Path>| {
        let mut cmd = support::tollgate();
        cmd.env_remove("CREDENTIALS_DIRECTORY")
            .args(["check", "--config"])
            .arg(&path);
        if let Some(c) = creds {
            cmd.env("CREDENTIALS_DIRECTORY", c);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    let (code, err) = run(None);
    assert_ne!(code, 0);
    for (line, key) in [
        (4, "store.password_file"),
        (5, "store.hash_key_file"),
        (6, "store.sentinel_password_file"),
        (12, "identity.jwt.secret_file"),
    ] {
        let want = format!("tollgate.toml:{line}:1: {key}: cannot read ");
        assert!(err.contains(&want), "{want:?} not in:\n{err}");
    }

    // The same relative names, found in $CREDENTIALS_DIRECTORY.
    for (name, secret) in [
        ("redis-password", "pw\n"),
        ("hash-key", "a-long-random-hash-key\n"),
        ("sentinel-password", "spw\n"),
        ("jwt-secret", "0123456789abcdef0123456789abcdef\n"),
    ] {
        std::fs::write(creds.path().join(name), secret).unwrap();
    }
    let (code, err) = run(Some(creds.path()));
    assert_eq!(code, 0, "{err}");

    // An empty file, and a key given both inline and as a file.
    std::fs::write(creds.path().join("redis-password"), "\n").unwrap();
    let text = std::fs::read_to_string(&path).unwrap().replace(
        "hash_key_file = \"hash-key\"",
        "hash_key_file = \"hash-key\"\nhash_key = \"inline\"",
    );
    std::fs::write(&path, text).unwrap();
    let (code, err) = run(Some(creds.path()));
    assert_ne!(code, 0);
    assert!(
        err.contains("store.password_file: ") && err.contains("is empty"),
        "{err}"
    );
    assert!(
        err.contains("store.hash_key_file: give either `hash_key` or `hash_key_file`, not both"),
        "{err}"
    );
}

/// The binary as systemd runs it: `store.password_file` is a relative name found in
/// `$CREDENTIALS_DIRECTORY`; the password rotated in Redis locks the gateway out (503,
/// logged) until the file is rewritten and SIGHUP reloads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_takes_its_password_from_the_credentials_directory_and_rotates_on_sighup() {
    let redis = redis_without_default_user();
    least_privilege(&redis, "first-password");
    let dir = tempfile::tempdir().unwrap();
    let creds = tempfile::tempdir().unwrap();
    let secret = creds.path().join("redis-password");
    std::fs::write(&secret, "first-password\n").unwrap();
    let up = Upstream::start().await;
    let port = support::redis::free_port();
    let path = dir.path().join("tollgate.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"

[store]
backend = "redis"
timeout = "500ms"
on_error = "deny"
username = "tollgate"
password_file = "redis-password"

[[store.shards]]
primary = "{url}"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 100 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
            url = redis.url(),
            up = up.url()
        ),
    )
    .unwrap();
    let gw = support::Binary::spawn(
        &path,
        port,
        &[("CREDENTIALS_DIRECTORY", creds.path().display().to_string())],
    );
    let url = format!("http://127.0.0.1:{port}/");
    let until_served = |what: &'static str| {
        let url = url.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let r = support::get(&url).await;
                if r.status == 200 {
                    return r;
                }
                assert!(Instant::now() < deadline, "{what}: still {}", r.status);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    until_served("at start").await;

    let _: String = redis.cmd(&[
        "ACL",
        "SETUSER",
        "tollgate",
        "resetpass",
        ">second-password",
    ]);
    let _: u64 = redis.cmd(&["CLIENT", "KILL", "USER", "tollgate"]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(support::get(&url).await.status, 503);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !gw.logs().contains("redis node unreachable") {
        assert!(Instant::now() < deadline, "no log line:\n{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!gw.logs().contains("first-password"), "{}", gw.logs());

    std::fs::write(&secret, "second-password\n").unwrap();
    gw.signal("-HUP");
    let served = until_served("after SIGHUP").await;
    assert_eq!(served.num("x-ratelimit-limit"), 100);
    let logs = gw.logs();
    assert!(logs.contains("config reloaded"), "{logs}");
    assert!(!logs.contains("second-password"), "{logs}");
}

/// `store.hash_key_file`: moving the key out of the TOML moves nobody; a changed file
/// (read at the reload, the config text unchanged) moves every caller, with a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hash_key_file_keys_the_windows_and_its_change_is_warned() {
    let redis = support::RedisServer::start();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("hash-key");
    let toml = |hash: &str| {
        format!(
            r#"
[store]
backend = "redis"
timeout = "2s"
{hash}

[[store.shards]]
primary = "{url}"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 100 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
            url = redis.url(),
            up = up.url()
        )
    };
    let key_with = |secret: &str| {
        KeyScheme::new("tollgate:", Some(secret))
            .key("core", "ip:127.0.0.1")
            .key
            .to_string()
    };
    let warnings = |outcome| match outcome {
        tollgate::server::ReloadOutcome::Applied { warnings, .. } => warnings,
        other => panic!("{other:?}"),
    };
    let gw = TestGateway::start(&toml("hash_key = \"first-secret-key\"")).await;
    assert_eq!(support::get(&gw.url("/")).await.status, 200);

    std::fs::write(&key_file, "first-secret-key\n").unwrap();
    let in_file = toml(&format!("hash_key_file = \"{}\"", key_file.display()));
    let moved = warnings(gw.reload(&in_file).expect("reload"));
    assert!(!moved.iter().any(|w| w.contains("hash_key")), "{moved:?}");
    assert_eq!(support::get(&gw.url("/")).await.status, 200);

    std::fs::write(&key_file, "second-secret-key\n").unwrap();
    let changed = warnings(gw.reload(&in_file).expect("reload"));
    assert!(
        changed
            .iter()
            .any(|w| w.contains("store.hash_key_file") && w.contains("fresh window")),
        "{changed:?}"
    );
    assert_eq!(support::get(&gw.url("/")).await.status, 200);

    let deadline = Instant::now() + Duration::from_secs(5);
    let count = |k: &str| redis.cmd::<Option<u64>>(&["HGET", k, "count"]);
    while (
        count(&key_with("first-secret-key")),
        count(&key_with("second-secret-key")),
    ) != (Some(2), Some(1))
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(count(&key_with("first-secret-key")), Some(2));
    assert_eq!(count(&key_with("second-secret-key")), Some(1));
}

/// The extra permissions docs/redis.md gives for cluster mode: the backticked rule
/// just before "in cluster mode", split into arguments.
fn documented_cluster_extras() -> Vec<String> {
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/redis.md"))
        .unwrap();
    let at = docs
        .find("` in cluster mode")
        .expect("docs/redis.md gives the cluster-mode ACL extras");
    let start = docs[..at].rfind('`').expect("a backticked rule") + 1;
    docs[start..at]
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Run a command on cluster node `port` as the test's `admin` user.
fn as_admin<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> T {
    let url = format!("redis://{}:{}@127.0.0.1:{port}", ADMIN.0, ADMIN.1);
    let mut c = redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
        .unwrap_or_else(|e| panic!("admin on port {port}: {e}"));
    support::redis::query(&mut c, args).unwrap_or_else(|e| panic!("port {port}: {args:?}: {e}"))
}

/// Cluster mode as the least-privilege user: the documented rule plus the documented
/// cluster extras on every node, the default user off. Callers on two different
/// masters are checked, charged, refused and reset; a caller whose slot is being
/// migrated is answered through `ASK` (`ASKING`); Redis refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_least_privilege_user_runs_the_request_path_on_a_cluster() {
    let cluster = support::cluster_replicas::ReplicatedCluster::start(3, 0);
    let caller_key = |id: &str| {
        KeyScheme::new("tollgate:", None)
            .key("core", &format!("client:{id}"))
            .key
            .to_string()
    };
    // Two callers on different masters (asked while the default user still works).
    let ids: Vec<String> = (0..24).map(|i| format!("c{i}")).collect();
    let mut callers: Vec<(String, usize)> = Vec::new();
    for id in &ids {
        let master = cluster.master_for_key(&caller_key(id));
        if callers.iter().all(|(_, m)| *m != master) {
            callers.push((id.clone(), master));
        }
    }
    assert!(callers.len() >= 2, "all callers on one master: {callers:?}");
    callers.truncate(2);

    let mut rule = documented_acl("tollgate-cluster-pw");
    rule.extend(documented_cluster_extras());
    let rule: Vec<&str> = rule.iter().map(String::as_str).collect();
    for n in &cluster.nodes {
        let ok: String = n.cmd(&[
            "ACL",
            "SETUSER",
            ADMIN.0,
            "on",
            ">admin-password",
            "~*",
            "&*",
            "+@all",
        ]);
        assert_eq!(ok, "OK");
        let ok: String = n.cmd(&rule);
        assert_eq!(ok, "OK");
        let ok: String = n.cmd(&["ACL", "SETUSER", "default", "off"]);
        assert_eq!(ok, "OK");
        let anonymous = n
            .conn()
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
        assert!(anonymous.is_err(), "{anonymous:?}");
    }

    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("redis-password");
    std::fs::write(&pw, "tollgate-cluster-pw\n").unwrap();
    let up = Upstream::start().await;
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let clients: String = ids
        .iter()
        .map(|id| {
            format!(
                "[[identity.clients]]\nid = \"{id}\"\nkey_sha256 = \"{}\"\ntier = \"gold\"\n\n",
                sha256_hex(&format!("{id}-key"))
            )
        })
        .collect();
    let toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
admin_token_sha256 = "{token}"

[store]
backend = "redis"
mode = "cluster"
nodes = [{nodes}]
timeout = "2s"
on_error = "deny"
username = "tollgate"
password_file = "{pw}"

{clients}
[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ gold = 3 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        token = sha256_hex(TOKEN),
        nodes = nodes.join(", "),
        pw = pw.display(),
        up = up.url(),
    );
    let gw = TestGateway::start(&toml).await;
    let as_caller = |id: &str| {
        let url = gw.url("/x");
        let auth = format!("Bearer {id}-key");
        async move { get_with(&url, &[("authorization", &auth)]).await }
    };
    let port_of = |i: usize| cluster.nodes[i].port;
    let slot_of = |key: &str| as_admin::<u16>(port_of(0), &["CLUSTER", "KEYSLOT", key]).to_string();
    let count_on =
        |i: usize, key: &str| -> Option<u64> { as_admin(port_of(i), &["HGET", key, "count"]) };
    // The charge is sent after the response: wait (≤ 5 s) for `want`.
    let settled = |i: usize, key: String, want: u64| async move {
        let deadline = Instant::now() + Duration::from_secs(5);
        while count_on(i, &key) != Some(want) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(count_on(i, &key), Some(want), "{key} on node {i}");
    };

    let admin = gw.gateway.admin_addr().unwrap();
    for (id, master) in &callers {
        let key = caller_key(id);
        // Check and charge, until the quota of 3 is used; then 429.
        let auth = format!("Bearer {id}-key");
        let first = support::first_answer(&gw, "/x", &[("authorization", &auth)]).await;
        assert_eq!(first.status, 200, "{id}: {}", first.text());
        assert_eq!(first.header("x-ratelimit-resource"), "core");
        assert_eq!(first.num("x-ratelimit-limit"), 3);
        assert_eq!(first.num("x-ratelimit-remaining"), 2);
        settled(*master, key.clone(), 1).await;
        for remaining in [1, 0] {
            let r = as_caller(id).await;
            assert_eq!(r.status, 200);
            assert_eq!(r.num("x-ratelimit-remaining"), remaining);
        }
        settled(*master, key.clone(), 3).await;
        let refused = as_caller(id).await;
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("x-ratelimit-resource"), "core");
        assert_eq!(refused.num("x-ratelimit-remaining"), 0);
        assert_eq!(count_on(*master, &key), Some(3));
        // The window lives on its slot's master only.
        let slot = slot_of(&key);
        for i in 0..cluster.nodes.len() {
            let held: u64 = as_admin(port_of(i), &["CLUSTER", "COUNTKEYSINSLOT", &slot]);
            assert_eq!(held, u64::from(i == *master), "slot {slot} on node {i}");
        }

        // The admin reset deletes the caller's window on its master.
        let reset = send(
            Method::POST,
            &format!("http://{admin}/callers/{id}/reset"),
            &[("authorization", &format!("Bearer {TOKEN}"))],
        )
        .await;
        assert_eq!(reset.status, 200, "{}", reset.text());
        assert_eq!(reset.json()["windows_deleted"], 1);
        let exists: u64 = as_admin(port_of(*master), &["EXISTS", &key]);
        assert_eq!(exists, 0);
        let again = as_caller(id).await;
        assert_eq!(again.status, 200);
        assert_eq!(again.num("x-ratelimit-remaining"), 2);
        settled(*master, key.clone(), 1).await;
    }

    // The second caller's slot is being migrated to the first caller's master, its
    // window already moved: its old master answers `ASK`, and the gateway sends
    // `ASKING` and the call to the importing master.
    let (id, from) = (&callers[1].0, callers[1].1);
    let to = callers[0].1;
    let key = caller_key(id);
    let slot = slot_of(&key);
    let from_id: String = as_admin(port_of(from), &["CLUSTER", "MYID"]);
    let to_id: String = as_admin(port_of(to), &["CLUSTER", "MYID"]);
    let ok: String = as_admin(
        port_of(to),
        &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id],
    );
    assert_eq!(ok, "OK");
    let ok: String = as_admin(
        port_of(from),
        &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id],
    );
    assert_eq!(ok, "OK");
    let to_port = port_of(to).to_string();
    let ok: String = as_admin(
        port_of(from),
        &[
            "MIGRATE",
            "127.0.0.1",
            &to_port,
            "",
            "0",
            "5000",
            "AUTH2",
            ADMIN.0,
            ADMIN.1,
            "KEYS",
            &key,
        ],
    );
    assert_eq!(ok, "OK");
    let asked = as_caller(id).await;
    assert_eq!(asked.status, 200, "{}", asked.text());
    assert_eq!(asked.num("x-ratelimit-remaining"), 1);
    // (The importing master answers for the slot after `ASKING` only.)
    let asked_count = || -> Option<u64> {
        let url = format!("redis://{}:{}@127.0.0.1:{}", ADMIN.0, ADMIN.1, port_of(to));
        let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
        let (count,): (Option<u64>,) = redis::pipe()
            .cmd("ASKING")
            .ignore()
            .cmd("HGET")
            .arg(&key)
            .arg("count")
            .query(&mut c)
            .unwrap();
        count
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while asked_count() != Some(2) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(asked_count(), Some(2));
    let left: u64 = as_admin(port_of(from), &["CLUSTER", "COUNTKEYSINSLOT", &slot]);
    assert_eq!(left, 0);
    let asking: String = as_admin(port_of(to), &["INFO", "commandstats"]);
    assert!(asking.contains("cmdstat_asking:calls="), "{asking}");

    // Redis refused nothing tollgate sent, on any node, and tollgate's connections
    // are the least-privilege user's.
    for i in 0..cluster.nodes.len() {
        let log: Vec<redis::Value> = as_admin(port_of(i), &["ACL", "LOG"]);
        assert!(log.is_empty(), "ACL LOG of node {i}: {log:?}");
        let clients: String = as_admin(port_of(i), &["CLIENT", "LIST"]);
        assert!(
            clients
                .lines()
                .filter(|l| l.contains("name=tollgate"))
                .all(|l| l.contains("user=tollgate")),
            "{clients}"
        );
    }
}
