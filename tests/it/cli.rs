//! The `tollgate` binary as an operator runs it: `check`, `--version`, SIGTERM, SIGHUP.

use crate::support;
use crate::support::{check, get, sha256_hex, tollgate, Upstream};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn version_prints_and_exits_zero() {
    let out = tollgate().arg("--version").output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("tollgate {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn check_accepts_the_shipped_configs() {
    for file in ["config/tollgate.toml", "config/redis-sharded.toml"] {
        let (code, stdout, stderr) = check(Path::new(file));
        assert_eq!(code, 0, "{file}: {stderr}");
        assert!(
            stdout.starts_with(&format!("{file}: ok: listen 127.0.0.1:8080")),
            "{stdout}"
        );
        assert_eq!(stdout.lines().count(), 1, "one-line summary: {stdout}");
    }
}

#[test]
fn check_reports_every_error_with_path_line_column_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        dir.path(),
        "bad.toml",
        r#"[server]
listen = "127.0.0.1:8080"
workers = 0

[[upstreams]]
name = "api"
targets = ["http://127.0.0.1:9000"]

[[upstreams]]
name = "api"
targets = ["http://127.0.0.1:9001"]

[[limits]]
name = "core"
window = "1h"
quota = { anonymous = 60, gold = 10 }
lease = 0

[[limits]]
name = "empty"
window = "1m"
quota = {}

[[routes]]
path_prefix = "/"
upstream = "nowhere"
limits = ["core", "missing"]
"#,
    );
    let (code, stdout, stderr) = check(&bad);
    assert_eq!(code, 1);
    assert_eq!(stdout, "");
    let p = bad.display().to_string();
    for expected in [
        format!("{p}:3:1: server.workers: must be at least 1"),
        format!("{p}:10:1: upstreams[1].name: duplicate upstream name \"api\""),
        format!("{p}:16:27: limits[0].quota.gold: unknown tier \"gold\""),
        format!("{p}:17:1: limits[0].lease: must be at least 1"),
        format!("{p}:22:1: limits[1].quota: is empty"),
        format!("{p}:26:1: routes[0].upstream: no [[upstreams]] entry is named \"nowhere\""),
        format!("{p}:27:19: routes[0].limits[1]: no [[limits]] entry is named \"missing\""),
    ] {
        assert!(
            stderr.lines().any(|l| l.starts_with(&expected)),
            "missing {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn check_rejects_syntax_unknown_keys_bad_durations_and_unsupported_features() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[server]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n", ":3:1: server.lisen: unknown field `lisen`"),
        ("[store]\ntimeout = \"fast\"\n", ":2:11: store.timeout: invalid duration \"fast\""),
        ("[server\n", ":1:"),
        ("[[limits]]\nname = \"x\"\nalgorithm = \"leaky\"\nwindow = \"1m\"\nquota = { anonymous = 1 }\n", ":3:13: limits[0].algorithm: unknown variant `leaky`, expected one of `fixed_window`, `sliding_window`, `sliding_log`, `gcra`, `concurrency`"),
        ("[[limits]]\nname = \"x\"\nalgorithm = \"gcra\"\nwindow = \"1m\"\nlease = 5\nquota = { anonymous = 1 }\n", "limits[0].lease: lease mode is for fixed windows only"),
        ("[[limits]]\nname = \"x\"\nwindow = \"7d\"\nalign = \"calendar\"\nquota = { anonymous = 1 }\n", "limits[0].align: a calendar window must divide a day"),
        ("[[limits]]\nname = \"x\"\nwindow = \"1m\"\nburst = 3\nquota = { anonymous = 1 }\n", "limits[0].burst: burst is for algorithm = \"gcra\" only"),
        ("[[limits]]\nname = \"x\"\nwindow = \"1m\"\nmode = \"shadow\"\nenforce_percent = 10\nquota = { anonymous = 1 }\n", "limits[0].enforce_percent: a limit in mode = \"shadow\" enforces for nobody"),
        ("[[limits]]\nname = \"x\"\nalgorithm = \"concurrency\"\nwindow = \"1m\"\non_limit = \"delay\"\nquota = { anonymous = 1 }\n", "limits[0].on_limit: a concurrency limit cannot delay"),
        ("[rate_limit_endpoint]\npath = \"rate_limit\"\n", "rate_limit_endpoint.path: must start with `/`"),
        ("[[limits]]\nname = \"x\"\nwindow = \"584541995years\"\nquota = { anonymous = 1 }\n", "limits[0].window: must be at most 1 year"),
        (
            "[[upstreams]]\nname = \"a\"\ntargets = [\"http://x:1\"]\n[[routes]]\npath_prefix = \"/\"\nupstream = \"a\"\nmethods = [\"get\"]\n",
            "routes[0].methods[0]: \"get\" is not an HTTP method in capitals",
        ),
        (
            "[[upstreams]]\nname = \"a\"\ntargets = [\"http://x:1\"]\n[[routes]]\npath_prefix = \"/\"\nupstream = \"a\"\ncharge = \"later\"\n",
            "routes[0].charge: \"later\": expected \"after_response\" or \"on_request\"",
        ),
        ("[store]\nbackend = \"redis\"\nmode = \"cluster\"\n", "store.nodes: mode \"cluster\" needs at least one seed node"),
        (
            "[store]\nbackend = \"redis\"\n[[store.shards]]\nreplicas = [\"redis://127.0.0.1:1\"]\n",
            "store.shards[0]: needs `primary = \"redis://HOST:PORT\"` or `sentinel",
        ),
        ("[server.tls]\ncert = \"a.pem\"\nkey = \"a.key\"\n", "server.tls.cert: cannot read "),
        ("[identity]\nclient_cert_subject_as_caller = true\n", "identity.client_cert_subject_as_caller: needs server.tls.client_ca"),
        ("[[upstreams]]\nname = \"a\"\ntargets = [\"http://x:1\"]\nca = \"nowhere.pem\"\n", "upstreams[0].ca"),
        ("[store]\nbackend = \"redis\"\n", "store.shards: backend \"redis\" needs at least one"),
        ("[server]\nmax_delayed = 0\n", "server.max_delayed: must be between 1 and 1000000"),
        ("[[limits]]\nname = \"x\"\nwindow = \"1m\"\nby = \"ip\"\ntrusted_only = true\nquota = { anonymous = 1 }\n", "limits[0].trusted_only: is for limits with by = \"header:NAME\" only"),
        ("[[limits]]\nname = \"x\"\nwindow = \"1m\"\nblock_for = \"0s\"\nquota = { anonymous = 1 }\n", ":4:1: limits[0].block_for: must be between 1s and 1 year"),
        ("[[limits]]\nname = \"x\"\nalgorithm = \"concurrency\"\nwindow = \"1m\"\nblock_for = \"15m\"\nquota = { anonymous = 1 }\n", ":5:1: limits[0].block_for: is not for concurrency limits"),
        ("[[limits]]\nname = \"x\"\nwindow = \"1m\"\nlease = 10\nblock_for = \"15m\"\nquota = { anonymous = 1 }\n", ":5:1: limits[0].block_for: is not for lease mode"),
    ];
    for (i, (text, expected)) in cases.iter().enumerate() {
        let path = write(dir.path(), &format!("case{i}.toml"), text);
        let (code, _, stderr) = check(&path);
        assert_eq!(code, 1, "case {i} should fail: {text}");
        let line = stderr
            .lines()
            .find(|l| !l.starts_with("warning:"))
            .unwrap_or("");
        assert!(
            line.starts_with(&path.display().to_string()),
            "case {i}: {stderr}"
        );
        assert!(
            stderr.contains(expected),
            "case {i}: expected {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn check_without_a_file_says_so() {
    let (code, _, stderr) = check(Path::new("/nonexistent/tollgate.toml"));
    assert_eq!(code, 1);
    assert!(
        stderr.contains("/nonexistent/tollgate.toml:1:1: (file): cannot read config file"),
        "{stderr}"
    );
}

/// A gateway process on a free port; killed if the test fails before it exits.
struct Running {
    child: Child,
    addr: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_config(upstream: &str, port: u16, quota: u64) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
shutdown_grace = "5s"

[log]
format = "json"

[[identity.clients]]
id = "acme"
key_sha256 = "{key}"

[[upstreams]]
name = "api"
targets = ["{upstream}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = {quota}, default = 100 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        key = sha256_hex("k")
    )
}

fn spawn(config: &Path, port: u16) -> Running {
    let child = tollgate()
        .arg("--config")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(Instant::now() < deadline, "gateway did not start listening");
        std::thread::sleep(Duration::from_millis(20));
    }
    Running { child, addr }
}

