//! On TLS, ALPN decides the protocol of a connection: the negotiated one is the only
//! one served. An HTTP/1.1 request on an `h2` connection is an invalid connection
//! preface (GOAWAY, as RFC 9113 §3.4 asks, h2spec http2/3.5/2), and an HTTP/2 preface on
//! an `http/1.1` connection a bad HTTP/1.1 request. Without ALPN (and on cleartext)
//! the first bytes decide, as before: HTTP/1.1, or HTTP/2 with prior knowledge.
//!
//! HTTP/1.1 is served by hyper (with upgrades), HTTP/2 by the h2 crate
//! ([`super::h2server`], which can send 1xx responses); both call the same [`Handler`],
//! with the request's body as [`Incoming`].

use super::h2server as h2;
use super::handler::{BoxError, Handler};
use super::incoming::Incoming;
use super::linger::Linger;
use super::minor_version::MinorVersion;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A [`Handler`] as hyper's HTTP/1.1 server calls it.
#[derive(Clone)]
pub(crate) struct Http1Service<H>(H);

impl<H: Handler> hyper::service::Service<http::Request<hyper::body::Incoming>> for Http1Service<H> {
    type Response = http::Response<H::Body>;
    type Error = Infallible;
    type Future = H::Future;

    fn call(&self, req: http::Request<hyper::body::Incoming>) -> H::Future {
        self.0.call(req.map(Incoming::Http1))
    }
}

/// The connection settings of a listener: HTTP/1.1's (hyper) and HTTP/2's (h2).
#[derive(Debug)]
pub(crate) struct Builders {
    /// HTTP/1.1, with upgrades (WebSocket).
    http1: http1::Builder,
    http2: h2::Settings,
}

type Http1Conn<T, H> =
    http1::UpgradeableConnection<TokioIo<Linger<MinorVersion<Prefixed<T>>>>, Http1Service<H>>;

impl Builders {
    /// The settings of a listener's connections: `http1` for HTTP/1.1, `http2` for
    /// HTTP/2.
    pub(crate) fn new(http1: http1::Builder, http2: h2::Settings) -> Self {
        Self { http1, http2 }
    }

    fn http1<T, H>(&self, io: Prefixed<T>, handler: H) -> Serving<'_, T, H>
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        H: Handler,
    {
        let conn = self
            .http1
            // Its close lingers (`super::linger`); an `HTTP/1.2` request line reads as
            // 1.1 (`super::minor_version`).
            .serve_connection(
                TokioIo::new(Linger::new(MinorVersion::new(io))),
                Http1Service(handler),
            )
            .with_upgrades();
        Serving::Http1(Box::pin(conn))
    }

    fn http2<T, H>(&self, io: Prefixed<T>, handler: H) -> Serving<'_, T, H>
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        H: Handler,
    {
        Serving::Http2(Box::pin(h2::Serve::new(io, &self.http2, handler)))
    }

    /// Serve `io` with `handler` in the protocol `alpn` names (see the module
    /// documentation), or the one its first bytes show when `alpn` is `None`.
    pub(crate) fn serve<T, H>(&self, alpn: Option<&[u8]>, io: T, handler: H) -> Serving<'_, T, H>
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        H: Handler,
    {
        match alpn {
            Some(b"h2") => self.http2(Prefixed::none(io), handler),
            Some(b"http/1.1") => self.http1(Prefixed::none(io), handler),
            _ => Serving::Sniffing(Sniff {
                builders: self,
                io: Some((io, handler)),
                got: [0; 24],
                n: 0,
            }),
        }
    }
}

/// A cleartext connection (or one without ALPN) whose first bytes are being read:
/// the HTTP/2 preface, or HTTP/1.1.
pub(crate) struct Sniff<'a, T, H> {
    builders: &'a Builders,
    io: Option<(T, H)>,
    got: [u8; 24],
    n: usize,
}

/// A connection being served, in whichever protocol [`Builders::serve`] chose.
pub(crate) enum Serving<'a, T, H: Handler> {
    Sniffing(Sniff<'a, T, H>),
    Http1(Pin<Box<Http1Conn<T, H>>>),
    Http2(Pin<Box<h2::Serve<Prefixed<T>, H>>>),
    /// Closed before a protocol was known.
    Closed,
}

impl<T, H> Serving<'_, T, H>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    /// Start closing gracefully: requests under way finish, no new ones are taken.
    pub(crate) fn graceful_shutdown(&mut self) {
        match self {
            Serving::Sniffing(_) => *self = Serving::Closed,
            Serving::Http1(c) => c.as_mut().graceful_shutdown(),
            Serving::Http2(c) => c.as_mut().graceful_shutdown(),
            Serving::Closed => {}
        }
    }
}

impl<T, H> Future for Serving<'_, T, H>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    type Output = Result<(), BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            match this {
                Serving::Sniffing(sniff) => {
                    let Some((io, _)) = &mut sniff.io else {
                        return Poll::Ready(Ok(()));
                    };
                    // Read until the bytes differ from the preface, end, or are all of it.
                    let mut h2 = false;
                    while sniff.n < PREFACE.len() {
                        let mut buf = ReadBuf::new(&mut sniff.got[sniff.n..]);
                        ready!(Pin::new(&mut *io).poll_read(cx, &mut buf))?;
                        let k = buf.filled().len();
                        if k == 0 {
                            break;
                        }
                        let matched =
                            sniff.got[sniff.n..sniff.n + k] == PREFACE[sniff.n..sniff.n + k];
                        sniff.n += k;
                        if !matched {
                            break;
                        }
                        h2 = sniff.n == PREFACE.len();
                    }
                    let (builders, n, got) = (sniff.builders, sniff.n, sniff.got);
                    let Some((io, handler)) = sniff.io.take() else {
                        return Poll::Ready(Ok(()));
                    };
                    if n == 0 {
                        // Closed before a byte.
                        return Poll::Ready(Ok(()));
                    }
                    let io = Prefixed {
                        prefix: got,
                        len: n,
                        at: 0,
                        inner: io,
                    };
                    *this = if h2 {
                        builders.http2(io, handler)
                    } else {
                        builders.http1(io, handler)
                    };
                }
                Serving::Http1(c) => return c.as_mut().poll(cx).map_err(Into::into),
                Serving::Http2(c) => return c.as_mut().poll(cx),
                Serving::Closed => return Poll::Ready(Ok(())),
            }
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
pub(crate) async fn h2_preface<T>(mut io: T, timeout: std::time::Duration) -> Option<Prefixed<T>>
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
            len: got.len(),
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
pub(crate) struct Prefixed<T> {
    prefix: [u8; 24],
    /// How many bytes of `prefix` were read (and are read again).
    len: usize,
    /// How much of `prefix` has been read again.
    at: usize,
    inner: T,
}

impl<T> Prefixed<T> {
    /// `inner`, none of whose bytes were read ahead.
    fn none(inner: T) -> Self {
        Self {
            prefix: [0; 24],
            len: 0,
            at: 0,
            inner,
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Prefixed<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.at < this.len {
            let rest = &this.prefix[this.at..this.len];
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
