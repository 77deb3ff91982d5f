//! `upstreams.response_timeout` on one timer per downstream HTTP/1 connection.
//!
//! A `tokio::time::timeout` per request registers a timer entry in the runtime's wheel
//! when the request first waits and removes it when the response comes: the wheel's lock
//! twice per request, about 550 instructions. An HTTP/1 connection serves one
//! request at a time, so it keeps one timer that each of its requests re-arms: a later
//! deadline only moves the entry's expiry forward (tokio re-files it when the earlier
//! one comes up), without the lock. An HTTP/2 connection's streams run at once, so each
//! of its requests keeps a timer of its own.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};
use tokio::time::{Instant, Sleep};

/// One downstream connection's response timer, made at its first request (a timer needs
/// the runtime, which a [`super::forward::Peer`] may be made without).
#[derive(Debug, Default)]
pub struct ConnectionTimer(Mutex<Option<Pin<Box<Sleep>>>>);

impl ConnectionTimer {
    /// `fut`, answering `Some` of its output, or `None` when `deadline` passes first. The
    /// timer is armed for `deadline` when `fut` first waits (a future that is ready at
    /// once never touches it). Only one request of the connection may wait on it at a
    /// time (HTTP/1): a second one would take the timer's wake-up from the first.
    pub fn within<F: Future>(&self, deadline: Instant, fut: F) -> Within<'_, F> {
        Within {
            fut,
            timer: self,
            deadline: Some(deadline),
        }
    }
}

pin_project_lite::pin_project! {
    /// A future with the connection's response timer: [`ConnectionTimer::within`]. A
    /// struct rather than an `async fn`, so that the future it wraps (the upstream
    /// exchange, several hundred bytes) is moved into it once, not once per call level.
    pub struct Within<'a, F> {
        #[pin]
        fut: F,
        timer: &'a ConnectionTimer,
        // The deadline until the timer is armed with it.
        deadline: Option<Instant>,
    }
}

impl<F: Future> Future for Within<'_, F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.fut.poll(cx) {
            return Poll::Ready(Some(out));
        }
        let mut timer = this.timer.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(deadline) = this.deadline.take() {
            match timer.as_mut() {
                // Later than the last deadline (as a connection's requests come): tokio
                // only moves the entry's expiry, without the wheel's lock.
                Some(sleep) => sleep.as_mut().reset(deadline),
                None => *timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        match timer.as_mut().map(|sleep| sleep.as_mut().poll(cx)) {
            Some(Poll::Pending) => Poll::Pending,
            _ => Poll::Ready(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ConnectionTimer;
    use std::time::Duration;
    use tokio::time::Instant;

    /// Real time, with margins wide enough for a busy machine: a future of `wait` ms
    /// against a deadline `limit` ms away finishes when it is much shorter, and is cut
    /// off at the deadline (not before, and not at the end of `wait`) when much longer.
    #[tokio::test]
    async fn each_request_gets_its_own_deadline_on_the_connections_timer() {
        let timer = ConnectionTimer::default();
        let ms = Duration::from_millis;
        for (wait, limit, done) in [
            (5, 400, true),
            (5_000, 150, false),
            // A deadline earlier than the last one (another upstream's timeout).
            (5, 300, true),
            (5_000, 100, false),
            (5, 600, true),
        ] {
            for shared in [true, false] {
                let start = Instant::now();
                let (deadline, fut) = (start + ms(limit), tokio::time::sleep(ms(wait)));
                let out = match shared {
                    true => timer.within(deadline, fut).await,
                    false => tokio::time::timeout_at(deadline, fut).await.ok(),
                };
                let took = start.elapsed();
                assert_eq!(out.is_some(), done, "{wait} ms against {limit} ms");
                if !done {
                    assert!(
                        took >= ms(limit) && took < ms(2_000),
                        "cut off after {took:?}"
                    );
                }
            }
            // The connection idles past the last deadline: the timer fires with no one
            // waiting, and the next request must still get its full time.
            tokio::time::sleep(ms(limit + 50)).await;
        }
    }
}
