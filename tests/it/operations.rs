//! Operating tollgate: hot reload (in-process and through the binary), file watching,
//! the admin endpoints, metrics, access logs, request ids, sd_notify, graceful shutdown.

use crate::support;
use crate::support::{get, get_with, sha256_hex, Binary, RedisServer, TestGateway, Upstream};
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY: &str = "ops-key";

fn config(upstream: &Upstream, quota: u64, extra_server: &str, store: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
shutdown_grace = "5s"
{extra_server}

{store}

[[identity.clients]]
id = "acme"
key_sha256 = "{key}"

[[upstreams]]
name = "api"
targets = ["{up}"]
response_timeout = "10s"

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = {quota}, default = 100000 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        key = sha256_hex(KEY),
        up = upstream.url()
    )
}

fn admin(gw: &TestGateway, path: &str) -> String {
    format!(
        "http://{}{}",
        gw.gateway.admin_addr().expect("admin listener"),
        path
    )
}

async fn wait_for_limit(url: &str, limit: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let r = get(url).await;
        if r.header("x-ratelimit-limit") == limit {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "X-RateLimit-Limit never became {limit} (is {})",
            r.header("x-ratelimit-limit")
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_finish_on_the_snapshot_they_started_with() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 10, "", "")).await;
    let url = gw.url("/slow/700");
    let in_flight = tokio::spawn(async move { get(&url).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    gw.reload(&config(&upstream, 20, "", "")).unwrap();
    assert_eq!(
        get(&gw.url("/")).await.header("x-ratelimit-limit"),
        "20",
        "new requests see the new config"
    );
    let r = in_flight.await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-limit"),
        "10",
        "the old request finished on its snapshot"
    );
    assert_eq!(gw.gateway.snapshot().generation, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_file_is_watched_through_rename_replace_and_symlink_swaps() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 10, "", "")).await;
    let dir = gw.path.parent().unwrap().to_path_buf();
    let _watcher = tollgate::reload::watch_file(gw.gateway.reloader(), gw.path.clone()).unwrap();

    // An editor's save: write a new file, rename it over the old one.
    let tmp = dir.join(".tollgate.toml.swp");
    std::fs::write(&tmp, config(&upstream, 11, "", "")).unwrap();
    std::fs::rename(&tmp, &gw.path).unwrap();
    wait_for_limit(&gw.url("/"), "11", Duration::from_secs(5)).await;

    // An invalid save is rejected and counted; the running config stays.
    std::fs::write(&tmp, "[server\n").unwrap();
    std::fs::rename(&tmp, &gw.path).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !get(&admin(&gw, "/metrics"))
        .await
        .text()
        .contains("tollgate_reloads_total{result=\"failed\"} 1")
    {
        assert!(Instant::now() < deadline, "failed reload not counted");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(get(&gw.url("/")).await.header("x-ratelimit-limit"), "11");

    // A Kubernetes ConfigMap mount: the file is a symlink through `..data`, which is
    // swapped atomically to a new directory.
    let k8s = dir.join("k8s");
    std::fs::create_dir(&k8s).unwrap();
    let v1 = k8s.join("..v1");
    std::fs::create_dir(&v1).unwrap();
    std::fs::write(v1.join("tollgate.toml"), config(&upstream, 12, "", "")).unwrap();
    std::os::unix::fs::symlink("..v1", k8s.join("..data")).unwrap();
    let cm_path = k8s.join("tollgate.toml");
    std::os::unix::fs::symlink("..data/tollgate.toml", &cm_path).unwrap();
    let file = tollgate::config::read(&cm_path).unwrap();
    gw.gateway.reload(&file).unwrap();
    let _cm_watcher = tollgate::reload::watch_file(gw.gateway.reloader(), cm_path.clone()).unwrap();
    assert_eq!(get(&gw.url("/")).await.header("x-ratelimit-limit"), "12");

    let v2 = k8s.join("..v2");
    std::fs::create_dir(&v2).unwrap();
    std::fs::write(v2.join("tollgate.toml"), config(&upstream, 13, "", "")).unwrap();
    std::os::unix::fs::symlink("..v2", k8s.join("..data_tmp")).unwrap();
    std::fs::rename(k8s.join("..data_tmp"), k8s.join("..data")).unwrap();
    wait_for_limit(&gw.url("/"), "13", Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_files_and_the_same_broken_content_do_not_reload() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 10, "", "")).await;
    let dir = gw.path.parent().unwrap().to_path_buf();
    let _watcher = tollgate::reload::watch_file(gw.gateway.reloader(), gw.path.clone()).unwrap();
    let failed = || async {
        sample(
            &get(&admin(&gw, "/metrics")).await.text(),
            "tollgate_reloads_total{result=\"failed\"}",
        )
    };

    // A broken save fails once.
    std::fs::write(&gw.path, "[server\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while failed().await < 1.0 {
        assert!(Instant::now() < deadline, "failed reload not counted");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // A log file in the same directory, written 20 times, and the same broken content
    // saved again: no more reloads.
    let log = dir.join("tollgate.log");
    for i in 0..20 {
        std::fs::write(&log, format!("line {i}\n")).unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    std::fs::write(&gw.path, "[server\n").unwrap();
    tokio::time::sleep(tollgate::reload::DEBOUNCE * 3).await;
    assert_eq!(failed().await, 1.0, "one failed reload, not one per event");
    assert_eq!(get(&gw.url("/")).await.header("x-ratelimit-limit"), "10");

    // A good save still applies.
    std::fs::write(&gw.path, config(&upstream, 12, "", "")).unwrap();
    wait_for_limit(&gw.url("/"), "12", Duration::from_secs(5)).await;

    // An unreadable file is one failed reload, not two.
    let _ = gw.gateway.reload_from(&dir.join("missing.toml"), false);
    assert_eq!(failed().await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_a_primary_without_traffic() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = format!(
        "[store]\nbackend = \"redis\"\ntimeout = \"100ms\"\n[[store.shards]]\nprimary = \"{}\"\n",
        redis.url()
    );
    let gw = TestGateway::start(&config(&upstream, 10, "", &store)).await;
    let status_within = |want: u16, within: Duration| {
        let url = admin(&gw, "/readyz");
        async move {
            let started = Instant::now();
            loop {
                if get(&url).await.status == want {
                    return started.elapsed();
                }
                assert!(
                    started.elapsed() < within,
                    "/readyz never answered {want} within {within:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    status_within(200, Duration::from_secs(5)).await;
    // No request goes through the gateway: the background PING notices on its own.
    redis.kill();
    let down = status_within(503, Duration::from_secs(5)).await;
    redis.restart();
    let up = status_within(200, Duration::from_secs(10)).await;
    println!("503 {down:?} after the kill, 200 {up:?} after the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_shards_primaries() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = format!(
        "[store]\nbackend = \"redis\"\ntimeout = \"100ms\"\non_error = \"allow\"\nbreaker_failures = 2\nbreaker_cooloff = \"200ms\"\n[[store.shards]]\nprimary = \"{}\"\n",
        redis.url()
    );
    let gw = TestGateway::start(&config(&upstream, 10, "", &store)).await;
    assert_eq!(get(&admin(&gw, "/healthz")).await.status, 200);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = get(&admin(&gw, "/readyz")).await;
        if r.status == 200 {
            let body = r.json();
            assert_eq!(body["ready"], true);
            assert_eq!(body["shards"][0]["nodes"][0]["role"], "primary");
            assert_eq!(body["shards"][0]["nodes"][0]["connected"], true);
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {}", r.text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    redis.kill();
    // Traffic (or the lost connection) shows the primary is gone.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        get(&gw.url("/")).await;
        let r = get(&admin(&gw, "/readyz")).await;
        if r.status == 503 {
            assert_eq!(r.json()["ready"], false);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "readyz stayed 200 with the primary dead"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        get(&admin(&gw, "/healthz")).await.status,
        200,
        "alive though not ready"
    );

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        get(&gw.url("/")).await;
        if get(&admin(&gw, "/readyz")).await.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "readyz did not come back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Parse Prometheus text: every sample line is `name{labels} value`.
fn samples(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (name, value) = l
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("not a sample: {l}"));
            assert!(name.starts_with("tollgate_"), "unprefixed metric: {l}");
            if let Some(open) = name.find('{') {
                assert!(name.ends_with('}'), "bad labels: {l}");
                for pair in name[open + 1..name.len() - 1]
                    .split("\",")
                    .filter(|p| !p.is_empty())
                {
                    let (k, v) = pair
                        .split_once("=\"")
                        .unwrap_or_else(|| panic!("bad label {pair} in {l}"));
                    assert!(
                        k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                        "{l}"
                    );
                    assert!(!v.contains('\n'));
                }
            }
            (
                name.to_string(),
                value
                    .parse::<f64>()
                    .unwrap_or_else(|_| panic!("bad value in {l}")),
            )
        })
        .collect()
}

fn sample(text: &str, name: &str) -> f64 {
    samples(text)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_prometheus_text_and_move_with_traffic() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = format!(
        "[store]\nbackend = \"redis\"\ntimeout = \"500ms\"\n[[store.shards]]\nprimary = \"{}\"\n",
        redis.url()
    );
    let gw = TestGateway::start(&config(&upstream, 3, "", &store)).await;
    let before = get(&admin(&gw, "/metrics")).await;
    assert_eq!(before.status, 200);
    assert!(before.header("content-type").starts_with("text/plain"));
    samples(&before.text());

    for _ in 0..5 {
        get(&gw.url("/")).await;
    }
    get_with(&gw.url("/"), &[("authorization", "Bearer wrong")]).await;
    let text = get(&admin(&gw, "/metrics")).await.text();
    let all = samples(&text);
    assert_eq!(
        sample(
            &text,
            "tollgate_requests_total{route=\"/\",status=\"200\",decision=\"allowed\"}"
        ),
        3.0
    );
    assert_eq!(
        sample(
            &text,
            "tollgate_requests_total{route=\"/\",status=\"429\",decision=\"rejected\"}"
        ),
        2.0
    );
    assert_eq!(
        sample(
            &text,
            "tollgate_rejections_total{limit=\"core\",tier=\"anonymous\"}"
        ),
        2.0
    );
    assert_eq!(
        sample(
            &text,
            "tollgate_requests_total{route=\"none\",status=\"401\",decision=\"unauthenticated\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            "tollgate_upstream_latency_seconds_count{upstream=\"api\"}"
        ),
        3.0
    );
    assert_eq!(
        sample(&text, "tollgate_local_cache_hits_total"),
        1.0,
        "the second 429 came from the cache"
    );
    assert_eq!(sample(&text, "tollgate_config_generation"), 1.0);
    let node = format!(
        "shard=\"0\",role=\"primary\",node=\"127.0.0.1:{}\"",
        redis.port
    );
    // 3 checks + 3 charges + the first rejection's check + the 401's failed-authentication
    // check and charge (identity.failed_auth_limit).
    assert_eq!(
        sample(&text, &format!("tollgate_store_calls_total{{{node}}}")),
        9.0
    );
    assert_eq!(
        sample(
            &text,
            &format!("tollgate_store_latency_seconds_count{{{node}}}")
        ),
        9.0
    );
    assert_eq!(
        sample(&text, &format!("tollgate_store_breaker_state{{{node}}}")),
        0.0
    );
    assert!(all.iter().any(
        |(n, _)| n.starts_with("tollgate_store_latency_seconds_bucket")
            && n.contains("le=\"0.0001\"")
    ));
    assert!(all
        .iter()
        .any(|(n, _)| n.starts_with("tollgate_in_flight_requests")));
    assert!(all
        .iter()
        .any(|(n, _)| n.starts_with("tollgate_open_connections")));

    gw.reload(&config(&upstream, 4, "", &store)).unwrap();
    let text = get(&admin(&gw, "/metrics")).await.text();
    assert_eq!(sample(&text, "tollgate_reloads_total{result=\"ok\"}"), 1.0);
    assert_eq!(sample(&text, "tollgate_config_generation"), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_endpoint_redacts_secrets() {
    let upstream = Upstream::start().await;
    let store = "[store]\nhash_key = \"fleet-secret\"\n";
    let gw = TestGateway::start(&config(&upstream, 3, "", store)).await;
    let r = get(&admin(&gw, "/config")).await;
    assert_eq!(r.status, 200);
    let body = r.json();
    assert_eq!(body["generation"], 1);
    assert_eq!(body["content_hash"].as_str().unwrap().len(), 64);
    assert_eq!(body["config"]["identity"]["clients"][0]["id"], "acme");
    assert_eq!(
        body["config"]["identity"]["clients"][0]["key_sha256"],
        "<redacted>"
    );
    assert_eq!(body["config"]["store"]["hash_key"], "<redacted>");
    assert!(!r.text().contains(&sha256_hex(KEY)) && !r.text().contains("fleet-secret"));
    assert_eq!(body["pending_restart"], serde_json::json!({}));

    // A reload that changes [log] and [server]: /config shows what runs, and the file's
    // new values apart, as waiting for a restart.
    let changed = config(
        &upstream,
        4,
        "shutdown_grace = \"7s\"\n[log]\nlevel = \"debug\"",
        store,
    )
    .replace("shutdown_grace = \"5s\"\n", "");
    gw.reload(&changed).unwrap();
    let body = get(&admin(&gw, "/config")).await.json();
    assert_eq!(body["generation"], 2);
    assert_eq!(body["config"]["log"]["level"], "info", "the running level");
    assert_eq!(body["config"]["server"]["shutdown_grace"], "5s");
    assert_eq!(body["pending_restart"]["log"]["level"], "debug");
    assert_eq!(body["pending_restart"]["server"]["shutdown_grace"], "7s");
    assert_eq!(
        body["config"]["limits"][0]["quota"]["anonymous"], 4,
        "the rest is applied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_generated_propagated_and_returned() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 10, "", "")).await;
    let r = get(&gw.url("/echo")).await;
    let id = r.header("x-request-id").to_string();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    assert_eq!(
        r.json()["headers"]["x-request-id"],
        id.as_str(),
        "sent upstream"
    );
    let r = get_with(&gw.url("/echo"), &[("x-request-id", "client-chosen-42")]).await;
    assert_eq!(r.header("x-request-id"), "client-chosen-42");
    assert_eq!(r.json()["headers"]["x-request-id"], "client-chosen-42");
    let r = get_with(&gw.url("/nowhere"), &[("authorization", "Bearer nope")]).await;
    assert_eq!(r.status, 401);
    assert_eq!(
        r.header("x-request-id").len(),
        36,
        "gateway answers carry one too"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_under_load_loses_nothing() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 100000, "", "")).await;
    let ok = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    // 20 HTTP/1.1 requests and 20 HTTP/2 streams in flight when shutdown starts.
    for i in 0..40 {
        let url = gw.url("/slow/600");
        let ok = ok.clone();
        tasks.push(tokio::spawn(async move {
            let builder =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new());
            let client = if i % 2 == 0 {
                builder.build_http::<http_body_util::Empty<bytes::Bytes>>()
            } else {
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .http2_only(true)
                    .build_http::<http_body_util::Empty<bytes::Bytes>>()
            };
            let resp = client
                .get(url.parse().unwrap())
                .await
                .expect("request lost");
            assert_eq!(resp.status(), 200);
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .expect("body lost")
                .to_bytes();
            assert_eq!(&body[..], b"slow ok");
            ok.fetch_add(1, Ordering::SeqCst);
        }));
    }
    tokio::time::sleep(Duration::from_millis(250)).await;
    let started = Instant::now();
    gw.gateway.shutdown();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(ok.load(Ordering::SeqCst), 40);
    tokio::time::timeout(Duration::from_secs(5), gw.gateway.wait())
        .await
        .expect("stopped after draining");
    assert!(started.elapsed() < Duration::from_secs(3));
}

// ----- the binary: SIGHUP under load, sd_notify, access log, healthcheck -----

fn write(path: &Path, text: &str) {
    // Write then rename, so that a reload never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn binary_config(upstream: &Upstream, port: u16, admin: u16, quota: u64) -> String {
    let mut text = config(
        upstream,
        100,
        "watch_config = false\n[log]\nformat = \"json\"",
        "",
    );
    // A route to an upstream that refuses connections.
    text.push_str(&format!(
        "\n[[upstreams]]\nname = \"dead\"\ntargets = [\"http://127.0.0.1:{}\"]\n\n[[routes]]\npath_prefix = \"/dead\"\nupstream = \"dead\"\n",
        support::redis::free_port()
    ));
    text.replace(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"",
        &format!("listen = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\""),
    )
    .replace("default = 100000", &format!("default = {quota}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_sighup_reloads_under_load_fail_no_request() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let (port, admin_port) = (support::redis::free_port(), support::redis::free_port());
    // Quotas no loader reaches in the test, even against an optimised build.
    write(
        &path,
        &binary_config(&upstream, port, admin_port, 1_000_000),
    );
    let gw = Binary::spawn(&path, port, &[]);
    let url = format!("http://127.0.0.1:{port}/");
    let auth = format!("Bearer {KEY}");

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loader = {
        let (url, auth, stop) = (url.clone(), auth.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0usize, Vec::new());
            while !stop.load(Ordering::SeqCst) {
                let r = get_with(&url, &[("authorization", &auth)]).await;
                if r.status == 200 {
                    ok += 1;
                } else {
                    failed.push(r.status);
                }
            }
            (ok, failed)
        })
    };

    let mut current = 1_000_000;
    for i in 0..20u64 {
        if i % 4 == 3 {
            write(&path, "[server]\nlisten = \"not an address\"\n");
            gw.signal("-HUP");
            tokio::time::sleep(Duration::from_millis(150)).await;
            let r = get_with(&url, &[("authorization", &auth)]).await;
            assert_eq!(
                r.header("x-ratelimit-limit"),
                current.to_string(),
                "an invalid file leaves the previous config"
            );
        } else {
            current = 2_000_000 + i;
            write(&path, &binary_config(&upstream, port, admin_port, current));
            gw.signal("-HUP");
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let r = get_with(&url, &[("authorization", &auth)]).await;
                if r.header("x-ratelimit-limit") == current.to_string() {
                    break;
                }
                assert!(Instant::now() < deadline, "reload {i} not visible");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    let (ok, failed) = loader.await.unwrap();
    assert!(
        failed.is_empty(),
        "failed requests during reloads: {failed:?}"
    );
    assert!(ok > 50, "only {ok} requests went through");
    let metrics = get(&format!("http://127.0.0.1:{admin_port}/metrics"))
        .await
        .text();
    assert_eq!(
        sample(&metrics, "tollgate_reloads_total{result=\"ok\"}"),
        15.0
    );
    assert_eq!(
        sample(&metrics, "tollgate_reloads_total{result=\"failed\"}"),
        5.0
    );
    assert_eq!(sample(&metrics, "tollgate_config_generation"), 16.0);
}

/// A SIGHUP with a huge broken file (10,000 bad client entries) must not
/// freeze the gateway: the proxy and `/healthz` keep answering while it is validated, the
/// log gets a capped report, and the running config stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_with_ten_thousand_bad_entries_keeps_the_gateway_answering() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let (port, admin_port) = (support::redis::free_port(), support::redis::free_port());
    let good = binary_config(&upstream, port, admin_port, 1000);
    write(&path, &good);
    let gw = Binary::spawn(&path, port, &[]);
    let url = format!("http://127.0.0.1:{port}/");
    let healthz = format!("http://127.0.0.1:{admin_port}/healthz");

    let mut bad = good.clone();
    for i in 0..10_000 {
        bad.push_str(&format!(
            "\n[[identity.clients]]\nid = \"c{i}\"\nkey_sha256 = \"not-hex-{i}\"\n"
        ));
    }
    write(&path, &bad);
    let started = Instant::now();
    gw.signal("-HUP");
    // Until the reload is rejected (and a little after), every request is answered
    // promptly.
    let mut slowest = Duration::ZERO;
    loop {
        for u in [&url, &healthz] {
            let t = Instant::now();
            let r = tokio::time::timeout(Duration::from_secs(2), get(u))
                .await
                .unwrap_or_else(|_| panic!("{u} did not answer within 2s during the reload"));
            assert_eq!(r.status, 200, "{u}");
            slowest = slowest.max(t.elapsed());
        }
        if gw.logs().contains("reload rejected") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the reload was not rejected within 60s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "rejected after {:?}; slowest answer meanwhile {slowest:?}",
        started.elapsed()
    );
    let logs = gw.logs();
    let reported = logs.matches("identity.clients[").count();
    assert_eq!(
        reported,
        tollgate::config::MAX_REPORTED,
        "the report is capped"
    );
    assert!(
        logs.contains("9900 more errors not shown"),
        "the rest is counted: {}",
        logs.lines().rev().take(3).collect::<Vec<_>>().join("\n")
    );
    let r = get_with(&url, &[("authorization", &format!("Bearer {KEY}"))]).await;
    assert_eq!(
        r.header("x-ratelimit-limit"),
        "1000",
        "the running config stays"
    );

    // `tollgate check` prints the same capped report and exits 1.
    let (code, _, stderr) = support::check(&path);
    assert_eq!(code, 1);
    assert_eq!(stderr.lines().count(), tollgate::config::MAX_REPORTED + 1);
}

/// The watcher never applies an empty, route-less or half-written file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_waits_for_a_settled_file_and_refuses_empty_or_routeless_ones() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 10, "", "")).await;
    let _watcher = tollgate::reload::watch_file(gw.gateway.reloader(), gw.path.clone()).unwrap();
    let metric = |result: &'static str| {
        let url = admin(&gw, "/metrics");
        async move {
            sample(
                &get(&url).await.text(),
                &format!("tollgate_reloads_total{{result=\"{result}\"}}"),
            )
        }
    };
    let wait_failed = |n: f64| {
        let metric = &metric;
        async move {
            let deadline = Instant::now() + Duration::from_secs(5);
            while metric("failed").await < n {
                assert!(Instant::now() < deadline, "failed reload {n} not counted");
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    };

    // Truncated to 0 bytes (an editor about to write, a crashed deploy): refused.
    std::fs::write(&gw.path, "").unwrap();
    wait_failed(1.0).await;
    assert_eq!(get(&gw.url("/")).await.status, 200, "the routes stay");
    assert_eq!(get(&gw.url("/")).await.header("x-ratelimit-limit"), "10");

    // A valid file without a single route: refused on reload.
    let routeless = config(&upstream, 10, "", "");
    let routeless = &routeless[..routeless.find("[[routes]]").unwrap()];
    std::fs::write(&gw.path, routeless).unwrap();
    wait_failed(2.0).await;
    assert_eq!(get(&gw.url("/")).await.status, 200, "the routes stay");
    let err = gw.reload(routeless).unwrap_err();
    assert!(
        err.error_lines()
            .iter()
            .any(|l| l.contains("routes: no [[routes]]: a reload would answer every request 404")),
        "{err}"
    );

    // Written in two parts, the second more than the debounce after the first: the
    // first part alone is valid, but the file is applied once, whole.
    let ok_before = metric("ok").await;
    let generation = gw.gateway.snapshot().generation;
    let whole = format!(
        "{}\n[[routes]]\npath_prefix = \"/extra\"\nupstream = \"api\"\nlimits = [\"core\"]\n",
        config(&upstream, 11, "", "")
    );
    let first = config(&upstream, 11, "", "");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&gw.path).unwrap();
        f.write_all(first.as_bytes()).unwrap();
        f.flush().unwrap();
        tokio::time::sleep(tollgate::reload::DEBOUNCE + Duration::from_millis(100)).await;
        f.write_all(&whole.as_bytes()[first.len()..]).unwrap();
    }
    wait_for_limit(&gw.url("/"), "11", Duration::from_secs(5)).await;
    tokio::time::sleep(tollgate::reload::DEBOUNCE + tollgate::reload::SETTLE * 3).await;
    assert_eq!(
        metric("ok").await,
        ok_before + 1.0,
        "one reload, of the whole file"
    );
    let snap = gw.gateway.snapshot();
    assert_eq!(snap.generation, generation + 1);
    assert_eq!(snap.config.routes.len(), 2, "the file was applied whole");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_notifications_access_log_and_healthcheck() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let (port, admin_port) = (support::redis::free_port(), support::redis::free_port());
    write(&path, &binary_config(&upstream, port, admin_port, 1000));
    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut gw = Binary::spawn(
        &path,
        port,
        &[
            ("NOTIFY_SOCKET", socket_path.display().to_string()),
            ("WATCHDOG_USEC", "200000".into()),
        ],
    );
    let recv = || {
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let recv_until = |want: &str| {
        let mut seen = Vec::new();
        loop {
            let msg = recv();
            if msg.contains(want) {
                return (msg, seen);
            }
            seen.push(msg);
            assert!(seen.len() < 50, "never got {want}: {seen:?}");
        }
    };
    assert_eq!(recv_until("READY=1").0.trim(), "READY=1");
    assert_eq!(recv_until("WATCHDOG=1").0.trim(), "WATCHDOG=1");

    // A request: access log line, request id.
    let r = get_with(
        &format!("http://127.0.0.1:{port}/echo"),
        &[("authorization", &format!("Bearer {KEY}"))],
    )
    .await;
    assert_eq!(r.status, 200);
    let request_id = r.header("x-request-id").to_string();
    // A wrong key (401) and a dead upstream (502).
    let r = get_with(
        &format!("http://127.0.0.1:{port}/echo?token=secret"),
        &[("authorization", "Bearer not-a-key")],
    )
    .await;
    assert_eq!(r.status, 401);
    let r = get(&format!("http://127.0.0.1:{port}/dead/x")).await;
    assert_eq!(r.status, 502);
    let dead_id = r.header("x-request-id").to_string();

    // Reload: RELOADING=1 with MONOTONIC_USEC, then READY=1.
    gw.signal("-HUP");
    let (reloading, _) = recv_until("RELOADING=1");
    assert!(reloading.contains("MONOTONIC_USEC="), "{reloading}");
    recv_until("READY=1");

    // Healthcheck subcommand.
    let ok = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["healthcheck", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let dead = format!("http://127.0.0.1:{}/healthz", support::redis::free_port());
    let bad = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["healthcheck", "--url", &dead])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));

    gw.signal("-TERM");
    recv_until("STOPPING=1");
    let status = gw.child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    let mut access = Vec::new();
    let mut all = String::new();
    for line in BufReader::new(std::fs::File::open(path.with_extension("log")).unwrap()).lines() {
        let line = line.unwrap();
        all.push_str(&line);
        all.push('\n');
        let v: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        if v["target"] == "tollgate::access" {
            access.push(v);
        }
    }
    assert_eq!(access.len(), 3, "one access line per request: {access:?}");
    let a = &access[0];
    assert_eq!(a["method"], "GET");
    assert_eq!(a["path"], "/echo");
    // The client IP as its keyed hash (log.client_ip = "hash", the default).
    let client = a["client"].as_str().unwrap();
    assert_eq!(client.len(), 32, "{client}");
    assert!(
        !all.contains("127.0.0.1\""),
        "the client IP was logged: {all}"
    );
    assert_eq!(a["route"], "/");
    assert_eq!(a["status"], 200);
    assert_eq!(a["caller"], "acme");
    assert_eq!(a["decision"], "allowed");
    assert_eq!(a["limit"], "core");
    assert_eq!(a["remaining"], 999);
    assert!(
        a["upstream_ms"].as_f64().unwrap() >= 0.0
            && a["total_ms"].as_f64().unwrap() >= a["upstream_ms"].as_f64().unwrap()
    );
    assert_eq!(a["request_id"], request_id.as_str());
    assert!(!all.contains(KEY), "the raw key was logged");
    // The wrong key: unauthenticated, no caller, path without the query string.
    let u = &access[1];
    assert_eq!(u["status"], 401);
    assert_eq!(u["decision"], "unauthenticated");
    assert_eq!(u["caller"], "-");
    assert_eq!(u["path"], "/echo");
    assert_eq!(u["client"], client, "same client, same hash");
    assert!(!all.contains("secret") && !all.contains("not-a-key"));
    // The dead upstream: a warning naming the upstream, its target and the request id,
    // with the error as text.
    assert_eq!(access[2]["status"], 502);
    let warn: Vec<serde_json::Value> = all_lines(&all)
        .into_iter()
        .filter(|v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("upstream failed"))
                || v["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("upstream failed"))
        })
        .collect();
    assert_eq!(warn.len(), 1, "{all}");
    let w = &warn[0];
    assert_eq!(w["upstream"], "dead");
    assert!(w["addr"].as_str().unwrap().starts_with("127.0.0.1:"), "{w}");
    assert_eq!(w["request_id"], dead_id.as_str());
    let error = w["error"].as_str().unwrap();
    assert!(
        error.contains("refused") && !error.contains("Os {"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_survive_reloads_including_memory_store_changes() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 10, "", "")).await;
    for used in 1..=2 {
        assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-used"), used);
    }
    // A limit change keeps the window.
    gw.reload(&config(&upstream, 20, "", "")).unwrap();
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-used"), 3);
    // So does a change to [store] that keeps the memory backend.
    gw.reload(&config(
        &upstream,
        20,
        "",
        "[store]\ntimeout = \"75ms\"\nlocal_cache_size = 5\n",
    ))
    .unwrap();
    let r = get(&gw.url("/")).await;
    assert_eq!(
        (r.num("x-ratelimit-limit"), r.num("x-ratelimit-used")),
        (20, 4)
    );
    assert_eq!(gw.gateway.snapshot().generation, 3);
}

/// Every line of a JSON log, parsed.
fn all_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listener_drains_on_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 100, "", "")).await;
    let admin_addr = gw.gateway.admin_addr().unwrap();

    // A keep-alive admin connection that has answered one request and now idles,
    // and one whose request is half sent when shutdown starts.
    let mut idle = tokio::net::TcpStream::connect(admin_addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: admin\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = idle.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let mut busy = tokio::net::TcpStream::connect(admin_addr).await.unwrap();
    busy.write_all(b"GET /readyz HTTP/1.1\r\nhost: admin\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let started = Instant::now();
    gw.gateway.shutdown();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The request under way is answered, with "connection: close".
    busy.write_all(b"\r\n").await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(3), busy.read_to_end(&mut answer))
        .await
        .expect("the half-sent request is answered, then the connection closes")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    // The idle keep-alive connection is closed, not held until the grace period ends.
    let n = tokio::time::timeout(Duration::from_secs(3), idle.read(&mut buf))
        .await
        .expect("idle admin connection closed on shutdown")
        .unwrap_or(0);
    assert_eq!(n, 0, "idle admin connection gets EOF");
    // No new admin connections.
    assert!(tokio::net::TcpStream::connect(admin_addr).await.is_err());
    tokio::time::timeout(Duration::from_secs(4), gw.gateway.wait())
        .await
        .expect("gateway and admin listener stop well before the 5 s grace");
    assert!(started.elapsed() < Duration::from_secs(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_in_flight_until_its_response_body_ends() {
    use http_body_util::BodyExt;
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 100, "", "")).await;
    let in_flight = |gw: &TestGateway| -> i64 {
        gw.gateway
            .metrics()
            .render()
            .lines()
            .find_map(|l| {
                l.strip_prefix("tollgate_in_flight_requests ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(-1)
    };
    assert_eq!(in_flight(&gw), 0);
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    // 64 MiB the client does not read yet: the headers arrive, the body waits.
    let resp = client
        .get(gw.url("/download/67108864").parse().unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(in_flight(&gw), 1, "headers sent, body still streaming");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 64 << 20);
    let deadline = Instant::now() + Duration::from_secs(3);
    while in_flight(&gw) != 0 {
        assert!(Instant::now() < deadline, "in flight after the body ended");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
