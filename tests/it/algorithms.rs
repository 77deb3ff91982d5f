//! The limit algorithms, held to one reference model, and the policies around them
//! (on_request, shadow mode, enforce_percent, delay, the rate-limit endpoint).
//!
//! Random timelines of (time step, caller, cost, operation) are replayed against the pure
//! model (`tollgate::limiter::algorithm::apply`), the memory store and the Redis store
//! (`lua/apply.lua` on a real `redis-server`); every verdict (admitted, used, reset_at,
//! retry_at, epoch, blocked, block_started) must be identical. proptest shrinks a failing timeline to the
//! smallest one that still disagrees.

use crate::support;
use crate::support::RedisServer;
use proptest::prelude::*;
use std::collections::HashMap;
use tollgate::config::{Problems, StoreConfig};
use tollgate::limiter::algorithm::{self, Algorithm, Align, Op, OpKind, Policy, State, Verdict};
use tollgate::limiter::key::{KeyScheme, LimitKey};
use tollgate::limiter::store::memory::MemoryStore;
use tollgate::limiter::store::redis::RedisStore;
use tollgate::limiter::store::{Item, Store};

/// One step of a timeline.
#[derive(Debug, Clone)]
struct Step {
    /// Milliseconds since the previous step.
    dt: u64,
    caller: usize,
    cost: u64,
    /// 0 peek, 1 charge, 2 reserve, 3 refund (of an earlier charge or reservation),
    /// 4 block (a refusal's BLOCK, `block_for`).
    op: u8,
    /// Which earlier charge or reservation a refund takes back (modulo how many).
    pick: usize,
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (0u64..700, 0usize..3, 1u64..4, 0u8..5, 0usize..16).prop_map(
            |(dt, caller, cost, op, pick)| Step {
                dt,
                caller,
                cost,
                op,
                pick,
            },
        ),
        1..40,
    )
}

fn policies() -> Vec<Policy> {
    let base = |algorithm, quota, window_ms| Policy {
        algorithm,
        quota,
        window_ms,
        burst: quota,
        align: Align::FirstRequest,
        block_ms: 0,
    };
    // `block_for` on every algorithm it is allowed for: shorter than the window, and
    // longer (a block outlives the state under it).
    let blocking = |p: Policy, block_ms| Policy { block_ms, ..p };
    vec![
        blocking(base(Algorithm::FixedWindow, 3, 2_000), 1_500),
        blocking(base(Algorithm::FixedWindow, 3, 1_000), 4_000),
        blocking(base(Algorithm::SlidingWindow, 4, 1_000), 2_500),
        blocking(base(Algorithm::SlidingLog, 3, 1_500), 1_000),
        blocking(base(Algorithm::SlidingLog, 3, 1_000), 3_000),
        blocking(base(Algorithm::Gcra, 3, 1_000), 2_000),
        Policy {
            burst: 2,
            ..blocking(base(Algorithm::Gcra, 5, 3_000), 1_200)
        },
        base(Algorithm::FixedWindow, 5, 2_000),
        Policy {
            align: Align::Epoch,
            ..base(Algorithm::FixedWindow, 4, 1_000)
        },
        Policy {
            align: Align::Month,
            ..base(Algorithm::FixedWindow, 6, 2_630_016_000)
        },
        base(Algorithm::SlidingWindow, 6, 1_000),
        base(Algorithm::SlidingLog, 5, 1_500),
        base(Algorithm::Gcra, 4, 1_000),
        Policy {
            burst: 2,
            ..base(Algorithm::Gcra, 7, 3_000)
        },
        base(Algorithm::Concurrency, 2, 1_200),
    ]
}

struct Stores {
    rt: tokio::runtime::Runtime,
    memory: MemoryStore,
    redis: RedisStore,
    _server: RedisServer,
}

