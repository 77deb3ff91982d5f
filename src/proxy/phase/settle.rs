//! Phase 6, settle: charge every limit once the response status is known, unless the
//! status is uncharged (in `uncharged_statuses`, or not in `charged_statuses` when the
//! route has that list; the access log's `uncharged` field says which; then the check's numbers stand, and reservations and lease
//! units are given back). The upstream may say what the request cost
//! (`upstreams.cost_header`, [`crate::proxy::upstream::Upstream::take_cost`]; the header
//! never reaches the client): that is what limits checked before forwarding are
//! charged, and what reserved (`on_request`, `reserve_in_flight`) and lease-mode
//! limits, which took the route's cost before forwarding, are settled to: the
//! difference refunded when it is less, the excess charged (past the quota) when it
//! is more ([`crate::limiter::Ticket::charge`]). Without a valid header the route's
//! cost stands. Concurrency limits count requests, not cost.

use super::check::Checked;
use crate::limiter::{Applied, SlotGuard, Usage};
use crate::proxy::access::AccessLog;
use crate::proxy::access::Uncharged;
use crate::proxy::route::Route;
use crate::proxy::{Body, Context};
use http::Response;
use std::sync::Arc;

/// A settled request: what its limits read after the charge, for the headers.
#[derive(Debug)]
pub struct Settled {
    /// Per applied limit, its usage after the charge (`None`: the store failed).
    pub usages: Vec<Option<Usage>>,
    /// Every limit that applied, in the order of `usages`.
    pub applied: Arc<[Applied]>,
    /// The concurrency slots, to be held by the response body.
    pub slots: Option<SlotGuard>,
    /// When it was settled, milliseconds since the Unix epoch (for the headers).
    pub now_ms: u64,
}

/// Charge (or release) the request `checked` admitted on `route`, given its upstream's
/// `response` (whose cost header is removed), noting the cost charged in `log`.
///
/// Not an `async fn`, for the reason [`crate::proxy::handle`] gives (arguments kept once).
#[allow(clippy::manual_async_fn)]
pub fn settle<'r, 'c: 'r>(
    ctx: &'r Context<'r>,
    route: &'r Route,
    checked: &'r mut Checked<'c>,
    response: &'r mut Response<Body>,
    log: &'r mut AccessLog,
) -> impl std::future::Future<Output = Settled> + use<'r, 'c> {
    async move {
        let ticket = &mut checked.ticket;
        let applied = ticket.applied().clone();
        let cost = route
            .upstream
            .take_cost(response.headers_mut())
            .unwrap_or(route.cost);
        // One reading of the clock for the charge and the headers. The charge is handed
        // to the store when `charge` is called, so a client going away from here on does
        // not count it twice.
        let now_ms = ctx.clock.now_ms();
        let uncharged = route
            .uncharged_by(response.status())
            .or((cost == 0).then_some(Uncharged::CostZero));
        let usages = if uncharged.is_none() {
            log.cost = cost;
            let note = log.trace.as_deref_mut().and_then(|t| t.store_note(false));
            ticket.charge_noted(cost, now_ms, note).await
        } else {
            log.uncharged = uncharged;
            ticket.release(now_ms)
        };
        Settled {
            usages,
            applied,
            slots: checked.slots.take(),
            now_ms,
        }
    }
}
