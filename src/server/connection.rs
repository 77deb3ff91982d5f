//! One client connection, from its TLS handshake (on a TLS listener) to its end: HTTP
//! served with [`crate::wire::alpn`], each request through [`proxy::handle`], under the
//! connection's timeouts (idle, header read, send) and the gateway's shutdown.

use super::guards;
use super::limits;
use super::shared::{Shared, LOG_TARGET};
use crate::budget::Counted;
use crate::proxy;
use crate::wire::{alpn, Interim};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

/// One accepted connection, ready to serve HTTP once its transport (plain TCP, or TLS
/// after the handshake) is ready.
pub(super) struct Connection {
    pub(super) builders: Arc<alpn::Builders>,
    pub(super) shutdown: watch::Receiver<bool>,
    pub(super) idle_timeout: Duration,
    pub(super) send_timeout: Duration,
    pub(super) header_read_timeout: Duration,
    pub(super) shared: Arc<Shared>,
    pub(super) peer: SocketAddr,
    /// The key of the peer's address whose share of the descriptor budget each request
    /// takes (`server.descriptor_share_per_ip`); `None` for a trusted proxy.
    pub(super) address: Option<std::net::IpAddr>,
    /// Held until the connection ends: the accept loop waits for every one at shutdown.
    /// (`server.max_connections`, `server.max_connections_per_ip` and the descriptor
    /// budget count the socket itself, a
    /// [`Counted`] one, for as long as it is open: in a tunnel too.)
    pub(super) _held: mpsc::Sender<()>,
}

