//! `POST /callers/{id}/reset` on the admin listener: a caller at its limit is unblocked
//! at once, on this gateway and (within 2 s) on every other gateway of a fleet.

use crate::support::redis::free_port;
use crate::support::*;
use http::Method;
use std::time::{Duration, Instant};
use tollgate::limiter::key::KeyScheme;

const TOKEN: &str = "admin-token-for-tests";

/// Two clients of tier gold; `core` (fixed window, 3), `search` (sliding window, 2),
/// `perip` (by IP) and `conc` (concurrency) on every route.
fn config(listen: &str, admin: &str, store: &str, up: &Upstream, token: Option<&str>) -> String {
    let token = token
        .map(|t| format!("admin_token_sha256 = \"{}\"\n", sha256_hex(t)))
        .unwrap_or_default();
    format!(
        r#"
[server]
listen = "{listen}"
admin_listen = "{admin}"
{token}
{store}

[[identity.clients]]
id = "acme"
key_sha256 = "{acme}"
tier = "gold"

[[identity.clients]]
id = "bob"
key_sha256 = "{bob}"
tier = "gold"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ gold = 3 }}

[[limits]]
name = "search"
algorithm = "sliding_window"
window = "1h"
quota = {{ gold = 2 }}

[[limits]]
name = "perip"
by = "ip"
window = "1h"
quota = {{ gold = 1000 }}

[[limits]]
name = "conc"
algorithm = "concurrency"
window = "1m"
quota = {{ gold = 100 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core", "search", "perip", "conc"]
"#,
        acme = sha256_hex("acme-key"),
        bob = sha256_hex("bob-key"),
        up = up.url(),
    )
}

async fn call(url: &str, key: &str) -> Reply {
    get_with(url, &[("authorization", &format!("Bearer {key}"))]).await
}

async fn reset(admin: &str, path: &str, token: Option<&str>) -> Reply {
    send_bearer(Method::POST, &format!("http://{admin}{path}"), token).await
}

use crate::support::client::Reply;

/// The flow support runs, on one gateway and `store`: limited, reset one limit,
/// limited by the other, reset all, served with full budgets; another client untouched.
async fn unblocks_a_caller(store: &str) {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(
        "127.0.0.1:0",
        "127.0.0.1:0",
        store,
        &up,
        Some(TOKEN),
    ))
    .await;
    let (url, admin) = (gw.url("/x"), gw.admin());
    assert_eq!(call(&url, "bob-key").await.status, 200);
    for _ in 0..2 {
        assert_eq!(call(&url, "acme-key").await.status, 200);
    }
    let refused = call(&url, "acme-key").await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-ratelimit-resource"), "search");
    // Again, from the over-limit cache.
    assert_eq!(call(&url, "acme-key").await.status, 429);

    // Only `search`: `core` keeps its 2 units.
    let r = reset(&admin, "/callers/acme/reset?limit=search", Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["caller"], "acme");
    assert_eq!(v["cleared"], serde_json::json!(["search"]));
    assert_eq!(v["windows_deleted"], 1);
    let served = call(&url, "acme-key").await;
    assert_eq!(served.status, 200);
    assert_eq!(served.header("x-ratelimit-resource"), "core");
    assert_eq!(served.num("x-ratelimit-used"), 3);
    assert_eq!(served.num("x-ratelimit-remaining"), 0);
    let refused = call(&url, "acme-key").await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-ratelimit-resource"), "core");

    // Every limit of the caller: full budgets again.
    let r = reset(&admin, "/callers/acme/reset", Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["cleared"], serde_json::json!(["core", "search"]));
    assert_eq!(v["windows_deleted"], 2);
    let skipped: Vec<&str> = v["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["limit"].as_str().unwrap())
        .collect();
    assert_eq!(skipped, ["perip", "conc"]);
    let served = call(&url, "acme-key").await;
    assert_eq!(served.status, 200);
    assert_eq!(served.header("x-ratelimit-resource"), "search");
    assert_eq!(served.num("x-ratelimit-used"), 1);
    assert_eq!(served.num("x-ratelimit-remaining"), 1);
    assert_eq!(served.num("x-ratelimit-limit"), 2);

    // GET /top reads the windows from the store: acme's are full again.
    let top = get(&format!("http://{admin}/top")).await.json();
    let search = top["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "search")
        .unwrap();
    let acme = search["refused"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["caller"] == "acme")
        .unwrap();
    assert_eq!(acme["remaining"], 1, "{top}");

    // bob's windows were not touched.
    let bob = call(&url, "bob-key").await;
    assert_eq!(bob.status, 200);
    assert_eq!(bob.header("x-ratelimit-resource"), "search");
    assert_eq!(bob.num("x-ratelimit-used"), 2);

    // A client with no live window: nothing to delete, still 200.
    let r = reset(&admin, "/callers/nobody/reset", Some(TOKEN)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["windows_deleted"], 0);
}

#[tokio::test]
async fn reset_unblocks_a_caller_on_the_memory_store() {
    unblocks_a_caller("[store]\nbackend = \"memory\"").await;
}

#[tokio::test]
async fn reset_unblocks_a_caller_on_redis() {
    let redis = RedisServer::start();
    let store = store_toml(Backend::Redis, &[&redis], "deny", "500ms");
    unblocks_a_caller(&store).await;
}

/// Anonymous callers: `core` by caller (2), `perip` by IP (3), `everyone` global; the
/// access log (and `GET /top`) shows clients as `log.client_ip` says.
fn anonymous_config(store: &str, up: &Upstream, client_ip: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
admin_token_sha256 = "{token}"
{store}

[log]
client_ip = "{client_ip}"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 2 }}

