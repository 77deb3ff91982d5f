//! `GET /top` on the admin listener and `tollgate top`: who is being limited now.

use crate::support::*;

fn config(up: &Upstream) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"

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
quota = {{ anonymous = 2, gold = 3 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
cost = 2
"#,
        acme = sha256_hex("acme-key"),
        bob = sha256_hex("bob-key"),
        up = up.url(),
    )
}

/// `tollgate top --once` against the admin listener `admin`: its table (run off this
/// thread: the gateway answers on it).
async fn top_once(admin: std::net::SocketAddr) -> String {
    let out = tokio::task::spawn_blocking(move || {
        tollgate()
            .args(["top", "--once", "--admin", &admin.to_string()])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn top_names_the_callers_being_refused_and_using_the_most() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(&up)).await;
    let auth = |k: &str| format!("Bearer {k}");
    // acme: 1 admitted (2 units), then 5 refusals; bob: 1 admitted; an anonymous caller:
    // 1 admitted, 1 refused.
    for _ in 0..6 {
        get_with(&gw.url("/x"), &[("authorization", &auth("acme-key"))]).await;
    }
    get_with(&gw.url("/x"), &[("authorization", &auth("bob-key"))]).await;
    assert_eq!(get(&gw.url("/x")).await.status, 200);
    assert_eq!(get(&gw.url("/x")).await.status, 429);

    let admin = gw.gateway.admin_addr().unwrap();
    let v = get(&format!("http://{admin}/top")).await.json();
    let core = &v["limits"][0];
    assert_eq!(core["name"], "core");
    assert_eq!(core["refused"][0]["caller"], "acme");
    assert_eq!(core["refused"][0]["tier"], "gold");
    assert_eq!(core["refused"][0]["count"], 5);
    let anonymous = &core["refused"][1];
    assert_eq!(anonymous["tier"], "anonymous");
    assert_eq!(anonymous["count"], 1);
    let hash = anonymous["caller"].as_str().unwrap();
    assert!(
        hash.len() == 32 && hash.chars().all(|c| c.is_ascii_hexdigit()),
        "{hash}"
    );
    let used: Vec<(String, u64)> = core["used"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["caller"].as_str().unwrap().to_string(),
                h["count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(used.contains(&("acme".into(), 2)), "{used:?}");
    assert!(used.contains(&("bob".into(), 2)), "{used:?}");
    assert!(used.contains(&(hash.to_string(), 2)), "{used:?}");

    // The terminal view, once.
    let text = top_once(admin).await;
    let first = text.lines().nth(1).unwrap();
    assert!(
        first.starts_with("core") && first.contains("acme") && first.contains("gold"),
        "{text}"
    );
}

#[tokio::test]
async fn top_shows_what_remains_of_each_callers_window() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(&up)).await;
    let auth = |k: &str| format!("Bearer {k}");
    // acme: 1 admitted (2 of 3 units), then refused; an anonymous caller: 1 admitted
    // (2 of 2).
    for _ in 0..3 {
        get_with(&gw.url("/x"), &[("authorization", &auth("acme-key"))]).await;
    }
    assert_eq!(get(&gw.url("/x")).await.status, 200);
    let admin = gw.gateway.admin_addr().unwrap();
    let v = get(&format!("http://{admin}/top")).await.json();
    let core = &v["limits"][0];
    let acme = &core["refused"][0];
    assert_eq!(acme["caller"], "acme");
    assert_eq!(
        (acme["quota"].as_u64(), acme["remaining"].as_u64()),
        (Some(3), Some(1))
    );
    let anonymous = core["used"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["tier"] == "anonymous")
        .unwrap();
    assert_eq!(
        (anonymous["quota"].as_u64(), anonymous["remaining"].as_u64()),
        (Some(2), Some(0))
    );

    let text = top_once(admin).await;
    assert!(
        text.lines().next().unwrap().ends_with("REMAINING"),
        "{text}"
    );
    let acme = text.lines().find(|l| l.contains("acme")).unwrap();
    assert!(acme.trim_end().ends_with(" 1"), "{text}");
}

/// `used`, `remaining` and `reset` are the caller's current window in the store (with
/// Redis, every gateway's requests), and rank the `used` list; `count` is this
/// gateway's own admitted units of the last minutes.
#[tokio::test]
async fn used_is_each_callers_current_window_across_the_fleet() {
    let redis = RedisServer::start();
    let store = store_toml(Backend::Redis, &[&redis], "deny", "500ms");
    let up = Upstream::start().await;
    let toml = config(&up).replace("gold = 3", "gold = 10").replacen(
        "[[identity.clients]]",
        &format!("{store}\n\n[[identity.clients]]"),
        1,
    );
    let (a, b) = (
        TestGateway::start(&toml).await,
        TestGateway::start(&toml).await,
    );
    let auth = |k: &str| [("authorization", format!("Bearer {k}"))];
    let call = |gw: &TestGateway, key: &str| {
        let url = gw.url("/x");
        let headers = auth(key);
        async move {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            get_with(&url, &headers).await
        }
    };
    // acme: 3 requests (6 units) through A, 1 (2 units) through B; bob: 2 (4 units)
    // through B. B saw more of bob than of acme, but acme's window holds more.
    for _ in 0..3 {
        assert_eq!(call(&a, "acme-key").await.status, 200);
    }
    let last = call(&b, "acme-key").await;
    assert_eq!(last.status, 200);
    for _ in 0..2 {
        assert_eq!(call(&b, "bob-key").await.status, 200);
    }

    let admin = b.gateway.admin_addr().unwrap();
    let v = get(&format!("http://{admin}/top")).await.json();
    let used = v["limits"][0]["used"].as_array().unwrap();
    let row = |h: &serde_json::Value| {
        (
            h["caller"].as_str().unwrap().to_string(),
            h["count"].as_u64().unwrap(),
            h["used"].as_u64(),
            h["remaining"].as_u64(),
        )
    };
    let rows: Vec<_> = used.iter().map(row).collect();
    assert_eq!(
        rows,
        [
            ("acme".to_string(), 2, Some(8), Some(2)),
            ("bob".to_string(), 4, Some(4), Some(6)),
        ],
        "{v}"
    );
    assert_eq!(
        used[0]["reset"].as_u64(),
        Some(last.num("x-ratelimit-reset")),
        "{v}"
    );

    // The terminal view's USED is the window's.
    let text = top_once(admin).await;
    let acme = text.lines().find(|l| l.contains("acme")).unwrap();
    let cols: Vec<&str> = acme.split_whitespace().collect();
    assert_eq!(cols[cols.len() - 2..], ["8", "2"], "{text}");
}
