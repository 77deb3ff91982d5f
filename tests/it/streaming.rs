//! Large bodies stream through the gateway in flat memory. The test runs in a process of
//! its own (`alone_in_process`) so that the process's memory reading is not disturbed by
//! other tests.

use crate::support::{alone_in_process, TestGateway, Upstream};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::convert::Infallible;
use std::time::Duration;

const CONFIG: &str = r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "api"
targets = ["UPSTREAM"]
response_timeout = "60s"
PROTOCOL

[[limits]]
name = "core"
window = "1h"
quota = { anonymous = 1000 }

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// 200 MB up and 200 MB down through the gateway, to an HTTP/1.1 and to an HTTP/2
/// upstream (flow control both ways); the process (gateway, upstream and client all
/// live in it) never holds more than a small fraction of that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_stream_both_ways_in_flat_memory() {
    if !alone_in_process(
        "streaming::large_bodies_stream_both_ways_in_flat_memory",
        &[],
    ) {
        return;
    }
    let upstream = Upstream::start().await;
    for protocol in ["http1", "http2"] {
        let config = CONFIG
            .replace("UPSTREAM", &upstream.url())
            .replace("PROTOCOL", &format!("protocol = \"{protocol}\""));
        let gw = TestGateway::start(&config).await;
        stream_both_ways(&gw, protocol).await;
    }
}

async fn stream_both_ways(gw: &TestGateway, protocol: &str) {
    const SIZE: usize = 200 * 1024 * 1024;
    let baseline = rss_bytes();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(baseline));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_bytes(), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    // Download.
    let client = Client::builder(TokioExecutor::new())
        .build_http::<http_body_util::combinators::BoxBody<Bytes, Infallible>>();
    let req = Request::get(gw.url(&format!("/download/{SIZE}")))
        .body(Full::new(Bytes::new()).boxed())
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut received = 0usize;
    while let Some(frame) = body.frame().await {
        received += frame.unwrap().data_ref().map(|d| d.len()).unwrap_or(0);
    }
    assert_eq!(received, SIZE, "{protocol} upstream");

    // Upload, generated as it is sent.
    let chunk = Bytes::from(vec![b'u'; 64 * 1024]);
    let stream = futures_util::stream::iter(
        (0..SIZE / chunk.len()).map(move |_| Ok::<_, Infallible>(Frame::data(chunk.clone()))),
    );
    let req = Request::post(gw.url("/upload"))
        .body(StreamBody::new(stream).boxed())
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let reply: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(reply["bytes"], SIZE, "{protocol} upstream");

    sampler.abort();
    let grew = peak
        .load(std::sync::atomic::Ordering::Relaxed)
        .saturating_sub(baseline);
    assert!(
        grew < 64 * 1024 * 1024,
        "memory grew by {} MiB while streaming 2×200 MiB ({protocol} upstream)",
        grew >> 20
    );
}
