//! OpenTelemetry tracing (`[tracing]`, issue 49) against a real OTLP/HTTP receiver that
//! decodes what it gets with the official protobuf definitions, a real upstream that
//! echoes what it received, and the gateway in this process.

use crate::support;
use crate::support::otlp::{attr, hex, Receiver};
use crate::support::{get_with, TestGateway, Upstream};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::time::{Duration, Instant};

/// A gateway on `upstream` with one limit of `quota` a minute, tracing to `endpoint`
/// with the `[tracing]` lines `tracing` and `trusted_proxies`.
fn config(upstream: &Upstream, quota: u64, endpoint: &str, tracing: &str, trusted: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[identity]
trusted_proxies = [{trusted}]

[tracing]
enabled = true
endpoint = "{endpoint}"
batch_timeout = "50ms"
{tracing}

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1m"
quota = {{ anonymous = {quota} }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        up = upstream.url()
    )
}

pub(crate) fn server_spans(spans: &[Span]) -> Vec<&Span> {
    spans
        .iter()
        .filter(|s| s.kind == SpanKind::Server as i32)
        .collect()
}

pub(crate) fn child<'a>(spans: &'a [Span], parent: &Span, name: &str) -> &'a Span {
    spans
        .iter()
        .find(|s| s.name == name && s.parent_span_id == parent.span_id)
        .unwrap_or_else(|| panic!("no child span {name:?} of the server span in {spans:#?}"))
}

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

#[tokio::test]
async fn with_ratio_0_only_refusals_are_exported_with_their_limit_remaining_and_decision() {
    support::capture_logs();
    let up = Upstream::start().await;
    let rx = Receiver::start(true).await;
    let toml = config(
        &up,
        2,
        &rx.endpoint(),
        "sample_ratio = 0.0\nsample_refusals = true\nheaders = { authorization = \"Bearer collector-secret\" }",
        "",
    );
    let gw = TestGateway::start(&toml).await;
    for _ in 0..2 {
        assert_eq!(get_with(&gw.url("/ok-traced"), &[]).await.status, 200);
    }
    let refused = get_with(&gw.url("/refused-traced"), &[]).await;
    assert_eq!(refused.status, 429);
    // The refusal's body and headers say no more than before: no trace ids.
    assert!(refused.headers.get("traceparent").is_none());
    assert!(!refused.text().contains(TRACE_ID));

    rx.wait_spans(1).await;
    // Give a late span of an allowed request the time to show up (it would have been
    // queued before the refusal's, so it would be in the same batch or an earlier one).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let spans = rx.spans();
    let servers = server_spans(&spans);
    assert_eq!(servers.len(), 1, "only the refusal: {spans:#?}");
    let s = servers[0];
    assert_eq!(attr(s, "tollgate.decision").as_deref(), Some("rejected"));
    assert_eq!(attr(s, "tollgate.limit").as_deref(), Some("core"));
    assert_eq!(attr(s, "tollgate.quota").as_deref(), Some("2"));
    assert_eq!(attr(s, "tollgate.remaining").as_deref(), Some("0"));
    assert_eq!(
        attr(s, "tollgate.reset"),
        Some(refused.header("x-ratelimit-reset").to_string())
    );
    assert_eq!(attr(s, "tollgate.tier").as_deref(), Some("anonymous"));
    assert_eq!(attr(s, "http.response.status_code").as_deref(), Some("429"));
    assert_eq!(attr(s, "http.request.method").as_deref(), Some("GET"));
    assert_eq!(attr(s, "url.path").as_deref(), Some("/refused-traced"));
    assert_eq!(attr(s, "http.route").as_deref(), Some("/"));
    // The caller as a keyed hash, never the address.
    let hash = attr(s, "tollgate.caller.hash").unwrap();
    assert_eq!(hash.len(), 32, "{hash}");
    assert!(!spans
        .iter()
        .flat_map(|s| &s.attributes)
        .any(|kv| format!("{:?}", kv.value).contains("127.0.0.1") && kv.key != "server.address"));
    // Exported for being a refusal, not sampled: the server span alone (nothing was
    // recorded as it passed, so that unsampled requests cost little).
    assert_eq!(spans.len(), 1, "{spans:#?}");
    assert!(s.end_time_unix_nano >= s.start_time_unix_nano);
    // How it was sent: OTLP/HTTP protobuf with the collector's header.
    let export = &rx.exports()[0];
    assert_eq!(export.path, "/v1/traces");
    assert_eq!(export.content_type, "application/x-protobuf");
    assert_eq!(
        export.authorization.as_deref(),
        Some("Bearer collector-secret")
    );
    assert_eq!(export.service_name.as_deref(), Some("tollgate"));
    // The access line of the refusal names the same trace and span.
    let lines = support::log_lines(&["/refused-traced", "decision=\"rejected\""]);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains(&format!("trace_id={}", hex(&s.trace_id))),
        "{}",
        lines[0]
    );
    assert!(
        lines[0].contains(&format!("span_id={}", hex(&s.span_id))),
        "{}",
        lines[0]
    );
    let m = &gw.gateway.metrics();
    assert_eq!(m.trace_spans_dropped("queue_full").get(), 0);
    assert_eq!(m.trace_spans_exported.get(), spans.len() as u64);
}

