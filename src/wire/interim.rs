//! Forwarding 1xx (informational) responses to clients (RFC 9110 §15.2: a proxy MUST
//! forward them): `103 Early Hints`, `102 Processing` and the like.
//!
//! To HTTP/1.1 clients: hyper's server has no way to send one before the final
//! response (`Service` returns one response). So the client connection's socket is
//! wrapped ([`Interim`]): a 1xx is written there, ahead of anything hyper writes next,
//! while hyper's write buffer is empty, which it is from the moment a request's handler
//! starts until its final response head is encoded (the handler is waiting for the
//! upstream). A 1xx that arrives while hyper still has bytes of an earlier response to
//! write (pipelined requests on a full socket) is dropped rather than risk interleaving.
//!
//! To HTTP/2 clients: they are served with the h2 crate ([`super::h2server`], since hyper's
//! HTTP/2 server cannot send a 1xx either), and a request's handle holds its stream's
//! `SendResponse`: a 1xx goes out at once as interim HEADERS
//! (`SendResponse::send_informational`). The server takes the `SendResponse` back once
//! the handler has returned, before it sends the final response, so no 1xx can follow
//! the final response: one that comes later finds the handle empty and is dropped.
//!
//! 1xx come from HTTP/1.1 upstreams through `hyper::ext::on_informational` (see
//! `proxy::forward`), and from HTTP/2 upstreams through the h2 crate's
//! `ResponseFuture::poll_informational` (see [`super::h2client`], which replaced hyper's
//! HTTP/2 client because it skips them); both hand them to the same [`Informational`].
//! HTTP/1.0 clients never get one (RFC 9110 §15.2).
use http::{HeaderMap, StatusCode};
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What a connection's [`Interim`] and its requests' [`Informational`] handles share.
#[derive(Debug, Default)]
struct Shared {
    /// Whether `queue` has bytes (checked without the lock on every write).
    pending: AtomicBool,
    /// Whether hyper's writes so far have all been flushed (its buffer is empty): set by
    /// a completed flush, cleared by any write.
    clean: AtomicBool,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Encoded 1xx responses not yet written, and how much of them was.
    queue: Vec<u8>,
    written: usize,
    /// The connection task's waker, from hyper's last flush: woken to write the queue.
    waker: Option<Waker>,
}

/// A client connection's socket, through which 1xx responses are written ahead of
/// hyper's own bytes.
#[derive(Debug)]
pub struct Interim<T> {
    io: T,
    shared: Arc<Shared>,
}

/// The handle a request's forwarder uses to send 1xx responses to its client (in the
/// request's extensions): through the HTTP/1.1 connection's [`Interim`] socket, or as
/// HEADERS on the request's HTTP/2 stream.
#[derive(Debug, Clone)]
pub struct Informational(Sink);

#[derive(Debug, Clone)]
enum Sink {
    Http1(Arc<Shared>),
    /// The stream's response handle, until the server takes it to send the final
    /// response (after the handler returned: no 1xx can follow it).
    Http2(H2Respond),
}

/// An HTTP/2 stream's response handle, shared by its server task and its request's
/// [`Informational`] until the final response.
pub type H2Respond = Arc<Mutex<Option<h2::server::SendResponse<bytes::Bytes>>>>;

impl<T> Interim<T> {
    /// Wrap a client connection's socket.
    pub fn new(io: T) -> Self {
        Self {
            io,
            shared: Arc::default(),
        }
    }

    /// The handle for the requests of this connection.
    pub fn handle(&self) -> Informational {
        Informational(Sink::Http1(self.shared.clone()))
    }
}

impl Informational {
    /// The handle of an HTTP/2 stream (see [`super::h2server`]).
    pub fn http2(respond: H2Respond) -> Self {
        Informational(Sink::Http2(respond))
    }

    /// Send a 1xx response (`status`, `headers` without hop-by-hop ones) to the client
    /// before the final response. `false` when it was dropped: `status` is not 1xx (or
    /// is 100 or 101, which the gateway answers itself), hyper still has bytes of an
    /// earlier response to write (HTTP/1.1), or the stream is reset or answered
    /// (HTTP/2).
    pub fn send(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        if !status.is_informational()
            || status == StatusCode::CONTINUE
            || status == StatusCode::SWITCHING_PROTOCOLS
        {
            return false;
        }
        let mut headers = headers.clone();
        crate::http::strip_hop_by_hop(&mut headers);
        // No length on a 1xx (RFC 9110 §8.6; HTTP/2 clients reject one).
        headers.remove(http::header::CONTENT_LENGTH);
        let shared = match &self.0 {
            Sink::Http1(shared) => shared,
            Sink::Http2(respond) => {
                let mut respond = respond.lock().unwrap_or_else(|e| e.into_inner());
                let Some(respond) = respond.as_mut() else {
                    return false;
                };
                let mut head = http::Response::new(());
                *head.status_mut() = status;
                *head.headers_mut() = headers;
                return respond.send_informational(head).is_ok();
            }
        };
        let mut bytes = format!(
            "HTTP/1.1 {} {}\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or("Informational")
        )
        .into_bytes();
        for (name, value) in &headers {
            bytes.extend_from_slice(name.as_str().as_bytes());
            bytes.extend_from_slice(b": ");
            bytes.extend_from_slice(value.as_bytes());
            bytes.extend_from_slice(b"\r\n");
        }
        bytes.extend_from_slice(b"\r\n");
        let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
        let before = state.queue.len();
        state.queue.extend_from_slice(&bytes);
        // Queued, then checked (both SeqCst, against a write's `clean = false` then
        // `pending` check): either the writer sees it pending and writes it before its
        // own bytes, or this sees the writer has written since its last flush and takes
        // it back. Never after the start of a message of hyper's.
        shared.pending.store(true, Ordering::SeqCst);
        if !shared.clean.load(Ordering::SeqCst) {
            // Taken back (no drain can have written it: drains hold the lock too).
            state.queue.truncate(before);
            if state.queue.len() == state.written {
                state.queue.clear();
                state.written = 0;
                shared.pending.store(false, Ordering::SeqCst);
            }
            return false;
        }
        if let Some(waker) = &state.waker {
            waker.wake_by_ref();
        }
        true
    }
}

impl<T: AsyncWrite + Unpin> Interim<T> {
    /// Write what is queued; `Ready(Ok)` once nothing is left.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if !self.shared.pending.load(Ordering::SeqCst) {
            return Poll::Ready(Ok(()));
        }
        let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        while state.written < state.queue.len() {
            let n = match Pin::new(&mut self.io).poll_write(cx, &state.queue[state.written..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            state.written += n;
        }
        state.queue.clear();
        state.written = 0;
        self.shared.pending.store(false, Ordering::SeqCst);
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Interim<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Interim<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.shared.clean.store(false, Ordering::SeqCst);
        std::task::ready!(this.drain(cx))?;
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.shared.clean.store(false, Ordering::SeqCst);
        std::task::ready!(this.drain(cx))?;
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.drain(cx))?;
        let flushed = Pin::new(&mut this.io).poll_flush(cx);
        if let Poll::Ready(Ok(())) = flushed {
            // hyper flushes the socket only once its own buffer is written out: from
            // here until its next write, a 1xx can go first. Its next poll after a 1xx
            // is queued writes it.
            let mut state = this.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            if !state
                .waker
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                state.waker = Some(cx.waker().clone());
            }
            this.shared.clean.store(true, Ordering::SeqCst);
        }
        flushed
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
