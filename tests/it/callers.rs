//! `GET /callers/{id}` on the admin listener and `tollgate caller ID`: every limit that
//! applies to one caller, read from the store without charging (with Redis, the fleet's
//! count), with the reset endpoint's id forms and token rules.

use crate::support::client::Reply;
use crate::support::redis::free_port;
use crate::support::*;
use http::Method;
use serde_json::Value;
use std::time::{Duration, Instant};
use tollgate::limiter::key::KeyScheme;

const TOKEN: &str = "admin-token-for-caller-reads";

/// acme (gold) and bob (silver); `core` (fixed window) for gold and anonymous,
/// `search` (sliding window) for gold only, `perip` by IP, `everyone` global,
/// `anononly` for anonymous callers and on no route, `bulk` in lease mode on `/bulk`.
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
tier = "silver"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ gold = 5, anonymous = 4 }}

[[limits]]
name = "search"
algorithm = "sliding_window"
window = "1h"
quota = {{ gold = 3 }}

[[limits]]
name = "perip"
by = "ip"
window = "1h"
quota = {{ gold = 100, anonymous = 10 }}

[[limits]]
name = "everyone"
by = "global"
window = "1h"
quota = {{ gold = 1000, anonymous = 1000 }}

[[limits]]
name = "anononly"
window = "1m"
quota = {{ anonymous = 7 }}

[[limits]]
name = "bulk"
window = "1h"
lease = 10
quota = {{ gold = 100 }}

[[routes]]
path_prefix = "/bulk"
upstream = "api"
limits = ["bulk"]

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core", "search", "perip", "everyone"]
"#,
        acme = sha256_hex("acme-key"),
        bob = sha256_hex("bob-key"),
        up = up.url(),
    )
}

async fn call(url: &str, key: &str) -> Reply {
    get_with(url, &[("authorization", &format!("Bearer {key}"))]).await
}

async fn read(admin: &str, id: &str, token: Option<&str>) -> Reply {
    read_with(Method::GET, admin, id, token).await
}

async fn read_with(method: Method, admin: &str, id: &str, token: Option<&str>) -> Reply {
    send_bearer(method, &format!("http://{admin}/callers/{id}"), token).await
}

/// The entry of the limit `name` in a `GET /callers/{id}` answer.
fn limit<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("no limit {name} in {v}"))
}

