//! A WebSocket (or other allowed upgrade) once both sides switched protocols: the
//! client and upstream connections joined, bytes copied both ways until either side
//! closes or nothing moves for `server.tunnel_idle_timeout`.

use http::HeaderValue;
use hyper_util::rt::TokioIo;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Copy bytes both ways between the client and the upstream once both connections
/// are upgraded, until either side closes or no byte has moved either way for
/// `idle_timeout`. `slot` (its place among `server.max_tunnels`) is held until then;
/// both sockets stay counted in the descriptor budget until they are dropped.
pub(super) async fn tunnel(
    client: crate::wire::ClientSide,
    upstream: hyper::upgrade::OnUpgrade,
    mut slot: crate::budget::TunnelSlot,
    idle_timeout: Duration,
    request_id: HeaderValue,
) {
    let id = request_id.to_str().unwrap_or("-").to_string();
    let upstream = async { upstream.await.map_err(Into::into) };
    match futures_util::future::try_join(client, upstream).await {
        Ok((client, upstream)) => {
            slot.open();
            let opened = tokio::time::Instant::now();
            let last = Arc::new(AtomicU64::new(0));
            let mut client = Touch::new(client, opened, last.clone());
            let mut upstream = Touch::new(TokioIo::new(upstream), opened, last.clone());
            let copy = tokio::io::copy_bidirectional(&mut client, &mut upstream);
            tokio::pin!(copy);
            let idle = tokio::time::sleep(idle_timeout);
            tokio::pin!(idle);
            loop {
                tokio::select! {
                    copied = copy.as_mut() => {
                        match copied {
                            Ok((up, down)) => tracing::debug!(request_id = %id, bytes_up = up, bytes_down = down, "tunnel closed"),
                            Err(e) => tracing::debug!(request_id = %id, error = %e, "tunnel ended with an error"),
                        }
                        return;
                    }
                    _ = idle.as_mut() => {
                        let moved = opened + Duration::from_millis(last.load(Ordering::Relaxed));
                        let until = moved + idle_timeout;
                        if tokio::time::Instant::now() >= until {
                            tracing::debug!(request_id = %id, ?idle_timeout, "idle tunnel closed (server.tunnel_idle_timeout)");
                            return;
                        }
                        idle.as_mut().reset(until);
                    }
                }
            }
        }
        Err(e) => tracing::debug!(request_id = %id, error = %e, "upgrade failed"),
    }
}

/// One side of a tunnel, noting when it last read a byte (milliseconds since the
/// tunnel opened, shared by both sides).
struct Touch<T> {
    io: T,
    opened: tokio::time::Instant,
    last: Arc<AtomicU64>,
}

impl<T> Touch<T> {
    fn new(io: T, opened: tokio::time::Instant, last: Arc<AtomicU64>) -> Self {
        Self { io, opened, last }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Touch<T> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            let ms = u64::try_from(this.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
            this.last.store(ms, Ordering::Relaxed);
        }
        polled
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Touch<T> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
