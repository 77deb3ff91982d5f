//! `tollgate replay`: generated access logs whose answers are known, on each
//! algorithm; a trace sent through a running gateway, replayed over its own access log;
//! gzip and nginx input; unparsed lines; `--compare`; the JSON shape; `--plot`.

use crate::support;
use crate::support::{sha256_hex, tollgate, Upstream};
use std::io::Write;
use std::path::{Path, PathBuf};

/// 2026-11-24T11:00:00Z: a minute boundary (sliding windows align on it).
const T0: u64 = 1_795_518_000_000;

fn config(dir: &Path, name: &str, limits: &str, routes_limits: &str) -> PathBuf {
    let text = format!(
        r#"[server]
listen = "127.0.0.1:0"

[[identity.clients]]
id = "acme"
key_sha256 = "{}"
tier = "default"

[[identity.clients]]
id = "globex"
key_sha256 = "{}"
tier = "default"

[[upstreams]]
name = "api"
targets = ["http://127.0.0.1:9"]

{limits}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = [{routes_limits}]
"#,
        sha256_hex("acme-key"),
        sha256_hex("globex-key"),
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn limit(name: &str, algorithm: &str, window: &str, quota: u64) -> String {
    format!(
        "[[limits]]\nname = \"{name}\"\nalgorithm = \"{algorithm}\"\nwindow = \"{window}\"\nquota = {{ anonymous = {quota}, default = {quota} }}\n"
    )
}

/// A tollgate text access line for a request that began at `start` (epoch ms) and
/// took `dur` ms.
fn text_line(start: u64, dur: u64, path: &str, status: u16, caller: &str) -> String {
    let end = tollgate::replay::report::rfc3339(start + dur);
    format!(
        "{end}  INFO tollgate::access: request method=GET path=\"{path}\" route=\"/\" status={status} client=\"203.0.113.9\" caller=\"{caller}\" tier=\"-\" key=\"-\" decision=\"allowed\" limit=\"-\" remaining=-1 cost=1 upstream_ms=0.5 total_ms={dur}.0 request_id=\"r\""
    )
}

/// The same request as a tollgate JSON access line.
fn json_line(start: u64, dur: u64, path: &str, status: u16, caller: &str) -> String {
    serde_json::json!({
        "timestamp": tollgate::replay::report::rfc3339(start + dur),
        "level": "INFO",
        "method": "GET",
        "path": path,
        "route": "/",
        "status": status,
        "client": "203.0.113.9",
        "caller": caller,
        "decision": "allowed",
        "cost": 1,
        "total_ms": dur as f64,
        "message": "request",
        "target": "tollgate::access",
    })
    .to_string()
}

fn write_lines(dir: &Path, name: &str, lines: &[String]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// `tollgate replay --format json --config CONFIG [extra] LOGS`: the parsed document.
fn replay_json(config: &Path, extra: &[&str], logs: &[&Path]) -> serde_json::Value {
    let out = tollgate()
        .arg("replay")
        .arg("--config")
        .arg(config)
        .args(["--format", "json"])
        .args(extra)
        .args(logs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "replay failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// The entry of `limits` for `name` and `tier`.
fn entry<'a>(doc: &'a serde_json::Value, name: &str, tier: &str) -> &'a serde_json::Value {
    doc["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name && l["tier"] == tier)
        .unwrap_or_else(|| panic!("no {name}/{tier} in {doc:#}"))
}

/// One caller, 100 requests within one second against 10 a minute: 90 refused, on
/// each algorithm that counts units (a known answer, whatever the algorithm).
#[test]
fn a_burst_of_100_against_10_a_minute_refuses_90_on_every_algorithm() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..100)
        .map(|i| text_line(T0 + i * 10, 1, "/v1/x", 200, "acme"))
        .collect();
    let log = write_lines(dir.path(), "access.log", &lines);
    for algorithm in ["fixed_window", "sliding_window", "sliding_log", "gcra"] {
        let cfg = config(
            dir.path(),
            &format!("{algorithm}.toml"),
            &limit("core", algorithm, "1m", 10),
            "\"core\"",
        );
        let doc = replay_json(&cfg, &[], &[&log]);
        let core = entry(&doc, "core", "default");
        assert_eq!(core["requests"], 100, "{algorithm}: {core:#}");
        assert_eq!(core["refused"], 90, "{algorithm}: {core:#}");
        assert_eq!(core["callers_refused"], 1, "{algorithm}");
        assert_eq!(core["top"][0]["caller"], "acme", "{algorithm}");
        assert_eq!(core["top"][0]["refused"], 90, "{algorithm}");
        // The 11th request (at T0 + 100 ms) is the first refused.
        assert_eq!(core["top"][0]["first_refused_ms"], T0 + 100, "{algorithm}");
        assert_eq!(core["peak_used"], 10, "{algorithm}");
        assert_eq!(core["peak_quota"], 10, "{algorithm}");
        assert_eq!(doc["totals"]["refused"], 90, "{algorithm}");
    }
}

/// Time moves with the log: 100 requests over two minutes (one every 1.2 s) against 10
/// a minute. A fixed window (from the first request) admits 10 in [0, 60 s) and 10 in
/// [60 s, 120 s); the sliding log admits 10 at 0-10.8 s and, as those leave the
/// window, 10 at 60-70.8 s: 80 refused either way. GCRA (10 a minute, burst 10: one
/// unit every 6 s) admits while the theoretical arrival time stays within 60 s of
/// now: 12 at 0-13.2 s (the bucket drains while it fills), then one every 6 s from
/// 18 s to 114 s (17): 29 admitted, 71 refused.
#[test]
fn refusals_follow_the_logs_clock() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..100)
        .map(|i| json_line(T0 + i * 1_200, 2, "/v1/x", 200, "acme"))
        .collect();
    let log = write_lines(dir.path(), "access.json", &lines);
    for (algorithm, refused) in [("fixed_window", 80), ("sliding_log", 80), ("gcra", 71)] {
        let cfg = config(
            dir.path(),
            &format!("{algorithm}.toml"),
            &limit("core", algorithm, "1m", 10),
            "\"core\"",
        );
        let doc = replay_json(&cfg, &[], &[&log]);
        assert_eq!(
            entry(&doc, "core", "default")["refused"],
            refused,
            "{algorithm}"
        );
    }
}

