//! On TLS, ALPN decides the protocol of a connection: the negotiated one is the only
//! one served. An HTTP/1.1 request on an `h2` connection is an invalid connection
//! preface (GOAWAY, as RFC 9113 §3.4 asks, h2spec http2/3.5/2), and an HTTP/2 preface on
//! an `http/1.1` connection a bad HTTP/1.1 request. Without ALPN (and on cleartext)
//! the first bytes decide, as before: HTTP/1.1, or HTTP/2 with prior knowledge.

use hyper::body::{Body, Incoming};
use hyper::rt::{Read, Write};
use hyper::server::conn::http1;
use hyper::service::Service;
use hyper_util::rt::TokioExecutor;
use hyper_util::server::conn::auto;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The connection builders of a listener: the sniffing one, and one per protocol ALPN
/// can settle on.
#[derive(Debug)]
pub(super) struct Builders {
    sniffing: auto::Builder<TokioExecutor>,
    /// HTTP/2 only (served without the HTTP/1.1 upgrade path, which hyper-util's
    /// `http2_only` needs; HTTP/2's own extended CONNECT still works).
    http2: auto::Builder<TokioExecutor>,
    /// HTTP/1.1 only, with upgrades (WebSocket).
    http1: http1::Builder,
}

impl Builders {
    /// `sniffing` for connections without ALPN, and its HTTP/2 settings for `h2` ones;
    /// `http1` (the same HTTP/1.1 settings as `sniffing`'s) for `http/1.1` ones.
    pub(super) fn new(sniffing: auto::Builder<TokioExecutor>, http1: http1::Builder) -> Self {
        Self {
            http2: sniffing.clone().http2_only(),
            sniffing,
            http1,
        }
    }

    /// Serve `io` with `service` in the protocol `alpn` names (see the module
    /// documentation), or the one its first bytes show when `alpn` is `None`.
    pub(super) fn serve<I, S, B>(&self, alpn: Option<&[u8]>, io: I, service: S) -> Serving<'_, I, S>
    where
        S: Service<hyper::Request<Incoming>, Response = hyper::Response<B>> + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
        I: Read + Write + Unpin + Send + 'static,
    {
        match alpn {
            Some(b"h2") => Serving::Http2(Box::pin(self.http2.serve_connection(io, service))),
            Some(b"http/1.1") => Serving::Http1(Box::pin(
                self.http1.serve_connection(io, service).with_upgrades(),
            )),
            _ => Serving::Sniffing(Box::pin(
                self.sniffing.serve_connection_with_upgrades(io, service),
            )),
        }
    }
}

/// A connection being served, in whichever protocol [`Builders::serve`] chose.
pub(super) enum Serving<'a, I, S>
where
    S: hyper::service::HttpService<Incoming>,
{
    Sniffing(Pin<Box<auto::UpgradeableConnection<'a, I, S, TokioExecutor>>>),
    Http2(Pin<Box<auto::Connection<'a, I, S, TokioExecutor>>>),
    Http1(Pin<Box<http1::UpgradeableConnection<I, S>>>),
}

impl<I, S, B> Serving<'_, I, S>
where
    S: Service<hyper::Request<Incoming>, Response = hyper::Response<B>> + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    I: Read + Write + Unpin + Send + 'static,
{
    /// Start closing gracefully: requests under way finish, no new ones are taken.
    pub(super) fn graceful_shutdown(&mut self) {
        match self {
            Serving::Sniffing(c) => c.as_mut().graceful_shutdown(),
            Serving::Http2(c) => c.as_mut().graceful_shutdown(),
            Serving::Http1(c) => c.as_mut().graceful_shutdown(),
        }
    }
}

impl<I, S, B> Future for Serving<'_, I, S>
where
    S: Service<hyper::Request<Incoming>, Response = hyper::Response<B>> + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    I: Read + Write + Unpin + Send + 'static,
{
    type Output = Result<(), BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Serving::Sniffing(c) => c.as_mut().poll(cx),
            Serving::Http2(c) => c.as_mut().poll(cx),
            Serving::Http1(c) => c.as_mut().poll(cx).map_err(Into::into),
        }
    }
}

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// An empty SETTINGS frame, then GOAWAY (last stream 0, `PROTOCOL_ERROR`): the answer
/// to an invalid connection preface (RFC 9113 §3.4). (h2 closes without a GOAWAY.)
const BAD_PREFACE: [u8; 26] = [
    0, 0, 0, 4, 0, 0, 0, 0, 0, // SETTINGS, no parameters
    0, 0, 8, 7, 0, 0, 0, 0, 0, // GOAWAY, 8 bytes, stream 0
    0, 0, 0, 0, // last stream id 0
    0, 0, 0, 1, // PROTOCOL_ERROR
];

/// On a connection that negotiated `h2`: read the client's first 24 bytes (within
/// `timeout`) and check they are the HTTP/2 preface. If so, the connection with those
/// bytes put back in front, for hyper to read again; if not (an HTTP/1.1 request, say),
/// answer with GOAWAY and close: `None`.
pub(super) async fn h2_preface<T>(mut io: T, timeout: std::time::Duration) -> Option<Prefixed<T>>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut got = [0u8; 24];
    let mut n = 0;
    let read = async {
        while n < got.len() {
            match io.read(&mut got[n..]).await {
                Ok(0) | Err(_) => return false,
                Ok(k) => {
                    if got[n..n + k] != PREFACE[n..n + k] {
                        return false;
                    }
                    n += k;
                }
            }
        }
        true
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(true) => Some(Prefixed {
            prefix: got,
            at: 0,
            inner: io,
        }),
        Ok(false) => {
            let _ = tokio::time::timeout(timeout, async {
                let _ = io.write_all(&BAD_PREFACE).await;
                let _ = io.shutdown().await;
            })
            .await;
            None
        }
        Err(_) => None,
    }
}

/// A connection whose first bytes (the checked HTTP/2 preface) are read again from a
/// copy before the rest comes from the connection itself.
pub(super) struct Prefixed<T> {
    prefix: [u8; 24],
    /// How much of `prefix` has been read again.
    at: usize,
    inner: T,
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Prefixed<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.at < this.prefix.len() {
            let rest = &this.prefix[this.at..];
            let k = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..k]);
            this.at += k;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Prefixed<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
