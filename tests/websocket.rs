//! WebSocket passthrough: the upgrade request is limited and charged once, then the
//! tunnel copies bytes both ways until either side closes.

mod support;

use futures_util::{SinkExt, StreamExt};
use support::{TestGateway, Upstream};
use tokio_tungstenite::tungstenite::Message;

/// A WebSocket echo server on a free loopback port; its `ws://` base URL.
async fn echo_server() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                    return;
                };
                while let Some(Ok(msg)) = ws.next().await {
                    if (msg.is_text() || msg.is_binary()) && ws.send(msg).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websockets_pass_through_and_the_upgrade_is_limited_once() {
    let ws_upstream = echo_server().await;
    let http_upstream = Upstream::start().await;
    let toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "ws"
targets = ["{ws_upstream}"]

[[upstreams]]
name = "api"
targets = ["{api}"]

[[limits]]
name = "sockets"
window = "1h"
quota = {{ anonymous = 2 }}

[[routes]]
path_prefix = "/ws"
upstream = "ws"
limits = ["sockets"]

[[routes]]
path_prefix = "/"
upstream = "api"
"#,
        api = http_upstream.url()
    );
    let gw = TestGateway::start(&toml).await;
    let url = format!("ws://{}/ws", gw.addr);

    let mut sockets = Vec::new();
    for n in 1..=2u64 {
        let stream = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        let (mut ws, response) = tokio_tungstenite::client_async(url.as_str(), stream)
            .await
            .expect("upgraded through the gateway");
        assert_eq!(response.status(), 101);
        assert_eq!(
            response.headers()["x-ratelimit-used"],
            n.to_string().as_str()
        );
        // Many messages over one upgrade: charged once.
        for i in 0..20 {
            ws.send(Message::text(format!("hello {i}"))).await.unwrap();
            let echoed = ws.next().await.unwrap().unwrap();
            assert_eq!(echoed.into_text().unwrap().as_str(), format!("hello {i}"));
        }
        sockets.push(ws);
    }
    // The third upgrade is over the limit: 429, never reaches the upstream.
    let stream = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    match tokio_tungstenite::client_async(url.as_str(), stream).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 429);
        }
        other => panic!("expected 429, got {:?}", other.map(|(_, r)| r.status())),
    }
    // Open tunnels keep working after the refusal, and close cleanly.
    for mut ws in sockets {
        ws.send(Message::text("still here")).await.unwrap();
        let echoed = ws.next().await.unwrap().unwrap();
        assert_eq!(echoed.into_text().unwrap().as_str(), "still here");
        ws.close(None).await.unwrap();
    }
    // Plain requests are unaffected.
    assert_eq!(support::get(&gw.url("/")).await.status, 200);
}