fn signal(child: &Child, sig: &str) {
    assert!(Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_in_flight_request_finish_and_exits_zero() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let port = support::redis::free_port();
    let config = write(dir.path(), "t.toml", &run_config(&upstream.url(), port, 10));
    let mut gw = spawn(&config, port);

    let url = format!("http://{}/slow/1000", gw.addr);
    let in_flight = tokio::spawn(async move { get(&url).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(&gw.child, "-TERM");

    let r = in_flight.await.unwrap();
    assert_eq!(r.status, 200, "the in-flight request completes");
    assert_eq!(r.text(), "slow ok");
    let status = tokio::task::spawn_blocking(move || {
        let s = gw.child.wait().unwrap();
        let mut logs = String::new();
        for line in BufReader::new(gw.child.stderr.take().unwrap()).lines() {
            logs.push_str(&line.unwrap());
            logs.push('\n');
        }
        (s, logs)
    })
    .await
    .unwrap();
    assert_eq!(status.0.code(), Some(0), "logs:\n{}", status.1);
    // log.format = "json": every line is a JSON object.
    for line in status.1.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v.get("level").is_some());
    }
    assert!(status.1.contains("SIGTERM received"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_a_valid_file_and_keeps_running_on_an_invalid_one() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let port = support::redis::free_port();
    let config = write(dir.path(), "t.toml", &run_config(&upstream.url(), port, 10));
    let gw = spawn(&config, port);
    let url = format!("http://{}/", gw.addr);
    assert_eq!(get(&url).await.header("x-ratelimit-limit"), "10");

    // A valid change: the new quota shows in the headers, the window carries on.
    write(dir.path(), "t.toml", &run_config(&upstream.url(), port, 20));
    signal(&gw.child, "-HUP");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = get(&url).await;
        if r.header("x-ratelimit-limit") == "20" {
            assert!(
                r.num("x-ratelimit-used") >= 2,
                "the window survives a reload"
            );
            break;
        }
        assert!(Instant::now() < deadline, "reload not applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // An invalid file: logged, and the running config stays.
    write(dir.path(), "t.toml", "[server]\nlisten = 3\n");
    signal(&gw.child, "-HUP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = get(&url).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-limit"), "20");
}

#[test]
fn check_against_the_running_config_warns_when_the_shard_list_changes() {
    let dir = tempfile::tempdir().unwrap();
    let shards = |n: usize| {
        let mut s = String::from("[store]\nbackend = \"redis\"\n");
        for i in 0..n {
            s.push_str(&format!(
                "[[store.shards]]\nprimary = \"redis://127.0.0.1:{}\"\n",
                7000 + i
            ));
        }
        s
    };
    let old = write(dir.path(), "old.toml", &shards(2));
    let new = write(dir.path(), "new.toml", &shards(3));
    let out = tollgate()
        .args(["check", "--config"])
        .arg(&new)
        .arg("--against")
        .arg(&old)
        .output()
        .unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "store.shards: the shard list changed (2 -> 3 shards): about 33% of callers move"
        ),
        "{stderr}"
    );
    let out = tollgate()
        .args(["check", "--config"])
        .arg(&old)
        .arg("--against")
        .arg(&old)
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).contains("shard list changed"));

    // A changed hash_key is named as such, not as a shard change.
    let rekeyed = write(
        dir.path(),
        "rekeyed.toml",
        &shards(2).replace(
            "backend = \"redis\"\n",
            "backend = \"redis\"\nhash_key = \"s2\"\n",
        ),
    );
    let out = tollgate()
        .args(["check", "--config"])
        .arg(&rekeyed)
        .arg("--against")
        .arg(&old)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("store.hash_key: store.hash_key changed: every caller gets new keys"),
        "{stderr}"
    );
    assert!(!stderr.contains("store.shards"), "{stderr}");
}

