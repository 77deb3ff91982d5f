//! HTTP/2 clients, served with the h2 crate (TLS ALPN `h2`, and cleartext with prior
//! knowledge), so that a request's 1xx responses (`103 Early Hints`, `102`) reach the
//! client on its stream before the final response (hyper's HTTP/2 server cannot send
//! one; see [`super::interim`]). What hyper's server did is done here the same way:
//! connection settings from `[server]` ([`Settings`]), keep-alive PINGs, a graceful
//! shutdown's two GOAWAYs, a task per stream, a client's RST_STREAM cancelling its
//! request, `Date`, `Content-Length` from a body of known size, hop-by-hop headers
//! removed from responses, response bodies sent within the client's
//! flow-control window, trailers, and RFC 8441 extended CONNECT (WebSockets).

use super::handler::{BoxError, Handler};
use super::incoming::{H2Body, Incoming};
use super::interim::{H2Respond, Informational};
use super::tunnel::{H2Io, H2Upgrade};
use bytes::Bytes;
use h2::server::{Connection, Handshake, SendResponse};
use h2::{Ping, PingPong, RecvStream, SendStream};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response};
use http_body::Body as _;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// A client's stream window and the connection's, bytes (hyper's defaults).
const WINDOW: u32 = 1024 * 1024;

/// The `[server]` settings of HTTP/2 connections (read at start).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// `server.http2_max_streams`: streams a client may have open at once.
    pub(crate) max_streams: u32,
    /// `server.max_header_bytes`: the largest header list a client may send, bytes
    /// (larger: 431).
    pub(crate) max_header_list: u32,
    /// A PING goes out this long after the last answered one, and the connection closes
    /// when its answer takes as long again.
    pub(crate) keep_alive: Duration,
}

impl Settings {
    fn builder(&self) -> h2::server::Builder {
        let mut b = h2::server::Builder::new();
        b.initial_window_size(WINDOW)
            .initial_connection_window_size(WINDOW)
            .max_concurrent_streams(self.max_streams)
            .max_header_list_size(self.max_header_list)
            // WebSockets over HTTP/2 (RFC 8441 extended CONNECT).
            .enable_connect_protocol()
            // Rapid reset (CVE-2023-44487): a client that resets streams faster than
            // they are accepted, or makes the server reset many, gets GOAWAY.
            .max_pending_accept_reset_streams(20)
            .max_local_error_reset_streams(Some(256));
        b
    }
}

/// An HTTP/2 connection being served.
pub(crate) struct Serve<T, H> {
    state: State<T>,
    handler: H,
    keep_alive: Duration,
    /// When the next PING goes out, or (a PING unanswered) when the connection gives up.
    timer: Pin<Box<tokio::time::Sleep>>,
    pong_due: bool,
    ping: Option<PingPong>,
    /// Whether a graceful shutdown was asked for (before the handshake ended, too).
    closing: bool,
}

// The whole `Serve` is boxed once per connection (`alpn::Serving`): no second box.
#[allow(clippy::large_enum_variant)]
enum State<T> {
    Handshaking(Pin<Box<Handshake<T, Bytes>>>),
    Serving(Connection<T, Bytes>),
}

impl<T, H> Serve<T, H>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    /// Serve `io` (its client preface not read yet) with `handler`.
    pub(crate) fn new(io: T, settings: &Settings, handler: H) -> Self {
        Self {
            state: State::Handshaking(Box::pin(settings.builder().handshake(io))),
            handler,
            keep_alive: settings.keep_alive,
            timer: Box::pin(tokio::time::sleep(settings.keep_alive)),
            pong_due: false,
            ping: None,
            closing: false,
        }
    }

    /// Start closing gracefully: GOAWAY, then (once the client answered its PING) the
    /// final GOAWAY; streams under way finish.
    pub(crate) fn graceful_shutdown(&mut self) {
        self.closing = true;
        if let State::Serving(conn) = &mut self.state {
            conn.graceful_shutdown();
        }
    }

    /// Send a PING when it is due; an error once one went unanswered too long.
    fn poll_keep_alive(&mut self, cx: &mut Context<'_>) -> Result<(), BoxError> {
        let Some(ping) = &mut self.ping else {
            return Ok(());
        };
        if self.pong_due {
            match ping.poll_pong(cx) {
                Poll::Ready(Ok(_)) => {
                    self.pong_due = false;
                    let next = tokio::time::Instant::now() + self.keep_alive;
                    self.timer.as_mut().reset(next);
                }
                Poll::Ready(Err(e)) => return Err(e.into()),
                Poll::Pending => {}
            }
        }
        while self.timer.as_mut().poll(cx).is_ready() {
            if self.pong_due {
                return Err("the client did not answer a keep-alive PING".into());
            }
            ping.send_ping(Ping::opaque())?;
            self.pong_due = true;
            let next = tokio::time::Instant::now() + self.keep_alive;
            self.timer.as_mut().reset(next);
            // Registers for the answer.
            if let Poll::Ready(Ok(_)) = ping.poll_pong(cx) {
                self.pong_due = false;
            }
        }
        Ok(())
    }
}

