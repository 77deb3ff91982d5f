//! `[[limits]].block_for` (issue 48, item 2): once a limit refuses a caller, every
//! request of that caller on that limit is refused until the block ends, whatever the
//! window says; the block is kept in the store with an absolute end, so every gateway
//! sharing it blocks, and `POST /callers/{id}/reset` lifts it. Against real gateways
//! (their clocks moved by the test), a real upstream and a real `redis-server`.

use crate::support::client::Reply;
use crate::support::*;
use http::Method;
use std::time::{Duration, Instant};
use tollgate::clock::Clock;

const TOKEN: &str = "admin-token-for-block-tests";

/// A gateway on `store` with an admin listener, the client acme (tier gold) and one
/// limit `core` on every route: 3 a window of 10 s for gold and anonymous callers, a
/// block of `block_for` after a refusal.
fn config(store: &str, up: &Upstream, block_for: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
admin_token_sha256 = "{token}"

{store}

[headers]
style = ["github", "ietf"]

[[identity.clients]]
id = "acme"
key_sha256 = "{acme}"
tier = "gold"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "10s"
quota = {{ gold = 3, anonymous = 3 }}
block_for = "{block_for}"

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        token = sha256_hex(TOKEN),
        acme = sha256_hex("acme-key"),
        up = up.url(),
    )
}

async fn admin(method: Method, gw: &TestGateway, path: &str) -> Reply {
    send_bearer(method, &format!("http://{}{path}", gw.admin()), Some(TOKEN)).await
}

async fn as_acme(gw: &TestGateway) -> Reply {
    get_with(&gw.url("/x"), &[("authorization", "Bearer acme-key")]).await
}