#[tokio::test]
async fn a_trusted_trace_is_continued_and_the_upstream_sees_tollgates_span_as_parent() {
    let up = Upstream::start().await;
    let rx = Receiver::start(true).await;
    let toml = config(
        &up,
        100,
        &rx.endpoint(),
        "sample_ratio = 0.0",
        "\"127.0.0.1/32\"",
    );
    let gw = TestGateway::start(&toml).await;
    // Sampled by the parent (ratio 0 would not sample a new trace).
    let reply = get_with(
        &gw.url("/echo/continued"),
        &[("traceparent", PARENT), ("tracestate", "congo=t61rcWkgMzE")],
    )
    .await;
    assert_eq!(reply.status, 200);
    let seen = reply.json()["headers"].clone();
    let forwarded = seen["traceparent"].as_str().unwrap().to_string();
    let parts: Vec<&str> = forwarded.split('-').collect();
    assert_eq!(parts.len(), 4, "{forwarded}");
    assert_eq!(parts[0], "00");
    assert_eq!(parts[1], TRACE_ID, "the trace is continued");
    assert_eq!(parts[3], "01", "sampled");
    assert_eq!(seen["tracestate"], "congo=t61rcWkgMzE");

    let spans = rx.wait_spans(4).await;
    let servers = server_spans(&spans);
    assert_eq!(servers.len(), 1, "{spans:#?}");
    let s = servers[0];
    assert_eq!(hex(&s.trace_id), TRACE_ID);
    assert_eq!(hex(&s.parent_span_id), "00f067aa0ba902b7");
    assert_eq!(s.trace_state, "congo=t61rcWkgMzE");
    assert_eq!(attr(s, "tollgate.decision").as_deref(), Some("allowed"));
    assert_eq!(attr(s, "http.response.status_code").as_deref(), Some("200"));
    assert_eq!(attr(s, "tollgate.remaining").as_deref(), Some("99"));
    assert_eq!(attr(s, "server.address").as_deref(), Some("127.0.0.1"));
    // Children: the check, the charge, and the upstream call, whose span is the parent
    // the upstream was told about.
    child(&spans, s, "check");
    child(&spans, s, "charge");
    let call = child(&spans, s, "upstream");
    assert_eq!(call.kind, SpanKind::Client as i32);
    assert_eq!(
        hex(&call.span_id),
        parts[2],
        "upstream's parent is tollgate's span"
    );
    assert_eq!(hex(&call.trace_id), TRACE_ID);
    assert_eq!(attr(call, "tollgate.upstream").as_deref(), Some("api"));
    assert_eq!(
        attr(call, "tollgate.upstream.attempts").as_deref(),
        Some("1")
    );
    assert_eq!(attr(call, "server.port"), Some(up.addr.port().to_string()));
    assert_eq!(
        attr(call, "network.protocol.version").as_deref(),
        Some("1.1")
    );
    for c in spans.iter().filter(|c| c.parent_span_id == s.span_id) {
        assert!(c.start_time_unix_nano >= s.start_time_unix_nano, "{c:?}");
        assert!(c.end_time_unix_nano <= s.end_time_unix_nano, "{c:?}");
    }
}