/// Threads of a process that serve the proxy listener: tokio's worker threads
/// (`runtime = "multi_thread"`) or tollgate's per-core workers (`"per_core"`, the
/// default).
fn runtime_workers(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| matches!(name.trim(), "tokio-rt-worker" | "tollgate-worker"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_workers_sizes_the_runtime() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    for workers in [1usize, 3] {
        let port = support::redis::free_port();
        let text = run_config(&upstream.url(), port, 10).replace(
            "shutdown_grace = \"5s\"",
            &format!("shutdown_grace = \"5s\"\nworkers = {workers}"),
        );
        let config = write(dir.path(), &format!("w{workers}.toml"), &text);
        let gw = spawn(&config, port);
        assert_eq!(get(&format!("http://{}/", gw.addr)).await.status, 200);
        assert_eq!(
            runtime_workers(gw.child.id()),
            workers,
            "workers = {workers}"
        );
    }
}

#[test]
fn check_reports_unknown_keys_and_every_error_after_them() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"[server]
listen = "127.0.0.1:8080"

[[upstreams]]
name = "api"
targets = ["http://127.0.0.1:9000"]

[[limits]]
name = "core"
window = "1h"
quota = { anonymous = 60 }
colour = "blue"

[[limits]]
name = "search"
window = "4 fortnights"
quota = { anonymous = 10 }

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core", "nope"]
"#;
    let bad = write(dir.path(), "two.toml", text);
    let (code, _, stderr) = check(&bad);
    assert_eq!(code, 1);
    let p = bad.display().to_string();
    assert!(
        stderr.contains(&format!(
            "{p}:12:1: limits[0].colour: unknown field `colour`"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "{p}:16:10: limits[1].window: invalid duration \"4 fortnights\""
        )),
        "{stderr}"
    );
    // With the duration fixed, the unknown key is still reported, and so are the
    // semantic errors of the rest of the file.
    let bad = write(dir.path(), "one.toml", &text.replace("4 fortnights", "4m"));
    let (code, _, stderr) = check(&bad);
    assert_eq!(code, 1);
    let p = bad.display().to_string();
    assert!(
        stderr.contains(&format!(
            "{p}:12:1: limits[0].colour: unknown field `colour`"
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "{p}:22:19: routes[0].limits[1]: no [[limits]] entry is named \"nope\""
        )),
        "{stderr}"
    );
}

