//! Opening a connection to a target: TCP (counted in the descriptor budget), then TLS
//! for `https://` targets, then the HTTP/1.1 or HTTP/2 handshake.

use super::super::body::RequestBody;
use super::{Pool, PoolError};
use crate::budget::{Budget, Counted};
use crate::wire::h2client;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
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

    pub(super) async fn connect_h1(
        &self,
        budget: &Budget,
    ) -> Result<http1::SendRequest<RequestBody>, PoolError> {
        let stream = self.tcp(budget).await?;
        let max = self.connector.max_response_header_bytes;
        let tx = match &self.connector.tls {
            None => spawn_h1(TokioIo::new(stream), max).await?,
            Some(tls) => spawn_h1(TokioIo::new(self.tls(stream, tls).await?), max).await?,
        };
        Ok(tx)
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
/// `max_head_bytes` (and its request line) at least.
pub(super) async fn spawn_h1<T>(
    io: TokioIo<T>,
    max_head_bytes: usize,
) -> Result<http1::SendRequest<RequestBody>, PoolError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (tx, conn) = http1::Builder::new()
        .max_buf_size(max_head_bytes.saturating_add(8192).max(H1_DEFAULT_MAX_BUF))
        .handshake(io)
        .await
        .map_err(PoolError::http)?;
    tokio::spawn(async move {
        // With upgrades: a 101 answer hands the connection over to a tunnel (WebSocket).
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "upstream connection ended with an error");
        }
    });
    Ok(tx)
}
