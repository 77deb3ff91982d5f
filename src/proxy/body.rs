//! The request body as it goes upstream: the client's body, streamed, counted against the
//! route's `max_request_bytes`, cut off when it stops arriving for `server.body_timeout`,
//! and telling the upstream connection's pool whether it was sent to its end.

use super::error::causes;
use crate::wire::Incoming;
use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http_body::{Body as HttpBody, Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// The client's request body on its way upstream. Past `limit` bytes it fails with
/// [`TooLarge`], which cuts the upload off; the request path then answers 413. When no
/// byte of it arrives for `timeout` while the upstream connection waits for one, it
/// fails with [`BodyTimedOut`] (408).
#[derive(Debug)]
pub struct RequestBody {
    /// `None` only once dropped (see `Drop`).
    inner: Option<Incoming>,
    /// Bytes still allowed; `None`: no limit.
    left: Option<u64>,
    /// The limit, bytes (for the error).
    limit: u64,
    /// `server.body_timeout`.
    timeout: Duration,
    /// Made at the first wait for the client (most bodies never wait).
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether `timer` runs for the current wait (no frame since it was set).
    waiting: bool,
    state: Arc<BodyState>,
    /// Frames of a body sent once already, to send again (see [`RequestBody::replay`]),
    /// in order, before anything of `inner`.
    again: std::collections::VecDeque<Frame<Bytes>>,
}

/// What the upstream connection's pool knows of a [`RequestBody`]: whether it was sent
/// to its end, and a way to cut it off (which ends its connection).
#[derive(Debug, Default)]
pub struct BodyState {
    done: AtomicBool,
    cut: AtomicBool,
    waker: AtomicWaker,
}

impl BodyState {
    /// Whether the whole body was handed to the upstream connection (or there was none).
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Fail the body at its next poll with [`CutOff`], so that its connection closes
    /// instead of carrying the rest of an upload nobody will read.
    pub fn cut_off(&self) {
        self.cut.store(true, Ordering::Release);
        self.waker.wake();
    }
}

impl RequestBody {
    /// `inner`, allowed at most `limit` bytes (`None`: any number), and at most
    /// `timeout` without a byte while it is waited for.
    pub fn new(inner: Incoming, limit: Option<u64>, timeout: Duration) -> Self {
        let state = Arc::new(BodyState::default());
        if inner.is_end_stream() {
            state.done.store(true, Ordering::Release);
        }
        Self {
            inner: Some(inner),
            left: limit,
            limit: limit.unwrap_or(u64::MAX),
            timeout,
            timer: None,
            waiting: false,
            state,
            again: Default::default(),
        }
    }

    /// A body that is `frames` (all of a body, read whole and sent once), to send
    /// again: for a request an HTTP/2 upstream did not process.
    pub fn replay(frames: Vec<Frame<Bytes>>) -> Self {
        let state = Arc::new(BodyState::default());
        state.done.store(true, Ordering::Release);
        Self {
            inner: None,
            left: None,
            limit: u64::MAX,
            timeout: Duration::ZERO,
            timer: None,
            waiting: false,
            state,
            again: frames.into(),
        }
    }

    /// What the pool follows of this body.
    pub fn state(&self) -> Arc<BodyState> {
        self.state.clone()
    }

    /// Whether the client has been silent for `timeout` (arming the timer at the start
    /// of a wait).
    fn timed_out(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.waiting {
            self.waiting = true;
            timer.as_mut().reset(deadline);
        }
        timer.as_mut().poll(cx).is_ready()
    }
}

/// A request body went past the route's `max_request_bytes` (the limit, in bytes).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("request body larger than {0} bytes")]
pub struct TooLarge(pub u64);

/// No byte of the request body arrived for `server.body_timeout` (the timeout).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("no byte of the request body arrived for {0:?}")]
pub struct BodyTimedOut(pub Duration);

/// The upstream's response ended before the request body was sent: the rest of the body
/// is not sent, and the connection is closed.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the response ended before the request body was sent; upload cut off")]
pub struct CutOff;

/// The client's request body could not be read (malformed chunked encoding, a short
/// body, a reset): the client's fault, answered 400, never blamed on the upstream.
#[derive(Debug, thiserror::Error)]
#[error("the request body could not be read: {0}")]
pub struct ClientBody(#[source] crate::wire::BodyError);

/// The error of a [`RequestBody`]: [`ClientBody`], [`TooLarge`], [`BodyTimedOut`] or
/// [`CutOff`].
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

impl HttpBody for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if self.state.cut.load(Ordering::Acquire) {
            return Poll::Ready(Some(Err(Box::new(CutOff))));
        }
        if let Some(frame) = self.again.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                self.waiting = false;
                if let (Some(left), Some(data)) = (self.left, frame.data_ref()) {
                    let n = data.len() as u64;
                    if n > left {
                        return Poll::Ready(Some(Err(Box::new(TooLarge(self.limit)))));
                    }
                    self.left = Some(left - n);
                }
                if self.is_end_stream() {
                    self.state.done.store(true, Ordering::Release);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(ClientBody(e))))),
            Poll::Ready(None) => {
                self.state.done.store(true, Ordering::Release);
                Poll::Ready(None)
            }
            Poll::Pending => {
                self.state.waker.register(cx.waker());
                if self.state.cut.load(Ordering::Acquire) {
                    return Poll::Ready(Some(Err(Box::new(CutOff))));
                }
                if self.timed_out(cx) {
                    return Poll::Ready(Some(Err(Box::new(BodyTimedOut(self.timeout)))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.again.is_empty() && self.inner.as_ref().is_none_or(Incoming::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self
            .inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Incoming::size_hint);
        let again: u64 = self
            .again
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        if again > 0 {
            // The upper bound first: the lower may never pass it.
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper.saturating_add(again));
            }
            hint.set_lower(hint.lower().saturating_add(again));
        }
        hint
    }
}

/// Longest wait for the next byte of a body that is drained after an early response.
const LINGER_GAP: Duration = Duration::from_secs(5);
/// Longest a body is drained after an early response.
const LINGER_TOTAL: Duration = Duration::from_secs(30);

impl Drop for RequestBody {
    /// An upload cut off because the response came first (see [`BodyState::cut_off`]):
    /// the rest of the client's body is read and thrown away for a while (as nginx's
    /// lingering close does), at most [`LINGER_GAP`] without a byte and
    /// [`LINGER_TOTAL`] in all, so that a client that sends its whole body before
    /// reading still gets the response instead of a reset connection.
    fn drop(&mut self) {
        if !self.state.cut.load(Ordering::Acquire) || self.is_end_stream() {
            return;
        }
        let (Some(mut inner), Ok(runtime)) =
            (self.inner.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let gap = self.timeout.min(LINGER_GAP);
        runtime.spawn(async move {
            use http_body_util::BodyExt;
            let drained = async {
                while let Ok(Some(Ok(_))) = tokio::time::timeout(gap, inner.frame()).await {}
            };
            let _ = tokio::time::timeout(LINGER_TOTAL, drained).await;
        });
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

/// Whether `error` (or one of its sources) is a request body that stopped arriving
/// ([`BodyTimedOut`]).
pub fn timed_out(error: &(dyn std::error::Error + 'static)) -> Option<BodyTimedOut> {
    causes(error).find_map(|e| e.downcast_ref::<BodyTimedOut>().copied())
}
