//! A connection's guards (the shutdown signal and its one timer), polled only when one
//! of them woke the connection's task.
//!
//! A connection's task is woken many times per request: the request's bytes, the
//! upstream's answer, each Redis reply. `tokio::select!` polls every branch on each of
//! those wakes, so the shutdown watch (a mutex in its `Notify`), the timer and the
//! branch-order RNG were polled two to three times per proxied request for nothing:
//! about 200 instructions each time (callgrind).
//! [`Guards::poll`] polls the connection on every wake, and the guards with a waker of
//! their own, only when that waker was woken (or when they fired and were handled).

use futures_util::task::AtomicWaker;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

/// The guards' waker: marks them woken, then wakes the connection's task.
struct GuardWake {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for GuardWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// One connection's guards' waker (one allocation per connection).
pub(super) struct Guards {
    wake: Arc<GuardWake>,
    waker: Waker,
}

impl Guards {
    /// Guards to be polled on the first call of [`Guards::poll`].
    pub(super) fn new() -> Self {
        let wake = Arc::new(GuardWake {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        Self {
            waker: Waker::from(wake.clone()),
            wake,
        }
    }

    /// Poll `conn` with the task's context; when it is pending, poll `guards` with the
    /// guards' own waker if that was woken since they were last polled (or
    /// [`Guards::rearm`] was called). The first of the two that is ready answers.
    pub(super) fn poll<T>(
        &self,
        cx: &mut Context<'_>,
        conn: impl FnOnce(&mut Context<'_>) -> Poll<T>,
        guards: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        if let Poll::Ready(done) = conn(cx) {
            return Poll::Ready(done);
        }
        // Where the guards' wake goes: this task (the same waker on every poll, for a
        // Tokio task; registered each time all the same, as a future must).
        self.wake.task.register(cx.waker());
        // Cleared before they are polled: a wake while they are polled is kept.
        if self.wake.woken.swap(false, Ordering::AcqRel) {
            return guards(&mut Context::from_waker(&self.waker));
        }
        Poll::Pending
    }

    /// A guard fired and was handled (a timer reset, the shutdown begun): poll the
    /// guards again on the next call, so that they register for their next firing.
    pub(super) fn rearm(&self) {
        self.wake.woken.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::{poll_fn, Future};
    use std::time::Duration;

    /// The guards are polled on the first call, then only when their own waker is woken
    /// (here: the timer fires), not on the connection's wakes; the connection is polled
    /// on every call.
    #[tokio::test]
    async fn guards_are_polled_only_when_they_woke_the_task() {
        let guards = Guards::new();
        let timer = tokio::time::sleep(Duration::from_millis(200));
        tokio::pin!(timer);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let (mut conn_polls, mut guard_polls, mut got) = (0, 0, Vec::new());
        tokio::spawn(async move {
            for i in 0..5 {
                tokio::time::sleep(Duration::from_millis(10)).await;
                tx.send(i).unwrap();
            }
            std::future::pending::<()>().await;
        });
        let fired = poll_fn(|cx| {
            guards.poll(
                cx,
                |cx| {
                    conn_polls += 1;
                    while let Poll::Ready(Some(i)) = rx.poll_recv(cx) {
                        got.push(i);
                    }
                    Poll::<&str>::Pending
                },
                |gcx| {
                    guard_polls += 1;
                    timer.as_mut().poll(gcx).map(|()| "timer")
                },
            )
        })
        .await;
        assert_eq!(fired, "timer");
        assert_eq!(got, [0, 1, 2, 3, 4]);
        assert!(conn_polls >= 6, "polled on each message: {conn_polls}");
        assert_eq!(
            guard_polls, 2,
            "first call, then when the timer woke the task"
        );
        // Handled and rearmed: polled on the next call.
        guards.rearm();
        let again = poll_fn(|cx| {
            Poll::Ready(guards.poll(cx, |_| Poll::<()>::Pending, |_| Poll::Ready(())))
        })
        .await;
        assert!(again.is_ready());
    }
}
