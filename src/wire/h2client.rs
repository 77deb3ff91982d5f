//! HTTP/2 to upstreams (`protocol = "http2"`) on the h2 crate directly, so that the
//! 1xx responses of an HTTP/2 upstream (`103 Early Hints`, ...) reach clients:
//! hyper's HTTP/2 client skips them (its `on_informational` is HTTP/1.1 only).
//!
//! What hyper's client did is done here the same way: its connection settings (16 KiB
//! frames, 1 MiB send buffer, no server push), with the header-list limit set to
//! `upstreams.max_response_header_bytes`; the
//! request head stripped of connection-specific fields, with `Content-Length` set from
//! a body of known length; the request body piped on its own task within the stream's
//! flow-control window (data, then trailers or an empty end-of-stream frame), reset
//! with `CANCEL` when the response is no longer awaited; the response body read with
//! its flow-control capacity given back as the client reads, trailers passed on, and a
//! `RST_STREAM(NO_ERROR)` after the response taken as its end (RFC 9113 §8.1).
//!
//! One thing is better than hyper's: when the request body fails while being sent (too
//! large, stopped arriving, unreadable), the response's error is that body error, so
//! that the client gets 413, 408 or 400 as with an HTTP/1.1 upstream, not 502.
//!
//! One stream cannot stall the others: a response body's stream window
//! ([`STREAM_WINDOW`], 1 MiB) is what a client that stops reading can hold, and the
//! connection's window is that times the streams one connection carries at most
//! ([`MAX_STREAMS`]), so that however many of its streams are not read, the connection
//! still has window for the others. A connection with no stream left to open is not
//! given more requests: the pool opens another ([`Connection::claim`]). A stream whose
//! client stopped reading ends with its client's connection (`server.send_timeout`):
//! its response body is dropped, which resets the stream (`CANCEL`) and gives its
//! window back.
//!
//! A request the upstream did not process is given back to be sent again on another
//! connection ([`SendFailure::unprocessed`]): one on a stream above the last stream id
//! of a graceful `GOAWAY` (`NO_ERROR`, RFC 9113 §6.8), one refused with
//! `REFUSED_STREAM` (§8.7), and one the connection could not open a stream for. A
//! request body is streamed as it comes; a copy of it is kept while it is at most
//! [`REPLAY_BYTES`] (the rest of it read from the client, when it was still arriving
//! as the upstream refused the request), so that the request can be sent again with
//! it; a larger body cannot be, nor one that fails or stops arriving for
//! `server.body_timeout` (the request's error stands: 502).

mod pipe;
mod response;

pub use response::ResponseBody;

use super::interim::Informational;
use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Method, Request, Response};
use http_body::{Body as HttpBody, Frame};
use pipe::Pipe;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use tokio::sync::oneshot;

/// Stream window, bytes: what one response's stream may have buffered unread (hyper's
/// default is 2 MiB).
pub const STREAM_WINDOW: u32 = 1024 * 1024;
/// Streams one connection carries at most (fewer when the upstream's
/// `SETTINGS_MAX_CONCURRENT_STREAMS` says so); the pool opens another connection for
/// more.
pub const MAX_STREAMS: usize = 100;
/// Connection window, bytes: every stream's window, so that streams whose responses are
/// not read cannot take the window of the others (100 MiB).
const CONN_WINDOW: u32 = STREAM_WINDOW * MAX_STREAMS as u32;
/// Largest frame accepted, bytes.
const MAX_FRAME: u32 = 16 * 1024;
/// Request body bytes buffered per stream beyond what flow control lets go, bytes.
const MAX_SEND_BUF: usize = 1024 * 1024;
/// The largest request body kept while it is sent, to send again if the upstream does
/// not process the request (64 KiB): a larger one is not sent again.
pub const REPLAY_BYTES: usize = 64 * 1024;
/// Streams the client may open before the server's SETTINGS arrive.
const INITIAL_MAX_SEND_STREAMS: usize = 100;
/// Streams reset for a local error before the connection is given up (hyper's default).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;

/// One HTTP/2 connection to an upstream target, shared by requests (cloned per request).
#[derive(Debug, Clone)]
pub struct Connection {
    tx: h2::client::SendRequest<Bytes>,
    /// Set when the connection's task has ended.
    closed: Arc<AtomicBool>,
    /// Streams claimed on it and not yet ended ([`Connection::claim`]).
    streams: Arc<AtomicUsize>,
}

/// One stream's place on a [`Connection`], from [`Connection::claim`] until its response
/// body and request body are both done with (then the place is free again).
#[derive(Debug)]
pub struct Claim(Arc<AtomicUsize>);

