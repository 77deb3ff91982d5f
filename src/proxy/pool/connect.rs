//! Opening a connection to a target: TCP (counted in the descriptor budget), then TLS
//! for `https://` targets, then the HTTP/1.1 or HTTP/2 handshake. An HTTP/1.1
//! connection's socket notes when its I/O times out ([`IoFacts`]).

use super::{Pool, PoolError, H1};
use crate::budget::{Budget, Counted};
use crate::wire::h2client;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

impl Pool {
    /// A new TCP connection to the target, counted in `budget`.
    pub(super) async fn tcp(&self, budget: &Budget) -> Result<Counted<TcpStream>, PoolError> {
        let c = &self.connector;
        let descriptor = budget
            .upstream()
            .ok_or_else(|| PoolError::NoDescriptor(c.authority.clone()))?;
        let default_port = if c.tls.is_some() { 443 } else { 80 };
        let addr = format!(
            "{}:{}",
            c.authority.host(),
            c.authority.port_u16().unwrap_or(default_port)
        );
        let stream = match tokio::time::timeout(c.connect_timeout, TcpStream::connect(&addr)).await
        {
            Err(_) => return Err(PoolError::ConnectTimeout(c.authority.clone())),
            Ok(Err(e)) => return Err(PoolError::Connect(c.authority.clone(), e)),
            Ok(Ok(s)) => s,
        };
        let _ = stream.set_nodelay(true);
        Ok(Counted::new(stream, descriptor))
    }

    pub(super) async fn tls(
        &self,
        stream: Counted<TcpStream>,
        tls: &(TlsConnector, ServerName<'static>),
    ) -> Result<tokio_rustls::client::TlsStream<Counted<TcpStream>>, PoolError> {
        let c = &self.connector;
        let (connector, name) = tls;
        match tokio::time::timeout(c.connect_timeout, connector.connect(name.clone(), stream)).await
        {
            Err(_) => Err(PoolError::Tls(
                c.authority.clone(),
                std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake timed out"),
            )),
            Ok(Err(e)) => Err(PoolError::Tls(c.authority.clone(), e)),
            Ok(Ok(s)) => Ok(s),
        }
    }

    pub(super) async fn connect_h1(&self, budget: &Budget) -> Result<H1, PoolError> {
        let stream = self.tcp(budget).await?;
        let max = self.connector.max_response_header_bytes;
        match &self.connector.tls {
            None => spawn_h1(stream, max).await,
            Some(tls) => spawn_h1(self.tls(stream, tls).await?, max).await,
        }
    }

    pub(super) async fn connect_h2(
        &self,
        budget: &Budget,
    ) -> Result<h2client::Connection, PoolError> {
        let stream = self.tcp(budget).await?;
        let max = self.connector.max_response_header_bytes;
        let conn = match &self.connector.tls {
            None => h2client::Connection::handshake(stream, max).await?,
            Some(tls) => h2client::Connection::handshake(self.tls(stream, tls).await?, max).await?,
        };
        Ok(conn)
    }
}

/// hyper's default HTTP/1.1 read buffer limit (8 KiB + 100 × 4 KiB), in bytes: the
/// buffer is never made smaller than this, so that large bodies still stream in large
/// reads; `upstreams.max_response_header_bytes` is checked on the parsed head.
const H1_DEFAULT_MAX_BUF: usize = 8192 + 4096 * 100;

/// An HTTP/1.1 connection on `io` whose read buffer holds a head of
/// `max_head_bytes` (and its request line) at least, its I/O watched ([`IoFacts`]).
pub(super) async fn spawn_h1<T>(io: T, max_head_bytes: usize) -> Result<H1, PoolError>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let facts = Arc::new(IoFacts::default());
    let io = TokioIo::new(Watched {
        io,
        facts: facts.clone(),
    });
    let (tx, conn) = http1::Builder::new()
        .max_buf_size(max_head_bytes.saturating_add(8192).max(H1_DEFAULT_MAX_BUF))
        .handshake(io)
        .await
        .map_err(|error| PoolError::Http {
            error,
            timed_out: false,
        })?;
    tokio::spawn(async move {
        // With upgrades: a 101 answer hands the connection over to a tunnel (WebSocket).
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "upstream connection ended with an error");
        }
    });
    Ok(H1 { tx, io: facts })
}

/// What an HTTP/1.1 connection's socket saw that hyper's errors say only as an untyped
/// cause: whether a read or a write failed because it timed out
/// (`io::ErrorKind::TimedOut`: the kernel's `ETIMEDOUT`, its retransmissions
/// unanswered). Noted by the socket ([`Watched`]) as it happens, and read by the
/// exchange that then fails ([`PoolError::Http`]), which is answered 504 instead of 502,
/// without looking into hyper's error for an `io::Error`.
#[derive(Debug, Default)]
pub(super) struct IoFacts {
    timed_out: AtomicBool,
}

impl IoFacts {
    /// Whether a read or write of the connection timed out.
    pub(super) fn timed_out(&self) -> bool {
        self.timed_out.load(Ordering::Acquire)
    }

    /// Note what a read or write of the connection failed with.
    #[cold]
    #[inline(never)]
    fn failed(&self, error: &io::Error) {
        if error.kind() == io::ErrorKind::TimedOut {
            self.timed_out.store(true, Ordering::Release);
        }
    }
}

/// An upstream connection's socket, noting its failures in its [`IoFacts`]; it only
/// looks at what a read or write returned when it is an error.
#[derive(Debug)]
struct Watched<T> {
    io: T,
    facts: Arc<IoFacts>,
}

impl<T> Watched<T> {
    /// `polled`, noted when it is an error.
    #[inline(always)]
    fn note<R>(&self, polled: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if let Poll::Ready(Err(e)) = &polled {
            self.facts.failed(e);
        }
        polled
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        this.note(polled)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.note(polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.note(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.note(polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
