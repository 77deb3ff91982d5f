//! How the pool reads a failure: the step, the fault and the retry-safety it gives each.

use super::connect::spawn_h1;
use super::*;
use crate::proxy::body::BodyFailure;
use crate::proxy::error::{Fault, ProxyError, Step};
use crate::wire::Incoming;
use hyper_util::rt::TokioIo;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

fn pool() -> Arc<Pool> {
    let connector = Connector {
        upstream: Arc::from("api"),
        authority: Authority::from_static("10.0.0.7:9000"),
        connect_timeout: Duration::from_secs(1),
        tls: None,
        protocol: UpstreamProtocol::Http1,
        max_response_header_bytes: 8192,
    };
    Pool::new(connector, 1, Duration::from_secs(60), 1)
}

fn request() -> Request<RequestBody> {
    Request::get("/")
        .header("host", "api")
        .body(RequestBody::new(
            Incoming::Empty,
            None,
            Duration::from_secs(1),
        ))
        .expect("a request")
}

/// A socket that takes every write and, once something was written, fails its reads
/// with the OS error `errno` (as the kernel does with `ETIMEDOUT` when its
/// retransmissions go unanswered).
#[derive(Default)]
struct FailingReads {
    errno: Option<i32>,
    written: bool,
    reader: Option<Waker>,
}

impl AsyncRead for FailingReads {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        _: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match (self.written, self.errno) {
            (true, Some(errno)) => Poll::Ready(Err(io::Error::from_raw_os_error(errno))),
            _ => {
                self.reader = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for FailingReads {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.written = true;
        if let Some(reader) = self.reader.take() {
            reader.wake();
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// An HTTP/1.1 exchange whose socket's read timed out is a timeout (504); one whose
/// read was reset is a failure (502). The pool reads the timeout from hyper's error
/// once, into a typed fact (`PoolError::Http`'s `timed_out`) that decides the fault;
/// the log line still prints the error's text whole.
#[tokio::test]
async fn an_exchange_whose_socket_timed_out_is_a_504() {
    let pool = pool();
    use rustix::io::Errno;
    for (errno, fault, status) in [
        (Errno::TIMEDOUT, Fault::Timeout, 504),
        (Errno::CONNRESET, Fault::Failed, 502),
    ] {
        let socket = FailingReads {
            errno: Some(errno.raw_os_error()),
            ..Default::default()
        };
        let mut tx = spawn_h1(TokioIo::new(socket), 8192)
            .await
            .expect("a connection");
        let error = PoolError::http(tx.send_request(request()).await.expect_err("fails"));
        let timed_out = matches!(
            error,
            PoolError::Http {
                timed_out: true,
                ..
            }
        );
        assert_eq!(timed_out, errno == Errno::TIMEDOUT);
        let SendError { failure, unsent } = pool.exchange_failed(error, None, None);
        assert_eq!((failure.fault(), failure.step()), (fault, Step::Send));
        assert!(!failure.retry_safe() && unsent.is_none());
        let said = io::Error::from_raw_os_error(errno.raw_os_error()).to_string();
        assert!(failure.detail().ends_with(&said), "{}", failure.detail());
        assert_eq!(ProxyError::Forwarded(failure).status().as_u16(), status);
    }
}

/// A failure to connect names its step and hands the request back (retry-safe); a body
/// that failed decides the fault of the exchange it failed in.
#[test]
fn connecting_is_retry_safe_and_the_body_comes_first() {
    let pool = pool();
    let authority = || Authority::from_static("10.0.0.7:9000");
    let refused = io::Error::from(io::ErrorKind::ConnectionRefused);
    let untrusted = io::Error::other("invalid peer certificate");
    for (error, step, fault) in [
        (
            PoolError::Connect(authority(), refused),
            Step::Connect,
            Fault::Failed,
        ),
        (
            PoolError::ConnectTimeout(authority()),
            Step::Connect,
            Fault::Timeout,
        ),
        (
            PoolError::NoDescriptor(authority()),
            Step::Connect,
            Fault::NoDescriptor,
        ),
        (
            PoolError::Tls(authority(), untrusted),
            Step::TlsHandshake,
            Fault::Failed,
        ),
    ] {
        let Err(SendError { failure, unsent }) = pool.connected::<()>(Err(error), request()) else {
            panic!("an error")
        };
        assert_eq!((failure.step(), failure.fault()), (step, fault));
        assert!(failure.retry_safe() && unsent.is_some());
        assert_eq!(failure.authority().as_str(), "10.0.0.7:9000");
        assert_eq!(failure.upstream(), "api");
    }
    let reset = PoolError::Connect(authority(), io::ErrorKind::ConnectionReset.into());
    let body = Some(BodyFailure::TooLarge(10));
    let failure = pool.exchange_failed(reset, body, None).failure;
    assert_eq!(failure.fault(), Fault::Body(BodyFailure::TooLarge(10)));
    assert_eq!(failure.step(), Step::RequestBody);
}