fn stores() -> Stores {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let cfg: StoreConfig = toml::from_str(&format!(
        "backend = \"redis\"\ntimeout = \"2s\"\n[[shards]]\nprimary = \"{}\"\n",
        server.url()
    ))
    .unwrap();
    let mut problems = Problems::default();
    let redis = RedisStore::from_config(&cfg, &mut problems).expect("store config");
    rt.block_on(async {
        redis.start();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !tollgate::limiter::store::primaries_ready(&redis.report()) {
            assert!(
                std::time::Instant::now() < deadline,
                "redis store never became ready"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    });
    Stores {
        rt,
        memory: MemoryStore::new(),
        redis,
        _server: server,
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Replay `timeline` under `policy` against the model and both stores, `per_call` steps
/// to a store call; the verdicts of every step, or the first disagreement. The steps of
/// one call share its instant (the first one's) and, as the gateway's calls do, its
/// kind: a call whose first step peeks only peeks (the check's read); in any other,
/// peeks are reservations (charges, reservations and refunds go to a shard in one
/// script call, a peek in another, not ordered with it).
fn replay(
    stores: &Stores,
    policy: &Policy,
    timeline: &[Step],
    case: u64,
    per_call: usize,
) -> Result<(), String> {
    // Ahead of the real clock, so that Redis never expires a key the timeline still uses
    // (keys expire by Redis's clock, one second after the gateway stops trusting them).
    let mut now = now_ms() + 3_600_000;
    let scheme = KeyScheme::new(&format!("prop{case}:"), None);
    let keys: Vec<LimitKey> = (0..3)
        .map(|c| scheme.key(policy.algorithm.name(), &format!("caller:{c}")))
        .collect();
    let mut model: Vec<State> = vec![State::Empty; 3];
    let mut taken: HashMap<usize, Vec<(u64, u64)>> = HashMap::new(); // caller → (cost, epoch)
    let mut next_id = case * 1_000_000 + 1;
    for (g, call) in timeline.chunks(per_call).enumerate() {
        now += call[0].dt;
        let peeks = call[0].op == 0;
        let ops: Vec<(usize, Op)> = call
            .iter()
            .map(|step| {
                let nothing_to_refund = taken.get(&step.caller).is_none_or(Vec::is_empty);
                let code = match step.op {
                    _ if peeks => 0,
                    // A refund of nothing is a peek in the one-step replay.
                    3 if nothing_to_refund && per_call == 1 => 0,
                    0 | 3 if nothing_to_refund || step.op == 0 => 2,
                    code => code,
                };
                let op = match code {
                    0 => Op {
                        kind: OpKind::Peek,
                        cost: step.cost,
                        id: 0,
                    },
                    4 => Op {
                        kind: OpKind::Block,
                        cost: step.cost,
                        id: 0,
                    },
                    1 | 2 => {
                        next_id += 1;
                        Op {
                            kind: if code == 1 {
                                OpKind::Charge
                            } else {
                                OpKind::Reserve
                            },
                            cost: step.cost,
                            id: next_id,
                        }
                    }
                    _ => match taken.get(&step.caller).filter(|t| !t.is_empty()) {
                        Some(t) => {
                            let (cost, epoch) = t[step.pick % t.len()];
                            // Now and then part of it: a reservation settled to a
                            // smaller cost (`upstreams.cost_header`).
                            let cost = if step.pick % 3 == 1 && cost > 1 {
                                cost / 2
                            } else {
                                cost
                            };
                            Op {
                                kind: OpKind::Refund,
                                cost,
                                id: epoch,
                            }
                        }
                        None => Op {
                            kind: OpKind::Peek,
                            cost: step.cost,
                            id: 0,
                        },
                    },
                };
                (step.caller, op)
            })
            .collect();
        let expected: Vec<Verdict> = ops
            .iter()
            .map(|&(caller, op)| algorithm::apply(policy, &mut model[caller], op, now))
            .collect();
        let items: Vec<Item> = ops
            .iter()
            .map(|&(caller, op)| Item {
                key: &keys[caller],
                policy,
                op,
            })
            .collect();
        let (memory, redis) = stores.rt.block_on(async {
            let m = stores.memory.apply(&items, now).await;
            let r = stores.redis.apply(&items, now).await;
            (m, r)
        });
        for (k, &(caller, op)) in ops.iter().enumerate() {
            let memory = memory[k].as_ref().expect("the memory store answers");
            let redis = redis[k]
                .as_ref()
                .map_err(|e| e.to_string())
                .expect("redis answers");
            if memory != &expected[k] || redis != &expected[k] {
                return Err(format!(
                    "call {g} item {k} {op:?} at +{} ms, caller {caller}:\n  model  {:?}\n  memory {memory:?}\n  redis  {redis:?}",
                    now % 100_000, expected[k]
                ));
            }
            if matches!(op.kind, OpKind::Charge | OpKind::Reserve) && expected[k].admitted {
                taken
                    .entry(caller)
                    .or_default()
                    .push((op.cost, expected[k].epoch));
            }
            if op.kind == OpKind::Refund {
                if let Some(t) = taken.get_mut(&caller) {
                    if let Some(i) = t.iter().position(|&(c, e)| e == op.id && c >= op.cost) {
                        t[i].0 -= op.cost;
                        if t[i].0 == 0 {
                            t.remove(i);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Every policy's random timelines, `per_call` steps to a store call, `cases` of them.
fn replay_every_policy(per_call: usize, cases: u32, first_case: u64) {
    let stores = stores();
    let case = std::sync::atomic::AtomicU64::new(first_case);
    for policy in policies() {
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases,
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let result = runner.run(&steps(), |timeline| {
            let c = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            replay(&stores, &policy, &timeline, c, per_call).map_err(TestCaseError::fail)
        });
        if let Err(e) = result {
            panic!("{policy:?}, {per_call} step(s) a call: {e}");
        }
    }
}

#[test]
fn every_algorithm_answers_alike_in_the_model_the_memory_store_and_redis() {
    replay_every_policy(1, 48, 1);
}

/// Several items in one store call, as a busy shard's batcher sends them: often the same
/// caller's window more than once (Redis reads and writes each fixed window once per
/// call, `lua/apply.lua`); every item's verdict must be the one of the items applied one
/// by one.
#[test]
fn every_algorithm_answers_alike_when_one_call_carries_several_items() {
    replay_every_policy(5, 32, 10_000);
}

/// The sliding window is an estimate: on one random trace of reservations, count how
/// often it decides otherwise than the exact sliding log.
#[test]
fn sliding_window_disagrees_rarely_with_the_sliding_log() {
    let (quota, window_ms) = (20, 10_000);
    let log = Policy {
        algorithm: Algorithm::SlidingLog,
        ..Policy::fixed(quota, window_ms)
    };
    let estimate = Policy {
        algorithm: Algorithm::SlidingWindow,
        ..log
    };
    let (mut a, mut b) = (State::Empty, State::Empty);
    // A deterministic pseudo-random trace: gaps of 0-999 ms, about as many requests as
    // the quota allows (2 a second), so that many decisions are close calls.
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut now = 1_000_000_000_000;
    let (mut total, mut differ) = (0u32, 0u32);
    for id in 1..=20_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        now += x % 1_000;
        let op = Op {
            kind: OpKind::Reserve,
            cost: 1,
            id,
        };
        let exact = algorithm::apply(&log, &mut a, op, now).admitted;
        let estimated = algorithm::apply(&estimate, &mut b, op, now).admitted;
        total += 1;
        differ += u32::from(exact != estimated);
    }
    let rate = f64::from(differ) / f64::from(total);
    println!(
        "sliding_window vs sliding_log: {differ} of {total} decisions differ ({:.2}%)",
        rate * 100.0
    );
    assert!(
        differ > 0,
        "the estimate is not exact: some decisions must differ"
    );
    assert!(rate < 0.15, "disagreement {rate}");
}

// ----- end to end, through the gateway, on both stores -----

use crate::support::{get, store_toml, Backend, TestGateway, Upstream};

fn gateway_config(upstream: &Upstream, store: &str, limit: &str, route_extra: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

{store}

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "l"
{limit}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["l"]
{route_extra}
"#,
        up = upstream.url()
    )
}

/// An upstream and a gateway in front of it with one limit `l` (its TOML lines) on `/`.
async fn start(store: &str, limit: &str, route_extra: &str) -> (Upstream, TestGateway) {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&gateway_config(&upstream, store, limit, route_extra)).await;
    (upstream, gw)
}

async fn each_backend(test: impl AsyncFn(Backend, String, Option<&RedisServer>)) {
    test(
        Backend::Memory,
        store_toml(Backend::Memory, &[], "allow", "1s"),
        None,
    )
    .await;
    let redis = RedisServer::start();
    let toml = store_toml(Backend::Redis, &[&redis], "allow", "1s");
    test(Backend::Redis, toml, Some(&redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_admits_a_burst_then_one_request_per_emission_interval() {
    each_backend(async |backend, store, _redis| {
        let limit = "algorithm = \"gcra\"\nwindow = \"10s\"\nquota = { anonymous = 2 }\nburst = 2";
        let (_upstream, gw) = start(&store, limit, "").await;
        let url = gw.url("/x");
        let first = get(&url).await;
        assert_eq!(first.status, 200, "{backend:?}");
        assert_eq!(first.header("x-ratelimit-limit"), "2");
        assert_eq!(first.header("x-ratelimit-remaining"), "1");
        assert_eq!(get(&url).await.status, 200);
        let refused = get(&url).await;
        assert_eq!(refused.status, 429, "{backend:?}");
        // Emission interval 10 s / 2 = 5 s: the next unit fits 5 s from now.
        assert_eq!(refused.header("retry-after"), "5");
        assert_eq!(refused.header("x-ratelimit-remaining"), "0");
        gw.clock.advance(std::time::Duration::from_millis(5_000));
        let again = get(&url).await;
        assert_eq!(again.status, 200, "{backend:?}");
        assert_eq!(again.header("x-ratelimit-remaining"), "0");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_log_counts_the_last_window_exactly() {
    each_backend(async |backend, store, redis| {
        let limit = "algorithm = \"sliding_log\"\nwindow = \"10s\"\nquota = { anonymous = 3 }";
        let (_upstream, gw) = start(&store, limit, "").await;
        let url = gw.url("/x");
        assert_eq!(get(&url).await.status, 200);
        gw.clock.advance(std::time::Duration::from_secs(4));
        assert_eq!(get(&url).await.status, 200);
        assert_eq!(get(&url).await.status, 200);
        let refused = get(&url).await;
        assert_eq!(refused.status, 429, "{backend:?}");
        // The first entry ages out 10 s after it was made: 6 s from now.
        assert_eq!(refused.header("retry-after"), "6");
        if let Some(redis) = redis {
            let keys = redis.keys();
            assert_eq!(keys.len(), 1, "{keys:?}");
            assert!(keys[0].contains(":l:sliding_log:{"), "{keys:?}");
            let n: u64 = redis.cmd(&["ZCARD", &keys[0]]);
            assert_eq!(n, 3, "one member per charge; the refused request left none");
            // Each member is "ID:COST" in integers, as the gateway's ids (up to 2^53) are
            // written, never a number's 14-digit form ("4.5035996273700e+15:1").
            let members: Vec<String> = redis.cmd(&["ZRANGE", &keys[0], "0", "-1"]);
            assert!(
                members.iter().all(|m| m
                    .split_once(':')
                    .is_some_and(
                        |(id, cost)| id.parse::<u64>().is_ok_and(|id| id > 0) && cost == "1"
                    )),
                "{members:?}"
            );
        }
        gw.clock.advance(std::time::Duration::from_secs(6));
        assert_eq!(get(&url).await.status, 200, "{backend:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_limits_requests_in_flight_and_frees_slots_when_the_body_ends() {
    each_backend(async |backend, store, redis| {
        let limit = "algorithm = \"concurrency\"\nwindow = \"30s\"\nquota = { anonymous = 2 }";
        let (_upstream, gw) = start(&store, limit, "").await;
        let slow = gw.url("/slow/700");
        let a = tokio::spawn(get_owned(slow.clone()));
        let b = tokio::spawn(get_owned(slow.clone()));
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let refused = get(&gw.url("/x")).await;
        assert_eq!(refused.status, 429, "{backend:?}: two in flight of 2");
        assert_eq!(refused.header("x-ratelimit-used"), "2");
        assert_eq!(refused.header("retry-after"), "1");
        if let Some(redis) = &redis {
            // Each slot's member is its id in integers (ids go up to 2^53).
            let keys = redis.keys();
            let members: Vec<String> = redis.cmd(&["ZRANGE", &keys[0], "0", "-1"]);
            assert_eq!(members.len(), 2, "{members:?}");
            assert!(
                members
                    .iter()
                    .all(|m| m.parse::<u64>().is_ok_and(|id| id > 0)),
                "{members:?}"
            );
        }
        assert_eq!(a.await.unwrap(), 200);
        assert_eq!(b.await.unwrap(), 200);
        // Slots are given back when the response bodies end.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        loop {
            let r = get(&gw.url("/x")).await;
            if r.status == 200 && r.header("x-ratelimit-used") == "1" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "slots never came back: {}",
                r.status
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        if let Some(redis) = redis {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let keys = redis.keys();
            let held: u64 = keys.iter().map(|k| redis.cmd::<u64>(&["ZCARD", k])).sum();
            assert_eq!(held, 0, "every slot given back in Redis: {keys:?}");
        }
    })
    .await;
}

async fn get_owned(url: String) -> u16 {
    get(&url).await.status.as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charge_on_request_never_admits_more_than_the_quota_and_refunds_uncharged() {
    each_backend(async |backend, store, _redis| {
        let limit = "window = \"1h\"\nquota = { anonymous = 10 }";
        let route = "charge = \"on_request\"\nuncharged_statuses = [304]";
        let (_upstream, gw) = start(&store, limit, route).await;
        // 40 concurrent requests, each in flight for 300 ms: exactly 10 get through.
        let tasks: Vec<_> = (0..40)
            .map(|_| tokio::spawn(get_owned(gw.url("/slow/300"))))
            .collect();
        let mut ok = 0;
        for t in tasks {
            let status = t.await.unwrap();
            assert!(status == 200 || status == 429, "{status}");
            ok += u32::from(status == 200);
        }
        assert_eq!(ok, 10, "{backend:?}: on_request admits exactly the quota");
        // An uncharged status gives its reservation back.
        gw.clock.advance(std::time::Duration::from_secs(3_600));
        let r = get(&gw.url("/status/304")).await;
        assert_eq!(r.status, 304);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        loop {
            let r = get(&gw.url("/x")).await;
            assert_eq!(r.status, 200);
            if r.header("x-ratelimit-used") == "1" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "304 never refunded: used {}",
                r.header("x-ratelimit-used")
            );
            gw.clock.advance(std::time::Duration::from_secs(3_600));
        }
    })
    .await;
}

// ----- policies: shadow mode, gradual rollout, delay, the rate-limit endpoint -----

fn metric(gw: &TestGateway, series: &str) -> u64 {
    let text = gw.gateway.metrics().render();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_limit_reports_but_never_refuses() {
    each_backend(async |backend, store, _redis| {
        let limit = "window = \"1h\"\nquota = { anonymous = 2 }\nmode = \"shadow\"";
        let (_upstream, gw) = start(&store, limit, "").await;
        for i in 1..=5u64 {
            let r = get(&gw.url("/x")).await;
            assert_eq!(r.status, 200, "{backend:?}: request {i} let through");
            assert_eq!(r.num("x-ratelimit-used"), i, "still counted");
        }
        assert_eq!(
            metric(
                &gw,
                "tollgate_shadow_rejections_total{limit=\"l\",tier=\"anonymous\"}"
            ),
            3,
            "{backend:?}: three would have been refused"
        );
        // A concurrent burst (requests held by reservations while others are in
        // flight) is let through and counted in full too.
        let burst: Vec<_> = (0..10)
            .map(|_| {
                let url = gw.url("/slow/200");
                tokio::spawn(async move { get(&url).await.status })
            })
            .collect();
        for t in burst {
            assert_eq!(t.await.unwrap(), 200, "{backend:?}: let through");
        }
        assert_eq!(
            get(&gw.url("/x")).await.num("x-ratelimit-used"),
            16,
            "{backend:?}: the burst was counted"
        );
        assert_eq!(
            metric(
                &gw,
                "tollgate_shadow_rejections_total{limit=\"l\",tier=\"anonymous\"}"
            ),
            14,
            "{backend:?}: every request past the quota would have been refused"
        );
        assert_eq!(
            metric(
                &gw,
                "tollgate_rejections_total{limit=\"l\",tier=\"anonymous\"}"
            ),
            0
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enforce_percent_refuses_a_stable_share_of_callers() {
    let limit = "window = \"1h\"\nquota = { anonymous = 1 }\nenforce_percent = 25";
    let (_upstream, gw) = start(&store_toml(Backend::Memory, &[], "allow", "1s"), limit, "").await;
    // 200 callers: the limit counts a header's value, so each tenant is one subject.
    let text = std::fs::read_to_string(&gw.path).unwrap().replace(
        "quota = { anonymous = 1 }",
        "quota = { anonymous = 1 }\nby = \"header:x-tenant\"",
    );
    gw.reload(&text).unwrap();
    let mut enforced = 0;
    for tenant in 0..200 {
        let t = tenant.to_string();
        let h = [("x-tenant", t.as_str())];
        assert_eq!(support::get_with(&gw.url("/x"), &h).await.status, 200);
        let second = support::get_with(&gw.url("/x"), &h).await.status;
        let third = support::get_with(&gw.url("/x"), &h).await.status;
        assert_eq!(
            second, third,
            "tenant {tenant}: the same decision every time"
        );
        enforced += u32::from(second == 429);
    }
    assert!(
        (30..=70).contains(&enforced),
        "about 25% of 200 enforced: {enforced}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_limit_delay_holds_a_request_until_the_limit_admits_it() {
    each_backend(async |backend, store, _redis| {
        let limit = "algorithm = \"gcra\"\nwindow = \"1s\"\nquota = { anonymous = 1 }\non_limit = \"delay\"\nmax_delay = \"2s\"\nmax_waiting = 1";
        let (_upstream, gw) = start(&store, limit, "").await;
        assert_eq!(get(&gw.url("/x")).await.status, 200);
        // The next unit fits 1 s later (by the gateway's clock): the request waits.
        let started = std::time::Instant::now();
        let held = tokio::spawn(get_owned(gw.url("/x")));
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        // A second request of the same caller beyond max_waiting = 1: 429 at once.
        let refused = get(&gw.url("/x")).await;
        assert_eq!(refused.status, 429, "{backend:?}: only one may wait");
        gw.clock.advance(std::time::Duration::from_millis(1_000));
        assert_eq!(held.await.unwrap(), 200, "{backend:?}: admitted after waiting");
        assert!(started.elapsed() >= std::time::Duration::from_millis(700));
        // Past max_delay: refused at once.
        let limit_far = "algorithm = \"gcra\"\nwindow = \"10s\"\nquota = { anonymous = 1 }\non_limit = \"delay\"\nmax_delay = \"2s\"";
        let (_upstream, gw) = start(&store, limit_far, "").await;
        assert_eq!(get(&gw.url("/x")).await.status, 200);
        let t = std::time::Instant::now();
        let r = get(&gw.url("/x")).await;
        assert_eq!(r.status, 429, "{backend:?}: 10 s away is past max_delay");
        assert_eq!(r.header("retry-after"), "10");
        assert!(t.elapsed() < std::time::Duration::from_millis(500));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_endpoint_shows_every_limit_and_is_never_charged() {
    each_backend(async |backend, store, _redis| {
        let upstream = Upstream::start().await;
        let text = format!(
            "{}\n[[limits]]\nname = \"daily\"\nwindow = \"1d\"\nalign = \"calendar\"\nquota = {{ anonymous = 100 }}\n\n[rate_limit_endpoint]\npath = \"/rate_limit\"\n",
            gateway_config(&upstream, &store, "window = \"1h\"\nquota = { anonymous = 10 }", "")
        );
        let gw = TestGateway::start(&text).await;
        assert_eq!(get(&gw.url("/x")).await.status, 200);
        for _ in 0..3 {
            let r = get(&gw.url("/rate_limit")).await;
            assert_eq!(r.status, 200, "{backend:?}");
            let body = r.json();
            assert_eq!(body["resources"]["l"]["used"], 1, "{body}");
            assert_eq!(body["resources"]["l"]["remaining"], 9);
            assert_eq!(body["resources"]["l"]["limit"], 10);
            assert_eq!(body["resources"]["l"]["window"], 3600);
            assert_eq!(body["resources"]["l"]["algorithm"], "fixed_window");
            assert_eq!(body["resources"]["daily"]["used"], 0);
            assert_eq!(body["rate"]["limit"], 10, "the most constrained: {body}");
        }
        // Not charged: the route's next request is the second.
        assert_eq!(get(&gw.url("/x")).await.num("x-ratelimit-used"), 2);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_counts_the_previous_window_by_its_overlap() {
    use tollgate::clock::Clock;
    each_backend(async |backend, store, _redis| {
        let limit = "algorithm = \"sliding_window\"\nwindow = \"10s\"\nquota = { anonymous = 4 }";
        let (_upstream, gw) = start(&store, limit, "").await;
        // Move to 1 s into a 10 s window (windows start at multiples of 10 s).
        let now = gw.clock.now_ms();
        gw.clock.advance(std::time::Duration::from_millis(
            10_000 - now % 10_000 + 1_000,
        ));
        for _ in 0..4 {
            assert_eq!(get(&gw.url("/x")).await.status, 200, "{backend:?}");
        }
        assert_eq!(get(&gw.url("/x")).await.status, 429);
        // 5 s into the next window the 4 count for half: 2 used, 2 left.
        gw.clock.advance(std::time::Duration::from_secs(14));
        let r = get(&gw.url("/x")).await;
        assert_eq!(r.status, 200, "{backend:?}");
        assert_eq!(r.num("x-ratelimit-used"), 3, "2 (weighted) + 1");
        assert_eq!(get(&gw.url("/x")).await.status, 200);
        let refused = get(&gw.url("/x")).await;
        assert_eq!(refused.status, 429, "{backend:?}");
        // 4 * (10 - t) / 10 + 2 <= 3 once 7.5 s into the window: 2.5 s from now.
        assert_eq!(refused.header("retry-after"), "3");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calendar_day_resets_at_utc_midnight() {
    use tollgate::clock::Clock;
    each_backend(async |backend, store, _redis| {
        let limit = "window = \"1d\"\nalign = \"calendar\"\nquota = { anonymous = 2 }";
        let (_upstream, gw) = start(&store, limit, "").await;
        let r = get(&gw.url("/x")).await;
        let midnight_s = (gw.clock.now_ms() / 86_400_000 + 1) * 86_400;
        assert_eq!(r.num("x-ratelimit-reset"), midnight_s, "{backend:?}");
        assert_eq!(get(&gw.url("/x")).await.status, 200);
        assert_eq!(get(&gw.url("/x")).await.status, 429);
        // Right after midnight UTC: a new day, a new window.
        let to_midnight = midnight_s * 1000 - gw.clock.now_ms();
        gw.clock
            .advance(std::time::Duration::from_millis(to_midnight + 1));
        let r = get(&gw.url("/x")).await;
        assert_eq!(r.status, 200, "{backend:?}");
        assert_eq!(r.num("x-ratelimit-reset"), midnight_s + 86_400);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_limits_admit_only_together_and_keep_nothing_of_a_refused_request() {
    each_backend(async |backend, store, _redis| {
        let upstream = Upstream::start().await;
        let text = gateway_config(&upstream, &store, "window = \"1h\"\nquota = { anonymous = 100 }", "charge = \"on_request\"")
            .replace("limits = [\"l\"]", "limits = [\"l\", \"tight\"]")
            + "\n[[limits]]\nname = \"tight\"\nalgorithm = \"gcra\"\nwindow = \"1h\"\nquota = { anonymous = 1 }\n\n[rate_limit_endpoint]\npath = \"/rate_limit\"\n";
        let gw = TestGateway::start(&text).await;
        let first = get(&gw.url("/x")).await;
        assert_eq!(first.status, 200, "{backend:?}");
        assert_eq!(first.header("x-ratelimit-resource"), "tight", "the tightest limit");
        for _ in 0..3 {
            let r = get(&gw.url("/x")).await;
            assert_eq!(r.status, 429, "{backend:?}");
            assert_eq!(r.header("x-ratelimit-resource"), "tight");
        }
        // What "l" reserved for the refused requests was given back.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        loop {
            let used = get(&gw.url("/rate_limit")).await.json()["resources"]["l"]["used"].clone();
            if used == 1 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{backend:?}: l still holds {used}");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
}
