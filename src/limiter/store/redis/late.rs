//! The late answers of reservations whose calls timed out.
//!
//! A call to a shard's primary that carries reservations (`lua/apply.lua`'s RESERVE) is
//! not abandoned when its caller is answered with a timeout (`store.timeout`): it runs
//! on in the background, for up to [`super::LATE_BOUND_FACTOR`] × `store.timeout` in
//! all ([`super::node::Node::call_keeping_late`]), and when it ends, what became of
//! each of its reservations is kept here by the reservation's op id
//! ([`LateAnswers::publish`]): landed (with its epoch), refused, or unknown (the late
//! call failed too). The request that was admitted without an answer (fail open) asks
//! for it after its response ([`LateAnswers::take`]), and is then charged only if its
//! reservation did not land, or refunded if it landed and the request is not charged:
//! so it is counted once.
//!
//! Bounded: an answer nobody asks for within [`KEEP`] is dropped, and at most
//! [`MAX_ANSWERS`] are kept (the oldest dropped first).

use crate::limiter::store::Late;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How long an answer is kept for its request.
const KEEP: Duration = Duration::from_secs(30);

/// Most answers kept.
const MAX_ANSWERS: usize = 65_536;

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct LateAnswers {
    state: Mutex<State>,
    /// Wakes every request waiting for an answer when answers arrive.
    arrived: Notify,
}

#[derive(Debug, Default)]
struct State {
    answers: HashMap<u64, Late>,
    /// Op ids in the order they were published, with when.
    order: VecDeque<(Instant, u64)>,
}

impl LateAnswers {
    /// What became of each reservation of a late call: `(op id, outcome)`.
    pub(super) fn publish(&self, outcomes: impl IntoIterator<Item = (u64, Late)>) {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (id, late) in outcomes {
            if s.answers.insert(id, late).is_none() {
                s.order.push_back((now, id));
            }
        }
        while let Some(&(at, id)) = s.order.front() {
            if s.order.len() <= MAX_ANSWERS && now.duration_since(at) < KEEP {
                break;
            }
            s.order.pop_front();
            s.answers.remove(&id);
        }
        drop(s);
        self.arrived.notify_waiters();
    }

    /// The answer for the reservation with op id `id`, waiting for it up to `bound`;
    /// [`Late::Unknown`] when none came.
    pub(super) async fn take(&self, id: u64, bound: Duration) -> Late {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if let Some(late) = self
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .answers
                .remove(&id)
            {
                return late;
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return Late::Unknown;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_answer_is_given_once_to_whoever_asks_before_or_after_it_came() {
        let late = std::sync::Arc::new(LateAnswers::default());
        let waiting = {
            let late = late.clone();
            tokio::spawn(async move { late.take(7, Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        late.publish([(7, Late::Landed { epoch: 42 }), (8, Late::NotLanded)]);
        assert_eq!(waiting.await.unwrap(), Late::Landed { epoch: 42 });
        assert_eq!(
            late.take(8, Duration::from_millis(1)).await,
            Late::NotLanded
        );
        assert_eq!(
            late.take(8, Duration::from_millis(1)).await,
            Late::Unknown,
            "given once"
        );
    }
}
