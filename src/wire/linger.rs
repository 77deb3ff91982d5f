//! Lingering close for HTTP/1.1 client connections, as nginx's `lingering_close` does.
//!
//! When hyper closes a connection the client may still be sending: a request head past
//! `server.max_header_bytes` that was answered 431 at its first 32 KB, or a body the
//! response did not wait for. A socket closed with bytes unread makes the kernel reset
//! the connection, and a client still writing then gets a broken pipe or a reset in
//! place of the answer it was sent (over TLS, a client sending a 70 KB head would see a
//! connection error, not the 431). So a close ([`Linger`]'s
//! `poll_shutdown`, which hyper calls when it closes a connection) first closes the
//! sending side (TLS `close_notify`, then TCP FIN), then reads and discards what the
//! client still sends until it closes its side, for at most [`LINGER_TIME`] and
//! [`LINGER_BYTES`].
//!
//! A connection that switched protocols (hyper wrote a `101` head: a WebSocket tunnel
//! now owns it) closes plainly: there a close of the sending side is a half-close, and
//! what the client sends after it is the tunnel's to forward. The `101` is recognised
//! at the start of a write, where hyper puts a response head (behind the unflushed end
//! of an earlier pipelined response it would be missed; tunnels follow a single
//! upgrade request in practice).

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How long a closing connection reads what its client still sends, at most.
pub(crate) const LINGER_TIME: Duration = Duration::from_secs(2);

/// How much a closing connection reads and discards at most, in bytes.
pub(crate) const LINGER_BYTES: usize = 1 << 20;

/// A client connection whose close lingers (see the module documentation).
#[derive(Debug)]
pub(crate) struct Linger<T> {
    io: T,
    state: State,
    /// A `101` was written: close without lingering.
    switched: bool,
}

/// The start of the head hyper writes for a `101`.
const SWITCHING: &[u8] = b"HTTP/1.1 101 ";

#[derive(Debug)]
enum State {
    Open,
    /// The sending side is closed; reading until the client closes, the deadline or
    /// the byte bound.
    Draining {
        deadline: Pin<Box<tokio::time::Sleep>>,
        read: usize,
    },
    Closed,
}

impl<T> Linger<T> {
    /// Wrap a client connection.
    pub(crate) fn new(io: T) -> Self {
        Self {
            io,
            state: State::Open,
            switched: false,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Linger<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Linger<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.switched |= buf.starts_with(SWITCHING);
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.switched |= bufs.iter().any(|b| b.starts_with(SWITCHING));
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                State::Open if this.switched => return Pin::new(&mut this.io).poll_shutdown(cx),
                State::Open => {
                    std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
                    this.state = State::Draining {
                        deadline: Box::pin(tokio::time::sleep(LINGER_TIME)),
                        read: 0,
                    };
                }
                State::Draining { deadline, read } => {
                    if deadline.as_mut().poll(cx).is_ready() {
                        this.state = State::Closed;
                        continue;
                    }
                    let mut scratch = [0u8; 8192];
                    let mut buf = ReadBuf::new(&mut scratch);
                    match Pin::new(&mut this.io).poll_read(cx, &mut buf) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                            *read += buf.filled().len();
                            if *read >= LINGER_BYTES {
                                this.state = State::Closed;
                            }
                        }
                        // The client closed its side (or the connection failed): done.
                        Poll::Ready(_) => this.state = State::Closed,
                    }
                }
                State::Closed => return Poll::Ready(Ok(())),
            }
        }
    }
}
