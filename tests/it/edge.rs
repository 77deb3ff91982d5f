//! What crosses the edge, against the real gateway and
//! a raw recording upstream that logs the exact bytes it receives:
//!
//! - upgrades pass only from the route's allow-list (`routes.upgrades`): no `h2c`
//!   tunnel past the limiter, no `Upgrade: foo/1`, no `HTTP2-Settings`;
//! - headers tollgate reads, sets or strips cannot be spoofed in another spelling
//!   (`X_Consumer_Id`), underscores are dropped unless `server.underscores_in_headers`,
//!   and a client's `Forwarded`, `X-Real-IP` and rate-limit headers do not cross;
//! - routing sees the path a servlet container or IIS would serve (`;params`, trailing
//!   dots), and method / URL overrides are stripped unless a route trusts them;
//! - a transfer coding tollgate does not implement gets 501, and `OPTIONS *` stays
//!   asterisk-form.

use crate::support;
use crate::support::raw::*;
use crate::support::{sha256_hex, TestGateway};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

// ---------------------------------------------------------------- upgrades

fn upgrade_config(rec: &Recorder) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "search"
window = "1h"
quota = {{ anonymous = 1 }}

[[routes]]
path_prefix = "/search"
upstream = "api"
limits = ["search"]

[[routes]]
path_prefix = "/plain"
upstream = "api"
upgrades = []