impl<T, H> Future for Serve<T, H>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    type Output = Result<(), BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        while let State::Handshaking(handshake) = &mut this.state {
            let mut conn = ready!(handshake.as_mut().poll(cx))?;
            if this.closing {
                conn.graceful_shutdown();
            }
            this.ping = conn.ping_pong();
            this.state = State::Serving(conn);
        }
        this.poll_keep_alive(cx)?;
        let State::Serving(conn) = &mut this.state else {
            return Poll::Pending;
        };
        loop {
            match ready!(conn.poll_accept(cx)) {
                Some(Ok((req, respond))) => {
                    tokio::spawn(stream(req, respond, this.handler.clone()));
                }
                Some(Err(e)) => return Poll::Ready(Err(e.into())),
                None => return Poll::Ready(Ok(())),
            }
        }
    }
}

/// Serve one stream: call the handler with its request, answer it (or, for a 2xx
/// answer to an extended CONNECT, hand the stream to the tunnel), and send the body.
async fn stream<H: Handler>(req: Request<RecvStream>, respond: SendResponse<Bytes>, handler: H) {
    let (mut parts, recv) = req.into_parts();
    let declared = content_length(&parts.headers);
    if let Some(protocol) = parts.extensions.remove::<h2::ext::Protocol>() {
        parts
            .extensions
            .insert(hyper::ext::Protocol::from(protocol.as_str()));
    }
    let respond: H2Respond = Arc::new(Mutex::new(Some(respond)));
    parts
        .extensions
        .insert(Informational::http2(respond.clone()));
    let (body, connect) = if parts.method == Method::CONNECT {
        if declared.is_some_and(|n| n != 0) {
            reset(&respond, h2::Reason::PROTOCOL_ERROR);
            return;
        }
        let (upgrade, tx) = H2Upgrade::pair();
        parts.extensions.insert(upgrade);
        (Incoming::Empty, Some((tx, recv)))
    } else {
        (Incoming::Http2(H2Body::new(recv, declared)), None)
    };
    let handled = handler.call(Request::from_parts(parts, body));
    tokio::pin!(handled);
    // The handler runs until it answers, or the client resets the stream (which drops
    // it, as hyper did: the upstream request is cancelled).
    let answered = poll_fn(|cx| {
        if let Poll::Ready(response) = handled.as_mut().poll(cx) {
            return Poll::Ready(Some(response));
        }
        let mut respond = respond.lock().unwrap_or_else(|e| e.into_inner());
        match respond.as_mut().map(|r| r.poll_reset(cx)) {
            Some(Poll::Pending) => Poll::Pending,
            _ => Poll::Ready(None),
        }
    })
    .await;
    let Some(Ok(response)) = answered else {
        return;
    };
    // From here no 1xx can be sent: the final response goes now.
    let Some(mut respond) = respond.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return;
    };
    let (head, body) = response.into_parts();
    let mut head = Response::from_parts(head, ());
    // What HTTP/2 forbids (RFC 9113 §8.2.2), should the response carry any.
    crate::http::strip_hop_by_hop(head.headers_mut());
    head.headers_mut().entry(header::DATE).or_insert_with(date);
    if let Some((tx, recv)) = connect {
        if head.status().is_success() {
            if content_length(head.headers()).is_some_and(|n| n != 0) {
                respond.send_reset(h2::Reason::INTERNAL_ERROR);
                return;
            }
            head.headers_mut().remove(header::CONTENT_LENGTH);
            if let Ok(send) = respond.send_response(head, false) {
                let _ = tx.send(H2Io::new(send, recv));
            }
            return;
        }
    }
    if body.is_end_stream() {
        let _ = respond.send_response(head, true);
        return;
    }
    if let Some(len) = body.size_hint().exact() {
        head.headers_mut()
            .entry(header::CONTENT_LENGTH)
            .or_insert_with(|| HeaderValue::from(len));
    }
    let Ok(mut send) = respond.send_response(head, false) else {
        return;
    };
    if let Err(e) = send_body(body, &mut send).await {
        tracing::debug!(error = %e, "HTTP/2 response body not sent to its end; stream reset");
        send.send_reset(h2::Reason::INTERNAL_ERROR);
    }
}