/// A concurrency limit of 2, replayed from the logged durations: 10 requests of 1 s
/// starting every 100 ms: the first two hold the slots, the next 8 are refused; the
/// 11th starts at 1.1 s, when both have ended, and is admitted.
#[test]
fn concurrency_is_replayed_from_the_logged_durations() {
    let dir = tempfile::tempdir().unwrap();
    let mut reqs: Vec<(u64, u64)> = (0..10).map(|i| (T0 + i * 100, 1_000)).collect();
    reqs.push((T0 + 1_100, 50));
    // Lines are written when responses end.
    reqs.sort_by_key(|(s, d)| s + d);
    let lines: Vec<String> = reqs
        .iter()
        .map(|(s, d)| text_line(*s, *d, "/v1/x", 200, "acme"))
        .collect();
    let log = write_lines(dir.path(), "access.log", &lines);
    let cfg = config(
        dir.path(),
        "c.toml",
        &limit("slots", "concurrency", "1m", 2),
        "\"slots\"",
    );
    let doc = replay_json(&cfg, &[], &[&log]);
    let slots = entry(&doc, "slots", "default");
    assert_eq!(slots["requests"], 11, "{slots:#}");
    assert_eq!(slots["refused"], 8, "{slots:#}");
    assert_eq!(slots["not_replayable"], 0);

    // nginx `combined` has no durations: not replayable, and said so.
    let nginx = write_lines(
        dir.path(),
        "nginx.log",
        &[
            r#"192.0.2.1 - - [24/Nov/2026:11:00:00 +0000] "GET / HTTP/1.1" 200 5 "-" "ua""#
                .to_string(),
        ],
    );
    let doc = replay_json(&cfg, &[], &[&nginx]);
    let slots = entry(&doc, "slots", "anonymous");
    assert_eq!(slots["not_replayable"], 1, "{doc:#}");
    assert!(
        doc["notes"].to_string().contains("concurrency limits need"),
        "{doc:#}"
    );
}

