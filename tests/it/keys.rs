//! `identity.clients_file`: a keys file with several keys per client (rotation without
//! a budget reset), per-client quotas, disabled clients and expiring keys, reloaded on
//! change and on SIGHUP, validated as a whole; `tollgate key new`.

use crate::support;
use crate::support::redis::free_port;
use crate::support::*;
use serde_json::json;
use std::path::Path;
use std::time::{Duration, Instant};

fn line(id: &str, key: &str, extra: serde_json::Value) -> String {
    let mut v = json!({ "id": id, "key_sha256": sha256_hex(key) });
    if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
        v.extend(extra.clone());
    }
    format!("{v}\n")
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A gateway config with `clients_file = keys`, limit `core` (gold 20, default 10,
/// anonymous 3 an hour) and limit `search` (gold 2 an hour).
fn config(listen: &str, up: &str, keys: &Path, server_extra: &str, inline: &str) -> String {
    format!(
        r#"
[server]
listen = "{listen}"
{server_extra}

[identity]
clients_file = "{keys}"

{inline}

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 3, default = 10, gold = 20 }}

[[limits]]
name = "search"
window = "1h"
quota = {{ gold = 2 }}

[[routes]]
path_prefix = "/search"
upstream = "api"
limits = ["search"]

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        keys = keys.display(),
    )
}

async fn call(gw: &str, key: &str) -> support::client::Reply {
    get_with(gw, &[("authorization", &format!("Bearer {key}"))]).await
}

#[tokio::test]
async fn keys_file_clients_get_their_tier_their_own_quotas_and_refusals() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    let text = [
        "# customers\n".to_string(),
        line(
            "acme",
            "acme-key",
            json!({"tier": "gold", "quotas": {"core": 5}, "label": "ci key"}),
        ),
        "\n".into(),
        line("bob", "bob-key", json!({"tier": "gold"})),
        line("carol", "carol-key", json!({})),
        line(
            "dave",
            "dave-key",
            json!({"tier": "gold", "disabled": true}),
        ),
        line("erin", "erin-old", json!({"expires_at": now_s() - 10})),
        line("erin", "erin-new", json!({"expires_at": now_s() + 3600})),
    ]
    .concat();
    std::fs::write(&keys, text).unwrap();
    let gw = TestGateway::start(&config("127.0.0.1:0", &up.url(), &keys, "", "")).await;

    // acme's own quota for core wins over gold's 20; gold's search quota still applies.
    let r = call(&gw.url("/x"), "acme-key").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-limit"), "5");
    let r = call(&gw.url("/search"), "acme-key").await;
    assert_eq!(r.header("x-ratelimit-limit"), "2");
    // bob: gold's quota. carol: no tier given, "default".
    assert_eq!(
        call(&gw.url("/x"), "bob-key")
            .await
            .header("x-ratelimit-limit"),
        "20"
    );
    assert_eq!(
        call(&gw.url("/x"), "carol-key")
            .await
            .header("x-ratelimit-limit"),
        "10"
    );
    // A disabled client and an expired key: 401, not forwarded.
    let before = up.hits();
    for key in ["dave-key", "erin-old", "unknown"] {
        let r = call(&gw.url("/x"), key).await;
        assert_eq!(r.status, 401, "{key}");
        assert_eq!(r.json()["message"], "Bad credentials");
    }
    assert_eq!(up.hits(), before);
    // erin's other key has not expired.
    assert_eq!(call(&gw.url("/x"), "erin-new").await.status, 200);
}

