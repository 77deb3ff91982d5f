//! Real parts for the integration tests: `redis-server` processes on free loopback
//! ports, a real HTTP upstream, the gateway itself, and a small HTTP client.
#![allow(dead_code, unused_imports, missing_docs, unreachable_pub)]

pub mod binary;
pub mod client;
pub mod cluster_replicas;
pub mod forwarder;
pub mod lag;
pub mod otlp;
pub mod raw;
pub mod redis;
pub mod tls_redis;
pub mod topology;
pub mod upstream;

pub use self::redis::RedisServer;
pub use binary::Binary;
pub use client::{get, get_with, h2_client, send, send_bearer};
pub use upstream::Upstream;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use tollgate::clock::ManualClock;
use tollgate::config::ConfigFile;
use tollgate::Gateway;

/// A gateway started in-process from TOML text, with a clock the test can move.
pub struct TestGateway {
    pub gateway: Gateway,
    pub clock: Arc<ManualClock>,
    pub addr: std::net::SocketAddr,
    _dir: tempfile::TempDir,
    pub path: PathBuf,
}

impl TestGateway {
    /// The admin listener's address, `IP:PORT` (the config must set `admin_listen`).
    pub fn admin(&self) -> String {
        self.gateway.admin_addr().unwrap().to_string()
    }

    pub async fn start(toml: &str) -> TestGateway {
        init_logs();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tollgate.toml");
        std::fs::write(&path, runtime_from_env(toml)).unwrap();
        let file = tollgate::config::read(&path).unwrap_or_else(|r| panic!("config:\n{r}"));
        let clock = ManualClock::new();
        let gateway = Gateway::start(&file, clock.clone())
            .await
            .unwrap_or_else(|e| panic!("start: {e}"));
        let addr = gateway.local_addr();
        TestGateway {
            gateway,
            clock,
            addr,
            _dir: dir,
            path,
        }
    }

    /// Reload from new TOML text.
    pub fn reload(
        &self,
        toml: &str,
    ) -> Result<tollgate::server::ReloadOutcome, tollgate::config::ConfigReport> {
        std::fs::write(&self.path, runtime_from_env(toml)).unwrap();
        let file: ConfigFile = tollgate::config::read(&self.path)?;
        self.gateway.reload(&file)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }
}

/// The gateway's Redis store report, one entry a shard (a cluster master); panics for
/// another store.
pub fn store_report(gw: &TestGateway) -> Vec<tollgate::limiter::store::redis::ShardReport> {
    match &**gw.gateway.snapshot().limiter.store() {
        tollgate::limiter::store::AnyStore::Redis(r) => r.report(),
        other => panic!("not a redis store: {other:?}"),
    }
}

/// Wait (≤ 10 s) until the gateway's Redis store has started and every node has a
/// connection.
pub async fn wait_connected(gw: &TestGateway) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let r = store_report(gw);
        if !r.is_empty() && r.iter().all(|s| s.nodes.iter().all(|n| n.connected)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "store nodes did not connect: {r:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Poll `check` every 20 ms until it holds (panics with `what` after `within`).
pub async fn wait_until(within: std::time::Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !check() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {within:?}: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// GET `path` as the anonymous caller `ip` (`X-Forwarded-For`, from a trusted proxy).
pub async fn as_ip(gw: &TestGateway, path: &str, ip: &str) -> client::Reply {
    get_with(&gw.url(path), &[("x-forwarded-for", ip)]).await
}

/// GET `path` with `headers` until the answer is not 503 (a store connection is still
/// opening), for at most 10 s; that answer.
pub async fn first_answer(gw: &TestGateway, path: &str, headers: &[(&str, &str)]) -> client::Reply {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let r = get_with(&gw.url(path), headers).await;
        if r.status != 503 || std::time::Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// `toml` with `server.runtime` set to `$TOLLGATE_TEST_RUNTIME` (`per_core` or
/// `multi_thread`) when that is set and the text names no runtime itself: run a test
/// module under the other runtime shape with e.g.
/// `TOLLGATE_TEST_RUNTIME=per_core cargo test --test it abuse::`.
pub fn runtime_from_env(toml: &str) -> String {
    match std::env::var("TOLLGATE_TEST_RUNTIME") {
        Ok(shape) if !shape.is_empty() => with_runtime(toml, &shape),
        _ => toml.to_string(),
    }
}

/// The parts of each upstream pool of a gateway [`TestGateway::start`] starts from a
/// config that sets neither `runtime` nor `workers`: 1 under
/// `TOLLGATE_TEST_RUNTIME=multi_thread`, else (`per_core`, the default) one per CPU.
pub fn pool_parts() -> usize {
    match std::env::var("TOLLGATE_TEST_RUNTIME").as_deref() {
        Ok("multi_thread") => 1,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
    }
}

/// `toml` with `runtime = "SHAPE"` in its `[server]` table (added when there is none),
/// unless it sets `runtime` already.
pub fn with_runtime(toml: &str, shape: &str) -> String {
    if toml
        .lines()
        .any(|l| l.trim_start().starts_with("runtime ="))
    {
        return toml.to_string();
    }
    let line = format!("runtime = \"{shape}\"\n");
    match toml.find("[server]\n") {
        Some(at) => {
            let at = at + "[server]\n".len();
            format!("{}{line}{}", &toml[..at], &toml[at..])
        }
        None => format!("[server]\n{line}{toml}"),
    }
}

/// Install this test binary's one tracing subscriber (once; later calls do nothing): the
/// lines `RUST_LOG` selects go to the test's output, and every line at `info` or above is
/// kept for [`log_lines`] once a test has called [`capture_logs`]. One subscriber serves
/// every test of the binary, whichever starts first.
pub fn init_logs() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{fmt, EnvFilter, Layer};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let shown = fmt::layer()
            .with_test_writer()
            .with_filter(EnvFilter::from_default_env());
        let kept = fmt::layer()
            .with_ansi(false)
            .with_writer(|| Capture)
            .with_filter(EnvFilter::new("info"));
        let _ = tracing_subscriber::registry()
            .with(shown)
            .with(kept)
            .try_init();
    });
}