[[routes]]
path_prefix = "/"
upstream = "api"
"#,
        up = rec.url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_upgrade_is_a_plain_request_and_opens_no_tunnel_past_the_limit() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&upgrade_config(&rec)).await;
    let smuggle = b"GET /search HTTP/1.1\r\nhost: a\r\nupgrade: h2c\r\nconnection: Upgrade, HTTP2-Settings\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n\r\n";
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let first = exchange(&mut s, smuggle).await;
    assert_eq!(
        first.status, 200,
        "a plain request, never 101: {}",
        first.head
    );
    assert_eq!(first.body, "ok");
    assert_eq!(first.header("x-ratelimit-used").as_deref(), Some("1"));
    // The client now speaks HTTP/2 as if the tunnel were open: the gateway reads it as
    // HTTP/1.1 (and refuses it), it never reaches the upstream.
    let _ = s
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await;
    // The next request on the limited route is refused.
    let second = ask(&gw, b"GET /search HTTP/1.1\r\nhost: a\r\n\r\n").await;
    assert_eq!(second.status, 429, "{}", second.head);
    assert_eq!(rec.requests(), 1);
    let seen = rec.text().to_lowercase();
    assert!(seen.starts_with("get /search http/1.1\r\n"), "{seen}");
    for never in ["upgrade", "http2-settings", "h2c", "pri *", "aamaaabk"] {
        assert!(
            !seen.contains(never),
            "{never:?} reached the upstream: {seen}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_off_the_allow_list_are_plain_requests() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&upgrade_config(&rec)).await;
    for (what, req) in [
        (
            "foo/1",
            "GET /x HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: foo/1\r\n\r\n",
        ),
        (
            "h2c among others",
            "GET /x HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: h2c, foo\r\n\r\n",
        ),
        (
            "websocket on a route with upgrades = []",
            "GET /plain HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n",
        ),
        (
            "HTTP2-Settings without an Upgrade",
            "GET /x HTTP/1.1\r\nhost: a\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n\r\n",
        ),
    ] {
        rec.clear();
        let before = rec.requests();
        let a = ask(&gw, req.as_bytes()).await;
        assert_eq!(a.status, 200, "{what}: {}", a.head);
        requests_reach(&rec, before + 1).await;
        let seen = rec.text().to_lowercase();
        for never in ["upgrade", "http2-settings", "foo"] {
            assert!(!seen.contains(never), "{what}: {never:?} crossed: {seen}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_upgrade_needs_the_rfc_6455_handshake() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&upgrade_config(&rec)).await;
    let key = "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n";
    for (what, req) in [
        (
            "no key",
            "GET /ws HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\n\r\n".to_string(),
        ),
        (
            "a key that is not 16 bytes",
            "GET /ws HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\nsec-websocket-key: c2hvcnQ=\r\nsec-websocket-version: 13\r\n\r\n".to_string(),
        ),
        (
            "version 8",
            format!("GET /ws HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\n{key}sec-websocket-version: 8\r\n\r\n"),
        ),
        (
            "POST",
            format!("POST /ws HTTP/1.1\r\nhost: a\r\ncontent-length: 0\r\nconnection: upgrade\r\nupgrade: websocket\r\n{key}sec-websocket-version: 13\r\n\r\n"),
        ),
    ] {
        let a = ask(&gw, req.as_bytes()).await;
        assert_eq!(a.status, 400, "{what}: {}", a.head);
        assert!(a.body.contains("\"message\""), "{what}: a JSON body: {}", a.body);
    }
    assert_eq!(rec.requests(), 0, "none of them was forwarded");
    // The complete handshake passes, and the tunnel opens.
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let a = exchange(
        &mut s,
        format!("GET /ws HTTP/1.1\r\nhost: a\r\nconnection: Upgrade\r\nupgrade: websocket\r\n{key}sec-websocket-version: 13\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(a.status, 101, "{}", a.head);
    assert_eq!(a.header("upgrade").as_deref(), Some("websocket"));
    s.write_all(b"through the tunnel").await.unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !rec.text().contains("through the tunnel") && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seen = rec.text().to_lowercase();
    assert!(seen.contains("upgrade: websocket"), "{seen}");
    assert!(seen.contains("through the tunnel"), "{seen}");
}

// ------------------------------------------------- spoofed identity headers

fn identity_config(rec: &Recorder, server: &str, identity: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
{server}

[identity]
forward_caller_header = "x-consumer-id"
forward_tier_header = "x-consumer-tier"
{identity}

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
quota = {{ anonymous = 100, silver = 100 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        up = rec.url(),
        bob = sha256_hex("bob-key"),
    )
}

/// One request with `headers` (raw lines); what the upstream received (lowercase).
async fn crossed(gw: &TestGateway, rec: &Recorder, headers: &str) -> String {
    rec.clear();
    let before = rec.requests();
    let a = ask(
        gw,
        format!("GET /who HTTP/1.1\r\nhost: a\r\n{headers}\r\n").as_bytes(),
    )
    .await;
    assert_eq!(a.status, 200, "{}: {}", a.head, a.body);
    requests_reach(rec, before + 1).await;
    rec.text().to_lowercase()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_headers_cannot_be_spoofed_with_underscores() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&identity_config(&rec, "", "")).await;
    // Anonymous: the spoofed spellings never cross, nor does any underscore header.
    let seen = crossed(
        &gw,
        &rec,
        "X_Consumer_Id: alice\r\nX_Consumer_Tier: gold\r\nx-consumer-id: mallory\r\nX_Custom: 1\r\n",
    )
    .await;
    assert!(!seen.contains("alice"), "{seen}");
    assert!(!seen.contains("gold"), "{seen}");
    assert!(!seen.contains("mallory"), "{seen}");
    assert!(!seen.contains("x_custom"), "{seen}");
    // Bob's key: the upstream hears bob only, never "alice,bob".
    let seen = crossed(
        &gw,
        &rec,
        "authorization: Bearer bob-key\r\nX_Consumer_Id: alice\r\nx_consumer_tier: gold\r\n",
    )
    .await;
    assert!(seen.contains("\r\nx-consumer-id: bob\r\n"), "{seen}");
    assert!(seen.contains("\r\nx-consumer-tier: silver\r\n"), "{seen}");
    assert!(!seen.contains("alice") && !seen.contains("gold"), "{seen}");

    // underscores_in_headers = true: other underscore headers cross, the spoofing
    // spellings of what tollgate sets or strips still never do.
    let gw = TestGateway::start(&identity_config(&rec, "underscores_in_headers = true", "")).await;
    let seen = crossed(
        &gw,
        &rec,
        "X_Custom: 1\r\nX_Consumer_Id: alice\r\nx_forwarded_for: 6.6.6.6\r\nX_RateLimit_Remaining: 9\r\nx_real_ip: 6.6.6.6\r\nX_HTTP_Method_Override: DELETE\r\nhttp2_settings: AAMAAABkAAQAAP__\r\n",
    )
    .await;
    assert!(seen.contains("\r\nx_custom: 1\r\n"), "{seen}");
    for never in [
        "alice",
        "6.6.6.6",
        "x_ratelimit",
        "delete",
        "aamaaabk",
        "x_consumer",
    ] {
        assert!(!seen.contains(never), "{never:?} crossed: {seen}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_real_ip_and_rate_limit_headers_do_not_cross_from_an_untrusted_peer() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&identity_config(&rec, "", "")).await;
    let seen = crossed(
        &gw,
        &rec,
        "Forwarded: for=6.6.6.6;proto=https\r\nX-Real-IP: 6.6.6.6\r\nX-RateLimit-Remaining: 999\r\nX-RateLimit-Limit: 999\r\nRateLimit: \"core\";r=999;t=1\r\nRateLimit-Policy: \"core\";q=999;w=1\r\n",
    )
    .await;
    for never in ["6.6.6.6", "forwarded:", "x-ratelimit", "ratelimit", "999"] {
        assert!(!seen.contains(never), "{never:?} crossed: {seen}");
    }
    // X-Real-IP is the client IP the limiter used.
    assert!(seen.contains("\r\nx-real-ip: 127.0.0.1\r\n"), "{seen}");

    // From a trusted proxy, Forwarded is kept, and X-Real-IP is the client its
    // X-Forwarded-For names (what the limiter used), not what it wrote in X-Real-IP.
    let gw = TestGateway::start(&identity_config(
        &rec,
        "",
        "trusted_proxies = [\"127.0.0.1\"]",
    ))
    .await;
    let seen = crossed(
        &gw,
        &rec,
        "Forwarded: for=203.0.113.7\r\nX-Forwarded-For: 203.0.113.7\r\nX-Real-IP: 6.6.6.6\r\nX-RateLimit-Remaining: 999\r\n",
    )
    .await;
    assert!(
        seen.contains("\r\nforwarded: for=203.0.113.7\r\n"),
        "{seen}"
    );
    assert!(seen.contains("\r\nx-real-ip: 203.0.113.7\r\n"), "{seen}");
    assert!(
        !seen.contains("6.6.6.6") && !seen.contains("x-ratelimit"),
        "{seen}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_header_with_an_underscore_needs_underscores_in_headers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.toml");
    std::fs::write(
        &path,
        "[identity]\napi_key_header = \"x_api_key\"\n[[upstreams]]\nname = \"a\"\ntargets = [\"http://127.0.0.1:9\"]\n[[routes]]\npath_prefix = \"/\"\nupstream = \"a\"\n",
    )
    .unwrap();
    let (code, _, err) = support::check(&path);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("identity.api_key_header") && err.contains("underscores_in_headers"),
        "{err}"
    );
}

// ------------------------------------------------- path and method overrides

fn routing_config(rec: &Recorder, trust: bool) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "admin"
window = "1h"
quota = {{ anonymous = 100 }}

[[limits]]
name = "deletes"
window = "1h"
quota = {{ anonymous = 1 }}

[[limits]]
name = "other"
window = "1h"
quota = {{ anonymous = 100 }}

[[routes]]
path_prefix = "/admin"
path_match = "segments"
upstream = "api"
limits = ["admin"]
trust_method_override = {trust}

[[routes]]
path_prefix = "/items"
methods = ["DELETE"]
upstream = "api"
limits = ["deletes"]
trust_method_override = {trust}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["other"]
"#,
        up = rec.url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_parameters_and_trailing_dots_route_like_the_upstream_serves_them() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&routing_config(&rec, false)).await;
    for path in [
        "/admin;x/users",
        "/admin;jsessionid=1/users",
        "/admin./users",
        "/admin.../users",
        "/public/..;/admin/users",
        "/admin;/users",
    ] {
        rec.clear();
        let before = rec.requests();
        let a = ask(
            &gw,
            format!("GET {path} HTTP/1.1\r\nhost: a\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(a.status, 200, "{path}: {}", a.head);
        assert_eq!(
            a.header("x-ratelimit-resource").as_deref(),
            Some("admin"),
            "{path} is limited by the /admin route"
        );
        requests_reach(&rec, before + 1).await;
        let seen = rec.text();
        assert!(
            seen.starts_with(&format!("GET {path} HTTP/1.1\r\n")),
            "{path}: the upstream gets the path unchanged: {seen}"
        );
    }
    // Not every dot or semicolon is the admin route.
    let a = ask(&gw, b"GET /administrator;x HTTP/1.1\r\nhost: a\r\n\r\n").await;
    assert_eq!(a.header("x-ratelimit-resource").as_deref(), Some("other"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_and_url_overrides_are_stripped_unless_the_route_trusts_them() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&routing_config(&rec, false)).await;
    for override_header in [
        "X-HTTP-Method-Override: DELETE",
        "X-Method-Override: DELETE",
        "X-HTTP-Method: DELETE",
        "X-Original-URL: /admin/users",
        "X-Rewrite-URL: /admin/users",
    ] {
        rec.clear();
        let before = rec.requests();
        let a = ask(
            &gw,
            format!(
                "POST /items HTTP/1.1\r\nhost: a\r\ncontent-length: 0\r\n{override_header}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
        assert_eq!(a.status, 200, "{override_header}: {}", a.head);
        assert_eq!(
            a.header("x-ratelimit-resource").as_deref(),
            Some("other"),
            "{override_header}: routed and limited as the POST it is"
        );
        requests_reach(&rec, before + 1).await;
        let seen = rec.text().to_lowercase();
        assert!(seen.starts_with("post /items http/1.1\r\n"), "{seen}");
        for never in [
            "override",
            "x-http-method",
            "x-original-url",
            "x-rewrite-url",
            "/admin",
        ] {
            assert!(
                !seen.contains(never),
                "{override_header}: {never:?} crossed: {seen}"
            );
        }
    }

    // With the opt-in, a POST overridden to DELETE is routed and limited as a DELETE,
    // and the upstream gets the override it will act on.
    let gw = TestGateway::start(&routing_config(&rec, true)).await;
    rec.clear();
    let over = b"POST /items HTTP/1.1\r\nhost: a\r\ncontent-length: 0\r\nX-HTTP-Method-Override: DELETE\r\n\r\n";
    let a = ask(&gw, over).await;
    assert_eq!(a.status, 200, "{}", a.head);
    assert_eq!(a.header("x-ratelimit-resource").as_deref(), Some("deletes"));
    assert!(
        rec.text()
            .to_lowercase()
            .contains("\r\nx-http-method-override: delete\r\n"),
        "{}",
        rec.text()
    );
    let a = ask(&gw, over).await;
    assert_eq!(a.status, 429, "the DELETE quota of 1 is spent: {}", a.head);
    // An X-Original-URL is believed only where the route it names trusts it: here
    // /admin does, so the request is limited by /admin.
    let a = ask(
        &gw,
        b"GET /public HTTP/1.1\r\nhost: a\r\nX-Original-URL: /admin/users\r\n\r\n",
    )
    .await;
    assert_eq!(a.header("x-ratelimit-resource").as_deref(), Some("admin"));
    // Overrides that disagree are never believed.
    rec.clear();
    let a = ask(
        &gw,
        b"POST /items HTTP/1.1\r\nhost: a\r\ncontent-length: 0\r\nX-HTTP-Method-Override: DELETE\r\nX-Method-Override: PUT\r\n\r\n",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.head);
    assert_eq!(a.header("x-ratelimit-resource").as_deref(), Some("other"));
    assert!(
        !rec.text().to_lowercase().contains("override"),
        "{}",
        rec.text()
    );
}

// ------------------------------------------ transfer codings, OPTIONS *

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_coding_besides_chunked_gets_501_and_is_never_forwarded() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&upgrade_config(&rec)).await;
    for te in ["gzip, chunked", "deflate,chunked", "x-custom, chunked"] {
        let a = ask(
            &gw,
            format!("POST /x HTTP/1.1\r\nhost: a\r\ntransfer-encoding: {te}\r\n\r\n5\r\nhello\r\n0\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(a.status, 501, "{te}: {}", a.head);
        assert!(a.body.contains("\"message\""), "{te}: {}", a.body);
    }
    // Two header lines: the same.
    let a = ask(
        &gw,
        b"POST /x HTTP/1.1\r\nhost: a\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(a.status, 501, "{}", a.head);
    assert_eq!(rec.requests(), 0, "nothing was forwarded");
    // Plain chunked still crosses.
    let a = ask(
        &gw,
        b"POST /x HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.head);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_asterisk_is_forwarded_in_asterisk_form() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&upgrade_config(&rec)).await;
    let a = ask(&gw, b"OPTIONS * HTTP/1.1\r\nhost: a\r\n\r\n").await;
    assert_eq!(a.status, 200, "{}", a.head);
    requests_reach(&rec, 1).await;
    let seen = rec.text();
    assert!(seen.starts_with("OPTIONS * HTTP/1.1\r\n"), "{seen}");
}