#[tokio::test]
async fn a_rotated_key_carries_on_the_clients_window() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    std::fs::write(&keys, line("acme", "old-key", json!({"tier": "gold"}))).unwrap();
    let gw = TestGateway::start(&config("127.0.0.1:0", &up.url(), &keys, "", "")).await;
    for used in 1..=3 {
        let r = call(&gw.url("/x"), "old-key").await;
        assert_eq!(r.num("x-ratelimit-used"), used);
    }
    assert_eq!(call(&gw.url("/x"), "new-key").await.status, 401);

    // Step 1: add the new key to the client.
    let mut text = std::fs::read_to_string(&keys).unwrap();
    text.push_str(&line("acme", "new-key", json!({"label": "2026 key"})));
    std::fs::write(&keys, &text).unwrap();
    assert!(gw.gateway.reloader().reload_keys(false));
    // Step 2: callers move; the window carries on across both keys.
    let r = call(&gw.url("/x"), "new-key").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-used"), 4);
    assert_eq!(r.header("x-ratelimit-limit"), "20", "the client's tier");
    assert_eq!(
        call(&gw.url("/x"), "old-key").await.num("x-ratelimit-used"),
        5
    );

    // Step 3: expire the old key; it is refused, the budget is not reset.
    let text = [
        line(
            "acme",
            "old-key",
            json!({"tier": "gold", "expires_at": now_s() - 1}),
        ),
        line("acme", "new-key", json!({"label": "2026 key"})),
    ]
    .concat();
    std::fs::write(&keys, text).unwrap();
    assert!(gw.gateway.reloader().reload_keys(false));
    assert_eq!(call(&gw.url("/x"), "old-key").await.status, 401);
    assert_eq!(
        call(&gw.url("/x"), "new-key").await.num("x-ratelimit-used"),
        6
    );

    // A broken file keeps the running keys.
    std::fs::write(&keys, "{\"id\": \"acme\"}\n").unwrap();
    assert!(!gw.gateway.reloader().reload_keys(false));
    assert_eq!(
        call(&gw.url("/x"), "new-key").await.num("x-ratelimit-used"),
        7
    );
}

#[tokio::test]
async fn inline_clients_take_an_array_of_keys_sharing_one_window() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    // The file adds a third key to the inline client.
    std::fs::write(&keys, line("acme", "k3", json!({}))).unwrap();
    let inline = format!(
        "[[identity.clients]]\nid = \"acme\"\nkey_sha256 = [\"{}\", \"{}\"]\ntier = \"gold\"\n",
        sha256_hex("k1"),
        sha256_hex("k2")
    );
    let gw = TestGateway::start(&config("127.0.0.1:0", &up.url(), &keys, "", &inline)).await;
    for (i, key) in ["k1", "k2", "k3", "k1"].iter().enumerate() {
        let r = call(&gw.url("/x"), key).await;
        assert_eq!(r.status, 200, "{key}");
        assert_eq!(r.num("x-ratelimit-used"), i as u64 + 1, "{key}");
        assert_eq!(r.header("x-ratelimit-limit"), "20", "{key}");
    }
}

#[test]
fn check_reports_every_bad_line_with_its_path_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    let text = [
        line("acme", "a", json!({"tier": "gold"})),
        "not json\n".into(),
        line("acme", "b", json!({"tier": "default"})),
        line("bob", "a", json!({})),
        line("carol", "c", json!({"tier": "platinum"})),
        line("dan", "d", json!({"quotas": {"nope": 3}})),
        "{\"id\": \"x\", \"key_sha256\": \"abc\"}\n".into(),
        line("erin", "e", json!({"colour": "red"})),
    ]
    .concat();
    std::fs::write(&keys, text).unwrap();
    let cfg = dir.path().join("tollgate.toml");
    let toml = config("127.0.0.1:8080", "http://127.0.0.1:9", &keys, "", "");
    std::fs::write(&cfg, toml).unwrap();
    let (code, _, err) = check(&cfg);
    assert_eq!(code, 1, "{err}");
    let p = keys.display().to_string();
    for (n, what) in [
        (2, "not a key line"),
        (3, "tier \"default\" differs from \"gold\" given at line 1"),
        (4, "the same key is already given at line 1"),
        (5, "unknown tier \"platinum\""),
        (6, "no limit is named \"nope\""),
        (7, "64 hex characters"),
        (8, "unknown field `colour`"),
    ] {
        assert!(err.contains(&format!("{p}:{n}: ")), "line {n} in:\n{err}");
        let l = err
            .lines()
            .find(|l| l.contains(&format!("{p}:{n}: ")))
            .unwrap();
        assert!(l.contains(what), "{l}");
    }
    assert!(!err.contains(&format!("{p}:1: ")), "{err}");

    // A good file passes, and the summary counts clients.
    std::fs::write(
        &keys,
        [
            line("acme", "a", json!({"tier": "gold"})),
            line("acme", "b", json!({})),
        ]
        .concat(),
    )
    .unwrap();
    let (code, out, err) = check(&cfg);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 client(s)"), "{out}");
}

