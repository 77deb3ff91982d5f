//! Where an HTTP/1.1 connection goes when its exchange ends: back to its pool, or kept
//! for the downstream connection's next request ([`Affinity`]); the response body that
//! puts it there ([`PooledBody`]).

use super::super::body::{BodyError, BodyState, RequestBody};
use super::Pool;
use crate::clock::Coarse;
use crate::wire::h2client;
use bytes::Bytes;
use http::Response;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

/// Where an HTTP/1.1 connection goes when its exchange ends: the pool's `part`, or the
/// downstream connection's [`Affinity`]; `body` tells whether its request body was sent.
pub(super) struct Back {
    pub(super) part: usize,
    pub(super) tx: http1::SendRequest<RequestBody>,
    pub(super) body: Arc<BodyState>,
    pub(super) affinity: Option<Affinity>,
}

/// The HTTP/1.1 upstream connection that one downstream connection used last, kept for
/// that downstream connection's next request (pingora's connection reuse): checking it
/// out is one uncontended lock, with no pool stack and no clock read. One connection is
/// kept at most (the last one whose exchange ended, ready for another request); the one
/// it replaces, and the one kept when the downstream connection ends, go back to their
/// pool (where the idle bound and `keepalive_timeout` apply). A kept connection older
/// than its pool's `keepalive_timeout` is not used. Cloning shares it (the response body
/// holds a clone to put the connection back).
#[derive(Debug, Clone, Default)]
pub struct Affinity(Arc<KeptCell>);

/// See [`Affinity`].
#[derive(Debug)]
struct Kept {
    pool: Arc<Pool>,
    part: usize,
    tx: http1::SendRequest<RequestBody>,
    /// When it became idle (the coarse clock: its idle timeout is seconds long).
    since: Coarse,
}

impl Affinity {
    /// The kept connection, when it is `pool`'s, still open and young enough.
    pub(super) fn take(&self, pool: &Arc<Pool>) -> Option<http1::SendRequest<RequestBody>> {
        let mut kept = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
        if !kept.as_ref().is_some_and(|k| Arc::ptr_eq(&k.pool, pool)) {
            return None;
        }
        let k = kept.take()?;
        (!k.tx.is_closed() && k.since.elapsed() < pool.idle_timeout).then_some(k.tx)
    }

    /// Keep `tx` (ready for another request); the connection kept before goes back to
    /// its pool.
    fn keep(&self, pool: Arc<Pool>, part: usize, tx: http1::SendRequest<RequestBody>) {
        let new = Kept {
            pool,
            part,
            tx,
            since: Coarse::now(),
        };
        let old = self
            .0
             .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(new);
        if let Some(old) = old {
            old.pool.keep(old.part, old.tx, old.since);
        }
    }
}

/// The cell an [`Affinity`] shares: when the downstream connection and its last response
/// are gone, the connection kept in it goes back to its pool.
#[derive(Debug, Default)]
struct KeptCell(Mutex<Option<Kept>>);

impl Drop for KeptCell {
    fn drop(&mut self) {
        let kept = self.0.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(k) = kept {
            k.pool.keep(k.part, k.tx, k.since);
        }
    }
}

/// A response body from a pooled connection: when it has been read to its end (or had
/// none), an HTTP/1.1 connection goes back to its pool if its request body was sent to
/// its end, and is closed otherwise (an HTTP/2 one is shared anyway).
#[derive(Debug)]
pub struct PooledBody {
    inner: Inner,
    slot: Option<Slot>,
}

/// The body as the connection's protocol reads it.
#[derive(Debug)]
enum Inner {
    H1(Incoming),
    H2(h2client::ResponseBody),
}

impl Inner {
    fn is_end_stream(&self) -> bool {
        match self {
            Inner::H1(body) => body.is_end_stream(),
            Inner::H2(body) => body.is_end_stream(),
        }
    }
}

/// The HTTP/1.1 connection a response came on, and the request body it carries.
#[derive(Debug)]
struct Slot {
    pool: Arc<Pool>,
    /// The pool's part the connection came from (and goes back to).
    part: usize,
    tx: http1::SendRequest<RequestBody>,
    body: Arc<BodyState>,
    /// The downstream connection's, to keep the connection for its next request.
    affinity: Option<Affinity>,
}

impl Slot {
    /// The response was read to its end: the connection goes back to the downstream
    /// connection's [`Affinity`] (or the pool) if the request body was sent to its end
    /// too; otherwise the upload is cut off, which closes the connection.
    fn release(self) {
        if !self.body.is_done() {
            self.body.cut_off();
            return;
        }
        match self.affinity {
            Some(affinity) if self.tx.is_ready() => affinity.keep(self.pool, self.part, self.tx),
            _ => self.pool.checkin(self.part, self.tx),
        }
    }
}

impl PooledBody {
    fn release_if_done(&mut self) {
        if self.inner.is_end_stream() {
            if let Some(slot) = self.slot.take() {
                slot.release();
            }
        }
    }
}

impl HttpBody for PooledBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let polled = match &mut self.inner {
            Inner::H1(body) => Pin::new(body).poll_frame(cx).map_err(BodyError::from),
            Inner::H2(body) => Pin::new(body).poll_frame(cx).map_err(BodyError::from),
        };
        match &polled {
            Poll::Ready(None) => {
                if let Some(slot) = self.slot.take() {
                    slot.release();
                }
            }
            Poll::Ready(Some(Ok(_))) => self.release_if_done(),
            Poll::Ready(Some(Err(_))) => {
                if let Some(slot) = self.slot.take() {
                    slot.body.cut_off();
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::H1(body) => body.size_hint(),
            Inner::H2(body) => body.size_hint(),
        }
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body with nothing left (e.g. Content-Length: 0, or a 304) may never be
        // polled: its connection is reusable all the same.
        self.release_if_done();
        // The rest of the response is still on the wire: the connection is done for,
        // and so is what is left of its upload.
        if let Some(slot) = self.slot.take() {
            slot.body.cut_off();
        }
    }
}

impl Pool {
    pub(super) fn wrap_h2(
        &self,
        response: Response<h2client::ResponseBody>,
    ) -> Response<PooledBody> {
        response.map(|body| PooledBody {
            inner: Inner::H2(body),
            slot: None,
        })
    }

    pub(super) fn wrap(
        self: &Arc<Self>,
        response: Response<Incoming>,
        h1: Option<Back>,
    ) -> Response<PooledBody> {
        response.map(|inner| PooledBody {
            inner: Inner::H1(inner),
            slot: h1.map(|back| Slot {
                pool: self.clone(),
                part: back.part,
                tx: back.tx,
                body: back.body,
                affinity: back.affinity,
            }),
        })
    }
}
