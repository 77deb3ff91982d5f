//! The client side of a tunnel ([`client_upgrade`]): a WebSocket upgraded over HTTP/1.1
//! (hyper's `upgrade::on`), or an HTTP/2 extended CONNECT stream (RFC 8441, [`H2Io`])
//! handed over by [`super::h2server`] once it has sent the 2xx answer.

use super::incoming::BodyError;
use bytes::{Buf, Bytes};
use h2::{RecvStream, SendStream};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

/// Any byte stream a tunnel can copy to and from.
pub trait TunnelIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> TunnelIo for T {}

/// The client side of a tunnel, once the gateway's answer to the upgrade is sent.
pub type ClientSide = Pin<Box<dyn Future<Output = Result<Box<dyn TunnelIo>, BodyError>> + Send>>;

/// In an HTTP/2 CONNECT request's extensions: where its stream arrives once the
/// server has sent a 2xx answer.
#[derive(Debug, Clone)]
pub struct H2Upgrade(Arc<Mutex<Option<oneshot::Receiver<H2Io>>>>);

impl H2Upgrade {
    /// A pair: the request's handle, and the sender the server hands the stream to.
    pub fn pair() -> (Self, oneshot::Sender<H2Io>) {
        let (tx, rx) = oneshot::channel();
        (Self(Arc::new(Mutex::new(Some(rx)))), tx)
    }
}

/// The client side of `req`'s upgrade: its HTTP/2 stream (extended CONNECT), or the
/// HTTP/1.1 connection hyper hands over after the 101.
pub fn client_upgrade<B>(req: &mut http::Request<B>) -> ClientSide {
    let h2 = req
        .extensions_mut()
        .remove::<H2Upgrade>()
        .and_then(|u| u.0.lock().unwrap_or_else(|e| e.into_inner()).take());
    match h2 {
        Some(rx) => Box::pin(async move {
            let io = rx.await.map_err(|_| "the HTTP/2 stream was not upgraded")?;
            Ok(Box::new(io) as Box<dyn TunnelIo>)
        }),
        None => {
            let on = hyper::upgrade::on(req);
            Box::pin(async move {
                let upgraded = on.await?;
                Ok(Box::new(hyper_util::rt::TokioIo::new(upgraded)) as Box<dyn TunnelIo>)
            })
        }
    }
}

/// An HTTP/2 stream as a byte stream (the client side of an RFC 8441 tunnel): reads
/// its DATA, giving the capacity back as bytes are read, and writes DATA within the
/// client's flow-control window. Shutting it down ends the stream.
#[derive(Debug)]
pub struct H2Io {
    send: SendStream<Bytes>,
    recv: RecvStream,
    /// DATA received and not read yet.
    buf: Bytes,
}

impl H2Io {
    /// The stream whose request came on `recv` and whose answer went on `send`.
    pub fn new(send: SendStream<Bytes>, recv: RecvStream) -> Self {
        Self {
            send,
            recv,
            buf: Bytes::new(),
        }
    }
}

fn io_error(e: h2::Error) -> std::io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| std::io::ErrorKind::Other.into())
    } else {
        std::io::Error::new(std::io::ErrorKind::ConnectionReset, e)
    }
}

impl AsyncRead for H2Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        while this.buf.is_empty() {
            match ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    this.buf = data;
                }
                // The client ended its side (or reset it with NO_ERROR / CANCEL): EOF.
                None => return Poll::Ready(Ok(())),
                Some(Err(e)) if e.reason() == Some(h2::Reason::NO_ERROR) => {
                    return Poll::Ready(Ok(()))
                }
                Some(Err(e)) => return Poll::Ready(Err(io_error(e))),
            }
        }
        let n = this.buf.len().min(out.remaining());
        out.put_slice(&this.buf[..n]);
        this.buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for H2Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        this.send.reserve_capacity(buf.len());
        let n = loop {
            let available = this.send.capacity();
            if available > 0 {
                break available;
            }
            if let Poll::Ready(reason) = this.send.poll_reset(cx) {
                let e = match reason {
                    Ok(reason) => h2::Error::from(reason),
                    Err(e) => e,
                };
                return Poll::Ready(Err(io_error(e)));
            }
            match ready!(this.send.poll_capacity(cx)) {
                Some(Ok(0)) => continue,
                Some(Ok(n)) => break n,
                Some(Err(e)) => return Poll::Ready(Err(io_error(e))),
                None => return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
            }
        };
        let n = n.min(buf.len());
        this.send
            .send_data(Bytes::copy_from_slice(&buf[..n]), false)
            .map_err(io_error)?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        this.send.reserve_capacity(0);
        // Ending a stream that is already reset or ended is not an error here.
        let _ = this.send.send_data(Bytes::new(), true);
        Poll::Ready(Ok(()))
    }
}
