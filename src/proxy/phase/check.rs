//! Phase 4, check every limit of the route ([`crate::limiter::Limiter::check`]): a read
//! (which may be stale, never a write), or a reservation (`charge = "on_request"`,
//! `store.reserve_in_flight`). Over a limit → 429 whose headers come from that same
//! read; the store failing → `store.on_error`.

use super::Answer;
use crate::identity::Caller;
use crate::limiter::{Applied, Refusal, SlotGuard, Ticket, Usage};
use crate::metrics::Metrics;
use crate::proxy::access::{AccessLog, Decision};
use crate::proxy::error::ProxyError;
use crate::proxy::headers::Policy;
use crate::proxy::peer::Peer;
use crate::proxy::route::Route;
use crate::proxy::{refusal, Context, Gate};
use crate::wire::Incoming;
use http::Request;
use std::sync::Arc;

/// An admitted request's hold on its limits, from the check to the charge.
///
/// Fields drop in order: an uncharged request is charged (the ticket) before its
/// concurrency slots are given back.
#[derive(Debug)]
pub struct Checked<'r> {
    /// What the check admitted, charged or released by the settle phase (or the forward
    /// phase, when the upstream failed); dropped before either (the client went away
    /// once the upstream had the request), it charges the request in the background.
    pub ticket: Ticket<'r>,
    /// The concurrency slots taken, given back when the response body ends (or fails, or
    /// the client goes away): the guard travels with the body.
    pub slots: Option<SlotGuard>,
}

/// Check every limit of `route` for `caller`, and note the decision of an admitted
/// request in `log` (`allowed`, `store_error_allowed` when the store failed for a limit
/// and `store.on_error = "allow"`, `local` when `store.on_error = "local"` decided a
/// limit in this gateway's memory, `shadow_rejected` when a limit in shadow mode would
/// have refused it).
///
/// Errors: 429 with the rate-limit headers of the limit that refused (`rejected`, or
/// `local` when decided by `store.on_error = "local"`); 503
/// when the store failed and `store.on_error = "deny"` (`store_error_denied`).
///
/// Not an `async fn`, for the reason [`crate::proxy::handle`] gives (arguments kept once).
#[allow(clippy::manual_async_fn)]
pub fn check<'g: 'r, 'r>(
    snap: &'r Gate<'g>,
    ctx: &'r Context<'g>,
    req: &'r Request<Incoming>,
    peer: &'r Peer,
    caller: &'r Caller,
    route: &'r Route,
    log: &'r mut AccessLog,
) -> impl std::future::Future<Output = Result<Checked<'g>, Answer>> + 'r {
    async move {
        let clock: &dyn crate::clock::Clock = &**ctx.clock;
        let applied: Arc<[Applied]> =
            snap.limiter
                .applicable_to(&route.limits, caller, req.headers());
        let reserve = snap.limiter.reserves(route.on_request);
        // One reading of the clock for the check and what is counted with it.
        let now_ms = clock.now_ms();
        let note = log.trace.as_deref_mut().and_then(|t| t.store_note(true));
        let mut ticket = match snap
            .limiter
            .check_or_delay(
                &applied,
                route.cost,
                reserve,
                ctx.clock,
                ctx.delayed,
                now_ms,
                note,
            )
            .await
        {
            Ok(ticket) => ticket,
            Err(Refusal::OverLimit(usage)) => {
                return Err(over_limit(snap, ctx, peer, caller, &applied, usage, log))
            }
            Err(Refusal::StoreDenied(_)) => return Err(store_unavailable(snap)),
        };
        snap.limiter
            .count_used(&applied, caller, route.cost, now_ms);
        if ticket.usages().iter().any(Option::is_none) {
            log.decision = Decision::StoreErrorAllowed;
        } else if ticket.local() {
            log.decision = Decision::Local;
        }
        for usage in ticket.shadowed() {
            log.decision = Decision::ShadowRejected;
            shadow_rejection(ctx.metrics, usage, caller);
        }
        // From here on the request is the upstream's: if the client goes away before the
        // charge, it is charged all the same (when the ticket is dropped).
        let slots = ticket.slots();
        Ok(Checked { ticket, slots })
    }
}

/// The 503 of a failed store under `store.on_error = "deny"` (logged
/// `store_error_denied`): problem details with `headers.problem_details`.
#[cold]
fn store_unavailable(snap: &Gate<'_>) -> Answer {
    let error = ProxyError::StoreUnavailable;
    let decision = Decision::StoreErrorDenied;
    debug_assert_eq!(error.decision(), Some(decision));
    Answer::new(
        error.into_response_with(snap.headers.problem_details),
        decision,
    )
}

/// The 429 of a caller over the limit `usage` describes (logged `rejected`, counted in
/// the refusal metrics and `/top`).
fn over_limit(
    snap: &Gate<'_>,
    ctx: &Context<'_>,
    peer: &Peer,
    caller: &Caller,
    applied: &[Applied],
    usage: Usage,
    log: &mut AccessLog,
) -> Answer {
    // A delayed refusal came later than the check began: read the clock again.
    let now_ms = ctx.clock.now_ms();
    snap.limiter.count_refused(&usage.resource, caller, now_ms);
    ctx.metrics.rejections.inc(&usage.resource, &caller.tier);
    let label;
    let response = refusal::over_limit(
        &usage,
        usage.retry_after_s(now_ms),
        match &caller.client {
            // The peer's address, rendered once per connection.
            None if caller.ip == peer.ip() => peer.ip_text(),
            _ => {
                label = caller.label();
                &label
            }
        },
        snap.headers,
        applied.iter().map(Policy::of),
        now_ms,
    );
    log.usage = Some(usage);
    let decision = if snap.limiter.decided_locally(applied) {
        Decision::Local
    } else {
        Decision::Rejected
    };
    Answer::new(response, decision)
}

/// A limit in shadow mode (or outside its `enforce_percent`) would have refused this
/// request: count it in `tollgate_shadow_rejections_total` and log it (at most once a
/// second, with the number held back).
fn shadow_rejection(metrics: &Metrics, usage: &Usage, caller: &Caller) {
    static LOG: crate::logging::Throttle = crate::logging::Throttle::new();
    metrics
        .shadow_rejections
        .get_or_create(&crate::metrics::RejectionLabels {
            limit: usage.resource.clone(),
            tier: caller.tier.clone(),
        })
        .inc();
    if let Some(suppressed) = LOG.due(1_000) {
        tracing::info!(
            limit = %usage.resource,
            tier = %caller.tier,
            used = usage.used,
            limit_units = usage.quota,
            suppressed,
            "shadow: would have refused with 429; let through"
        );
    }
}