/// gzip-compressed logs read like plain ones (detected by content), and several files
/// are one timeline, read in the order of their first request whatever the order
/// given (a rotated `access.log.1.gz` after `access.log`, as a shell glob lists them).
#[test]
fn gzip_logs_are_read_and_files_are_put_in_time_order() {
    let dir = tempfile::tempdir().unwrap();
    // 15 requests in each of two minutes against 10 a minute: 5 refused in each. Read
    // in the wrong order, the second minute's window would refuse all of the first's.
    let lines: Vec<String> = (0..30)
        .map(|i| {
            text_line(
                T0 + (i / 15) * 60_000 + (i % 15) * 10,
                1,
                "/v1/x",
                200,
                "acme",
            )
        })
        .collect();
    let gz = dir.path().join("access.log.1.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&gz).unwrap(),
        flate2::Compression::default(),
    );
    enc.write_all((lines[..15].join("\n") + "\n").as_bytes())
        .unwrap();
    enc.finish().unwrap();
    let plain = write_lines(dir.path(), "access.log", &lines[15..]);
    let cfg = config(
        dir.path(),
        "f.toml",
        &limit("core", "fixed_window", "1m", 10),
        "\"core\"",
    );
    let doc = replay_json(&cfg, &[], &[&plain, &gz]);
    assert_eq!(doc["requests"], 30);
    assert_eq!(entry(&doc, "core", "default")["refused"], 10, "{doc:#}");
    assert_eq!(doc["unparsed_lines"], 0);
    assert_eq!(doc["logs"][0], gz.to_str().unwrap());
}

/// nginx `combined`: callers by client address; with a custom log_format's extra
/// quoted field, by caller id (their tier from the config).
#[test]
fn nginx_combined_logs_are_replayed_by_address_or_caller_field() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines = Vec::new();
    for i in 0..30 {
        // Two addresses, 15 requests each, within a minute.
        let addr = if i % 2 == 0 { "192.0.2.1" } else { "192.0.2.2" };
        lines.push(format!(
            r#"{addr} - - [24/Nov/2026:11:00:{:02} +0000] "GET /v1/items?page={i} HTTP/1.1" 200 512 "-" "curl/8.5""#,
            i
        ));
    }
    for i in 0..12 {
        lines.push(format!(
            r#"192.0.2.3 - - [24/Nov/2026:11:00:{:02} +0000] "POST /v1/orders HTTP/1.1" 201 2 "https://example.com/" "app/1" "globex" 0.012"#,
            30 + i
        ));
    }
    let log = write_lines(dir.path(), "nginx.log", &lines);
    let cfg = config(
        dir.path(),
        "n.toml",
        &limit("core", "fixed_window", "1m", 10),
        "\"core\"",
    );
    let doc = replay_json(&cfg, &[], &[&log]);
    let anon = entry(&doc, "core", "anonymous");
    assert_eq!(anon["requests"], 30);
    assert_eq!(anon["refused"], 10, "{anon:#}");
    assert_eq!(anon["callers_refused"], 2);
    let callers: Vec<&str> = anon["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["caller"].as_str().unwrap())
        .collect();
    assert_eq!(callers, ["192.0.2.1", "192.0.2.2"]);
    let default = entry(&doc, "core", "default");
    assert_eq!(default["requests"], 12);
    assert_eq!(default["refused"], 2);
    assert_eq!(default["top"][0]["caller"], "globex");
    assert_eq!(doc["unparsed_lines"], 0);
}

/// A line that cannot be read is counted and shown with its file and line number; it
/// never stops the replay. Other lines of tollgate's log are not errors.
#[test]
fn unparsed_lines_are_counted_and_shown_with_their_line_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines: Vec<String> = (0..20)
        .map(|i| text_line(T0 + i * 10, 1, "/v1/x", 200, "acme"))
        .collect();
    lines.insert(3, "this is not a log line".to_string());
    lines.insert(
        8,
        "2026-11-24T11:00:00.000Z  INFO tollgate::server: tollgate listening listen=127.0.0.1:8080"
            .to_string(),
    );
    lines.insert(12, "{\"truncated\": ".to_string());
    let log = write_lines(dir.path(), "access.log", &lines);
    let cfg = config(
        dir.path(),
        "f.toml",
        &limit("core", "fixed_window", "1m", 10),
        "\"core\"",
    );
    let doc = replay_json(&cfg, &[], &[&log]);
    assert_eq!(doc["unparsed_lines"], 2, "{doc:#}");
    assert_eq!(doc["other_lines"], 1);
    assert_eq!(doc["requests"], 20);
    assert_eq!(entry(&doc, "core", "default")["refused"], 10);
    assert_eq!(doc["unparsed"][0]["line"], 4);
    assert_eq!(doc["unparsed"][0]["text"], "this is not a log line");
    assert_eq!(doc["unparsed"][1]["line"], 13);

    // The text report shows them as FILE:LINE.
    let out = tollgate()
        .arg("replay")
        .arg("--config")
        .arg(&cfg)
        .arg(&log)
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("unparsed lines: 2"), "{text}");
    assert!(text.contains(&format!("{}:4: ", log.display())), "{text}");
}

