//! The IETF fields as draft-ietf-httpapi-ratelimit-headers-11 has them, end to end: `t`
//! is the seconds until the caller has more quota for every algorithm (GCRA's next
//! regained unit, the sliding window's and log's next freed unit, not only a window's
//! end), `Retry-After` is never earlier than `t` on a refusal, a concurrency limit says
//! `qu="concurrent-requests"`, and `headers.partition_key = true` adds `pk`, the
//! caller's keyed hash as a byte sequence (the digits the access log shows), never
//! otherwise. Every field is parsed as an RFC 9651 List. The `t` tests run on the memory
//! store and on a real `redis-server` (`lua/apply.lua` answers `more_at`).

use crate::support::client::Reply;
use crate::support::redis::RedisServer;
use crate::support::{capture_logs, get, log_lines, store_section, TestGateway, Upstream};
use base64::Engine as _;
use std::time::Duration;

/// One route per algorithm (`/fw`, `/sw`, `/sl`, `/g`, and `/slow` for the
/// concurrency limit `c`, the upstream's path that answers late), each with its one
/// limit.
fn config(upstream: &Upstream, partition_key: bool) -> String {
    config_on(upstream, partition_key, None)
}

/// [`config`] on the memory store (`None`) or a Redis server.
fn config_on(upstream: &Upstream, partition_key: bool, redis: Option<&RedisServer>) -> String {
    let limit = |name: &str, body: &str| {
        let prefix = if name == "c" { "slow" } else { name };
        format!("[[limits]]\nname = \"{name}\"\n{body}\n\n[[routes]]\npath_prefix = \"/{prefix}\"\nupstream = \"api\"\nlimits = [\"{name}\"]\n\n")
    };
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n{store}\n[headers]\nstyle = [\"github\", \"ietf\"]\npartition_key = {partition_key}\n\n[[upstreams]]\nname = \"api\"\ntargets = [\"{up}\"]\n\n{}{}{}{}{}",
        limit("fw", "window = \"1m\"\nquota = { anonymous = 1 }"),
        limit("sw", "algorithm = \"sliding_window\"\nwindow = \"10s\"\nquota = { anonymous = 4 }"),
        limit("sl", "algorithm = \"sliding_log\"\nwindow = \"10s\"\nquota = { anonymous = 3 }"),
        limit("g", "algorithm = \"gcra\"\nwindow = \"1m\"\nquota = { anonymous = 6 }\nburst = 3"),
        limit("c", "algorithm = \"concurrency\"\nwindow = \"30s\"\nquota = { anonymous = 1 }"),
        up = upstream.url(),
        store = store_section(redis),
    )
}

/// A gateway on each store in turn: memory, then a fresh `redis-server`.
async fn on_each_store(upstream: &Upstream, mut test: impl AsyncFnMut(TestGateway, &str)) {
    test(TestGateway::start(&config(upstream, false)).await, "memory").await;
    let redis = RedisServer::start();
    let gw = TestGateway::start(&config_on(upstream, false, Some(&redis))).await;
    crate::support::wait_connected(&gw).await;
    test(gw, "redis").await;
}

/// A parameter's bare item, as RFC 9651 has them (the kinds these fields use).
#[derive(Debug, Clone, PartialEq)]
enum Bare {
    Integer(i64),
    String(String),
    Bytes(Vec<u8>),
}

/// One list member: its sf-string and its parameters, in order.
type Member = (String, Vec<(String, Bare)>);

