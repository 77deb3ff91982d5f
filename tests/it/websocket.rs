//! WebSocket passthrough: the upgrade request is limited and charged once, then the
//! tunnel copies bytes both ways until either side closes.

use crate::support;
use crate::support::{TestGateway, Upstream};
use futures_util::{SinkExt, StreamExt};
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

/// A masked client text frame (RFC 6455 section 5.2) carrying `text` (< 126 bytes).
fn masked_text(text: &str) -> bytes::Bytes {
    let mask = [0x12u8, 0x34, 0x56, 0x78];
    let mut frame = vec![0x81, 0x80 | text.len() as u8];
    frame.extend_from_slice(&mask);
    frame.extend(text.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    frame.into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_over_http2_extended_connect_reaches_an_http1_upstream() {
    let ws_upstream = echo_server().await;
    let toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "ws"
targets = ["{ws_upstream}"]

[[limits]]
name = "sockets"
window = "1h"
quota = {{ anonymous = 5 }}

[[routes]]
path_prefix = "/"
upstream = "ws"
limits = ["sockets"]
"#
    );
    let gw = TestGateway::start(&toml).await;
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    // Let the server's SETTINGS (ENABLE_CONNECT_PROTOCOL) arrive.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(client.is_extended_connect_protocol_enabled());
    let mut req = http::Request::builder()
        .method("CONNECT")
        .uri(format!("http://{}/chat", gw.addr))
        .header("sec-websocket-version", "13")
        .body(())
        .unwrap();
    req.extensions_mut()
        .insert(h2::ext::Protocol::from_static("websocket"));
    let (response, mut send) = client.send_request(req, false).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200, "RFC 8441: 200 opens the tunnel");
    assert_eq!(response.headers()["x-ratelimit-used"], "1");
    let mut recv = response.into_body();
    send.send_data(masked_text("over h2"), false).unwrap();
    let data = recv.data().await.unwrap().unwrap();
    let _ = recv.flow_control().release_capacity(data.len());
    // The echo server's unmasked text frame.
    assert_eq!(&data[..], b"\x81\x07over h2");
}