fn reset(respond: &H2Respond, reason: h2::Reason) {
    if let Some(r) = respond.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        r.send_reset(reason);
    }
}

/// Send `body` on `send` within the client's flow-control window, then its trailers or
/// the end of the stream. Errors: the body failed, or the client reset the stream.
async fn send_body<B>(body: B, send: &mut SendStream<Bytes>) -> Result<(), BoxError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    tokio::pin!(body);
    loop {
        // The next frame, unless the client resets the stream first.
        let frame = poll_fn(|cx| {
            if let Poll::Ready(reason) = send.poll_reset(cx) {
                let e: BoxError = match reason {
                    Ok(reason) => h2::Error::from(reason).into(),
                    Err(e) => e.into(),
                };
                return Poll::Ready(Err(e));
            }
            body.as_mut().poll_frame(cx).map(Ok)
        })
        .await?;
        let frame = match frame {
            None => {
                send.send_data(Bytes::new(), true)?;
                return Ok(());
            }
            Some(Err(e)) => return Err(e.into()),
            Some(Ok(frame)) => frame,
        };
        let frame = match frame.into_data() {
            Ok(data) => {
                let end = body.is_end_stream();
                if !data.is_empty() {
                    // Wait for room in the window (h2 sends the chunk as it opens).
                    send.reserve_capacity(1);
                    poll_fn(|cx| {
                        while send.capacity() == 0 {
                            if let Poll::Ready(reason) = send.poll_reset(cx) {
                                let e: BoxError = match reason {
                                    Ok(reason) => h2::Error::from(reason).into(),
                                    Err(e) => e.into(),
                                };
                                return Poll::Ready(Err(e));
                            }
                            match ready!(send.poll_capacity(cx)) {
                                Some(Ok(_)) => {}
                                Some(Err(e)) => return Poll::Ready(Err(BoxError::from(e))),
                                None => return Poll::Ready(Err("the stream closed".into())),
                            }
                        }
                        Poll::Ready(Ok(()))
                    })
                    .await?;
                }
                send.send_data(data, end)?;
                if end {
                    return Ok(());
                }
                continue;
            }
            Err(frame) => frame,
        };
        if let Ok(trailers) = frame.into_trailers() {
            send.reserve_capacity(0);
            send.send_trailers(trailers)?;
            return Ok(());
        }
    }
}

/// A request's or response's `Content-Length`, when it has exactly one valid value.
fn content_length(headers: &HeaderMap) -> Option<u64> {
    let mut values = headers.get_all(header::CONTENT_LENGTH).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    first.to_str().ok()?.trim().parse().ok()
}

/// The `Date` header's value for now (formatted once a second per thread).
fn date() -> HeaderValue {
    thread_local! {
        static CACHED: std::cell::RefCell<(u64, HeaderValue)> =
            const { std::cell::RefCell::new((0, HeaderValue::from_static(""))) };
    }
    let now = std::time::SystemTime::now();
    let second = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    CACHED.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != second || cached.1.is_empty() {
            let value = HeaderValue::from_str(&httpdate::fmt_http_date(now))
                .unwrap_or(HeaderValue::from_static(""));
            *cached = (second, value);
        }
        cached.1.clone()
    })
}
