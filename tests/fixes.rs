//! Issue 17: fixes found by trying tollgate as a user would, against the real gateway,
//! real upstreams and real `redis-server`s.

mod support;

use std::time::Duration;
use support::{get, RedisServer, TestGateway, Upstream};

/// `[store]` for the memory store (none) or Redis shards.
fn store_section(redis: Option<&RedisServer>) -> String {
    match redis {
        None => String::new(),
        Some(r) => format!(
            "[store]\nbackend = \"redis\"\n[[store.shards]]\nprimary = \"{}\"\n",
            r.url()
        ),
    }
}

/// Item 1: on a `charge = "on_request"` route, an uncharged status (304) is refunded,
/// and its own response shows the state after the refund, on both stores, in both
/// header styles, for a fixed window and for GCRA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncharged_status_on_an_on_request_route_shows_the_state_after_its_refund() {
    for redis in [None, Some(RedisServer::start())] {
        for algorithm in ["fixed_window", "gcra"] {
            let upstream = Upstream::start().await;
            let text = format!(
                r#"
[server]
listen = "127.0.0.1:0"
{store}
[headers]
style = ["github", "ietf"]

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
algorithm = "{algorithm}"
window = "1h"
quota = {{ anonymous = 3 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
charge = "on_request"
"#,
                store = store_section(redis.as_ref()),
                up = upstream.url()
            );
            let gw = TestGateway::start(&text).await;
            let what = format!("redis {}, {algorithm}", redis.is_some());
            let ok = get(&gw.url("/")).await;
            assert_eq!(ok.status, 200, "{what}");
            assert_eq!(ok.header("x-ratelimit-remaining"), "2", "{what}");
            assert_eq!(ok.header("x-ratelimit-used"), "1", "{what}");
            assert!(
                ok.header("ratelimit").contains(";r=2"),
                "{what}: {}",
                ok.header("ratelimit")
            );
            let not_modified = get(&gw.url("/status/304")).await;
            assert_eq!(not_modified.status, 304, "{what}");
            assert_eq!(not_modified.header("x-ratelimit-remaining"), "2", "{what}");
            assert_eq!(not_modified.header("x-ratelimit-used"), "1", "{what}");
            assert!(
                not_modified.header("ratelimit").contains(";r=2"),
                "{what}: {}",
                not_modified.header("ratelimit")
            );
            if algorithm == "fixed_window" {
                assert_eq!(
                    not_modified.header("x-ratelimit-reset"),
                    ok.header("x-ratelimit-reset"),
                    "{what}: the same window"
                );
            }
            // And the store agrees: two more are admitted, then 429.
            for left in [1, 0] {
                let r = get(&gw.url("/")).await;
                assert_eq!(r.status, 200, "{what}");
                assert_eq!(
                    r.header("x-ratelimit-remaining"),
                    left.to_string(),
                    "{what}"
                );
            }
            assert_eq!(get(&gw.url("/")).await.status, 429, "{what}");
        }
    }
}

/// Item 2: two gateways on one Redis shard, `after_response`, quota 20, 100 requests
/// from 20 threads split over both: a 429 afterwards (from the store or the over-limit
/// cache) reports the count Redis holds, never in-flight units as charged ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_reports_the_count_the_store_holds() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
{store}
[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 20 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        store = store_section(Some(&redis)),
        up = upstream.url()
    );
    for round in 0..8 {
        let _: String = redis.cmd(&["FLUSHALL"]);
        let a = TestGateway::start(&text).await;
        let b = TestGateway::start(&text).await;
        let urls = [a.url("/"), b.url("/")];
        let tasks: Vec<_> = (0..20)
            .map(|t| {
                let url = urls[t % 2].clone();
                tokio::spawn(async move {
                    let mut ok = 0;
                    for _ in 0..5 {
                        ok += u32::from(get(&url).await.status == 200);
                    }
                    ok
                })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            admitted += t.await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let key = redis
            .keys()
            .into_iter()
            .find(|k| k.contains("core"))
            .expect("a window");
        let held: String = redis.cmd(&["HGET", &key, "count"]);
        assert_eq!(
            held,
            admitted.to_string(),
            "round {round}: Redis counts the admitted requests"
        );
        let held_n: u64 = held.parse().unwrap();
        // A refusal from the over-limit cache repeats a count the store held within the
        // last second (docs/redis.md): between the quota and today's count, never more.
        for gw in [&a, &b] {
            let r = get(&gw.url("/")).await;
            assert_eq!(r.status, 429, "round {round}");
            let used = r.num("x-ratelimit-used");
            assert!(
                (20..=held_n).contains(&used),
                "round {round}: the 429 says {used}, Redis holds {held_n}"
            );
            assert_eq!(r.header("x-ratelimit-remaining"), "0", "round {round}");
        }
        // Past the cache's bound, a refusal says exactly what Redis holds.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        for gw in [&a, &b] {
            let r = get(&gw.url("/")).await;
            assert_eq!(r.status, 429, "round {round}");
            assert_eq!(
                r.header("x-ratelimit-used"),
                held,
                "round {round}: the 429 says what Redis holds"
            );
            assert_eq!(r.header("x-ratelimit-remaining"), "0", "round {round}");
        }
    }
}
