//! What holds a place in the budget until dropped: a counted socket ([`Descriptor`],
//! [`Counted`]) and a tunnel's place ([`TunnelSlot`]).

use super::address::AddressSlot;
use prometheus_client::metrics::gauge::Gauge;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;

/// One counted socket: a client connection (and its place among
/// `server.max_connections` and `server.max_connections_per_ip`) or an upstream
/// connection. Given back when dropped.
#[derive(Debug)]
pub struct Descriptor {
    _fd: OwnedSemaphorePermit,
    _connection: Option<OwnedSemaphorePermit>,
    _per_address: Option<AddressSlot>,
    gauge: Gauge,
}

impl Descriptor {
    /// The socket's descriptor `fd` (with its client connection's places, if any),
    /// counted in `gauge` until dropped.
    pub(super) fn new(
        fd: OwnedSemaphorePermit,
        connection: Option<OwnedSemaphorePermit>,
        per_address: Option<AddressSlot>,
        gauge: &Gauge,
    ) -> Self {
        gauge.inc();
        Self {
            _fd: fd,
            _connection: connection,
            _per_address: per_address,
            gauge: gauge.clone(),
        }
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// A tunnel's place among `server.max_tunnels`, counted in `tollgate_open_tunnels` once
/// the tunnel is open ([`TunnelSlot::open`]); given back when dropped.
#[derive(Debug)]
pub struct TunnelSlot {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
    open: bool,
}

impl TunnelSlot {
    /// The place `permit`, counted in `gauge` once open.
    pub(super) fn new(permit: OwnedSemaphorePermit, gauge: &Gauge) -> Self {
        Self {
            _permit: permit,
            gauge: gauge.clone(),
            open: false,
        }
    }

    /// Both sides are upgraded: the tunnel is open.
    pub fn open(&mut self) {
        if !self.open {
            self.open = true;
            self.gauge.inc();
        }
    }
}

impl Drop for TunnelSlot {
    fn drop(&mut self) {
        if self.open {
            self.gauge.dec();
        }
    }
}

/// A socket with its [`Descriptor`]: counted for as long as the socket is open,
/// whoever holds it (a connection, the pool, a tunnel).
#[derive(Debug)]
pub struct Counted<T> {
    io: T,
    _descriptor: Descriptor,
}

impl<T> Counted<T> {
    /// `io`, counted by `descriptor`.
    pub fn new(io: T, descriptor: Descriptor) -> Self {
        Self {
            io,
            _descriptor: descriptor,
        }
    }

    /// The socket.
    pub fn get_ref(&self) -> &T {
        &self.io
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