/// Every invalid value is reported, not only the first one, each with
/// its line and column, capped at 100 lines and a count of the rest.
#[test]
fn check_reports_every_invalid_value_capped_with_a_count() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::from(
        "[server]\nlisten = 8080\n\n[[upstreams]]\nname = \"api\"\ntargets = [\"http://127.0.0.1:9000\", 7]\n\n",
    );
    for i in 0..10_000 {
        text.push_str(&format!(
            "[[limits]]\nname = \"l{i}\"\nwindow = \"zz\"\nquota = {{ anonymous = -1 }}\n\n"
        ));
    }
    text.push_str("[[routes]]\npath_prefix = \"/\"\nupstream = \"api\"\ncolour = \"blue\"\n");
    let bad = write(dir.path(), "many.toml", &text);
    let (code, _, stderr) = check(&bad);
    assert_eq!(code, 1);
    let p = bad.display().to_string();
    let lines: Vec<&str> = stderr.lines().collect();
    // server.listen, upstreams[0].targets[1], 2 per limit, routes[0].colour.
    assert_eq!(lines.len(), 101, "{}", &stderr[..stderr.len().min(3000)]);
    assert!(
        lines[0].starts_with(&format!("{p}:2:10: server.listen: invalid type")),
        "{}",
        lines[0]
    );
    assert!(
        lines[1].starts_with(&format!("{p}:6:37: upstreams[0].targets[1]: invalid type")),
        "{}",
        lines[1]
    );
    assert!(
        lines[2].starts_with(&format!(
            "{p}:10:10: limits[0].window: invalid duration \"zz\""
        )),
        "{}",
        lines[2]
    );
    assert!(
        lines[3].starts_with(&format!(
            "{p}:11:23: limits[0].quota.anonymous: invalid value: integer `-1`"
        )),
        "{}",
        lines[3]
    );
    assert!(lines[4].contains("limits[1].window"), "{}", lines[4]);
    assert_eq!(
        lines[100],
        format!(
            "{p}: 19903 more errors not shown (fix those above and run `tollgate check` again)"
        )
    );
    // Fixing the values leaves the unknown key, reported with the semantic checks.
    let fixed = text
        .replace("listen = 8080", "listen = \"127.0.0.1:8080\"")
        .replace(", 7]", "]")
        .replace("window = \"zz\"", "window = \"1h\"")
        .replace("anonymous = -1", "anonymous = 1");
    let (code, _, stderr) = check(&write(dir.path(), "fixed.toml", &fixed));
    assert_eq!(code, 1);
    assert!(
        stderr.contains("routes[0].colour: unknown field `colour`"),
        "{stderr}"
    );
}

/// `tollgate check`'s unknown-key hint, `tollgate --help` and `tollgate
/// check --help` name docs/configuration.md, the full reference of the config keys.
#[test]
fn the_unknown_key_hint_and_help_name_the_configuration_reference() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        dir.path(),
        "unknown.toml",
        "[server]\nlisten = \"127.0.0.1:8080\"\nlisen = 3\n",
    );
    let (code, _, stderr) = check(&bad);
    assert_eq!(code, 1);
    let line = stderr
        .lines()
        .find(|l| l.contains("server.lisen: unknown field `lisen`"))
        .unwrap_or_else(|| panic!("no unknown-key line in:\n{stderr}"));
    assert!(
        line.contains("docs/configuration.md"),
        "the hint names the reference: {line}"
    );
    for args in [&["--help"][..], &["check", "--help"]] {
        let out = tollgate().args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("docs/configuration.md"),
            "{args:?} names the reference:\n{help}"
        );
    }
}
