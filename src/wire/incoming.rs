//! A client's request body as the request path reads it, whichever server read the
//! request: hyper's HTTP/1.1 server ([`hyper::body::Incoming`]) or the HTTP/2 server
//! built on the h2 crate ([`super::h2server`]), whose streams are read here
//! ([`Incoming::Http2`]) with their flow control.

use bytes::Bytes;
use h2::RecvStream;
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

/// The error of an [`Incoming`] body (the client's stream failed, was reset or broke
/// HTTP's framing).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// A client's request body.
#[derive(Debug)]
pub enum Incoming {
    /// Read by hyper (HTTP/1.1 clients).
    Http1(hyper::body::Incoming),
    /// An HTTP/2 stream's DATA and trailers.
    Http2(H2Body),
    /// No body (an HTTP/2 CONNECT, whose stream becomes a tunnel).
    Empty,
}

impl Body for Incoming {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            Incoming::Http1(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            Incoming::Http2(b) => b.poll_frame(cx),
            Incoming::Empty => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Incoming::Http1(b) => b.is_end_stream(),
            Incoming::Http2(b) => b.recv.is_end_stream() && !b.trailers_due,
            Incoming::Empty => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Incoming::Http1(b) => b.size_hint(),
            Incoming::Http2(b) => b.left.map_or_else(SizeHint::default, SizeHint::with_exact),
            Incoming::Empty => SizeHint::with_exact(0),
        }
    }
}

/// An HTTP/2 request stream's body: its DATA (the capacity each frame took is given
/// back to the client as the frame is handed on), then its trailers.
#[derive(Debug)]
pub struct H2Body {
    recv: RecvStream,
    /// Bytes still to come, from `Content-Length` (h2 checks the stream against it).
    left: Option<u64>,
    /// Whether the DATA ended and trailers may follow.
    trailers_due: bool,
}

impl H2Body {
    /// The body of a stream whose request declared `content_length` bytes.
    pub fn new(recv: RecvStream, content_length: Option<u64>) -> Self {
        Self {
            recv,
            left: content_length,
            trailers_due: false,
        }
    }

    fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if !self.trailers_due {
            match ready!(poll_data(&mut self.recv, &mut self.left, cx)) {
                Some(Ok(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                None => self.trailers_due = true,
            }
        }
        match ready!(self.recv.poll_trailers(cx)) {
            Ok(Some(trailers)) => {
                self.trailers_due = false;
                Poll::Ready(Some(Ok(Frame::trailers(trailers))))
            }
            Ok(None) => {
                self.trailers_due = false;
                Poll::Ready(None)
            }
            Err(e) => Poll::Ready(Some(Err(e.into()))),
        }
    }
}

/// The next DATA of an HTTP/2 stream, its flow-control capacity given back (the
/// peer may send as much again) and counted off `left` (what `Content-Length` says is
/// still to come, bytes).
pub(crate) fn poll_data(
    recv: &mut RecvStream,
    left: &mut Option<u64>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Bytes, h2::Error>>> {
    let polled = ready!(recv.poll_data(cx));
    if let Some(Ok(data)) = &polled {
        let _ = recv.flow_control().release_capacity(data.len());
        if let Some(left) = left {
            *left = left.saturating_sub(data.len() as u64);
        }
    }
    Poll::Ready(polled)
}