[[limits]]
name = "perip"
by = "ip"
window = "1h"
quota = {{ anonymous = 3 }}

[[limits]]
name = "everyone"
by = "global"
window = "1h"
quota = {{ anonymous = 1000 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core", "perip", "everyone"]
"#,
        token = sha256_hex(TOKEN),
        up = up.url(),
    )
}

/// An anonymous caller at its limit is unblocked by the id `GET /top` shows for it:
/// its address's keyed hash (`log.client_ip = "hash"`) or its address (`"ip"`).
async fn unblocks_an_anonymous_caller(store: &str, client_ip: &str) {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&anonymous_config(store, &up, client_ip)).await;
    let (url, admin) = (gw.url("/x"), gw.admin());
    for _ in 0..2 {
        assert_eq!(get(&url).await.status, 200);
    }
    let refused = get(&url).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-ratelimit-resource"), "core");

    let top = get(&format!("http://{admin}/top")).await.json();
    let id = top["limits"][0]["refused"][0]["caller"]
        .as_str()
        .unwrap()
        .to_string();
    match client_ip {
        "ip" => assert_eq!(id, "127.0.0.1"),
        _ => assert_eq!(
            id,
            KeyScheme::new("tollgate:", None)
                .digest(b"ip:127.0.0.1")
                .hex()
        ),
    }

    let r = reset(&admin, &format!("/callers/{id}/reset"), Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["caller"], id.as_str());
    assert_eq!(v["anonymous"], true);
    assert_eq!(v["cleared"], serde_json::json!(["core", "perip"]));
    assert_eq!(v["skipped"][0]["limit"], "everyone");
    // `core` and `perip` were live; the global window stays.
    assert_eq!(v["windows_deleted"], 2);

    let served = get(&url).await;
    assert_eq!(served.status, 200);
    assert_eq!(served.header("x-ratelimit-resource"), "core");
    assert_eq!(served.num("x-ratelimit-used"), 1);
    assert_eq!(served.num("x-ratelimit-remaining"), 1);
    let top = get(&format!("http://{admin}/top")).await.json();
    let perip = top["limits"][1]["used"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["caller"] == id.as_str())
        .unwrap()
        .clone();
    assert_eq!(perip["remaining"], 2, "{top}");
    let everyone = &top["limits"][2]["used"][0];
    assert_eq!(everyone["remaining"], 997, "{top}");

    // A client id is still a client id: an id that is neither an address nor a hash
    // names no anonymous caller.
    let r = reset(&admin, "/callers/acme/reset", Some(TOKEN)).await;
    assert_eq!(r.json()["anonymous"], false);
    // `?limit=` may name a by-IP limit for an anonymous caller, not a global one.
    let r = reset(
        &admin,
        &format!("/callers/{id}/reset?limit=perip"),
        Some(TOKEN),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["windows_deleted"], 1);
    let r = reset(
        &admin,
        &format!("/callers/{id}/reset?limit=everyone"),
        Some(TOKEN),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
}

