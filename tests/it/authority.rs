//! One authority per request, against the real gateway, raw TCP
//! clients and a raw upstream that records the exact bytes it receives.
//!
//! Two routes share one upstream: `host = "api.example.com"` with a limit of 2, and
//! `host = "open.example.com"` without limits. A request names its host once: a second
//! `Host` field is 400 (RFC 9112 §3.2), the authority of an absolute-form target
//! replaces `Host` (RFC 9112 §3.2.2), and on HTTP/2 a `Host` that disagrees with
//! `:authority` is 400. The upstream receives exactly the Host that routing used.

use crate::support::raw::*;
use crate::support::TestGateway;
use tokio::net::TcpStream;

fn config(rec: &Recorder) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "app"
targets = ["{up}"]

[[limits]]
name = "api"
window = "1h"
quota = {{ anonymous = 2 }}

[[routes]]
host = "api.example.com"
path_prefix = "/"
upstream = "app"
limits = ["api"]

[[routes]]
host = "open.example.com"
path_prefix = "/"
upstream = "app"
"#,
        up = rec.url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_host_fields_are_refused_and_nothing_is_forwarded() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&config(&rec)).await;
    for hosts in [
        "host: open.example.com\r\nhost: api.example.com\r\n",
        "host: api.example.com\r\nhost: open.example.com\r\n",
        "host: open.example.com\r\nhost: open.example.com\r\n",
    ] {
        let a = ask(&gw, format!("GET / HTTP/1.1\r\n{hosts}\r\n").as_bytes()).await;
        assert_eq!(a.status, 400, "{hosts:?}: {}", a.head);
        assert!(
            a.header("content-type").is_some_and(|t| t.contains("json")),
            "a JSON error: {}",
            a.head
        );
    }
    // An HTTP/1.1 request without any Host is no better (RFC 9112 §3.2).
    let a = ask(&gw, b"GET / HTTP/1.1\r\n\r\n").await;
    assert_eq!(a.status, 400, "{}", a.head);
    // A Host that is not an authority (userinfo, a path, a space, more than one `:`, a
    // port that is not a number of at most 5 digits, no name) is refused too.
    for host in [
        "open.example.com@api.example.com",
        "api.example.com/x",
        "api example.com",
        "a:b:c",
        "api.example.com:x",
        "api.example.com:123456",
        ":80",
    ] {
        let a = ask(
            &gw,
            format!("GET / HTTP/1.1\r\nhost: {host}\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(a.status, 400, "{host}: {}", a.head);
    }
    // One Host is fine.
    let a = ask(&gw, b"GET / HTTP/1.1\r\nhost: open.example.com\r\n\r\n").await;
    assert_eq!(a.status, 200, "{}", a.head);
    assert_eq!(rec.requests(), 1, "only the good request was forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_form_target_is_routed_limited_and_forwarded_on_its_authority() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&config(&rec)).await;
    let smuggle = b"GET http://api.example.com/ HTTP/1.1\r\nhost: open.example.com\r\n\r\n";
    for expected in [200, 200, 429] {
        let a = ask(&gw, smuggle).await;
        assert_eq!(a.status, expected, "{}", a.head);
        assert_eq!(
            a.header("x-ratelimit-limit").as_deref(),
            Some("2"),
            "limited by api's limit: {}",
            a.head
        );
    }
    assert_eq!(rec.requests(), 2);
    for head in rec.heads() {
        assert!(head.starts_with("GET / HTTP/1.1\r\n"), "{head}");
        assert_eq!(
            values_of(&head, "host"),
            ["api.example.com"],
            "the upstream gets the Host routing used: {head}"
        );
        assert!(!head.contains("open.example.com"), "{head}");
    }
    // With a port, and without any Host: the target's authority is the Host.
    let rec2 = Recorder::start().await;
    let gw2 = TestGateway::start(&config(&rec2)).await;
    let a = ask(&gw2, b"GET http://API.example.com:8080/x HTTP/1.1\r\n\r\n").await;
    assert_eq!(a.status, 200, "{}", a.head);
    assert_eq!(a.header("x-ratelimit-limit").as_deref(), Some("2"));
    let heads = rec2.heads();
    assert_eq!(values_of(&heads[0], "host"), ["API.example.com:8080"]);
    // The other way round: an absolute-form to the open route is not limited, whatever
    // Host says.
    let a = ask(
        &gw2,
        b"GET http://open.example.com/ HTTP/1.1\r\nhost: api.example.com\r\n\r\n",
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.head);
    assert_eq!(a.header("x-ratelimit-limit"), None, "{}", a.head);
    assert_eq!(values_of(&rec2.heads()[1], "host"), ["open.example.com"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_http2_a_host_that_disagrees_with_the_authority_is_refused() {
    let rec = Recorder::start().await;
    let gw = TestGateway::start(&config(&rec)).await;
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(conn);
    let send = |uri: &str, host: Option<&str>| {
        let mut req = http::Request::get(uri);
        if let Some(host) = host {
            req = req.header("host", host);
        }
        let req = req.body(()).unwrap();
        let client = client.clone();
        async move {
            let mut c = client.ready().await.unwrap();
            let (response, _) = c.send_request(req, true).unwrap();
            let response = tokio::time::timeout(PATIENCE, response)
                .await
                .expect("an answer within the patience bound")
                .unwrap();
            (
                response.status().as_u16(),
                response
                    .headers()
                    .get("x-ratelimit-limit")
                    .map(|v| v.to_str().unwrap().to_string()),
            )
        }
    };
    let (status, _) = send("http://api.example.com/", Some("open.example.com")).await;
    assert_eq!(status, 400);
    let (status, _) = send("http://open.example.com/", Some("api.example.com")).await;
    assert_eq!(status, 400);
    assert_eq!(rec.requests(), 0, "nothing forwarded");
    // Agreeing (in any case) is fine, and so is :authority alone.
    let (status, limit) = send("http://api.example.com/", Some("API.example.com")).await;
    assert_eq!((status, limit.as_deref()), (200, Some("2")));
    let (status, limit) = send("http://api.example.com/", None).await;
    assert_eq!((status, limit.as_deref()), (200, Some("2")));
    let (status, _) = send("http://api.example.com/", None).await;
    assert_eq!(status, 429);
    assert_eq!(rec.requests(), 2);
    for head in rec.heads() {
        assert_eq!(
            values_of(&head, "host")
                .iter()
                .map(|h| h.to_ascii_lowercase())
                .collect::<Vec<_>>(),
            ["api.example.com"],
            "{head}"
        );
    }
    driver.abort();
}