fn names(v: &Value) -> Vec<String> {
    v["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn reads_a_keyed_client_and_an_anonymous_caller_on_the_memory_store() {
    let up = Upstream::start().await;
    let memory = "[store]\nbackend = \"memory\"";
    let gw = TestGateway::start(&config(
        "127.0.0.1:0",
        "127.0.0.1:0",
        memory,
        &up,
        Some(TOKEN),
    ))
    .await;
    let (url, admin) = (gw.url("/x"), gw.admin());
    let mut last = None;
    for _ in 0..2 {
        let r = call(&url, "acme-key").await;
        assert_eq!(r.status, 200);
        last = Some(r);
    }
    let last = last.unwrap();
    for _ in 0..3 {
        assert_eq!(get(&url).await.status, 200);
    }

    // The keyed client of tier gold: every limit with a quota for gold, in config order.
    let r = read(&admin, "acme", Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), "application/json");
    let v = r.json();
    assert_eq!(v["caller"], "acme");
    assert_eq!(v["tier"], "gold");
    assert_eq!(v["anonymous"], false);
    assert_eq!(names(&v), ["core", "search", "perip", "everyone", "bulk"]);
    let core = limit(&v, "core");
    assert_eq!(core["algorithm"], "fixed_window");
    assert_eq!(core["by"], "caller");
    assert_eq!(core["quota"], 5);
    assert_eq!(core["used"], 2);
    assert_eq!(core["remaining"], 3);
    assert_eq!(core["window"], 3600);
    assert_eq!(core["leases"], 0);
    assert!(core["blocked_until"].is_null(), "{v}");
    // The last response described `search` (fewest remaining): the same reset.
    assert_eq!(last.header("x-ratelimit-resource"), "search");
    let search = limit(&v, "search");
    assert_eq!(search["algorithm"], "sliding_window");
    assert_eq!(
        (&search["used"], &search["remaining"]),
        (&2.into(), &1.into())
    );
    assert_eq!(search["reset"], last.num("x-ratelimit-reset"));
    // By IP: a client is counted per address, which its id does not tell.
    let perip = limit(&v, "perip");
    assert_eq!(perip["quota"], 100);
    assert!(perip["used"].is_null() && perip["remaining"].is_null() && perip["reset"].is_null());
    // Global: everyone's requests.
    assert_eq!(limit(&v, "everyone")["used"], 5);
    assert_eq!(limit(&v, "bulk")["used"], 0);
    assert_eq!(limit(&v, "bulk")["remaining"], 100);

    // Reading charges nothing: read again, then a request is the third.
    let again = read(&admin, "acme", Some(TOKEN)).await.json();
    assert_eq!(limit(&again, "core")["used"], 2);
    let r = call(&url, "acme-key").await;
    assert_eq!(r.num("x-ratelimit-used"), 3);

    // A client without any request yet, of a tier no limit has a quota for.
    let bob = read(&admin, "bob", Some(TOKEN)).await;
    assert_eq!(bob.status, 200, "{}", bob.text());
    assert_eq!(bob.json()["tier"], "silver");
    assert_eq!(names(&bob.json()), Vec::<String>::new());

    // The anonymous caller by its address, and by its keyed hash (as /top shows it).
    let hash = KeyScheme::new("tollgate:", None)
        .digest(b"ip:127.0.0.1")
        .hex()
        .to_string();
    for id in ["127.0.0.1", hash.as_str()] {
        let r = read(&admin, id, Some(TOKEN)).await;
        assert_eq!(r.status, 200, "{id}: {}", r.text());
        let v = r.json();
        assert_eq!(v["caller"], id);
        assert_eq!(v["tier"], "anonymous");
        assert_eq!(v["anonymous"], true);
        assert_eq!(names(&v), ["core", "perip", "everyone", "anononly"]);
        assert_eq!(limit(&v, "core")["quota"], 4);
        assert_eq!(limit(&v, "core")["used"], 3);
        assert_eq!(limit(&v, "core")["remaining"], 1);
        // By IP: acme's 3 requests came from the same address.
        assert_eq!(limit(&v, "perip")["used"], 6);
        assert_eq!(limit(&v, "perip")["by"], "ip");
        assert_eq!(limit(&v, "everyone")["used"], 6);
        // A limit on no route still has a quota for the tier: listed, unused.
        let a = limit(&v, "anononly");
        assert_eq!(
            (&a["used"], &a["remaining"], &a["window"]),
            (&0.into(), &7.into(), &60.into())
        );
    }
    // Another address: nothing used.
    let other = read(&admin, "192.0.2.7", Some(TOKEN)).await.json();
    assert_eq!(limit(&other, "core")["used"], 0);
    assert_eq!(limit(&other, "everyone")["used"], 6);
}