impl Drop for Claim {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request body that [`Connection::send`] can send, and make again from the frames it
/// read (data and trailers, in order) to send the request again when the upstream did
/// not process it (see [`REPLAY_BYTES`]).
pub trait Replay: HttpBody<Data = Bytes> + Send + Unpin + Sized + 'static {
    /// A body that yields `frames`, then ends.
    fn replay(frames: Vec<Frame<Bytes>>) -> Self;
}

/// Why a [`Connection::send`] failed; `E` is the request body's error.
#[derive(Debug)]
pub enum StreamError<E> {
    /// The stream could not be opened or was reset, or the connection failed (reset,
    /// GOAWAY, a response head past the header-list limit, ...).
    H2(h2::Error),
    /// The request body failed while it was sent (the stream was reset for it).
    Body(E),
}

/// A failed [`Connection::send`] of a request with a body of type `B`.
#[derive(Debug)]
pub struct SendFailure<B: HttpBody> {
    /// What went wrong.
    pub error: StreamError<B::Error>,
    /// The request, when the upstream did not process it (a stream above a graceful
    /// `GOAWAY`'s last stream id, one refused with `REFUSED_STREAM`, or none opened)
    /// and its body can be sent again (none, or one read whole and kept: see
    /// [`REPLAY_BYTES`]): it may be sent again on another connection.
    pub unprocessed: Option<Request<B>>,
}

impl Connection {
    /// An HTTP/2 connection on `io` (TCP or TLS, already connected) that accepts response
    /// header lists of up to `max_head_bytes` (RFC 9113 §6.5.2 accounting: name, value
    /// and 32 per field); its task is spawned on the current runtime.
    ///
    /// Errors: the handshake failed (I/O, or the peer is no HTTP/2 server).
    pub async fn handshake<T>(io: T, max_head_bytes: usize) -> Result<Self, h2::Error>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let (tx, conn) = h2::client::Builder::new()
            .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONN_WINDOW)
            .max_frame_size(MAX_FRAME)
            .max_header_list_size(u32::try_from(max_head_bytes).unwrap_or(u32::MAX))
            .max_send_buffer_size(MAX_SEND_BUF)
            .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
            .enable_push(false)
            .handshake::<T, Bytes>(io)
            .await?;
        let closed = Arc::new(AtomicBool::new(false));
        let ended = closed.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream HTTP/2 connection ended with an error");
            }
            ended.store(true, Ordering::Release);
        });
        Ok(Self {
            tx,
            closed,
            streams: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// A place for one more stream, when the connection is open and has one: fewer
    /// streams claimed than [`MAX_STREAMS`] and than the upstream's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`. With `force`, a place even past those (on a
    /// new connection: the stream waits in [`Connection::ready`] for one).
    pub fn claim(&self, force: bool) -> Option<Claim> {
        if self.is_closed() {
            return None;
        }
        let most = MAX_STREAMS.min(self.tx.current_max_send_streams()).max(1);
        let claimed = self.streams.fetch_add(1, Ordering::AcqRel);
        let claim = Claim(self.streams.clone());
        (force || claimed < most).then_some(claim)
    }

    /// Whether the connection has ended (no request can go on it).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Whether `other` is a handle of the same connection.
    pub fn same(&self, other: &Connection) -> bool {
        Arc::ptr_eq(&self.closed, &other.closed)
    }

    /// Streams claimed on it and not yet ended ([`Connection::claim`]).
    pub fn in_flight(&self) -> usize {
        self.streams.load(Ordering::Acquire)
    }

    /// Wait until a stream may be opened.
    ///
    /// Errors: the connection has failed or been closed by the upstream (GOAWAY): no
    /// request was sent on it, and none can be.
    pub async fn ready(&mut self) -> Result<(), h2::Error> {
        std::future::poll_fn(|cx| self.tx.poll_ready(cx)).await
    }

    /// Send `req` (absolute URI: scheme and authority become `:scheme` and
    /// `:authority`) once [`Connection::ready`], on the stream `claim` holds a place
    /// for; the response once its head has come, its body streaming. 1xx responses that
    /// come before it go to `informational` (dropped without one).
    ///
    /// Errors: [`StreamError::H2`] when the stream could not be opened or was reset, or
    /// the connection failed; [`StreamError::Body`] when the request body failed first;
    /// with the request back when the upstream did not process it (see
    /// [`SendFailure`]).
    pub async fn send<B>(
        &mut self,
        req: Request<B>,
        informational: Option<Informational>,
        claim: Claim,
    ) -> Result<Response<ResponseBody>, SendFailure<B>>
    where
        B: Replay,
        B::Error: std::fmt::Display + Send + 'static,
    {
        let (mut head, body) = req.into_parts();
        strip_connection_headers(&mut head.headers);
        if let Some(len) = body.size_hint().exact() {
            if (len != 0 || has_payload_semantics(&head.method))
                && !head.headers.contains_key(header::CONTENT_LENGTH)
            {
                head.headers
                    .insert(header::CONTENT_LENGTH, http::HeaderValue::from(len));
            }
        }
        let eos = body.is_end_stream();
        // Kept to send the request again if the upstream does not process it.
        let again = head.clone();
        let (mut response, stream) = match self.tx.send_request(Request::from_parts(head, ()), eos)
        {
            Ok(sent) => sent,
            // No stream was opened: nothing of the request went out.
            Err(e) => {
                return Err(SendFailure {
                    error: StreamError::H2(e),
                    unprocessed: Some(Request::from_parts(again, body)),
                })
            }
        };
        let claim = Arc::new(claim);
        let mut pipe = None;
        // A request without a body can be sent again as it is; one with a body, when
        // the pipe has read all of it (see `Pipe::kept`).
        let mut bodiless = None;
        if eos {
            bodiless = Some(body);
        } else {
            let failure = Arc::new(Mutex::new(None));
            let (cancel, cancelled) = oneshot::channel();
            let (sent, whole) = oneshot::channel();
            tokio::spawn(Pipe::new(
                body,
                stream,
                failure.clone(),
                cancelled,
                sent,
                claim.clone(),
            ));
            pipe = Some((cancel, failure, whole));
        }
        let got = std::future::poll_fn(|cx| {
            if let Some(client) = &informational {
                // 1xx first: each goes to the client as soon as it comes. An error
                // shows in the response's own poll.
                while let Poll::Ready(Some(Ok(interim))) = response.poll_informational(cx) {
                    client.send(interim.status(), interim.headers());
                }
            }
            Pin::new(&mut response).poll(cx)
        })
        .await;
        match got {
            Ok(response) => {
                if let Some((cancel, _, _)) = pipe {
                    // Answered: the rest of the request body goes on being sent.
                    let _ = cancel.send(());
                }
                let (parts, recv) = response.into_parts();
                let body = ResponseBody::new(recv, &parts.headers, claim);
                Ok(Response::from_parts(parts, body))
            }
            Err(e) => {
                let Some((cancel, failure, whole)) = pipe else {
                    return Err(SendFailure {
                        unprocessed: bodiless
                            .filter(|_| not_processed(&e))
                            .map(|body| Request::from_parts(again, body)),
                        error: StreamError::H2(e),
                    });
                };
                if let Some(body_error) = failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    return Err(SendFailure {
                        error: StreamError::Body(body_error),
                        unprocessed: None,
                    });
                }
                // The pipe stops (at once, unless it has ended); it gives back the
                // whole body, if it read and kept it.
                drop(cancel);
                let mut unprocessed = None;
                if not_processed(&e) {
                    if let Ok(frames) = whole.await {
                        unprocessed = Some(Request::from_parts(again, B::replay(frames)));
                    }
                }
                Err(SendFailure {
                    unprocessed,
                    error: StreamError::H2(e),
                })
            }
        }
    }
}