/// Parse `field` strictly as an RFC 9651 List of Items whose bare items are
/// sf-strings (the policy names) and whose parameters are integers, sf-strings or byte
/// sequences: anything else (a token where a string belongs, a bad key, stray
/// characters, an integer of 16 digits, bad base64, a trailing comma) panics.
fn sf_list(field: &str) -> Vec<Member> {
    let b = field.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    let string = |i: &mut usize| -> String {
        assert_eq!(b.get(*i), Some(&b'"'), "an sf-string at {i} in {field:?}");
        *i += 1;
        let mut s = String::new();
        loop {
            match b.get(*i).copied() {
                Some(b'\\') => {
                    let c = b[*i + 1];
                    assert!(c == b'"' || c == b'\\', "bad escape in {field:?}");
                    s.push(c as char);
                    *i += 2;
                }
                Some(b'"') => {
                    *i += 1;
                    return s;
                }
                Some(c) if (0x20..=0x7e).contains(&c) => {
                    s.push(c as char);
                    *i += 1;
                }
                other => panic!("bad sf-string character {other:?} in {field:?}"),
            }
        }
    };
    loop {
        let name = string(&mut i);
        let mut params = Vec::new();
        while b.get(i) == Some(&b';') {
            i += 1;
            while b.get(i) == Some(&b' ') {
                i += 1;
            }
            let start = i;
            assert!(
                b.get(i)
                    .is_some_and(|c| c.is_ascii_lowercase() || *c == b'*'),
                "a key at {i} in {field:?}"
            );
            while b.get(i).is_some_and(|c| {
                c.is_ascii_lowercase() || c.is_ascii_digit() || b"_-.*".contains(c)
            }) {
                i += 1;
            }
            let key = field[start..i].to_string();
            assert_eq!(b.get(i), Some(&b'='), "{key} has a value in {field:?}");
            i += 1;
            let value = match b.get(i) {
                Some(b'"') => Bare::String(string(&mut i)),
                Some(b':') => {
                    let end = i + 1 + field[i + 1..].find(':').expect("closing ':'");
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(&field[i + 1..end])
                        .expect("base64 in a byte sequence");
                    i = end + 1;
                    Bare::Bytes(bytes)
                }
                Some(c) if c.is_ascii_digit() || *c == b'-' => {
                    let start = i;
                    i += 1;
                    while b.get(i).is_some_and(u8::is_ascii_digit) {
                        i += 1;
                    }
                    let digits = field[start..i].trim_start_matches('-');
                    assert!(digits.len() <= 15 && !digits.is_empty(), "{field:?}");
                    Bare::Integer(field[start..i].parse().unwrap())
                }
                other => panic!("unexpected bare item {other:?} in {field:?}"),
            };
            assert!(
                params.iter().all(|(k, _)| k != &key),
                "{key} twice in {field:?}"
            );
            params.push((key, value));
        }
        out.push((name, params));
        while b.get(i).is_some_and(|c| *c == b' ' || *c == b'\t') {
            i += 1;
        }
        match b.get(i) {
            None => return out,
            Some(b',') => {
                i += 1;
                while b.get(i).is_some_and(|c| *c == b' ' || *c == b'\t') {
                    i += 1;
                }
                assert!(i < b.len(), "a trailing comma in {field:?}");
            }
            Some(c) => panic!("unexpected {:?} at {i} in {field:?}", *c as char),
        }
    }
}

fn param<'a>(m: &'a Member, key: &str) -> Option<&'a Bare> {
    m.1.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// `RateLimit`'s one member, parsed: (name, r, t).
fn ratelimit(r: &Reply) -> (String, i64, i64) {
    let list = sf_list(r.header("ratelimit"));
    assert_eq!(list.len(), 1, "{list:?}");
    let int = |k| match param(&list[0], k) {
        Some(Bare::Integer(n)) => *n,
        other => panic!("{k}: {other:?}"),
    };
    (list[0].0.clone(), int("r"), int("t"))
}

/// `Retry-After` of a refusal, and `t` no later than it.
fn refused(r: &Reply, name: &str) -> (u64, i64) {
    assert_eq!(r.status, 429, "{name}");
    let (n, rem, t) = ratelimit(r);
    assert_eq!((n.as_str(), rem), (name, 0));
    let retry = r.num("retry-after");
    assert!(
        retry as i64 >= t,
        "{name}: Retry-After {retry} earlier than t={t}"
    );
    (retry, t)
}