#[tokio::test]
async fn reset_unblocks_an_anonymous_caller_by_its_hash_on_the_memory_store() {
    unblocks_an_anonymous_caller("[store]\nbackend = \"memory\"", "hash").await;
}

#[tokio::test]
async fn reset_unblocks_an_anonymous_caller_by_its_hash_on_redis() {
    let redis = RedisServer::start();
    let store = store_toml(Backend::Redis, &[&redis], "deny", "500ms");
    unblocks_an_anonymous_caller(&store, "hash").await;
}

#[tokio::test]
async fn reset_unblocks_an_anonymous_caller_by_its_address_on_redis() {
    let redis = RedisServer::start();
    let store = store_toml(Backend::Redis, &[&redis], "deny", "500ms");
    unblocks_an_anonymous_caller(&store, "ip").await;
}

#[tokio::test]
async fn every_gateway_of_a_fleet_admits_the_caller_within_two_seconds() {
    let redis = RedisServer::start();
    let store = store_toml(Backend::Redis, &[&redis], "deny", "500ms");
    let up = Upstream::start().await;
    let toml = config("127.0.0.1:0", "127.0.0.1:0", &store, &up, Some(TOKEN));
    let (a, b) = (
        TestGateway::start(&toml).await,
        TestGateway::start(&toml).await,
    );
    assert_eq!(call(&a.url("/x"), "bob-key").await.status, 200);
    for _ in 0..2 {
        assert_eq!(call(&a.url("/x"), "acme-key").await.status, 200);
    }
    // Both gateways refuse acme, and remember it in their over-limit caches.
    assert_eq!(call(&a.url("/x"), "acme-key").await.status, 429);
    assert_eq!(call(&b.url("/x"), "acme-key").await.status, 429);
    let acme_keys = [
        client_key("core", "acme"),
        client_key("search:sliding_window", "acme"),
    ];
    let keys = redis.keys();
    for k in &acme_keys {
        assert!(keys.contains(k), "{k} not in {keys:?}");
    }

    let r = reset(&a.admin(), "/callers/acme/reset", Some(TOKEN)).await;
    let asked = Instant::now();
    assert_eq!(r.status, 200, "{}", r.text());
    let keys = redis.keys();
    for k in &acme_keys {
        assert!(!keys.contains(k), "{k} still in {keys:?}");
    }
    assert!(
        keys.contains(&client_key("core", "bob")),
        "bob's window stays: {keys:?}"
    );

    // B first (its cache entry is the one to outlive), then A at once.
    let mut b_refusals = 0;
    loop {
        let r = call(&b.url("/x"), "acme-key").await;
        if r.status == 200 {
            assert_eq!(r.num("x-ratelimit-used"), 1);
            break;
        }
        assert_eq!(r.status, 429);
        b_refusals += 1;
        assert!(
            asked.elapsed() < Duration::from_secs(2),
            "gateway B still refuses acme 2 s after the reset ({b_refusals} refusals)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = call(&a.url("/x"), "acme-key").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-used"), 2);
}

