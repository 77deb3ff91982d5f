//! How a request holds each of its limits between the CHECK and the end of the request
//! ([`Stage`], [`Hold`]), and what the CHECK took ([`Taken`]): the types the check, the
//! ticket, the settling and the background work share.

use super::algorithm::Algorithm;
use super::{Applied, Usage};

/// How one limit is held between the check and the end of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Peeked before forwarding, charged after the response.
    Peek,
    /// Reserved before forwarding, refunded if the request is not charged.
    Reserve,
    /// Charged after the response, but reserved at the check because this gateway
    /// already had a request of the same caller and limit in flight (see
    /// [`Limiter::check`]); refunded if the request is not charged, topped up when the
    /// upstream says it cost more.
    Held,
    /// A concurrency slot, given back when the response body ends.
    Slot,
    /// Taken from this gateway's lease.
    Lease,
}

/// How one applied limit is held, decided once by [`Limiter::check`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Hold {
    pub(super) stage: Stage,
    /// The verdict's epoch, for a reservation or slot that was taken.
    pub(super) epoch: Option<u64>,
    /// A reservation ([`Stage::Reserve`], [`Stage::Held`]) or slot ([`Stage::Slot`])
    /// whose call failed in a way that it may still land ([`super::store::StoreError::may_have_run`]:
    /// a timeout): its op id, by which the store tells later what became of it
    /// ([`super::store::Store::late_reservation`]). A request let through (`on_error = "allow"`) is
    /// charged after its response only if its reservation did not land, and its
    /// reservation is refunded if it landed and the request is not charged (a slot that
    /// landed is given back when the response ends), in the background
    /// (`late::spawn`): counted once either way.
    pub(super) late: Option<u64>,
}

impl Applied {
    /// How this limit is held between the check and the end of the request.
    pub(super) fn stage(&self, on_request: bool) -> Stage {
        if self.limit.lease > 0 {
            Stage::Lease
        } else if self.policy.algorithm == Algorithm::Concurrency {
            Stage::Slot
        } else if on_request {
            Stage::Reserve
        } else {
            Stage::Peek
        }
    }
}

/// What a CHECK took and found, per applied limit, in order.
#[derive(Debug)]
pub(super) struct Taken {
    /// The usage of each applied limit (`None` where the store failed and
    /// `on_error = "allow"`).
    pub(super) usages: Vec<Option<Usage>>,
    /// How each limit is held, and what to give back.
    pub(super) holds: Vec<Hold>,
    /// Refusals of limits in shadow mode (or outside their `enforce_percent`).
    pub(super) shadowed: Vec<Usage>,
    /// The units the check took or counted (the route's `cost`).
    pub(super) cost: u64,
    /// A limit was answered by `store.on_error = "local"`'s local enforcement.
    pub(super) local: bool,
}