/// Move the gateway's clock to `offset_ms` into the next window of `window_ms` (the
/// sliding window aligns its windows on multiples of its length since the epoch).
fn to_window_offset(gw: &TestGateway, window_ms: u64, offset_ms: u64) -> u64 {
    use tollgate::clock::Clock as _;
    let now = gw.clock.now_ms();
    let start = (now / window_ms + 1) * window_ms;
    gw.clock
        .advance(Duration::from_millis(start + offset_ms - now));
    start
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_t_is_the_time_until_the_next_unit_is_regained() {
    let upstream = Upstream::start().await;
    on_each_store(&upstream, async |gw, store| {
        // 6 a minute: one unit every 10 s, 3 at once. Each of three requests leaves the
        // next unit 10 s away (the old t, the TAT, was 10, 20, then 30).
        for left in [2, 1, 0] {
            let r = get(&gw.url("/g")).await;
            assert_eq!(r.status, 200, "{store}");
            assert_eq!(ratelimit(&r), ("g".into(), left, 10), "{store}");
        }
        let (retry, t) = refused(&get(&gw.url("/g")).await, "g");
        assert_eq!((retry, t), (10, 10), "{store}");
        gw.clock.advance(Duration::from_secs(4));
        let (retry, t) = refused(&get(&gw.url("/g")).await, "g");
        assert_eq!((retry, t), (6, 6), "{store}");
        gw.clock.advance(Duration::from_secs(6));
        let r = get(&gw.url("/g")).await;
        assert_eq!(r.status, 200, "{store}: one unit back");
        assert_eq!(ratelimit(&r), ("g".into(), 0, 10), "{store}");
    })
    .await;
    assert_eq!(upstream.hits(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_t_is_the_time_until_the_estimate_drops_one_unit() {
    let upstream = Upstream::start().await;
    on_each_store(&upstream, async |gw, _store| {
        // 4 per 10 s, all four at 0.5 s into a window: they fade over the next window,
        // and the estimate is 3 at 12.5 s (4 * (20 - t) / 10 <= 3), about 12 s after
        // them (they take well under a second).
        to_window_offset(&gw, 10_000, 500);
        let mut last = None;
        for left in [3, 2, 1, 0] {
            let r = get(&gw.url("/sw")).await;
            assert_eq!(r.status, 200);
            let (_, rem, t) = ratelimit(&r);
            assert_eq!(rem, left);
            last = Some(t);
        }
        assert_eq!(
            last,
            Some(12),
            "one unit back at 12.5 s, not at the reset (19.5 s)"
        );
        let (retry, t) = refused(&get(&gw.url("/sw")).await, "sw");
        assert_eq!((retry, t), (12, 12));
        // 5 s into the next window: the four weigh 2; one more request makes 3 (1 left),
        // and the estimate is 2 again once 4 * (10 - e) / 10 <= 1: at 7.5 s, 2.5 s away
        // (the old t, the reset, was 15).
        to_window_offset(&gw, 10_000, 5_000);
        let r = get(&gw.url("/sw")).await;
        assert_eq!(r.status, 200);
        assert_eq!(ratelimit(&r), ("sw".into(), 1, 3));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_log_t_is_the_time_until_the_oldest_charge_leaves_the_window() {
    let upstream = Upstream::start().await;
    on_each_store(&upstream, async |gw, _store| {
        // 3 per 10 s, at 0, 2 and 4 s: the first leaves at 10 s, 6 s after the third.
        for (left, t) in [(2, 10), (1, 8), (0, 6)] {
            let r = get(&gw.url("/sl")).await;
            assert_eq!(r.status, 200);
            assert_eq!(ratelimit(&r), ("sl".into(), left, t));
            gw.clock.advance(Duration::from_secs(2));
        }
        // At 6 s: refused until the first leaves, 4 s away.
        let (retry, t) = refused(&get(&gw.url("/sl")).await, "sl");
        assert_eq!((retry, t), (4, 4));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_never_earlier_than_t_and_concurrency_says_its_unit() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, false)).await;
    // Fixed window: t and Retry-After are the window's end.
    assert_eq!(get(&gw.url("/fw")).await.status, 200);
    assert_eq!(refused(&get(&gw.url("/fw")).await, "fw"), (60, 60));

    // Concurrency: one in flight of 1. The policy names the unit; no other limit does.
    let r = get(&gw.url("/slow/0")).await;
    let policy = sf_list(r.header("ratelimit-policy"));
    assert_eq!(policy.len(), 1);
    assert_eq!(
        param(&policy[0], "qu"),
        Some(&Bare::String("concurrent-requests".into()))
    );
    assert_eq!(param(&policy[0], "q"), Some(&Bare::Integer(1)));
    let slow = gw.url("/slow/800");
    let held = tokio::spawn(async move { get(&slow).await.status });
    tokio::time::sleep(Duration::from_millis(250)).await;
    let (retry, t) = refused(&get(&gw.url("/slow/0")).await, "c");
    assert_eq!((retry, t), (1, 1));
    assert_eq!(held.await.unwrap(), 200);

    for path in ["/fw", "/sw", "/sl", "/g"] {
        let policy = sf_list(get(&gw.url(path)).await.header("ratelimit-policy"));
        assert_eq!(
            param(&policy[0], "qu"),
            None,
            "{path}: requests, the default"
        );
        assert_eq!(param(&policy[0], "pk"), None, "{path}: no partition_key");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partition_key_is_the_keyed_hash_the_access_log_shows() {
    capture_logs();
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, true)).await;
    let path = format!("/g/partition-{}", gw.addr.port());
    let r = get(&gw.url(&path)).await;
    assert_eq!(r.status, 200);
    let policy = sf_list(r.header("ratelimit-policy"));
    let rl = sf_list(r.header("ratelimit"));
    let (Some(Bare::Bytes(pk)), Some(Bare::Bytes(same))) =
        (param(&policy[0], "pk"), param(&rl[0], "pk"))
    else {
        panic!("pk on both fields: {:?}", r.headers);
    };
    assert_eq!(pk, same);
    assert_eq!(pk.len(), 16, "the keyed digest's 16 bytes");
    let hex = hex::encode(pk);
    assert!(!r.header("ratelimit").contains("127.0.0.1"));
    // The access log shows the client as the same digest (log.client_ip = "hash").
    crate::support::wait_until(Duration::from_secs(5), "the access log line", || {
        !log_lines(&["tollgate::access", &path]).is_empty()
    })
    .await;
    let line = log_lines(&["tollgate::access", &path]).remove(0);
    assert!(
        line.contains(&format!("client=\"{hex}\"")),
        "pk {hex} is the logged client: {line}"
    );
    // The GitHub-style headers are unchanged.
    assert_eq!(r.header("x-ratelimit-limit"), "3");
    assert_eq!(r.header("x-ratelimit-remaining"), "2");
}