#[tokio::test]
async fn an_untrusted_clients_traceparent_is_neither_continued_nor_forwarded() {
    let up = Upstream::start().await;
    let rx = Receiver::start(true).await;
    // The peer (127.0.0.1) is not a trusted proxy.
    let toml = config(
        &up,
        100,
        &rx.endpoint(),
        "sample_ratio = 1.0",
        "\"10.0.0.0/8\"",
    );
    let gw = TestGateway::start(&toml).await;
    let reply = get_with(
        &gw.url("/echo/untrusted"),
        &[("traceparent", PARENT), ("tracestate", "congo=t61rcWkgMzE")],
    )
    .await;
    assert_eq!(reply.status, 200);
    let seen = reply.json()["headers"].clone();
    let forwarded = seen["traceparent"].as_str().unwrap();
    assert!(!forwarded.contains(TRACE_ID), "{forwarded}");
    assert!(!forwarded.contains("00f067aa0ba902b7"), "{forwarded}");
    assert!(
        forwarded.ends_with("-01"),
        "sampled by the ratio: {forwarded}"
    );
    assert!(seen.get("tracestate").is_none(), "{seen}");
    let spans = rx.wait_spans(4).await;
    let s = server_spans(&spans)[0];
    assert_ne!(hex(&s.trace_id), TRACE_ID);
    assert!(s.parent_span_id.is_empty(), "a new trace has no parent");
    assert_eq!(forwarded.split('-').nth(1), Some(hex(&s.trace_id).as_str()));

    // trust_incoming = "all" continues anyone's; "none" nobody's.
    for (trust, continued) in [("all", true), ("none", false)] {
        let toml = config(
            &up,
            100,
            &rx.endpoint(),
            &format!("trust_incoming = \"{trust}\""),
            "\"127.0.0.1/32\"",
        );
        gw.reload(&toml).unwrap();
        let reply = get_with(&gw.url("/echo/again"), &[("traceparent", PARENT)]).await;
        let seen = reply.json()["headers"].clone();
        let forwarded = seen["traceparent"].as_str().unwrap();
        assert_eq!(
            forwarded.contains(TRACE_ID),
            continued,
            "{trust}: {forwarded}"
        );
    }
}

#[tokio::test]
async fn tracing_off_leaves_traceparent_as_the_client_sent_it() {
    let up = Upstream::start().await;
    let toml =
        config(&up, 100, "http://127.0.0.1:9", "", "").replace("enabled = true", "enabled = false");
    let gw = TestGateway::start(&toml).await;
    let reply = get_with(
        &gw.url("/echo/off"),
        &[("traceparent", PARENT), ("tracestate", "a=1")],
    )
    .await;
    let seen = reply.json()["headers"].clone();
    assert_eq!(seen["traceparent"], PARENT);
    assert_eq!(seen["tracestate"], "a=1");
    assert!(gw.gateway.snapshot().tracer.is_none());
}

#[tokio::test]
async fn a_collector_that_never_answers_never_slows_a_request_and_dropped_spans_are_counted() {
    let up = Upstream::start().await;
    let rx = Receiver::start(false).await;
    let toml = config(
        &up,
        1000,
        &rx.endpoint(),
        "sample_ratio = 1.0\nqueue_size = 2\nbatch_size = 1\nexport_timeout = \"1h\"",
        "",
    );
    let gw = TestGateway::start(&toml).await;
    let started = Instant::now();
    for i in 0..30 {
        let reply = get_with(&gw.url(&format!("/hang/{i}")), &[]).await;
        assert_eq!(reply.status, 200);
    }
    let took = started.elapsed();
    // The exporter holds one span in the export that hangs and two in the queue: every
    // other span is dropped and counted, none exported.
    let m = gw.gateway.metrics();
    support::wait_until(Duration::from_secs(5), "spans counted as dropped", || {
        m.trace_spans_dropped("queue_full").get() >= 27 * 4
    })
    .await;
    // Each request's server span and its three children (check, upstream, charge).
    assert!(m.trace_spans_dropped("queue_full").get() <= 29 * 4);
    assert_eq!(m.trace_spans_dropped("queue_full").get() % 4, 0);
    assert_eq!(m.trace_spans_exported.get(), 0);
    assert_eq!(rx.arrived(), 1, "one export, hanging");
    assert!(took < Duration::from_secs(10), "30 requests took {took:?}");
}

#[tokio::test]
async fn a_collector_that_is_down_costs_its_spans_not_the_requests() {
    let up = Upstream::start().await;
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let toml = config(
        &up,
        1000,
        &endpoint,
        "sample_ratio = 1.0\nbatch_size = 5",
        "",
    );
    let gw = TestGateway::start(&toml).await;
    for i in 0..10 {
        assert_eq!(
            get_with(&gw.url(&format!("/down/{i}")), &[]).await.status,
            200
        );
    }
    let m = gw.gateway.metrics();
    support::wait_until(Duration::from_secs(5), "failed exports counted", || {
        m.trace_spans_dropped("export_failed").get() == 10 * 4
    })
    .await;
    assert_eq!(m.trace_spans_dropped("queue_full").get(), 0);
}