/// Whether a stream's error says that the upstream did not process its request: the
/// stream was above the last stream id of a graceful `GOAWAY` (RFC 9113 §6.8: h2 gives
/// those streams the `GOAWAY`'s own error, and only those when its code is `NO_ERROR`),
/// or the upstream refused it with `REFUSED_STREAM` (§8.7).
fn not_processed(e: &h2::Error) -> bool {
    e.is_remote()
        && ((e.is_go_away() && e.reason() == Some(h2::Reason::NO_ERROR))
            || (e.is_reset() && e.reason() == Some(h2::Reason::REFUSED_STREAM)))
}

/// Whether a request with this method has a body by definition (hyper's rule for
/// sending `Content-Length: 0`).
fn has_payload_semantics(method: &Method) -> bool {
    !matches!(
        *method,
        Method::GET | Method::HEAD | Method::DELETE | Method::CONNECT
    )
}

/// Remove what HTTP/2 forbids in a request head (RFC 9113 §8.2.2): the hop-by-hop
/// fields ([`crate::http::strip_hop_by_hop`]: the fixed list, `Proxy-*`, and what
/// `Connection` names), keeping only `TE: trailers`.
fn strip_connection_headers(headers: &mut HeaderMap) {
    let trailers = crate::http::hop::strip_request_hop_by_hop(headers);
    if trailers {
        headers.insert(header::TE, http::HeaderValue::from_static("trailers"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_specific_fields_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "x-hop, keep-alive".parse().unwrap());
        h.insert("x-hop", "1".parse().unwrap());
        h.insert("keep-alive", "5".parse().unwrap());
        h.insert(header::UPGRADE, "foo".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::TE, "gzip".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        strip_connection_headers(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        let mut h = HeaderMap::new();
        h.insert(header::TE, "trailers".parse().unwrap());
        strip_connection_headers(&mut h);
        assert_eq!(h.get(header::TE).unwrap(), "trailers");
    }
}
