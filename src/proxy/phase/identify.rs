//! Phase 2, identify the caller ([`crate::identity`]): an API key, a JWT, a verified
//! client certificate's CN, or `[identity.auth_request]` name the client and its tier;
//! no credential → the client IP. Guessing keys is limited per client IP
//! (`identity.failed_auth_limit`).

use super::edge::Edge;
use super::Answer;
use crate::identity::auth_request::Oversize;
use crate::identity::{Caller, IdentityError};
use crate::limiter::Usage;
use crate::proxy::access::{self, AccessLog, Decision};
use crate::proxy::error::ProxyError;
use crate::proxy::headers::Policy;
use crate::proxy::peer::Peer;
use crate::proxy::{Context, Gate};
use crate::wire::Incoming;
use http::Request;

/// Identify the caller of `req`, noting the client, caller, tier and key label in `log`.
///
/// Errors (logged `unauthenticated` unless said): 401 for an unknown key or an invalid
/// token, or the auth service's own refusal passed on; 400, 414 or 431 for what cannot
/// be judged; 503 when the auth service is unavailable (`on_error = "deny"`); 429 or
/// 503 when too many callouts are under way; 429 (logged `rejected`) for an address
/// past `identity.failed_auth_limit`.
///
/// Not an `async fn`, for the reason [`crate::proxy::handle`] gives (arguments kept once).
#[allow(clippy::manual_async_fn)]
pub fn identify<'r>(
    snap: &'r Gate<'r>,
    ctx: &'r Context<'r>,
    req: &'r Request<Incoming>,
    peer: &'r Peer,
    edge: &'r Edge,
    log: &'r mut AccessLog,
) -> impl std::future::Future<Output = Result<Caller, Answer>> + 'r {
    async move {
        let clock: &dyn crate::clock::Clock = &**ctx.clock;
        // An address past identity.failed_auth_limit presents no credential that is
        // looked up (nor asked about) until the window resets: 429 for all of them.
        if snap.limiter.blocks_any() && snap.identities.presents_credential(req.headers()) {
            let ip = snap.identities.client_ip(req.headers(), peer.ip());
            let now_ms = clock.now_ms();
            let blocked = snap
                .limiter
                .failed_auth_blocked(snap.identities.ip_key(ip), now_ms);
            if let Some(usage) = blocked {
                if access::enabled() {
                    log.client = snap.log_client(ip);
                }
                return Err(failed_auth_refusal(snap, log, usage, ip, now_ms));
            }
        }
        // On TLS, a verified client certificate's CN may name the client.
        let cert_cn = edge.tls.as_ref().and_then(|t| t.client_cn.as_deref());
        let identified = match snap
            .identities
            .identify_with_cert(req.headers(), peer.ip(), cert_cn)
        {
            // No local key: [identity.auth_request] may know it.
            Err(IdentityError::BadCredentials) => snap
                .identities
                .ask_auth_service(
                    req.headers(),
                    peer.ip(),
                    req.method(),
                    req.uri(),
                    ctx.budget,
                    ctx.metrics,
                )
                .await
                .unwrap_or(Err(IdentityError::BadCredentials)),
            identified => identified,
        };
        if access::enabled() {
            let ip = match &identified {
                Ok(caller) => caller.ip,
                Err(_) => snap.identities.client_ip(req.headers(), peer.ip()),
            };
            log.client = snap.log_client(ip);
        }
        let caller = match identified {
            Ok(caller) => caller,
            Err(IdentityError::AuthUnavailable(why)) => {
                tracing::warn!(
                    reason = why,
                    "auth service unavailable; identity.auth_request.on_error = \"deny\""
                );
                return Err(ProxyError::AuthUnavailable.into());
            }
            // Too many callouts under way (in all, or for this address): answered at once,
            // without a callout; not a failed authentication.
            Err(IdentityError::AuthBusy { per_address }) => {
                return Err(ProxyError::AuthBusy { per_address }.into());
            }
            Err(failure) => {
                // Guessing keys is limited per client IP (identity.failed_auth_limit), an
                // IPv6 client's by its network (identity.ipv6_prefix_len).
                let ip = snap.identities.client_ip(req.headers(), peer.ip());
                let key = snap.identities.ip_key(ip);
                // Boxed: a rare path, kept out of the request future's size (every request
                // allocates that much for it, see `server::Connection::serve`).
                if let Some(usage) = Box::pin(snap.limiter.failed_auth(key, ctx.clock)).await {
                    return Err(failed_auth_refusal(snap, log, usage, ip, clock.now_ms()));
                }
                return Err(unauthenticated(failure));
            }
        };
        log.caller = caller.client.as_ref().map(|c| c.id.clone());
        log.set_tier(&caller.tier);
        log.key_label = caller.key_label.clone();
        Ok(caller)
    }
}

/// The answer to a credential that identified no one (logged `unauthenticated`).
fn unauthenticated(failure: IdentityError) -> Answer {
    let error = match failure {
        IdentityError::Refused {
            status,
            content_type,
            body,
        } => {
            return Answer::new(
                crate::response::passed_on(status, content_type, body),
                Decision::Unauthenticated,
            )
        }
        IdentityError::BadCredentials
        | IdentityError::AuthUnavailable(_)
        | IdentityError::AuthBusy { .. } => ProxyError::BadCredentials,
        IdentityError::InvalidToken(reason) => ProxyError::InvalidToken(reason),
        e @ IdentityError::Malformed(_) => ProxyError::BadRequest(e.to_string()),
        IdentityError::AuthRejected(status) => ProxyError::AuthRejected(status),
        IdentityError::TooLargeToAsk(Oversize::Uri(max)) => ProxyError::UriTooLongToAsk(max),
        IdentityError::TooLargeToAsk(Oversize::Headers(max)) => {
            ProxyError::HeadersTooLargeToAsk(max)
        }
    };
    // A malformed credential is a failed authentication too (400, not `bad_request`).
    Answer::new(error.into_response(), Decision::Unauthenticated)
}

/// The 429 of a request from the client IP `ip` past `identity.failed_auth_limit`
/// (`usage` is that limit's window), at `now_ms` (epoch milliseconds): not forwarded,
/// logged as rejected.
fn failed_auth_refusal(
    snap: &Gate<'_>,
    log: &mut AccessLog,
    usage: Usage,
    ip: std::net::IpAddr,
    now_ms: u64,
) -> Answer {
    log.usage = Some(usage.clone());
    let policy = snap
        .limiter
        .failed_auth_limit()
        .map(|limit| Policy::of_limit(limit, usage.quota));
    let response = crate::proxy::refusal::over_limit(
        &usage,
        usage.retry_after_s(now_ms),
        &ip.to_string(),
        snap.headers,
        policy,
        now_ms,
    );
    Answer::new(response, Decision::Rejected)
}
