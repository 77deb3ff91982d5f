//! The body of a response from an HTTP/2 upstream.

use super::Claim;
use bytes::Bytes;
use http::header::{self, HeaderMap};
use http_body::{Body as HttpBody, Frame, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

/// A response body from an HTTP/2 upstream (see the module documentation).
#[derive(Debug)]
pub struct ResponseBody {
    recv: h2::RecvStream,
    data_done: bool,
    /// What `Content-Length` says is left, in bytes (`None`: not given).
    left: Option<u64>,
    /// The stream's place on its connection, held while the body is read.
    _claim: Arc<Claim>,
}

impl ResponseBody {
    /// The body of a response with these `headers` (its `Content-Length`, if any, is
    /// the size hint).
    pub(super) fn new(recv: h2::RecvStream, headers: &HeaderMap, claim: Arc<Claim>) -> Self {
        let length = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        Self {
            left: length.or(recv.is_end_stream().then_some(0)),
            recv,
            data_done: false,
            _claim: claim,
        }
    }
}

impl HttpBody for ResponseBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            let this = &mut *self;
            match ready!(crate::wire::incoming::poll_data(
                &mut this.recv,
                &mut this.left,
                cx
            )) {
                Some(Ok(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                // An early response (RFC 9113 §8.1): the body ends here.
                Some(Err(e)) if e.reason() == Some(h2::Reason::NO_ERROR) => {
                    return Poll::Ready(None)
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => self.data_done = true,
            }
        }
        match ready!(self.recv.poll_trailers(cx)) {
            Ok(trailers) => Poll::Ready(trailers.map(|t| Ok(Frame::trailers(t)))),
            Err(e) if e.reason() == Some(h2::Reason::NO_ERROR) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match self.left {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}
