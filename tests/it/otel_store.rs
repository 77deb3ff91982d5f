//! The store's part of a request's trace (`[tracing]`, issue 49): the check and charge
//! spans name the shard, the node (the real `redis-server`'s address), the script and
//! the batch, and carry a `breaker_open` event when a call finds the node's breaker
//! open and a `lease_refill` event when a lease-mode limit refills. Real Redis, a real
//! OTLP receiver, a real upstream.

use crate::otel::{child, server_spans};
use crate::support::otlp::{attr, attr_of, Receiver};
use crate::support::{get_with, RedisServer, TestGateway, Upstream};
use opentelemetry_proto::tonic::trace::v1::span::Event;
use opentelemetry_proto::tonic::trace::v1::Span;

/// A gateway on `upstream` with one limit of 100 an hour (`limit_extra`: more of its
/// keys) in the Redis shard `redis` (`store_extra`: more `[store]` keys), sampling
/// every request and tracing to `endpoint`.
fn config(
    upstream: &Upstream,
    redis: &RedisServer,
    endpoint: &str,
    store_extra: &str,
    limit_extra: &str,
) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[store]
backend = "redis"
key_prefix = "tollgate:"
{store_extra}

[[store.shards]]
primary = "{redis}"

[tracing]
enabled = true
endpoint = "{endpoint}"
batch_timeout = "50ms"
sample_ratio = 1.0

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 100 }}
{limit_extra}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        redis = redis.url(),
        up = upstream.url()
    )
}

/// The server span of the request to `path` and its child `name`.
fn span_of<'a>(spans: &'a [Span], path: &str, name: &str) -> &'a Span {
    let servers = server_spans(spans);
    let s = servers
        .iter()
        .find(|s| attr(s, "url.path").as_deref() == Some(path))
        .unwrap_or_else(|| panic!("no server span of {path} in {spans:#?}"));
    child(spans, s, name)
}

fn events<'a>(span: &'a Span, name: &str) -> Vec<&'a Event> {
    span.events.iter().filter(|e| e.name == name).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampled_request_through_redis_names_shard_node_script_and_batch() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let rx = Receiver::start(true).await;
    let gw = TestGateway::start(&config(&up, &redis, &rx.endpoint(), "", "")).await;
    crate::support::wait_connected(&gw).await;
    assert_eq!(get_with(&gw.url("/stored"), &[]).await.status, 200);
    let spans = rx.wait_spans(4).await;
    let node = format!("127.0.0.1:{}", redis.port);
    for name in ["check", "charge"] {
        let span = span_of(&spans, "/stored", name);
        let a = |key: &str| attr(span, key);
        assert_eq!(a("db.system.name").as_deref(), Some("redis"), "{name}");
        assert_eq!(a("tollgate.store.shard").as_deref(), Some("0"), "{name}");
        assert_eq!(a("tollgate.store.node"), Some(node.clone()), "{name}");
        assert_eq!(
            a("tollgate.store.role").as_deref(),
            Some("primary"),
            "{name}"
        );
        assert_eq!(
            a("tollgate.store.script").as_deref(),
            Some("apply.lua"),
            "{name}"
        );
        // Alone on an idle shard: its own call of its one operation.
        assert_eq!(
            a("tollgate.store.batch.operations").as_deref(),
            Some("1"),
            "{name}"
        );
        assert_eq!(
            a("tollgate.store.batch.requests").as_deref(),
            Some("1"),
            "{name}"
        );
        assert_eq!(a("tollgate.store.calls").as_deref(), Some("1"), "{name}");
        assert!(span.events.is_empty(), "{name}: {:?}", span.events);
    }
    // The window the spans describe is in that node.
    assert_eq!(redis.keys().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_finds_the_primarys_breaker_open_carries_a_breaker_open_event() {
    let mut redis = RedisServer::start();
    let up = Upstream::start().await;
    let rx = Receiver::start(true).await;
    let store = "timeout = \"200ms\"\non_error = \"allow\"\nbreaker_failures = 1\nbreaker_cooloff = \"60s\"";
    let gw = TestGateway::start(&config(&up, &redis, &rx.endpoint(), store, "")).await;
    crate::support::wait_connected(&gw).await;
    assert_eq!(get_with(&gw.url("/before"), &[]).await.status, 200);
    let node = format!("127.0.0.1:{}", redis.port);
    // The shard's primary dies (SIGKILL to its process).
    assert!(redis.pid().is_some());
    redis.kill();
    // Let through without the store (on_error = "allow"): the first call fails and
    // opens the breaker (1 failure), the ones after it are refused by it.
    let opened = get_with(&gw.url("/opens"), &[]).await;
    assert_eq!(opened.status, 200);
    let refused = get_with(&gw.url("/refused"), &[]).await;
    assert_eq!(refused.status, 200);
    let spans = rx.wait_spans(12).await;
    let before = span_of(&spans, "/before", "check");
    assert!(before.events.is_empty(), "{:?}", before.events);
    let cause = |path: &str, name: &str| -> Vec<String> {
        let span = span_of(&spans, path, name);
        events(span, "breaker_open")
            .into_iter()
            .map(|e| {
                let a = |k: &str| attr_of(&e.attributes, k);
                assert_eq!(a("tollgate.store.shard").as_deref(), Some("0"));
                assert_eq!(a("tollgate.store.node"), Some(node.clone()));
                assert!(e.time_unix_nano >= span.start_time_unix_nano);
                a("tollgate.breaker.cause").unwrap()
            })
            .collect()
    };
    assert_eq!(cause("/opens", "check"), ["opened"], "{spans:#?}");
    assert_eq!(cause("/opens", "charge"), ["refused"]);
    assert_eq!(cause("/refused", "check"), ["refused"]);
    assert_eq!(cause("/refused", "charge"), ["refused"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_refill_is_an_event_of_the_check_span() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let rx = Receiver::start(true).await;
    let gw = TestGateway::start(&config(&up, &redis, &rx.endpoint(), "", "lease = 10")).await;
    crate::support::wait_connected(&gw).await;
    assert_eq!(get_with(&gw.url("/refills"), &[]).await.status, 200);
    assert_eq!(get_with(&gw.url("/from-lease"), &[]).await.status, 200);
    let spans = rx.wait_spans(6).await;
    let check = span_of(&spans, "/refills", "check");
    let refills = events(check, "lease_refill");
    assert_eq!(refills.len(), 1, "{:?}", check.events);
    let a = |k: &str| attr_of(&refills[0].attributes, k);
    assert_eq!(a("tollgate.lease.wanted").as_deref(), Some("10"));
    assert_eq!(a("tollgate.lease.granted").as_deref(), Some("10"));
    assert_eq!(
        attr(check, "tollgate.store.script").as_deref(),
        Some("lease.lua")
    );
    assert_eq!(
        attr(check, "tollgate.store.node"),
        Some(format!("127.0.0.1:{}", redis.port))
    );
    // The next request is admitted from the units held here: no store call, no refill.
    let next = span_of(&spans, "/from-lease", "check");
    assert!(events(next, "lease_refill").is_empty(), "{:?}", next.events);
    assert_eq!(attr(next, "tollgate.store.calls").as_deref(), Some("0"));
    // Leased units are counted in the window when granted.
    let key = redis.keys();
    assert_eq!(key.len(), 1, "{key:?}");
}