impl Connection {
    /// Serve `stream` to its end: at once on a cleartext listener (`tls` is `None`), or
    /// after a TLS handshake with `tls` (the certificates current when it was accepted)
    /// within its `handshake_timeout`. A connection that negotiated `h2` is served only
    /// if its first bytes are the HTTP/2 preface (else GOAWAY).
    pub(super) async fn run(self, stream: Counted<TcpStream>, tls: Option<Arc<crate::tls::Tls>>) {
        let activity = limits::Activity::new();
        let Some(tls) = tls else {
            return self.serve(stream, None, None, activity).await;
        };
        let peer = self.peer;
        let handshake = tls.acceptor().accept(stream);
        match tokio::time::timeout(tls.handshake_timeout, handshake).await {
            Ok(Ok(stream)) => {
                let session = stream.get_ref().1;
                let info = tls.info(session);
                let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
                if alpn.as_deref() == Some(b"h2") {
                    // Only HTTP/2: an invalid preface gets GOAWAY.
                    let timeout = self.header_read_timeout;
                    if let Some(stream) = alpn::h2_preface(stream, timeout).await {
                        self.serve(stream, Some(info), alpn, activity).await;
                    }
                } else {
                    self.serve(stream, Some(info), alpn, activity).await;
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(target: LOG_TARGET, %peer, error = %e, "TLS handshake failed");
            }
            Err(_) => tracing::debug!(target: LOG_TARGET,
                %peer,
                timeout = ?tls.handshake_timeout,
                "TLS handshake timed out; connection closed"
            ),
        }
    }

    /// Serve HTTP/1.1 or HTTP/2 on `io` until the connection ends (only the protocol
    /// `alpn` names, when the TLS handshake negotiated one); `tls` (what the handshake
    /// told) goes into every request's extensions. `io`'s reads tell `activity`
    /// ([`limits::Reads`]).
    async fn serve<T>(
        self,
        io: T,
        tls: Option<crate::tls::TlsInfo>,
        alpn: Option<Vec<u8>>,
        activity: Arc<limits::Activity>,
    ) where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let io = match alpn.as_deref() {
            Some(b"h2") => limits::Reads::http2(io, activity.clone()),
            _ => limits::Reads::new(io, activity.clone()),
        };
        // 1xx responses reach HTTP/1.1 clients through the socket itself (hyper's server
        // cannot send them; HTTP/2 ones get theirs on their stream): see
        // `wire::interim`.
        let io = Interim::new(io);
        let informational = io.handle();
        let Connection {
            builders,
            mut shutdown,
            idle_timeout,
            send_timeout,
            header_read_timeout,
            shared,
            peer,
            address,
            _held,
        } = self;
        let conn_peer = Arc::new(proxy::forward::Peer::new(peer, address));
        let conn_activity = activity.clone();
        let handler = move |mut req: http::Request<crate::wire::Incoming>| {
            let shared = shared.clone();
            let peer = conn_peer.clone();
            if let Some(info) = &tls {
                req.extensions_mut().insert(info.clone());
            }
            // Where 1xx responses go: an HTTP/1.1 request's, through this connection's
            // socket (passed along, not in the request's extensions: a first extension
            // allocates a map per request); HTTP/2 streams come with their own in the
            // extensions (see `wire::h2server`).
            let informational =
                (req.version() == http::Version::HTTP_11).then(|| informational.clone());
            // Busy until the response body ends (the guard travels with it).
            let busy = conn_activity.request();
            // Boxed: hyper's dispatcher holds the service's future and moves it whole
            // when it takes it; boxed, it moves a pointer (the request path's future is
            // several KB). Written into the allocation (`Box::write`) rather than built
            // and then moved there (`Box::pin`), which copies all of it once more. One box
            // per request, in place, instead of a `Box::pin` each for `proxy::serve`'s and
            // `proxy::forward`'s futures: 818 instructions fewer per proxied request and
            // 443 per 429 (callgrind). Only the captures are written, not the several KB
            // of states that follow them, as long as no capture is laid out past those
            // states: rustc puts a capture with a large niche at the far end (the
            // address, an `Option<IpAddr>`, was there when it was a capture of its own,
            // and the write then copied all 4,561 bytes between: about 480 instructions
            // per request, callgrind), so the address comes with the `Peer`.
            Box::into_pin(Box::write(Box::new_uninit(), async move {
                let snap = shared.snapshot.load_full();
                let ctx = proxy::Context {
                    clock: &shared.clock,
                    metrics: &shared.metrics,
                    delayed: &shared.delayed,
                    budget: &shared.budget,
                    address: peer.share,
                    body_timeout: shared.body_timeout,
                    informational: informational.as_ref(),
                };
                let (response, finished) = proxy::handle(&snap.gate(), &ctx, req, &peer).await;
                // Watch the response body's progress for `server.send_timeout`; the
                // request's access line and in-flight count end with the body.
                Ok::<_, Infallible>(
                    response.map(|body| limits::SendWatch::new(body, finished, busy)),
                )
            }))
        };
        let conn = builders.serve(alpn.as_deref(), io, handler);
        tokio::pin!(conn);
        // Close gracefully (a response under way finishes first) at shutdown, or once
        // no request has been handled for `idle_timeout`; drop it when an HTTP/1 request
        // head has taken `header_read_timeout`, or the client has stopped reading a
        // response for `send_timeout`. One timer, re-armed when it fires: requests set
        // none.
        let mut closing = *shutdown.borrow();
        if closing {
            conn.graceful_shutdown();
        }
        let idle_check =
            tokio::time::sleep(idle_timeout.min(send_timeout).min(header_read_timeout));
        tokio::pin!(idle_check);
        let second = Duration::from_secs(1);
        // The guards (shutdown, the timer) are polled only when they woke the task, not
        // on each of a request's wakes (see `guards`).
        let guards = guards::Guards::new();
        let changed = shutdown.changed();
        tokio::pin!(changed);
        loop {
            let fired = std::future::poll_fn(|cx| {
                guards.poll(
                    cx,
                    |cx| conn.as_mut().poll(cx).map(Fired::Ended),
                    |cx| {
                        if !closing && changed.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(Fired::Shutdown);
                        }
                        idle_check.as_mut().poll(cx).map(|()| Fired::Check)
                    },
                )
            })
            .await;
            guards.rearm();
            match fired {
                Fired::Ended(ended) => {
                    if let Err(e) = ended {
                        tracing::debug!(target: LOG_TARGET, %peer, error = %e, "connection ended with an error");
                    }
                    return;
                }
                Fired::Shutdown => {
                    closing = true;
                    conn.graceful_shutdown();
                }
                Fired::Check => {
                    let head_for = activity.head_for();
                    if head_for >= header_read_timeout {
                        tracing::debug!(target: LOG_TARGET, %peer, ?head_for, "request head incomplete; connection closed (server.header_read_timeout)");
                        return;
                    }
                    let stalled_for = activity.stalled_for();
                    if stalled_for >= send_timeout {
                        // A response waits for a client that stopped reading (a graceful
                        // close would wait for it too): drop the connection.
                        tracing::debug!(target: LOG_TARGET, %peer, ?stalled_for, "client stopped reading; connection closed (server.send_timeout)");
                        return;
                    }
                    let idle_for = activity.idle_for();
                    if closing && idle_for > Duration::ZERO {
                        // Shut down gracefully, yet a client still holds the connection
                        // with nothing in flight (e.g. it never answers HTTP/2's closing
                        // PING): close it.
                        return;
                    }
                    let mut next = if !closing && idle_for >= idle_timeout {
                        tracing::debug!(target: LOG_TARGET, %peer, ?idle_for, "idle connection closed");
                        closing = true;
                        conn.graceful_shutdown();
                        second
                    } else if closing {
                        second
                    } else {
                        idle_timeout - idle_for
                    };
                    if stalled_for > Duration::ZERO {
                        next = next.min(send_timeout - stalled_for);
                    } else {
                        next = next.min(send_timeout);
                    }
                    // A head begun since this check is found by the next one, at most
                    // `header_read_timeout` away, which then waits for what it has left.
                    next = next.min(header_read_timeout - head_for);
                    let next = next.max(Duration::from_millis(10));
                    idle_check
                        .as_mut()
                        .reset(tokio::time::Instant::now() + next);
                }
            }
        }
    }
}

/// What ended a wait of a connection's task: the connection (its result), the shutdown
/// signal, or the connection's timer (idle, header read, send: see `Connection::serve`).
enum Fired<R> {
    Ended(R),
    Shutdown,
    Check,
}
