#![allow(missing_docs)]
//! Per-component micro-benchmarks of the request path: identity, route match, key
//! derivation, header rendering, the memory store, the whole limiter on the memory
//! store, and one round trip of each Lua script against a real `redis-server`.
//!
//! Run with `cargo bench --bench components` (add a filter such as `redis/` to run a
//! subset). The Redis benchmarks start their own `redis-server` on a free loopback port
//! (`$REDIS_SERVER`, else `redis-server` on `PATH`) and stop it by PID when done; when
//! no `redis-server` is found they are skipped with a message, the rest still run.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use http::{HeaderMap, HeaderValue};
use sha2::{Digest, Sha256};
use std::hint::black_box;
use std::net::{IpAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tollgate::config::{ClientConfig, IdentityConfig, Problems};
use tollgate::identity::Identities;
use tollgate::limiter::algorithm::{Op, OpKind, Policy};
use tollgate::limiter::key::KeyScheme;
use tollgate::limiter::store::memory::MemoryStore;
use tollgate::limiter::store::redis::{unpack_integers, APPLY_LUA, LEASE_LUA, REFUND_LUA};
use tollgate::limiter::store::Item;
use tollgate::limiter::Usage;
use tollgate::snapshot::Snapshot;

/// A fixed clock for the in-process benchmarks (the memory store never looks at the
/// real time).
const NOW_MS: u64 = 1_700_000_000_000;
/// One hour, the window of every benchmark limit.
const WINDOW_MS: u64 = 3_600_000;
/// A quota no benchmark run can use up, so every CHECK admits and every LEASE grants.
const HUGE_QUOTA: u64 = 1_000_000_000_000_000;

fn sha256_hex(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// A snapshot built from TOML text, as `tollgate check` and the gateway build it.
fn snapshot(toml: &str) -> Snapshot {
    let file = tollgate::config::parse(Path::new("bench.toml"), toml.to_string())
        .unwrap_or_else(|r| panic!("bench config does not parse:\n{r}"));
    let files = tollgate::load::Loaded::load(&file, None);
    Snapshot::build(&file, &files, None).unwrap_or_else(|r| panic!("bench config is invalid:\n{r}"))
}

// ---------------------------------------------------------------------------------------
// 1. Identity
// ---------------------------------------------------------------------------------------

fn identity(c: &mut Criterion) {
    let cfg = IdentityConfig {
        trusted_proxies: vec!["10.0.0.0/8".into()],
        clients: (0..100)
            .map(|i| ClientConfig {
                id: format!("client-{i}"),
                key_sha256: sha256_hex(&format!("key-{i}")).into(),
                tier: if i % 2 == 0 { "default" } else { "gold" }.into(),
            })
            .collect(),
        ..Default::default()
    };
    let mut problems = Problems::default();
    let ids = Identities::build(&cfg, &mut problems);
    assert!(problems.is_ok(), "identity config: {:?}", problems.errors);

    let direct: IpAddr = "203.0.113.7".parse().unwrap();
    let proxy: IpAddr = "10.0.0.1".parse().unwrap();
    let anonymous = HeaderMap::new();
    let mut bearer = HeaderMap::new();
    bearer.insert("authorization", HeaderValue::from_static("Bearer key-42"));
    let mut forwarded = HeaderMap::new();
    forwarded.insert(
        "x-forwarded-for",
        HeaderValue::from_static("198.51.100.23, 10.0.0.2"),
    );

    // The cases must take the path they claim to.
    assert!(ids.identify(&anonymous, direct).unwrap().client.is_none());
    assert!(ids.identify(&bearer, direct).unwrap().client.is_some());
    assert_eq!(
        ids.identify(&forwarded, proxy).unwrap().ip,
        "198.51.100.23".parse::<IpAddr>().unwrap()
    );

    let mut g = c.benchmark_group("identity");
    g.bench_function("anonymous (no key)", |b| {
        b.iter(|| black_box(ids.identify(black_box(&anonymous), direct)))
    });
    g.bench_function("bearer key (100 clients)", |b| {
        b.iter(|| black_box(ids.identify(black_box(&bearer), direct)))
    });
    g.bench_function("trusted proxy X-Forwarded-For", |b| {
        b.iter(|| black_box(ids.identify(black_box(&forwarded), proxy)))
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------
// 2. Route match
// ---------------------------------------------------------------------------------------

fn route_match(c: &mut Criterion) {
    let mut toml = String::from(
        "[server]\nlisten = \"127.0.0.1:0\"\n\
         [[upstreams]]\nname = \"api\"\ntargets = [\"http://127.0.0.1:9\"]\n\
         [[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = { anonymous = 60 }\n",
    );
    // 50 routes: 24 host-specific and 25 host-less prefixes of assorted lengths, and
    // the one the hit benchmark finds.
    for i in 0..24 {
        toml.push_str(&format!(
            "[[routes]]\nhost = \"api.example.com\"\npath_prefix = \"/v1/resource{i}/items\"\nupstream = \"api\"\nlimits = [\"core\"]\n"
        ));
    }
    for i in 0..25 {
        toml.push_str(&format!(
            "[[routes]]\npath_prefix = \"/v2/r{i}\"\nupstream = \"api\"\nlimits = [\"core\"]\n"
        ));
    }
    toml.push_str(
        "[[routes]]\nhost = \"api.example.com\"\npath_prefix = \"/v1/orders\"\nupstream = \"api\"\nlimits = [\"core\"]\n",
    );
    let snap = snapshot(&toml);
    let router = &snap.router;
    assert_eq!(router.len(), 50);
    assert_eq!(
        &*router
            .find(
                Some("api.example.com"),
                "/v1/orders/123",
                &http::Method::GET
            )
            .expect("hit")
            .path_prefix,
        "/v1/orders"
    );
    assert!(router
        .find(
            Some("other.example.org"),
            "/v3/nothing/here",
            &http::Method::GET
        )
        .is_none());

    let mut g = c.benchmark_group("route");
    g.bench_function("find hit (50 routes)", |b| {
        b.iter(|| {
            black_box(router.find(
                black_box(Some("api.example.com")),
                black_box("/v1/orders/123"),
                &http::Method::GET,
            ))
        })
    });
    g.bench_function("find miss (50 routes)", |b| {
        b.iter(|| {
            black_box(router.find(
                black_box(Some("other.example.org")),
                black_box("/v3/nothing/here"),
                &http::Method::GET,
            ))
        })
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------
// 3. Key derivation
// ---------------------------------------------------------------------------------------

fn key_derivation(c: &mut Criterion) {
    let scheme = KeyScheme::new("tollgate:", Some("secret"));
    let digest = scheme.digest(b"ip:203.0.113.7");

    let mut g = c.benchmark_group("key");
    g.bench_function("digest (HMAC-SHA256)", |b| {
        b.iter(|| black_box(scheme.digest(black_box(b"ip:203.0.113.7"))))
    });
    g.bench_function("key_for (from digest)", |b| {
        b.iter(|| black_box(scheme.key_for(black_box("core"), black_box(&digest))))
    });
    g.bench_function("key (digest + key_for)", |b| {
        b.iter(|| black_box(scheme.key(black_box("core"), black_box("ip:203.0.113.7"))))
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------
// 4. Header rendering
// ---------------------------------------------------------------------------------------

fn header_rendering(c: &mut Criterion) {
    let usage = Usage {
        resource: Arc::from("core"),
        quota: 5000,
        used: 1234,
        reset_at_ms: NOW_MS + WINDOW_MS,
        retry_at_ms: 0,
        blocked_until_ms: 0,
        more_at_ms: 0,
    };
    // A typical upstream response's headers, which put_usage adds to.
    let mut upstream = HeaderMap::new();
    upstream.insert("content-type", HeaderValue::from_static("application/json"));
    upstream.insert("content-length", HeaderValue::from_static("512"));
    upstream.insert(
        "date",
        HeaderValue::from_static("Tue, 14 Nov 2023 22:13:20 GMT"),
    );
    upstream.insert("server", HeaderValue::from_static("upstream"));

    let mut g = c.benchmark_group("headers");
    g.bench_function("put_usage (upstream response)", |b| {
        b.iter_batched_ref(
            || upstream.clone(),
            |h| tollgate::proxy::headers::put_usage(h, black_box(&usage)),
            BatchSize::SmallInput,
        )
    });
    // The same map again: the five headers are already there and are replaced in
    // place, so this is the formatting and hashing alone, without the map's growth.
    let mut reused = upstream.clone();
    tollgate::proxy::headers::put_usage(&mut reused, &usage);
    g.bench_function("put_usage (replacing)", |b| {
        b.iter(|| tollgate::proxy::headers::put_usage(&mut reused, black_box(&usage)))
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------
// 5. Memory store
// ---------------------------------------------------------------------------------------

fn memory_store(c: &mut Criterion) {
    let store = MemoryStore::new();
    let scheme = KeyScheme::new("tollgate:", None);
    let hot = scheme.key("core", "client:acme");
    let leased = scheme.key("core", "client:leased");
    let keys: Vec<_> = (0..100_000)
        .map(|i| {
            scheme.key(
                "core",
                &format!("ip:10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255),
            )
        })
        .collect();
    let policy = Policy::fixed(HUGE_QUOTA, WINDOW_MS);
    let item = |key, kind| Item {
        key,
        policy: &policy,
        op: Op {
            kind,
            cost: 1,
            id: 0,
        },
    };
    store
        .apply_now(&item(&hot, OpKind::Charge), NOW_MS)
        .unwrap();
    for k in &keys {
        store.apply_now(&item(k, OpKind::Charge), NOW_MS).unwrap();
    }

    let mut g = c.benchmark_group("memory");
    g.bench_function("check (hot key)", |b| {
        b.iter(|| black_box(store.apply_now(black_box(&item(&hot, OpKind::Peek)), NOW_MS)))
    });
    g.bench_function("charge (hot key)", |b| {
        b.iter(|| black_box(store.apply_now(black_box(&item(&hot, OpKind::Charge)), NOW_MS)))
    });
    let mut i = 0usize;
    g.bench_function("charge (100k keys)", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            black_box(store.apply_now(&item(&keys[i], OpKind::Charge), NOW_MS))
        })
    });
    g.bench_function("lease_now (hot key)", |b| {
        b.iter(|| black_box(store.lease_now(black_box(&leased), 10, HUGE_QUOTA, WINDOW_MS, NOW_MS)))
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------
// 6. The whole limiter on the memory store
// ---------------------------------------------------------------------------------------

fn limiter_memory(c: &mut Criterion) {
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\
         [store]\nbackend = \"memory\"\n\
         [[identity.clients]]\nid = \"acme\"\nkey_sha256 = \"{}\"\ntier = \"default\"\n\
         [[upstreams]]\nname = \"api\"\ntargets = [\"http://127.0.0.1:9\"]\n\
         [[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = {{ anonymous = {HUGE_QUOTA}, default = {HUGE_QUOTA} }}\n\
         [[routes]]\npath_prefix = \"/\"\nupstream = \"api\"\nlimits = [\"core\"]\n",
        sha256_hex("acme-key")
    );
    let snap = snapshot(&toml);
    let route = snap
        .router
        .find(None, "/v1/orders/123", &http::Method::GET)
        .expect("route");
    let mut headers = HeaderMap::new();
    headers.insert("authorization", HeaderValue::from_static("Bearer acme-key"));
    let peer: IpAddr = "203.0.113.7".parse().unwrap();
    let caller = snap.identities.identify(&headers, peer).expect("caller");
    assert!(caller.client.is_some());
    let limiter = &snap.limiter;
    let clock: tollgate::clock::SharedClock = Arc::new(tollgate::clock::SystemClock);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");

    let mut g = c.benchmark_group("limiter (memory)");
    g.bench_function("applicable (1 limit)", |b| {
        b.iter(|| black_box(limiter.applicable(&route.limits, black_box(&caller), &headers)))
    });
    g.bench_function("applicable, remembered (1 limit)", |b| {
        b.iter(|| black_box(limiter.applicable_to(&route.limits, black_box(&caller), &headers)))
    });
    g.bench_function("applicable + check + charge (1 limit)", |b| {
        b.iter(|| {
            rt.block_on(async {
                let applied: Arc<[_]> = limiter
                    .applicable(&route.limits, black_box(&caller), &headers)
                    .into();
                let mut ticket = limiter
                    .check(&applied, route.cost, false, &clock, NOW_MS, None)
                    .await
                    .expect("admitted");
                black_box(ticket.charge(route.cost, NOW_MS).await)
            })
        })
    });
    g.finish();
}

// ---------------------------------------------------------------------------------------
// 7. Lua scripts against a real redis-server
// ---------------------------------------------------------------------------------------

/// `$REDIS_SERVER`, else `redis-server` on `PATH` (and the usual system directories).
fn redis_server_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("REDIS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/bin", "/usr/sbin", "/usr/local/bin"])
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join("redis-server"))
        .find(|p| p.is_file());
    found
}

/// A `redis-server` child process, killed (by PID) and reaped when dropped.
struct RedisServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    fn start(bin: &Path) -> Result<RedisServer, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free loopback port: {e}"))?
            .port();
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
        let child = Command::new(bin)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--loglevel", "warning"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let server = RedisServer {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut con) = server.connect() {
                if redis::cmd("PING").query::<String>(&mut con).is_ok() {
                    return Ok(server);
                }
            }
            if Instant::now() > deadline {
                return Err(format!("redis-server on port {port} did not answer PING"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn connect(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.port))?
            .get_connection_with_timeout(Duration::from_secs(1))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn redis_scripts(c: &mut Criterion) {
    let Some(bin) = redis_server_bin() else {
        eprintln!(
            "SKIPPED redis/* benchmarks: redis-server not found on PATH. Install it \
             (Debian: apt-get install redis-server) or set REDIS_SERVER=/path/to/redis-server."
        );
        return;
    };
    let server = match RedisServer::start(&bin) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("SKIPPED redis/* benchmarks: {e}");
            return;
        }
    };
    let mut con = server.connect().expect("connect to redis-server");

    let apply = redis::Script::new(APPLY_LUA);
    let lease = redis::Script::new(LEASE_LUA);
    let refund = redis::Script::new(REFUND_LUA);
    for s in [&apply, &lease, &refund] {
        s.load(&mut con).expect("SCRIPT LOAD");
    }

    // Redis expires the windows by its own clock (PEXPIREAT reset_at + 1 s), so the
    // scripts get the real time here, not the fixed NOW_MS.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64;
    let scheme = KeyScheme::new("tollgate:", Some("secret"));
    let keys: Vec<String> = ["core", "search", "graphql"]
        .iter()
        .map(|limit| scheme.key(limit, "client:acme").key.to_string())
        .collect();
    let lease_key = scheme.key("core", "client:leased").key.to_string();
    let refund_key = scheme.key("core", "client:refunded").key.to_string();

    // Live windows for CHECK to read; a window with a count that refunds of 1 unit
    // cannot use up, so every REFUND takes the HINCRBY path.
    // lua/apply.lua's integers per key: op, algorithm (0: fixed window), quota, window,
    // burst, align, block (0: none), cost, now, id; all of a call's in ARGV[1], 8 bytes
    // little-endian each.
    let op_args =
        |op: u64, cost: u64| [op, 0, HUGE_QUOTA, WINDOW_MS, HUGE_QUOTA, 0, 0, cost, now, 0];
    let packed = |ops: &[[u64; 10]]| -> Vec<u8> {
        ops.iter().flatten().flat_map(|a| a.to_le_bytes()).collect()
    };
    let mut setup = apply.prepare_invoke();
    for k in &keys {
        setup.key(k);
    }
    setup.key(&refund_key).arg(packed(&[
        op_args(1, 1),
        op_args(1, 1),
        op_args(1, 1),
        op_args(1, HUGE_QUOTA),
    ]));
    // Three integers per key, packed; admitted: used, reset_at, epoch.
    let apply_reply = |reply: Vec<u8>| unpack_integers(&reply).expect("apply.lua's packed reply");
    let verdicts = apply_reply(setup.invoke(&mut con).expect("seed windows"));
    let refund_reset_at = verdicts[3 * 3 + 1] as u64;
    assert!(refund_reset_at > now);

    let mut check1 = apply.prepare_invoke();
    check1.key(&keys[0]).arg(packed(&[op_args(0, 1)]));
    let mut check3 = apply.prepare_invoke();
    for k in &keys {
        check3.key(k);
    }
    check3.arg(packed(&[op_args(0, 1); 3]));
    let mut charge1 = apply.prepare_invoke();
    charge1.key(&keys[0]).arg(packed(&[op_args(1, 1)]));
    let mut charge3 = apply.prepare_invoke();
    for k in &keys {
        charge3.key(k);
    }
    charge3.arg(packed(&[op_args(1, 1); 3]));
    let mut lease1 = lease.prepare_invoke();
    // lua/lease.lua: want, quota, window, now, gateway id, lease_ttl, units kept, their
    // reset_at (none).
    const GATEWAY_ID: u64 = 7;
    lease1
        .key(&lease_key)
        .arg(10)
        .arg(HUGE_QUOTA)
        .arg(WINDOW_MS)
        .arg(now)
        .arg(GATEWAY_ID)
        .arg(WINDOW_MS)
        .arg(0)
        .arg(0);
    // lua/refund.lua: units, their window's reset_at, gateway id.
    let mut refund1 = refund.prepare_invoke();
    refund1
        .key(&refund_key)
        .arg(1)
        .arg(refund_reset_at)
        .arg(GATEWAY_ID);

    // Each invocation must answer as the script's header says before it is timed.
    let r = apply_reply(check1.invoke(&mut con).unwrap());
    assert!(
        r.len() == 3 && r[0] >= 1 && r[1] as u64 > now,
        "apply.lua peek: {r:?}"
    );
    let r = apply_reply(check3.invoke(&mut con).unwrap());
    assert_eq!(r.len(), 9, "apply.lua peek: {r:?}");
    let r: Vec<u64> = lease1.invoke(&mut con).unwrap();
    assert_eq!(r[0], 10, "lease.lua granted: {r:?}");
    let r: Vec<u64> = refund1.invoke(&mut con).unwrap();
    assert_eq!(r[1], refund_reset_at, "refund.lua: {r:?}");

    let mut g = c.benchmark_group("redis");
    g.bench_function("PING (round-trip floor)", |b| {
        b.iter(|| redis::cmd("PING").query::<String>(&mut con).expect("PING"))
    });
    let cases = [
        ("apply.lua peek (1 key)", &check1),
        ("apply.lua peek (3 keys)", &check3),
        ("apply.lua charge (1 key)", &charge1),
        ("apply.lua charge (3 keys)", &charge3),
        ("lease.lua", &lease1),
        ("refund.lua", &refund1),
    ];
    for (name, invocation) in cases {
        g.bench_function(name, |b| {
            b.iter(|| {
                invocation
                    .invoke::<redis::Value>(&mut con)
                    .unwrap_or_else(|e| panic!("{name}: {e}"))
            })
        });
    }
    g.finish();
    drop(con);
    drop(server);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets =
        identity,
        route_match,
        key_derivation,
        header_rendering,
        memory_store,
        limiter_memory,
        redis_scripts
}
criterion_main!(benches);