/// Requests the gateway answered before its limits (an unknown key's 401, a refusal of
/// `identity.failed_auth_limit`) are skipped: no config's limits would see them.
#[test]
fn requests_answered_before_the_limits_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines: Vec<String> = (0..12)
        .map(|i| text_line(T0 + i * 10, 1, "/v1/x", 200, "anonymous"))
        .collect();
    for i in 0..5 {
        lines.push(
            text_line(T0 + 200 + i * 10, 1, "/v1/x", 401, "-")
                .replace("decision=\"allowed\"", "decision=\"unauthenticated\""),
        );
    }
    lines.push(
        text_line(T0 + 300, 1, "/v1/x", 429, "anonymous")
            .replace("decision=\"allowed\"", "decision=\"rejected\"")
            .replace("limit=\"-\"", "limit=\"failed_auth\""),
    );
    let log = write_lines(dir.path(), "access.log", &lines);
    let cfg = config(
        dir.path(),
        "f.toml",
        &limit("core", "fixed_window", "1m", 10),
        "\"core\"",
    );
    let doc = replay_json(&cfg, &[], &[&log]);
    assert_eq!(doc["requests"], 18);
    assert_eq!(doc["skipped"], 6);
    let core = entry(&doc, "core", "anonymous");
    assert_eq!(core["requests"], 12, "{doc:#}");
    assert_eq!(core["refused"], 2);
}

/// `--compare OLD.toml`: both configs side by side and the callers whose verdicts
/// change.
#[test]
fn compare_lists_both_configs_and_the_callers_whose_verdicts_change() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines: Vec<String> = (0..30)
        .map(|i| text_line(T0 + i * 10, 1, "/v1/x", 200, "acme"))
        .collect();
    lines.extend((0..8).map(|i| text_line(T0 + 1_000 + i * 10, 1, "/v1/x", 200, "globex")));
    let log = write_lines(dir.path(), "access.log", &lines);
    let old = config(
        dir.path(),
        "old.toml",
        &limit("core", "fixed_window", "1m", 20),
        "\"core\"",
    );
    let new = config(
        dir.path(),
        "new.toml",
        &limit("core", "fixed_window", "1m", 5),
        "\"core\"",
    );
    let doc = replay_json(&new, &["--compare", old.to_str().unwrap()], &[&log]);
    assert_eq!(entry(&doc, "core", "default")["refused"], 25 + 3);
    let cmp = &doc["compare"];
    assert_eq!(cmp["config"], old.to_str().unwrap());
    let old_core = cmp["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "core")
        .unwrap();
    assert_eq!(old_core["refused"], 10);
    assert_eq!(cmp["changed_callers_total"], 2);
    let changed = cmp["changed_callers"].as_array().unwrap();
    assert_eq!(changed[0]["caller"], "acme");
    assert_eq!(changed[0]["newly_refused"], 15);
    assert_eq!(changed[0]["newly_admitted"], 0);
    assert_eq!(changed[1]["caller"], "globex");
    assert_eq!(changed[1]["newly_refused"], 3);

    let out = tollgate()
        .arg("replay")
        .arg("--config")
        .arg(&new)
        .arg("--compare")
        .arg(&old)
        .arg(&log)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("callers whose verdicts change: 2"), "{text}");
    assert!(
        text.contains("refused: 28 under --config, 10 under --compare"),
        "{text}"
    );
}

/// `--format json` is exactly the documented shape (extra fields allowed).
#[test]
fn json_output_has_the_documented_shape() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..15)
        .map(|i| text_line(T0 + i * 10, 1, "/v1/x", 200, "anonymous"))
        .collect();
    let log = write_lines(dir.path(), "access.log", &lines);
    let cfg = config(
        dir.path(),
        "f.toml",
        &limit("core", "fixed_window", "1m", 10),
        "\"core\"",
    );
    let doc = replay_json(&cfg, &[], &[&log]);
    assert!(doc["unparsed_lines"].is_u64());
    let limits = doc["limits"].as_array().unwrap();
    assert_eq!(limits.len(), 1);
    let l = &limits[0];
    assert_eq!(l["name"], "core");
    assert_eq!(l["tier"], "anonymous");
    assert_eq!(l["requests"], 15);
    assert_eq!(l["refused"], 5);
    assert_eq!(l["callers_refused"], 1);
    let top = l["top"].as_array().unwrap();
    assert_eq!(top.len(), 1);
    // An anonymous caller is known by its logged address.
    assert_eq!(top[0]["caller"], "203.0.113.9");
    assert_eq!(top[0]["refused"], 5);
    assert_eq!(top[0]["first_refused"], "2026-11-24T11:00:00.100Z");
}