#[tokio::test]
async fn write_endpoints_need_the_admin_token() {
    let up = Upstream::start().await;
    let memory = "[store]\nbackend = \"memory\"";
    let off = TestGateway::start(&config("127.0.0.1:0", "127.0.0.1:0", memory, &up, None)).await;
    let r = reset(&off.admin(), "/callers/acme/reset", Some(TOKEN)).await;
    assert_eq!(r.status, 403);
    assert_eq!(r.header("content-type"), "application/json");
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("server.admin_token_sha256"),
        "{}",
        r.text()
    );

    let gw = TestGateway::start(&config(
        "127.0.0.1:0",
        "127.0.0.1:0",
        memory,
        &up,
        Some(TOKEN),
    ))
    .await;
    let admin = gw.admin();
    for token in [None, Some("wrong-token")] {
        let r = reset(&admin, "/callers/acme/reset", token).await;
        assert_eq!(r.status, 401, "{token:?}");
        assert_eq!(r.header("www-authenticate"), "Bearer");
        assert!(r.json()["message"].is_string());
    }
    let r = send(
        Method::GET,
        &format!("http://{admin}/callers/acme/reset"),
        &[],
    )
    .await;
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), "POST");
    let r = reset(&admin, "/callers/acme/reset?limit=nope", Some(TOKEN)).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = reset(&admin, "/callers/acme/reset?limit=perip", Some(TOKEN)).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("by = \\\"ip\\\""), "{}", r.text());
    let r = reset(&admin, "/callers/acme/reset?n=3", Some(TOKEN)).await;
    assert_eq!(r.status, 400);
    let r = reset(&admin, "/callers/acme%0Aforged/reset", Some(TOKEN)).await;
    assert_eq!(r.status, 400, "no forged log lines");
    let r = reset(&admin, "/callers/a%2Fb/reset", Some(TOKEN)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["caller"], "a/b");
    // The token's hash is not shown by GET /config.
    let cfg = get(&format!("http://{admin}/config")).await.json();
    assert_eq!(cfg["config"]["server"]["admin_token_sha256"], "<redacted>");
    assert!(cfg["pending_restart"].get("server").is_none());

    // A reload changes the token at once, without a restart warning for [server].
    let toml = config(
        "127.0.0.1:0",
        "127.0.0.1:0",
        memory,
        &up,
        Some("rotated-token"),
    );
    match gw.reload(&toml).unwrap() {
        tollgate::server::ReloadOutcome::Applied { warnings, .. } => {
            assert!(
                warnings.iter().all(|w| !w.contains("[server]")),
                "{warnings:?}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        reset(&admin, "/callers/acme/reset", Some(TOKEN))
            .await
            .status,
        401
    );
    assert_eq!(
        reset(&admin, "/callers/acme/reset", Some("rotated-token"))
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn a_bad_token_hash_is_a_config_error() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let toml = config(
        "127.0.0.1:0",
        "127.0.0.1:0",
        "[store]\nbackend = \"memory\"",
        &up,
        None,
    )
    .replace(
        "admin_listen",
        "admin_token_sha256 = \"not-hex\"\nadmin_listen",
    );
    std::fs::write(&path, toml).unwrap();
    let (code, _, err) = check(&path);
    assert_eq!(code, 1);
    assert!(
        err.contains(":4:") && err.contains("server.admin_token_sha256: must be 64 hex"),
        "{err}"
    );
}

#[tokio::test]
async fn each_reset_is_logged_with_who_asked() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let listen = format!("127.0.0.1:{port}");
    let admin = format!("127.0.0.1:{admin_port}");
    let path = dir.path().join("tollgate.toml");
    std::fs::write(
        &path,
        config(
            &listen,
            &admin,
            "[store]\nbackend = \"memory\"",
            &up,
            Some(TOKEN),
        ),
    )
    .unwrap();
    let bin = Binary::spawn(&path, port, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&admin).is_err() {
        assert!(Instant::now() < deadline, "admin listener did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = reset(&admin, "/callers/acme/reset?limit=core", Some(TOKEN)).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        reset(&admin, "/callers/acme/reset", Some("wrong"))
            .await
            .status,
        401
    );
    let fingerprint = &sha256_hex(TOKEN)[..8];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let logs = bin.logs();
        let line = logs.lines().find(|l| l.contains("caller reset"));
        let refused = logs.lines().find(|l| l.contains("admin write refused"));
        if let (Some(line), Some(refused)) = (line, refused) {
            assert!(line.contains("INFO"), "{line}");
            assert!(line.contains(&format!("token={fingerprint}")), "{line}");
            assert!(line.contains("peer=127.0.0.1:"), "{line}");
            assert!(line.contains("caller=acme"), "{line}");
            assert!(line.contains("[\"core\"]"), "{line}");
            assert!(!logs.contains(TOKEN), "the raw token is never logged");
            assert!(refused.contains("401"), "{refused}");
            break;
        }
        assert!(Instant::now() < deadline, "no log lines:\n{logs}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A caller id (or limit name) with a control or format character
/// (Unicode Cc, Cf: a bidi override U+202E, a zero-width space, a BOM) gets 400 with a
/// JSON message, with or without a good token, and nothing of it is logged.
#[tokio::test]
async fn reset_refuses_control_and_format_characters_and_logs_nothing_of_them() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let listen = format!("127.0.0.1:{port}");
    let admin = format!("127.0.0.1:{admin_port}");
    let path = dir.path().join("tollgate.toml");
    std::fs::write(
        &path,
        config(
            &listen,
            &admin,
            "[store]\nbackend = \"memory\"",
            &up,
            Some(TOKEN),
        ),
    )
    .unwrap();
    let bin = Binary::spawn(&path, port, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&admin).is_err() {
        assert!(Instant::now() < deadline, "admin listener did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // U+202E RIGHT-TO-LEFT OVERRIDE, U+200B ZERO WIDTH SPACE, U+FEFF, U+2066, U+0085.
    for id in [
        "acme%E2%80%AEtxt.exe",
        "ac%E2%80%8Bme",
        "%EF%BB%BFacme",
        "a%E2%81%A6b",
        "a%C2%85b",
    ] {
        for token in [Some(TOKEN), None, Some("wrong")] {
            let r = reset(&admin, &format!("/callers/{id}/reset"), token).await;
            assert_eq!(r.status, 400, "{id} {token:?}: {}", r.text());
            assert_eq!(r.header("content-type"), "application/json");
            assert!(
                r.json()["message"]
                    .as_str()
                    .unwrap()
                    .contains("control or format characters"),
                "{}",
                r.text()
            );
        }
    }
    let r = reset(
        &admin,
        "/callers/acme/reset?limit=core%E2%80%AE",
        Some(TOKEN),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    // A good id is still reset, and logged; the refused ones are not.
    let r = reset(&admin, "/callers/caf%C3%A9/reset", Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !bin.logs().contains("caller reset") {
        assert!(Instant::now() < deadline, "{}", bin.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = bin.logs();
    for c in ['\u{202e}', '\u{200b}', '\u{feff}', '\u{2066}', '\u{85}'] {
        assert!(!logs.contains(c), "{c:?} logged:\n{logs}");
    }
    assert!(!logs.contains("txt.exe"), "{logs}");
    assert!(!logs.contains("admin write refused"), "{logs}");
}

/// `GET /config` shows no query value and no user info of any URL
/// (a token in `identity.auth_request.url`'s query, a token as the URL's user), and
/// still shows where the URL goes.
#[tokio::test]
async fn get_config_redacts_every_query_value_and_user_info_of_urls() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let listen = format!("127.0.0.1:{port}");
    let admin = format!("127.0.0.1:{admin_port}");
    let path = dir.path().join("tollgate.toml");
    let toml = config(&listen, &admin, "", &up, None).replace(
        "[[upstreams]]",
        "[identity.auth_request]\nurl = \"http://userinfo-token@127.0.0.1:9/auth?token=s3cret-query-token&v=2\"\n\n[[upstreams]]",
    );
    std::fs::write(&path, toml).unwrap();
    let _bin = Binary::spawn(&path, port, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&admin).is_err() {
        assert!(Instant::now() < deadline, "admin listener did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = get(&format!("http://{admin}/config")).await;
    assert_eq!(r.status, 200);
    let text = r.text();
    for secret in ["s3cret-query-token", "userinfo-token", "v=2"] {
        assert!(!text.contains(secret), "{secret} in {text}");
    }
    assert_eq!(
        r.json()["config"]["identity"]["auth_request"]["url"],
        "http://<redacted>@127.0.0.1:9/auth?token=<redacted>&v=<redacted>"
    );
}