/// `tollgate_blocked_total{limit="core"}` on `gw` (0 when the row is absent).
fn blocks_started(gw: &TestGateway) -> u64 {
    let text = gw.gateway.metrics().render();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(r#"tollgate_blocked_total{limit="core"}"#)?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// The `t` of the `RateLimit` field: seconds until more quota.
fn ietf_t(r: &Reply) -> u64 {
    let field = r.header("ratelimit");
    field
        .split(';')
        .find_map(|p| p.trim().strip_prefix("t=")?.parse().ok())
        .unwrap_or_else(|| panic!("no t in RateLimit: {field:?}"))
}

/// A refusal by the block ending at `until_s` (epoch seconds), `left_s` seconds from
/// now (give or take one for rounding): every place a caller reads it.
fn assert_blocked(r: &Reply, until_s: u64, left_s: u64, what: &str) {
    assert_eq!(r.status, 429, "{what}: {}", r.text());
    assert_eq!(
        r.num("x-ratelimit-reset"),
        until_s,
        "{what}: X-RateLimit-Reset"
    );
    assert_eq!(r.num("x-ratelimit-remaining"), 0, "{what}");
    let retry = r.num("retry-after");
    assert!(
        retry <= left_s && retry + 1 >= left_s,
        "{what}: Retry-After {retry}, expected about {left_s}"
    );
    let t = ietf_t(r);
    assert!(t <= left_s && t + 1 >= left_s, "{what}: RateLimit t={t}");
    let body = r.json();
    assert_eq!(body["reset"], until_s, "{what}: body {body}");
    assert_eq!(body["retry_after"], retry, "{what}: body {body}");
}

/// Memory store: quota 3 a 10 s window, blocked for 30 s after the refusal. Past the
/// window's reset the caller is still refused, with the block's end; after the block it
/// is admitted in a fresh window. One block counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_blocks_the_caller_past_the_window_on_the_memory_store() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config("", &up, "30s")).await;
    for i in 1..=3 {
        assert_eq!(get(&gw.url("/x")).await.status, 200, "request {i}");
    }
    let before = gw.clock.now_ms();
    let refused = get(&gw.url("/x")).await;
    let after = gw.clock.now_ms();
    let until_s = refused.num("x-ratelimit-reset");
    assert!(
        ((before + 30_000).div_ceil(1000)..=(after + 30_000).div_ceil(1000)).contains(&until_s),
        "the block ends 30 s after the refusal, not at the window's end: {until_s}"
    );
    assert_blocked(&refused, until_s, 30, "the refusal");
    assert_eq!(blocks_started(&gw), 1, "the refusal started one block");

    // The caller read shows the block (the admin listener reads the system clock, which
    // the test has not moved yet).
    let read = admin(Method::GET, &gw, "/callers/127.0.0.1").await;
    assert_eq!(read.status, 200, "{}", read.text());
    let core = &read.json()["limits"][0];
    assert_eq!(core["blocked_until"], until_s, "{core}");
    assert_eq!(core["reset"], until_s, "{core}");

    // The window has reset (11 s later): the window alone would admit, the block refuses.
    gw.clock.advance(Duration::from_secs(11));
    let r = get(&gw.url("/x")).await;
    assert_blocked(&r, until_s, 19, "11 s later, the window reset");
    let r = get(&gw.url("/x")).await;
    assert_blocked(&r, until_s, 19, "again");
    assert_eq!(
        blocks_started(&gw),
        1,
        "a refusal during the block starts none"
    );

    // The block is over: admitted, in a new window.
    gw.clock.advance(Duration::from_secs(20));
    let r = get(&gw.url("/x")).await;
    assert_eq!(r.status, 200, "after the block: {}", r.text());
    assert_eq!(r.num("x-ratelimit-used"), 1);
    assert_eq!(blocks_started(&gw), 1);
}

/// Redis, two gateways: a caller refused on one is refused on the other at once, with
/// the same reset, and still after the window has reset; the key in Redis holds the
/// block's end; a reset on the admin listener lifts it on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_started_on_one_gateway_holds_on_the_other_until_reset() {
    let redis = RedisServer::start();
    let store = store_toml(Backend::Redis, &[&redis], "deny", "500ms");
    let up = Upstream::start().await;
    let toml = config(&store, &up, "1m");
    let (a, b) = (
        TestGateway::start(&toml).await,
        TestGateway::start(&toml).await,
    );
    for i in 1..=3 {
        assert_eq!(as_acme(&a).await.status, 200, "request {i} on A");
    }
    let refused = as_acme(&a).await;
    let until_s = refused.num("x-ratelimit-reset");
    assert_blocked(&refused, until_s, 60, "A's refusal");
    assert_eq!(blocks_started(&a), 1);

    // The block is in the limit's own key, as an absolute end in epoch milliseconds,
    // and the key lives at least as long.
    let key = client_key("core", "acme");
    let until_ms: u64 = redis
        .cmd::<Option<u64>>(&["HGET", &key, "block"])
        .expect("the block's end in the window's hash");
    assert_eq!(until_ms.div_ceil(1000), until_s);
    let pttl: i64 = redis.cmd(&["PTTL", &key]);
    assert!(pttl > 55_000, "the key outlives the block: PTTL {pttl}");

    // B has never seen acme: refused at once, with A's block.
    let r = as_acme(&b).await;
    assert_blocked(&r, until_s, 60, "B at once");
    // The window has reset (both gateways 11 s later): the block still refuses on B.
    a.clock.advance(Duration::from_secs(11));
    b.clock.advance(Duration::from_secs(11));
    let r = as_acme(&b).await;
    assert_blocked(&r, until_s, 49, "B after the window's reset");
    assert_eq!(blocks_started(&b), 0, "B saw A's block, it started none");
    assert_eq!(blocks_started(&a), 1);
    let read = admin(Method::GET, &b, "/callers/acme").await;
    assert_eq!(read.json()["limits"][0]["blocked_until"], until_s);

    // Lift it on A: the key is gone; A admits at once, B within 2 s (its over-limit
    // cache trusts a block for at most 1 s).
    let r = admin(Method::POST, &a, "/callers/acme/reset").await;
    let asked = Instant::now();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(!redis.keys().contains(&key), "{:?}", redis.keys());
    let r = as_acme(&a).await;
    assert_eq!(r.status, 200, "A after the reset: {}", r.text());
    assert_eq!(r.num("x-ratelimit-used"), 1);
    loop {
        let r = as_acme(&b).await;
        if r.status == 200 {
            assert_eq!(r.num("x-ratelimit-used"), 2);
            break;
        }
        assert_eq!(r.status, 429);
        assert!(
            asked.elapsed() < Duration::from_secs(2),
            "B still refuses acme 2 s after the reset"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Memory store: a reload that shortens `block_for` keeps the stored block's end (the
/// new length applies to the next block); `POST /callers/{id}/reset` lifts a block at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_a_blocks_end_and_a_reset_lifts_it_on_the_memory_store() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config("", &up, "30s")).await;
    for i in 1..=3 {
        assert_eq!(as_acme(&gw).await.status, 200, "request {i}");
    }
    let until_s = as_acme(&gw).await.num("x-ratelimit-reset");
    gw.reload(&config("", &up, "5s")).expect("the reload takes");
    gw.clock.advance(Duration::from_secs(11));
    let r = as_acme(&gw).await;
    assert_blocked(&r, until_s, 19, "after a reload to block_for = 5s");

    let r = admin(Method::POST, &gw, "/callers/acme/reset").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = as_acme(&gw).await;
    assert_eq!(r.status, 200, "reset lifts the block: {}", r.text());
    assert_eq!(r.num("x-ratelimit-used"), 1);

    // The next block is the reloaded length.
    for i in 2..=3 {
        assert_eq!(as_acme(&gw).await.status, 200, "request {i}");
    }
    let before = gw.clock.now_ms();
    let r = as_acme(&gw).await;
    let until_s = r.num("x-ratelimit-reset");
    assert!(
        until_s >= (before + 5_000).div_ceil(1000) && until_s <= (before + 6_000).div_ceil(1000),
        "a block of 5 s: {until_s}, refused at {before} ms: {:?}",
        r.text()
    );
    assert_blocked(&r, until_s, 5, "the new block");
    assert_eq!(blocks_started(&gw), 2, "two blocks, across the reload");
}

/// A replicated shard whose checks read the replica: gateway A's refusal writes the
/// block on the primary (its checks are peeks, on the replica); once replicated,
/// gateway B's check, a peek on the replica, refuses with the block's end and writes
/// nothing (no call reaches the primary).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peek_on_a_replica_refuses_with_the_block() {
    use crate::support::topology::{evalsha_calls, ReplicatedShard};
    let shard = ReplicatedShard::start(1);
    let store = format!(
        "[store]\nbackend = \"redis\"\non_error = \"deny\"\ntimeout = \"1s\"\n[[store.shards]]\nprimary = \"{}\"\nreplicas = [\"{}\"]\n",
        shard.primary.url(),
        shard.replicas[0].url()
    );
    let up = Upstream::start().await;
    let toml = config(&store, &up, "1m");
    let (a, b) = (
        TestGateway::start(&toml).await,
        TestGateway::start(&toml).await,
    );
    wait_connected(&a).await;
    wait_connected(&b).await;
    for i in 1..=3 {
        assert_eq!(as_acme(&a).await.status, 200, "request {i} on A");
    }
    let until_s = as_acme(&a).await.num("x-ratelimit-reset");
    shard.wait_replicated();
    let key = client_key("core", "acme");
    let on_replica: Option<u64> = shard.replicas[0].cmd(&["HGET", &key, "block"]);
    assert_eq!(on_replica.map(|ms| ms.div_ceil(1000)), Some(until_s));

    let primary_calls = evalsha_calls(&shard.primary);
    let r = as_acme(&b).await;
    assert_blocked(&r, until_s, 60, "B, reading the replica");
    assert_eq!(
        evalsha_calls(&shard.primary),
        primary_calls,
        "B's blocked check read the replica and wrote nothing"
    );
}

/// A route that reserves before forwarding (`charge = "on_request"`): the refused
/// reservation is followed by the BLOCK as a refused peek is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reservation_blocks_too() {
    let up = Upstream::start().await;
    let toml = config("", &up, "30s").replace(
        "limits = [\"core\"]\n",
        "limits = [\"core\"]\ncharge = \"on_request\"\n",
    );
    let gw = TestGateway::start(&toml).await;
    for i in 1..=3 {
        assert_eq!(get(&gw.url("/x")).await.status, 200, "request {i}");
    }
    let refused = get(&gw.url("/x")).await;
    let until_s = refused.num("x-ratelimit-reset");
    assert_blocked(&refused, until_s, 30, "the refused reservation");
    gw.clock.advance(Duration::from_secs(11));
    assert_blocked(&get(&gw.url("/x")).await, until_s, 19, "past the window");
    assert_eq!(blocks_started(&gw), 1);
}
