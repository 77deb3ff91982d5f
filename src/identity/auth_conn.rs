//! The connections to `[identity.auth_request]`'s service: hyper-util's connector with
//! each socket counted in the descriptor budget.

use crate::budget::{Descriptor, Sockets};
use futures_util::future::BoxFuture;
use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use tokio::net::TcpStream;

/// The descriptor budget had no room for a socket to the auth service.
#[derive(Debug, thiserror::Error)]
#[error("no descriptor left for a connection to the auth service (the open-file limit is spent)")]
pub(super) struct NoDescriptor;

/// Whether the callout failed for want of a descriptor ([`NoDescriptor`]).
pub(super) fn is_no_descriptor(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<NoDescriptor>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// hyper-util's connector, each socket counted in the descriptor budget (see
/// `State::sockets` of the callout): no socket is opened when the budget is spent.
#[derive(Clone)]
pub(super) struct CountedConnector {
    /// Opens the TCP connections.
    pub(super) http: HttpConnector,
    /// The descriptor budget, set by the first callout.
    pub(super) sockets: Arc<OnceLock<Sockets>>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for CountedConnector {
    type Response = CountedSocket;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<CountedSocket, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        // Taken before connecting; `None` only before the first `ask` set the budget.
        let descriptor = match self.sockets.get() {
            Some(sockets) => match sockets.take() {
                Some(d) => Some(d),
                None => return Box::pin(async { Err(Box::new(NoDescriptor) as BoxError) }),
            },
            None => None,
        };
        let connecting = self.http.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            Ok(CountedSocket {
                io,
                _descriptor: descriptor,
            })
        })
    }
}

/// A socket to the auth service with its place in the descriptor budget.
pub(super) struct CountedSocket {
    io: TokioIo<TcpStream>,
    _descriptor: Option<Descriptor>,
}

impl Connection for CountedSocket {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

impl hyper::rt::Read for CountedSocket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for CountedSocket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