#[tokio::test]
async fn caller_reads_answer_errors_and_follow_the_reset_endpoints_token_rules() {
    let up = Upstream::start().await;
    let memory = "[store]\nbackend = \"memory\"";
    let gw = TestGateway::start(&config(
        "127.0.0.1:0",
        "127.0.0.1:0",
        memory,
        &up,
        Some(TOKEN),
    ))
    .await;
    let admin = gw.admin();

    // Unknown client: 404 with a JSON message.
    let r = read(&admin, "nobody", Some(TOKEN)).await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.header("content-type"), "application/json");
    assert!(
        r.json()["message"].as_str().unwrap().contains("nobody"),
        "{}",
        r.text()
    );
    // Malformed ids: 400, with or without the token.
    for id in ["acme%E2%80%AEtxt", "bad%2", "%ff"] {
        for token in [Some(TOKEN), None] {
            let r = read(&admin, id, token).await;
            assert_eq!(r.status, 400, "{id}: {}", r.text());
            assert!(r.json()["message"].is_string());
        }
    }
    // More than one segment: not this endpoint.
    assert_eq!(read(&admin, "acme/x", Some(TOKEN)).await.status, 404);
    // Other methods: 405 (`POST /callers/{id}/reset` is the write).
    let r = read_with(Method::POST, &admin, "acme", Some(TOKEN)).await;
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), "GET, HEAD");
    assert_eq!(
        read_with(Method::HEAD, &admin, "acme", Some(TOKEN))
            .await
            .status,
        200
    );
    let r = send(
        Method::GET,
        &format!("http://{admin}/callers/acme?limit=core"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());

    // Missing or wrong token: what the reset endpoint answers, status and body.
    let reset = |token: Option<&'static str>| {
        let admin = admin.clone();
        async move {
            let auth = token.map(|t| format!("Bearer {t}"));
            let headers: Vec<(&str, &str)> =
                auth.iter().map(|a| ("authorization", a.as_str())).collect();
            send(
                Method::POST,
                &format!("http://{admin}/callers/acme/reset"),
                &headers,
            )
            .await
        }
    };
    for token in [None, Some("wrong-token")] {
        let r = read(&admin, "acme", token).await;
        let w = reset(token).await;
        assert_eq!(r.status, 401, "{token:?}");
        assert_eq!(r.header("www-authenticate"), "Bearer");
        assert_eq!((r.status, r.json()), (w.status, w.json()));
    }

    // Without server.admin_token_sha256: 403, as for the reset.
    let off = TestGateway::start(&config("127.0.0.1:0", "127.0.0.1:0", memory, &up, None)).await;
    let off_admin = off.admin();
    let r = read(&off_admin, "acme", Some(TOKEN)).await;
    assert_eq!(r.status, 403);
    let w = send(
        Method::POST,
        &format!("http://{off_admin}/callers/acme/reset"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
    )
    .await;
    assert_eq!((r.status, r.json()), (w.status, w.json()));
}

/// Two gateways on one `redis-server`: what gateway 1 charged, gateway 2 reads; in lease
/// mode, the window counts the units gateway 1 leased, and only gateway 1 holds them.
/// With Redis down, a read is a 503.
#[tokio::test]
async fn a_caller_read_on_redis_shows_the_whole_fleets_count() {
    let mut redis = RedisServer::start();
    let store = store_toml(Backend::Redis, &[&redis], "deny", "500ms");
    let up = Upstream::start().await;
    let toml = config("127.0.0.1:0", "127.0.0.1:0", &store, &up, Some(TOKEN));
    let (one, two) = (
        TestGateway::start(&toml).await,
        TestGateway::start(&toml).await,
    );
    for _ in 0..3 {
        assert_eq!(call(&one.url("/x"), "acme-key").await.status, 200);
    }
    assert_eq!(get(&one.url("/x")).await.status, 200);
    let v = read(&two.admin(), "acme", Some(TOKEN)).await;
    assert_eq!(v.status, 200, "{}", v.text());
    let v = v.json();
    assert_eq!(limit(&v, "core")["used"], 3);
    assert_eq!(limit(&v, "core")["remaining"], 2);
    assert_eq!(limit(&v, "search")["used"], 3);
    assert_eq!(limit(&v, "search")["remaining"], 0);
    assert_eq!(limit(&v, "everyone")["used"], 4);
    let anon = read(&two.admin(), "127.0.0.1", Some(TOKEN)).await.json();
    assert_eq!(limit(&anon, "core")["used"], 1);
    // The same numbers on gateway 1.
    let v1 = read(&one.admin(), "acme", Some(TOKEN)).await.json();
    assert_eq!(limit(&v1, "core")["used"], 3);
    assert_eq!(limit(&v1, "core")["reset"], limit(&v, "core")["reset"]);

    // Lease mode: a request through gateway 1 leases 10 units; the store counts all 10,
    // gateway 1 holds the 9 not used. (An idle lease is given back after 1 s: try again
    // when that happened between two reads.)
    let mut served = 0u64;
    let mut seen = false;
    for _ in 0..5 {
        assert_eq!(call(&one.url("/bulk"), "acme-key").await.status, 200);
        served += 1;
        let a = read(&one.admin(), "acme", Some(TOKEN)).await.json();
        let b = read(&two.admin(), "acme", Some(TOKEN)).await.json();
        let (a, b) = (limit(&a, "bulk"), limit(&b, "bulk"));
        let (used, leased) = (a["used"].as_u64().unwrap(), a["leases"].as_u64().unwrap());
        if leased > 0 && used - leased == served && b["used"] == a["used"] {
            assert_eq!(b["leases"], 0);
            assert_eq!(used % 10, 0, "leased 10 at a time: {a}");
            seen = true;
            break;
        }
    }
    assert!(seen, "never saw gateway 1's lease");

    // The store down: 503 with the store's error, not an empty list.
    redis.kill();
    let r = read(&two.admin(), "acme", Some(TOKEN)).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(
        r.json()["message"].as_str().unwrap().starts_with("store: "),
        "{}",
        r.text()
    );
}

