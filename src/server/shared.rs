//! What every connection of a gateway shares.

use crate::budget::Budget;
use crate::clock::SharedClock;
use crate::metrics::Metrics;
use crate::snapshot::Snapshot;
use arc_swap::ArcSwap;
use std::sync::Arc;
use std::time::Duration;

/// The target of the gateway's, the accept loops' and the connections' log lines (the
/// module they were written from before it was split, as log filters name it).
pub(super) const LOG_TARGET: &str = "tollgate::server";

/// State shared by every connection: the current snapshot, the clock, the metrics, the
/// descriptor budget and the request-body timeout.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) snapshot: Arc<ArcSwap<Snapshot>>,
    pub(super) clock: SharedClock,
    pub(super) metrics: Arc<Metrics>,
    /// `server.max_delayed` (read at start).
    pub(super) delayed: crate::limiter::delayed::DelayBudget,
    pub(super) budget: Arc<Budget>,
    /// `server.body_timeout` (read at start).
    pub(super) body_timeout: Duration,
}
