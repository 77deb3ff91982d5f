//! The request body as it goes upstream: the client's body, streamed, counted against the
//! route's `max_request_bytes`.

use super::error::causes;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The client's request body on its way upstream. Past `limit` bytes it fails with
/// [`TooLarge`], which cuts the upload off; the request path then answers 413.
#[derive(Debug)]
pub struct RequestBody {
    inner: Incoming,
    /// Bytes still allowed; `None`: no limit.
    left: Option<u64>,
    /// The limit, bytes (for the error).
    limit: u64,
}

impl RequestBody {
    /// `inner`, allowed at most `limit` bytes (`None`: any number).
    pub fn new(inner: Incoming, limit: Option<u64>) -> Self {
        Self {
            inner,
            left: limit,
            limit: limit.unwrap_or(u64::MAX),
        }
    }
}

/// A request body went past the route's `max_request_bytes` (the limit, in bytes).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("request body larger than {0} bytes")]
pub struct TooLarge(pub u64);

/// The client's request body could not be read (malformed chunked encoding, a short
/// body, a reset): the client's fault, answered 400, never blamed on the upstream.
#[derive(Debug, thiserror::Error)]
#[error("the request body could not be read: {0}")]
pub struct ClientBody(#[source] hyper::Error);

/// The error of a [`RequestBody`]: [`ClientBody`], or [`TooLarge`].
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

impl HttpBody for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(left), Some(data)) = (self.left, frame.data_ref()) {
                    let n = data.len() as u64;
                    if n > left {
                        return Poll::Ready(Some(Err(Box::new(TooLarge(self.limit)))));
                    }
                    self.left = Some(left - n);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(ClientBody(e))))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Whether `error` (or one of its sources) is a [`ClientBody`] error.
pub fn client_body(error: &(dyn std::error::Error + 'static)) -> bool {
    causes(error).any(|e| e.is::<ClientBody>())
}

/// Whether `error` (or one of its sources) is a [`TooLarge`] request body.
pub fn too_large(error: &(dyn std::error::Error + 'static)) -> Option<TooLarge> {
    causes(error).find_map(|e| e.downcast_ref::<TooLarge>().copied())
}