/// `--plot FILE.svg` writes an SVG with a panel per top caller and its refusals.
#[test]
fn plot_writes_an_svg_of_the_top_callers() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..300)
        .map(|i| text_line(T0 + i * 1_000, 1, "/v1/x", 200, "acme"))
        .collect();
    let log = write_lines(dir.path(), "access.log", &lines);
    let cfg = config(
        dir.path(),
        "f.toml",
        &limit("core", "fixed_window", "1m", 20),
        "\"core\"",
    );
    let svg = dir.path().join("top.svg");
    let doc = replay_json(&cfg, &["--plot", svg.to_str().unwrap()], &[&log]);
    assert_eq!(entry(&doc, "core", "default")["refused"], 200);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "{}", &text[..100.min(text.len())]);
    assert!(text.contains("acme — limit core"), "no panel title");
    assert!(text.contains("40 refused"), "no refusal marks");
    assert!(text.trim_end().ends_with("</svg>"));
}

/// Bad input that is not a line: an invalid config is reported like `tollgate check`
/// (exit 1), a missing log file too.
#[test]
fn an_invalid_config_or_a_missing_log_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        "bad.toml",
        &limit("core", "fixed_window", "1m", 10),
        "\"nope\"",
    );
    let log = write_lines(dir.path(), "a.log", &[]);
    let out = tollgate()
        .arg("replay")
        .arg("--config")
        .arg(&cfg)
        .arg(&log)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("routes[0].limits[0]"), "{err}");
    let good = config(
        dir.path(),
        "good.toml",
        &limit("core", "fixed_window", "1m", 10),
        "\"core\"",
    );
    let out = tollgate()
        .arg("replay")
        .arg("--config")
        .arg(&good)
        .arg(dir.path().join("missing.log"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.log"));
}

/// A trace sent through a running gateway (the real binary, its access log in a file):
/// replaying that gateway's own config over its own log refuses exactly the requests
/// it refused, limit by limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_refuses_what_the_running_gateway_refused() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let port = support::redis::free_port();
    let text = format!(
        r#"[server]
listen = "127.0.0.1:{port}"

[[identity.clients]]
id = "acme"
key_sha256 = "{}"
tier = "default"

[[upstreams]]
name = "api"
targets = ["{}"]

[[limits]]
name = "core"
window = "1m"
quota = {{ anonymous = 30, default = 12 }}

[[limits]]
name = "search"
algorithm = "sliding_log"
window = "1m"
quota = {{ anonymous = 3, default = 20 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]

[[routes]]
path_prefix = "/search"
upstream = "api"
limits = ["core", "search"]
uncharged_statuses = [404]
"#,
        sha256_hex("acme-key"),
        upstream.url(),
    );
    let path = dir.path().join("tollgate.toml");
    std::fs::write(&path, text).unwrap();
    let gw = support::Binary::spawn(&path, port, &[]);
    let base = format!("http://127.0.0.1:{port}");
    // A mixed trace: acme and an anonymous caller, on both routes; sequential, so that
    // the order the gateway decided in is the order of the log. acme is refused by
    // `core` only (12 of its 20 requests pass), the anonymous caller by `search` only
    // (3 of its 10 searches pass; those refused are not charged to `core`).
    let mut refused: std::collections::BTreeMap<String, u64> = Default::default();
    let mut total = 0;
    for i in 0..40 {
        let (path, key) = match i % 4 {
            0 => ("/items", Some("acme-key")),
            1 => ("/search?q=x", Some("acme-key")),
            2 => ("/items", None),
            _ => ("/search", None),
        };
        let url = format!("{base}{path}");
        let headers: Vec<(&str, String)> = key
            .map(|k| vec![("authorization", format!("Bearer {k}"))])
            .unwrap_or_default();
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = support::get_with(&url, &headers).await;
        if r.status == 429 {
            total += 1;
            *refused
                .entry(r.header("x-ratelimit-resource").to_string())
                .or_default() += 1;
        } else {
            assert_eq!(r.status, 200);
        }
    }
    assert_eq!(total, 8 + 7, "{refused:?}");
    gw.signal("-TERM");
    let mut gw = gw;
    gw.child.wait().unwrap();

    let doc = replay_json(&path, &[], &[&gw.log]);
    assert_eq!(doc["unparsed_lines"], 0, "{doc:#}");
    assert_eq!(doc["requests"], 40);
    assert_eq!(doc["totals"]["refused"], total, "{doc:#}");
    for name in ["core", "search"] {
        let replayed: u64 = doc["limits"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["name"] == name)
            .map(|l| l["refused"].as_u64().unwrap())
            .sum();
        assert_eq!(
            replayed,
            refused.get(name).copied().unwrap_or(0),
            "{name}: gateway {refused:?}, replay {doc:#}"
        );
    }
}

/// A line longer than 64 KiB (here an access line whose path is
/// 100,000 bytes, and a 1 MB line of junk) is counted as unparsed, with the reason,
/// and the lines around it are read as usual.
#[test]
fn a_line_longer_than_the_cap_is_counted_as_unparsed() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines: Vec<String> = (0..20)
        .map(|i| text_line(T0 + i * 10, 1, "/v1/x", 200, "acme"))
        .collect();
    let long_path = format!("/v1/{}", "a".repeat(100_000));
    lines.insert(5, text_line(T0 + 45, 1, &long_path, 200, "acme"));
    lines.insert(9, "x".repeat(1 << 20));
    let log = write_lines(dir.path(), "access.log", &lines);
    let cfg = config(
        dir.path(),
        "f.toml",
        &limit("core", "fixed_window", "1m", 10),
        "\"core\"",
    );
    let doc = replay_json(&cfg, &[], &[&log]);
    assert_eq!(doc["unparsed_lines"], 2, "{doc:#}");
    assert_eq!(doc["requests"], 20);
    assert_eq!(entry(&doc, "core", "default")["refused"], 10);
    assert_eq!(doc["unparsed"][0]["line"], 6);
    assert_eq!(doc["unparsed"][1]["line"], 10);
    for u in doc["unparsed"].as_array().unwrap() {
        assert!(
            u["reason"]
                .as_str()
                .unwrap()
                .starts_with("longer than 65536 bytes"),
            "{u}"
        );
        assert!(u["text"].as_str().unwrap().chars().count() <= 200);
    }
}