#[tokio::test]
async fn a_reload_applies_tracing_changes() {
    let up = Upstream::start().await;
    let first = Receiver::start(true).await;
    let second = Receiver::start(true).await;
    let toml = config(&up, 100, &first.endpoint(), "sample_ratio = 1.0", "");
    let gw = TestGateway::start(&toml).await;
    assert_eq!(get_with(&gw.url("/one"), &[]).await.status, 200);
    first.wait_spans(1).await;
    // The same [tracing]: the tracer (its queue and exporter) is kept.
    let before = gw.gateway.snapshot().tracer.clone().unwrap();
    gw.reload(&(toml.clone() + "\n")).unwrap();
    let kept = gw.gateway.snapshot().tracer.clone().unwrap();
    assert!(std::sync::Arc::ptr_eq(&before, &kept));
    // A new endpoint: spans go there.
    gw.reload(&config(
        &up,
        100,
        &second.endpoint(),
        "sample_ratio = 1.0",
        "",
    ))
    .unwrap();
    assert_eq!(get_with(&gw.url("/two"), &[]).await.status, 200);
    let spans = second.wait_spans(1).await;
    assert!(spans
        .iter()
        .any(|s| attr(s, "url.path").as_deref() == Some("/two")));
    // Off: requests carry no traceparent of tollgate's.
    let off =
        config(&up, 100, &second.endpoint(), "", "").replace("enabled = true", "enabled = false");
    gw.reload(&off).unwrap();
    let reply = get_with(&gw.url("/echo/off"), &[]).await;
    assert!(reply.json()["headers"].get("traceparent").is_none());
}

#[test]
fn tollgate_check_names_each_wrong_tracing_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    std::fs::write(dir.path().join("empty-token"), "\n").unwrap();
    std::fs::write(
        &path,
        r#"
[tracing]
enabled = true
endpoint = "ftp://collector:4318"
sample_ratio = 1.5
queue_size = 0
headers = { "bad header" = "x", authorization = "a" }
headers_file = { authorization = "empty-token", "x-token" = "missing-token" }

[[upstreams]]
name = "api"
targets = ["http://127.0.0.1:9"]

[[routes]]
path_prefix = "/"
upstream = "api"
"#,
    )
    .unwrap();
    let (code, _, stderr) = support::check(&path);
    assert_eq!(code, 1, "{stderr}");
    for key in [
        "tracing.endpoint",
        "tracing.sample_ratio",
        "tracing.queue_size",
        "tracing.headers.bad header",
        "tracing.headers_file.authorization",
        "tracing.headers_file.x-token",
    ] {
        assert!(
            stderr.contains(&format!(": {key}: ")),
            "{key} in:\n{stderr}"
        );
    }
    // The same file with tracing off is valid: nothing of [tracing] is read then.
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("enabled = true", "enabled = false")).unwrap();
    let (code, _, stderr) = support::check(&path);
    assert_eq!(code, 0, "{stderr}");
}

#[tokio::test]
async fn a_sampled_refusal_has_its_check_span_and_nothing_forwarded() {
    let up = Upstream::start().await;
    let rx = Receiver::start(true).await;
    let toml = config(&up, 1, &rx.endpoint(), "sample_ratio = 1.0", "");
    let gw = TestGateway::start(&toml).await;
    assert_eq!(get_with(&gw.url("/first"), &[]).await.status, 200);
    let refused = get_with(&gw.url("/second"), &[]).await;
    assert_eq!(refused.status, 429);
    // The allowed request's four spans, then the refusal's two.
    let spans = rx.wait_spans(6).await;
    let servers = server_spans(&spans);
    assert_eq!(servers.len(), 2, "{spans:#?}");
    let s = servers
        .iter()
        .find(|s| attr(s, "url.path").as_deref() == Some("/second"))
        .unwrap();
    assert_eq!(attr(s, "tollgate.decision").as_deref(), Some("rejected"));
    assert_eq!(attr(s, "tollgate.remaining").as_deref(), Some("0"));
    let check = child(&spans, s, "check");
    assert!(check.start_time_unix_nano >= s.start_time_unix_nano);
    assert!(check.end_time_unix_nano <= s.end_time_unix_nano);
    let children: Vec<&str> = spans
        .iter()
        .filter(|c| c.parent_span_id == s.span_id)
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(children, ["check"], "no upstream call, no charge");
}