#[tokio::test]
async fn tollgate_caller_prints_the_caller() {
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
    let _bin = Binary::spawn(&path, port, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&admin).is_err() {
        assert!(Instant::now() < deadline, "admin listener did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..2 {
        assert_eq!(
            call(&format!("http://{listen}/x"), "acme-key").await.status,
            200
        );
    }
    let run = |args: &[&str], token: Option<&str>| {
        let mut c = tollgate();
        c.arg("caller").args(args).arg("--config").arg(&path);
        c.env_remove("TOLLGATE_ADMIN_TOKEN");
        if let Some(t) = token {
            c.env("TOLLGATE_ADMIN_TOKEN", t);
        }
        let out = c.output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    let (code, out, err) = run(&["acme"], Some(TOKEN));
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "caller acme (tier gold)", "{out}");
    assert!(lines[1].starts_with("LIMIT"), "{out}");
    let core: Vec<&str> = lines[2].split_whitespace().collect();
    // LIMIT ALGORITHM BY QUOTA USED REMAINING RESET WINDOW LEASES BLOCKED_UNTIL
    assert_eq!(
        core[..6],
        ["core", "fixed_window", "caller", "5", "2", "3"],
        "{out}"
    );
    let perip: Vec<&str> = lines[4].split_whitespace().collect();
    assert_eq!(
        perip[..6],
        ["perip", "fixed_window", "ip", "100", "-", "-"],
        "{out}"
    );

    let (code, out, err) = run(&["127.0.0.1", "--json"], Some(TOKEN));
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["anonymous"], true);
    assert_eq!(limit(&v, "core")["used"], 0);

    // A token from a file, and --admin instead of the config's address.
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let tf = token_file.to_str().unwrap();
    let (code, out, err) = run(&["acme", "--admin", &admin, "--token-file", tf], None);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("caller acme"), "{out}");

    // Errors: a clear message and exit 1.
    let (code, _, err) = run(&["nobody"], Some(TOKEN));
    assert_eq!(code, 1);
    assert!(err.contains("404") && err.contains("nobody"), "{err}");
    let (code, _, err) = run(&["acme"], None);
    assert_eq!(code, 1);
    assert!(err.contains("TOLLGATE_ADMIN_TOKEN"), "{err}");
    let (code, _, err) = run(&["acme"], Some("wrong"));
    assert_eq!(code, 1);
    assert!(
        err.contains("401") && err.contains("bad admin token"),
        "{err}"
    );
}