/// The log lines kept since the first [`capture_logs`]: every line the gateways of this
/// process wrote at `info` or above.
static LOGS: std::sync::Mutex<Option<Vec<u8>>> = std::sync::Mutex::new(None);

/// The writer of the kept lines: into [`LOGS`] once capturing has started, else nowhere.
struct Capture;

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(kept) = LOGS.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            kept.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Start keeping log lines (before the gateway whose lines a test reads starts), and
/// install rustls's ring provider as the process default.
pub fn capture_logs() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    init_logs();
    LOGS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(Vec::new);
}

/// Kept log lines containing every one of `needles` (lines of other tests' gateways too:
/// needles name what is the test's own, e.g. an upstream name or a port).
pub fn log_lines(needles: &[&str]) -> Vec<String> {
    let kept = LOGS.lock().unwrap_or_else(|e| e.into_inner());
    let kept = kept.as_ref().expect("capture_logs first");
    String::from_utf8_lossy(kept)
        .lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .map(str::to_owned)
        .collect()
}

/// Run the test `name` (its path in this binary, e.g. `streaming::large_bodies`) in a
/// process of its own, for a test that changes or measures the whole process (an
/// environment variable, the process's memory). In the test binary's process this starts
/// the binary again with that one test and `env` added to its environment, waits for it,
/// asserts that it ran and passed, and returns `false`: the caller returns. In that child
/// process it returns `true`: the caller runs the test's body.
pub fn alone_in_process(name: &str, env: &[(&str, &str)]) -> bool {
    const CHILD: &str = "TOLLGATE_TEST_ALONE";
    if std::env::var(CHILD).as_deref() == Ok(name) {
        return true;
    }
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--test-threads=1"])
        .env(CHILD, name)
        .envs(env.iter().copied())
        .output()
        .expect("run the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} in a process of its own: {}\n{stdout}\n{stderr}",
        out.status
    );
    false
}

/// SHA-256 of an API key, hex, for `key_sha256`.
pub fn sha256_hex(key: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

/// `[store]` for the memory store (none) or Redis shards.
pub fn store_section(redis: Option<&RedisServer>) -> String {
    match redis {
        None => String::new(),
        Some(r) => format!(
            "[store]\nbackend = \"redis\"\n[[store.shards]]\nprimary = \"{}\"\n",
            r.url()
        ),
    }
}

/// Which store a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis,
}

/// `[store]` TOML for a backend; for Redis, the shards' primaries.
pub fn store_toml(
    backend: Backend,
    shards: &[&RedisServer],
    on_error: &str,
    timeout: &str,
) -> String {
    match backend {
        Backend::Memory => format!(
            "[store]\nbackend = \"memory\"\non_error = \"{on_error}\"\ntimeout = \"{timeout}\"\n"
        ),
        Backend::Redis => {
            let mut s = format!("[store]\nbackend = \"redis\"\non_error = \"{on_error}\"\ntimeout = \"{timeout}\"\n");
            for r in shards {
                s.push_str(&format!("[[store.shards]]\nprimary = \"{}\"\n", r.url()));
            }
            s
        }
    }
}

/// The `tollgate` binary, with the environment an operator's shell would not pass on
/// (`TOLLGATE_CONFIG`, `RUST_LOG`) removed.
pub fn tollgate() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    c.env_remove("TOLLGATE_CONFIG").env_remove("RUST_LOG");
    c
}

/// `tollgate check --config PATH`: exit code, stdout, stderr.
pub fn check(path: &Path) -> (i32, String, String) {
    let out = tollgate()
        .args(["check", "--config"])
        .arg(path)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The storage key of the limit keyed `key_name` for the client `id`, as a gateway with
/// `key_prefix = "tollgate:"` and no `hash_key` derives it.
pub fn client_key(key_name: &str, id: &str) -> String {
    tollgate::limiter::key::KeyScheme::new("tollgate:", None)
        .key(key_name, &format!("client:{id}"))
        .key
        .to_string()
}
