//! The task that sends a request body on its HTTP/2 stream, within the stream's
//! flow-control window, keeping a copy of a small body to send again (see the
//! documentation of [`super`]).

use super::{Claim, Replay, REPLAY_BYTES};
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use tokio::sync::oneshot;

/// The task that sends a request body on its stream (see the module documentation).
pub(super) struct Pipe<B: HttpBody> {
    body: B,
    tx: h2::SendStream<Bytes>,
    /// A data chunk waiting for flow-control capacity, and whether it ends the body.
    buffered: Option<(Bytes, bool)>,
    /// Where a failure of `body` is left for the response's error.
    failure: Arc<Mutex<Option<B::Error>>>,
    /// Resolves `Ok` when the response has come (the body goes on being sent), `Err`
    /// when the request was given up before (the stream is reset).
    cancelled: Option<oneshot::Receiver<()>>,
    /// The frames taken from `body` and their data's size in bytes, while that is at
    /// most [`REPLAY_BYTES`] (`None` past it): a body read whole is given to `sent` when
    /// the pipe ends (see [`Pipe::poll_collect`]), to be sent again if the upstream did
    /// not process the request.
    kept: Option<(Vec<Frame<Bytes>>, usize)>,
    /// Where the whole body goes when the pipe ends (see `kept`).
    sent: Option<oneshot::Sender<Vec<Frame<Bytes>>>>,
    /// Whether the pipe has ended ([`Pipe::poll_collect`] then runs).
    piped: bool,
    /// The stream's place on its connection, held while the body is sent.
    _claim: Arc<Claim>,
}

impl<B> Pipe<B>
where
    B: Replay,
    B::Error: std::fmt::Display + Send + 'static,
{
    /// The pipe of `body` on the stream `tx`: a failure of `body` is left in `failure`,
    /// the response's coming or being given up is told by `cancelled`, the whole body
    /// (when it was kept) goes to `sent`; `claim` is held while the body is sent.
    pub(super) fn new(
        body: B,
        tx: h2::SendStream<Bytes>,
        failure: Arc<Mutex<Option<B::Error>>>,
        cancelled: oneshot::Receiver<()>,
        sent: oneshot::Sender<Vec<Frame<Bytes>>>,
        claim: Arc<Claim>,
    ) -> Self {
        Self {
            body,
            tx,
            buffered: None,
            failure,
            cancelled: Some(cancelled),
            kept: Some((Vec::new(), 0)),
            sent: Some(sent),
            piped: false,
            _claim: claim,
        }
    }

    /// Keep a copy of `frame`, taken from the body, while the body is small enough.
    fn keep(&mut self, frame: &Frame<Bytes>) {
        let Some((frames, bytes)) = &mut self.kept else {
            return;
        };
        let size = frame.data_ref().map_or(0, Bytes::len);
        if *bytes + size > REPLAY_BYTES {
            self.kept = None;
            return;
        }
        *bytes += size;
        let copy = match frame.data_ref() {
            Some(data) => Frame::data(data.clone()),
            None => match frame.trailers_ref() {
                Some(trailers) => Frame::trailers(trailers.clone()),
                None => return,
            },
        };
        frames.push(copy);
    }

    /// Once the pipe has ended (the body sent, or the stream given up): the rest of a
    /// body small enough to keep is read from the client, while the request's sender
    /// waits for it (it does when the upstream did not process the request), and the
    /// whole body is given to it to send again. Bounded by [`REPLAY_BYTES`] and the
    /// body's own `server.body_timeout`.
    fn poll_collect(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            let Some(sent) = &mut self.sent else {
                return Poll::Ready(());
            };
            if self.kept.is_none() || sent.poll_closed(cx).is_ready() {
                return Poll::Ready(());
            }
            if self.body.is_end_stream() {
                if let (Some((frames, _)), Some(sent)) = (self.kept.take(), self.sent.take()) {
                    let _ = sent.send(frames);
                }
                return Poll::Ready(());
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => self.keep(&frame),
                Some(Err(_)) => return Poll::Ready(()),
                None => {}
            }
        }
    }

    /// Reset the stream after a failure of the request body, kept for the response.
    fn body_failed(&mut self, error: B::Error) {
        tracing::debug!(error = %error, "request body failed while sent to an HTTP/2 upstream");
        *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
        self.tx.send_reset(h2::Reason::INTERNAL_ERROR);
        // Nothing to send again; and the pipe ends now, dropping the stream, which
        // wakes the response's waiter with the reset.
        self.sent = None;
        self.kept = None;
    }

    fn poll_pipe(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), h2::Error>> {
        loop {
            if let Some(cancelled) = &mut self.cancelled {
                match Pin::new(cancelled).poll(cx) {
                    Poll::Ready(Ok(())) => self.cancelled = None,
                    Poll::Ready(Err(_)) => {
                        self.tx.send_reset(h2::Reason::CANCEL);
                        return Poll::Ready(Ok(()));
                    }
                    Poll::Pending => {}
                }
            }
            if let Poll::Ready(reason) = self.tx.poll_reset(cx)? {
                return Poll::Ready(Err(reason.into()));
            }
            if let Some((data, eos)) = self.buffered.take() {
                if self.tx.capacity() == 0 {
                    loop {
                        match self.tx.poll_capacity(cx) {
                            Poll::Ready(Some(Ok(0))) => {}
                            Poll::Ready(Some(Ok(_))) => break,
                            Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                            Poll::Ready(None) => return Poll::Ready(Ok(())),
                            Poll::Pending => {
                                self.buffered = Some((data, eos));
                                return Poll::Pending;
                            }
                        }
                    }
                }
                self.tx.send_data(data, eos)?;
                if eos {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    self.keep(&frame);
                    match frame.into_data() {
                        Ok(data) => {
                            let eos = self.body.is_end_stream();
                            if data.is_empty() {
                                self.tx.send_data(data, eos)?;
                                if eos {
                                    return Poll::Ready(Ok(()));
                                }
                            } else {
                                // A minimal claim: h2 raises it to what is buffered (as
                                // hyper does, so that no window is pinned by a body that
                                // sends nothing).
                                self.tx.reserve_capacity(1);
                                self.buffered = Some((data, eos));
                            }
                        }
                        Err(frame) => {
                            if let Ok(trailers) = frame.into_trailers() {
                                self.tx.reserve_capacity(0);
                                self.tx.send_trailers(trailers)?;
                                return Poll::Ready(Ok(()));
                            }
                        }
                    }
                }
                Some(Err(e)) => {
                    self.body_failed(e);
                    return Poll::Ready(Ok(()));
                }
                None => {
                    self.tx.send_data(Bytes::new(), true)?;
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

impl<B> Future for Pipe<B>
where
    B: Replay,
    B::Error: std::fmt::Display + Send + 'static,
{
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if !this.piped {
            if let Err(e) = ready!(this.poll_pipe(cx)) {
                tracing::debug!(error = %e, "request body to an HTTP/2 upstream not sent in full");
            }
            this.piped = true;
        }
        this.poll_collect(cx)
    }
}