#[test]
fn key_new_prints_the_key_once_and_appends_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    std::fs::write(&keys, line("old", "x", json!({}))).unwrap();
    let out = tollgate()
        .args([
            "key",
            "new",
            "--id",
            "acme",
            "--tier",
            "gold",
            "--clients-file",
        ])
        .arg(&keys)
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8(out.stdout).unwrap();
    let mut lines = stdout.lines();
    let key = lines.next().unwrap();
    assert!(key.starts_with("tg_") && key.len() == 46, "{key}");
    let v: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(v["id"], "acme");
    assert_eq!(v["tier"], "gold");
    assert_eq!(v["key_sha256"], sha256_hex(key));
    let file = std::fs::read_to_string(&keys).unwrap();
    assert_eq!(file.lines().count(), 2);
    assert!(!file.contains(key), "the raw key is never written");
    // Two keys are never the same.
    let again = tollgate()
        .args(["key", "new", "--id", "acme", "--tier", "gold"])
        .output()
        .unwrap();
    assert!(!String::from_utf8(again.stdout).unwrap().contains(key));
}

async fn eventually(what: &str, mut ok: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        if ok().await {
            return;
        }
        assert!(Instant::now() < deadline, "not within 2 s: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_running_gateway_follows_the_keys_file_and_sighup() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    std::fs::write(&keys, line("acme", "a", json!({"tier": "gold"}))).unwrap();
    let port = free_port();
    let cfg = dir.path().join("tollgate.toml");
    let listen = format!("127.0.0.1:{port}");
    std::fs::write(&cfg, config(&listen, &up.url(), &keys, "", "")).unwrap();
    let bin = Binary::spawn(&cfg, port, &[]);
    let url = format!("http://{listen}/x");
    assert_eq!(call(&url, "a").await.status, 200);
    assert_eq!(call(&url, "b").await.status, 401);

    // Added: served with its client's tier within 2 s.
    std::fs::write(
        &keys,
        [
            line("acme", "a", json!({"tier": "gold"})),
            line("bob", "b", json!({"tier": "gold"})),
        ]
        .concat(),
    )
    .unwrap();
    eventually("the new key is served", async || {
        let r = call(&url, "b").await;
        r.status == 200 && r.header("x-ratelimit-limit") == "20"
    })
    .await;
    // Removed: 401 within 2 s.
    std::fs::write(&keys, line("bob", "b", json!({"tier": "gold"}))).unwrap();
    eventually("the removed key is refused", async || {
        call(&url, "a").await.status == 401
    })
    .await;
    // Broken: logged as PATH:LINE, the running keys stay.
    std::fs::write(&keys, "{\"id\": \"bob\"}\nnot json\n").unwrap();
    let p = keys.display().to_string();
    let deadline = Instant::now() + Duration::from_secs(3);
    while !bin.logs().contains(&format!("{p}:2: ")) {
        assert!(Instant::now() < deadline, "{}", bin.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(bin.logs().contains(&format!("{p}:1: ")), "{}", bin.logs());
    assert_eq!(call(&url, "b").await.status, 200);
    drop(bin);

    // With watching off, SIGHUP reloads the keys file.
    std::fs::write(&keys, line("acme", "a", json!({"tier": "gold"}))).unwrap();
    std::fs::write(
        &cfg,
        config(&listen, &up.url(), &keys, "watch_config = false", ""),
    )
    .unwrap();
    let bin = Binary::spawn(&cfg, port, &[]);
    std::fs::write(&keys, line("carol", "c", json!({}))).unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(call(&url, "c").await.status, 401, "not watched");
    bin.signal("-HUP");
    eventually("SIGHUP reloads the keys", async || {
        call(&url, "c").await.status == 200
    })
    .await;
    assert_eq!(call(&url, "a").await.status, 401);
}

/// Waits until the gateway's log contains `what` (within 5 s).
fn logged(bin: &Binary, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !bin.logs().contains(what) {
        assert!(
            Instant::now() < deadline,
            "not logged: {what}\n{}",
            bin.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A keys file of clients `c{i}` with keys `k{i}` for `i` in `range`.
fn numbered(range: std::ops::Range<usize>) -> String {
    range
        .map(|i| line(&format!("c{i}"), &format!("k{i}"), json!({})))
        .collect()
}

/// A writer truncates the keys file, writes half of it, pauses 1.5 s
/// and writes the rest. The half-written file (and the empty one) would remove most
/// keys: they are held, so a key that is in the file before and after never gets 401;
/// the finished file is applied.
#[tokio::test]
async fn a_keys_file_written_in_place_with_a_pause_is_never_applied_half_written() {
    use std::io::Write;
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    std::fs::write(&keys, numbered(0..2000)).unwrap();
    let port = free_port();
    let cfg = dir.path().join("tollgate.toml");
    let listen = format!("127.0.0.1:{port}");
    std::fs::write(&cfg, config(&listen, &up.url(), &keys, "", "")).unwrap();
    let bin = Binary::spawn(&cfg, port, &[]);
    logged(&bin, "watching the keys file for changes");
    let url = format!("http://{listen}/x");
    assert_eq!(call(&url, "k1500").await.status, 200);

    let mut f = std::fs::File::create(&keys).unwrap(); // truncates
    f.write_all(numbered(0..1000).as_bytes()).unwrap();
    f.flush().unwrap();
    // During the pause (and after), keys of the second half stay in use: each probe
    // uses another key, so that no window fills up.
    let mut probe = 1000;
    let mut check_second_half = async |until: Instant| {
        while Instant::now() < until {
            let key = format!("k{probe}");
            let r = call(&url, &key).await;
            assert_eq!(r.status, 200, "{key}: {}\n{}", r.text(), bin.logs());
            probe += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    check_second_half(Instant::now() + Duration::from_millis(1500)).await;
    f.write_all(numbered(1000..2000).as_bytes()).unwrap();
    f.write_all(line("new", "k-new", json!({})).as_bytes())
        .unwrap();
    f.flush().unwrap();
    drop(f);
    logged(&bin, "keys file held");
    // The whole file is applied once it settles.
    eventually_within(4, "the finished file is applied", async || {
        call(&url, "k-new").await.status == 200
    })
    .await;
    check_second_half(Instant::now() + Duration::from_millis(300)).await;
    assert!(bin.logs().contains("clients=2001"), "{}", bin.logs());
    assert!(!bin.logs().contains("clients=1000"), "{}", bin.logs());
}

async fn eventually_within(secs: u64, what: &str, mut ok: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if ok().await {
            return;
        }
        assert!(Instant::now() < deadline, "not within {secs} s: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A change that removes more than
/// `identity.clients_file_max_removed_percent` of the keys is held (logged at warn)
/// until SIGHUP confirms it; a change that removes few keys applies on its own.
#[tokio::test]
async fn a_change_that_removes_many_keys_waits_for_sighup() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    std::fs::write(&keys, numbered(0..100)).unwrap();
    let port = free_port();
    let cfg = dir.path().join("tollgate.toml");
    let listen = format!("127.0.0.1:{port}");
    // The defaults: identity.clients_file_max_removed_percent = 10.
    std::fs::write(&cfg, config(&listen, &up.url(), &keys, "", "")).unwrap();
    let bin = Binary::spawn(&cfg, port, &[]);
    logged(&bin, "watching the keys file for changes");
    let url = format!("http://{listen}/x");

    // 8 of 100 keys go (not more than 10 %): applied on its own.
    let next = dir.path().join("keys.next");
    std::fs::write(&next, numbered(8..100)).unwrap();
    std::fs::rename(&next, &keys).unwrap();
    logged(&bin, "keys file reloaded");
    assert!(bin.logs().contains("clients=92 keys=92"), "{}", bin.logs());
    assert_eq!(call(&url, "k0").await.status, 401);

    // 30 of 92 go, and one comes: held, nothing of it is in use.
    std::fs::write(
        &next,
        [numbered(38..100), line("new", "k-new", json!({}))].concat(),
    )
    .unwrap();
    std::fs::rename(&next, &keys).unwrap();
    logged(
        &bin,
        "keys file held: it would remove 30 of the 92 keys in use",
    );
    let held = bin.logs();
    let held = held.lines().find(|l| l.contains("keys file held")).unwrap();
    assert!(held.contains("WARN"), "{held}");
    assert_eq!(call(&url, "k20").await.status, 200);
    assert_eq!(call(&url, "k-new").await.status, 401);

    // SIGHUP confirms it.
    bin.signal("-HUP");
    eventually_within(4, "SIGHUP applies the held file", async || {
        call(&url, "k-new").await.status == 200
    })
    .await;
    assert_eq!(call(&url, "k21").await.status, 401);
    assert_eq!(call(&url, "k50").await.status, 200);
    assert!(bin.logs().contains("clients=63 keys=63"), "{}", bin.logs());
}

/// A sparse keys file of 300 GiB is refused before it is read, with a
/// message naming `identity.clients_file_max_bytes`: `tollgate check` exits 1, and the
/// running gateway logs the error and keeps serving the keys it has.
#[tokio::test]
async fn a_keys_file_over_the_size_cap_is_refused_and_the_running_keys_stay() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    std::fs::write(&keys, numbered(0..10)).unwrap();
    let port = free_port();
    let cfg = dir.path().join("tollgate.toml");
    let listen = format!("127.0.0.1:{port}");
    std::fs::write(&cfg, config(&listen, &up.url(), &keys, "", "")).unwrap();
    let bin = Binary::spawn(&cfg, port, &[]);
    logged(&bin, "watching the keys file for changes");
    let url = format!("http://{listen}/x");
    assert_eq!(call(&url, "k3").await.status, 200);

    std::fs::OpenOptions::new()
        .write(true)
        .open(&keys)
        .unwrap()
        .set_len(300 << 30)
        .unwrap();
    logged(&bin, "keys file rejected");
    let logs = bin.logs();
    assert!(
        logs.contains(
            "322122547200 bytes, more than identity.clients_file_max_bytes = 268435456 bytes"
        ),
        "{logs}"
    );
    assert_eq!(call(&url, "k4").await.status, 200, "{}", bin.logs());
    assert!(bin.logs().contains("keys file rejected"));

    let (code, _, err) = check(&cfg);
    assert_eq!(code, 1, "{err}");
    let p = keys.display().to_string();
    assert!(
        err.contains(&format!(
            "{p}: the keys file is 322122547200 bytes, more than identity.clients_file_max_bytes = 268435456 bytes"
        )),
        "{err}"
    );
}

/// A line longer than the 64 KiB a key line may have is an error of
/// that line (it is never held whole).
#[test]
fn check_refuses_a_line_longer_than_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.jsonl");
    let long = format!("{{\"id\": \"{}\"}}\n", "x".repeat(10 << 20));
    std::fs::write(&keys, [numbered(0..2), long, numbered(2..3)].concat()).unwrap();
    let cfg = dir.path().join("tollgate.toml");
    std::fs::write(
        &cfg,
        config("127.0.0.1:8080", "http://127.0.0.1:9", &keys, "", ""),
    )
    .unwrap();
    let (code, _, err) = check(&cfg);
    assert_eq!(code, 1, "{err}");
    let p = keys.display().to_string();
    assert!(
        err.contains(&format!(
            "{p}:3: the line is 10485771 bytes, more than the 65536 a key line may have"
        )),
        "{err}"
    );
    assert_eq!(err.lines().filter(|l| l.contains(&p)).count(), 1, "{err}");
}