/// The windows of callers seen once are dropped once they have
/// passed, so the states held follow the windows open at once (about 1,000 here), not
/// the 20,000 callers of the log; decisions are unchanged (each caller's second
/// request in its minute is refused, its request a minute later is not).
#[test]
fn expired_windows_are_dropped_as_the_log_moves_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines = Vec::new();
    // 20 minutes, 1,000 new callers a minute, two requests each in their minute; the
    // callers of the first minute come back once in the third.
    for m in 0..20u64 {
        for c in 0..1000u64 {
            let start = T0 + m * 60_000 + c * 50;
            let caller = format!("c{}", m * 1000 + c);
            lines.push(text_line(start, 1, "/v1/x", 200, &caller));
            lines.push(text_line(start + 10, 1, "/v1/x", 200, &caller));
            if m == 2 && c < 100 {
                lines.push(text_line(start + 20, 1, "/v1/x", 200, &format!("c{c}")));
            }
        }
    }
    let log = write_lines(dir.path(), "access.log", &lines);
    let cfg = config(
        dir.path(),
        "f.toml",
        &limit("core", "fixed_window", "1m", 1),
        "\"core\"",
    );
    let doc = replay_json(&cfg, &[], &[&log]);
    assert_eq!(doc["requests"], 40_100, "{doc:#}");
    let core = entry(&doc, "core", "anonymous");
    assert_eq!(core["refused"], 20_000, "{core:#}");
    let peak = doc["windows"]["peak"].as_u64().unwrap();
    let dropped = doc["windows"]["dropped"].as_u64().unwrap();
    assert!(peak <= 5_000, "peak {peak}: {:#}", doc["windows"]);
    assert!(dropped >= 15_000, "dropped {dropped}: {:#}", doc["windows"]);
}
