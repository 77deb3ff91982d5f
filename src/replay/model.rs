//! One config's decisions over replayed requests: the routes, identities and limits of
//! a [`Snapshot`], run on the reference model ([`algorithm::apply`]) with the log's
//! timestamps as the clock. No store, no network, no upstream.
//!
//! A request is decided as the gateway decides it: every limit of its route is peeked
//! with the route's `cost`; when an enforced limit refuses, the request is refused
//! (attributed, like the gateway's 429, to the refusing limit that frees latest) and
//! nothing is charged; otherwise every limit is charged at the request's start (the
//! gateway counts a request's units as in flight from its check on), unless the status
//! is uncharged. A concurrency limit holds a slot for the request's logged duration.

pub use super::stats::{LimitStats, Minute, Series, Totals};

use super::stats::Fast;
use super::{Req, NO_ROUTE};
use crate::identity::Client;
use crate::limiter::algorithm::{self, Algorithm, Op, OpKind, Policy, State};
use crate::limiter::{By, Limit};
use crate::proxy::route::Route;
use crate::snapshot::Snapshot;
use std::collections::HashMap;
use std::sync::Arc;

/// A route's limits, each with its index in the snapshot's limits.
type RouteLimits = Vec<(u16, Arc<Limit>)>;

/// The most units one logged request is charged (a line's `cost` is not trusted further).
const MAX_COST: u64 = 100_000_000;

/// What happened to a request under one config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// No route matched (the gateway would answer 404).
    Unrouted,
    /// Routed, and no limit applied to its caller's tier.
    Unlimited,
    /// Every limit admitted it (or only shadowed limits refused it).
    Admitted,
    /// Refused (429) by the limit with this index.
    Refused(u16),
}

/// A caller's resolved identity in this config.
#[derive(Debug, Clone)]
enum Known {
    Unresolved,
    Anonymous,
    Client(Arc<Client>),
    Unknown,
}

/// One config, deciding requests.
#[derive(Debug)]
pub struct Model {
    snap: Snapshot,
    /// Routes by the index a [`Req`] carries, with their limits' indices.
    routes: Vec<(Arc<Route>, RouteLimits)>,
    /// Per (tier id × limit): the tier's quota, [`NONE`] without one, [`UNKNOWN`] not
    /// looked up yet.
    quotas: Vec<u64>,
    /// Clients by id.
    clients: HashMap<Arc<str>, Arc<Client>, Fast>,
    /// Per interned caller: its client in this config (resolved on first use).
    known: Vec<Known>,
    /// Per interned tier name: whether it is the anonymous tier's.
    anonymous_tier: Arc<str>,
    /// Limit states by [`subject_key`]; those whose window has passed are dropped (see
    /// [`Model::sweep`]).
    states: HashMap<u64, State, Fast>,
    /// How many states there may be before the next sweep.
    sweep_at: usize,
    /// States dropped because their window had passed.
    pub windows_dropped: u64,
    /// The most states held at once.
    pub peak_windows: usize,
    /// Per (tier id × limit index); `None` where no request was seen.
    stats: Vec<Option<LimitStats>>,
    /// Over every request.
    pub totals: Totals,
    /// For the plot: per (limit index, caller) selected, per minute since the epoch.
    pub series: Option<Series>,
    last_now: u64,
    peeks: Vec<Step>,
}

/// One limit applied to the request being decided.
#[derive(Debug, Clone, Copy)]
struct Step {
    limit: u16,
    key: u64,
    policy: Policy,
}

impl Model {
    /// A model of `snap`'s routes, clients and limits, with no state.
    pub fn new(snap: Snapshot) -> Self {
        let clients = snap
            .identities
            .keys()
            .all_clients()
            .iter()
            .map(|c| (c.id.clone(), c.clone()))
            .collect();
        let anonymous_tier = Arc::from(snap.config.identity.anonymous_tier.as_str());
        Self {
            snap,
            routes: Vec::new(),
            quotas: Vec::new(),
            clients,
            known: Vec::new(),
            anonymous_tier,
            states: HashMap::default(),
            sweep_at: MIN_SWEEP,
            windows_dropped: 0,
            peak_windows: 0,
            stats: Vec::new(),
            totals: Totals::default(),
            series: None,
            last_now: 0,
            peeks: Vec::new(),
        }
    }

    /// The snapshot.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snap
    }

    /// The numbers of each limit (by its index in the snapshot's limits) and tier id
    /// that saw a request.
    pub fn stats(&self) -> impl Iterator<Item = ((u16, u32), &LimitStats)> {
        let n = self.snap.limits.len().max(1);
        self.stats
            .iter()
            .enumerate()
            .filter_map(move |(i, s)| s.as_ref().map(|s| (((i % n) as u16, (i / n) as u32), s)))
    }

    /// The route index of a `method` request to `path` (no host is logged: routes for
    /// a `host` never match), or [`NO_ROUTE`].
    pub fn route(&mut self, method: &str, path: &str) -> u32 {
        let Ok(method) = http::Method::from_bytes(method.as_bytes()) else {
            return NO_ROUTE;
        };
        let path = crate::http::target::routing_path(path);
        let Some(route) = self.snap.router.find(None, &path, &method) else {
            return NO_ROUTE;
        };
        match self.routes.iter().position(|r| Arc::ptr_eq(&r.0, route)) {
            Some(i) => i as u32,
            None => {
                let limits = route
                    .limits
                    .iter()
                    .filter_map(|l| {
                        let i = self.snap.limits.iter().position(|s| Arc::ptr_eq(s, l))?;
                        Some((i as u16, l.clone()))
                    })
                    .collect();
                self.routes.push((route.clone(), limits));
                (self.routes.len() - 1) as u32
            }
        }
    }

    /// The tier of the caller `caller` (interned as `name`; `identified` when it is a
    /// client id), interned in `tiers`: its client's in this config, else the tier the
    /// log gave (`logged`), else the anonymous tier.
    pub fn tier(
        &mut self,
        caller: u32,
        name: &str,
        identified: bool,
        logged: Option<&str>,
        tiers: &mut super::Interner,
    ) -> u32 {
        let i = caller as usize;
        if self.known.len() <= i {
            self.known.resize(i + 1, Known::Unresolved);
        }
        if let Known::Unresolved = self.known[i] {
            self.known[i] = if !identified {
                Known::Anonymous
            } else {
                match self.clients.get(name) {
                    Some(c) => Known::Client(c.clone()),
                    None => Known::Unknown,
                }
            };
        }
        match (&self.known[i], logged) {
            (Known::Client(c), _) => tiers.id(&c.tier),
            (_, Some(t)) => tiers.id(t),
            (Known::Unknown, None) => {
                self.totals.unknown_callers += 1;
                tiers.id(&self.anonymous_tier)
            }
            _ => tiers.id(&self.anonymous_tier),
        }
    }

    /// Decide `req` (routed for this model as `route`, of tier `tier`/`tier_name`).
    pub fn decide(&mut self, req: &Req, route: u32, tier: u32, tier_name: &str) -> Outcome {
        self.totals.requests += 1;
        let now = req.start_ms.max(self.last_now);
        self.last_now = now;
        let Some((route, limits)) = self.routes.get(route as usize) else {
            self.totals.unrouted += 1;
            return Outcome::Unrouted;
        };
        let client = match self.known.get(req.caller as usize) {
            Some(Known::Client(c)) => Some(c.clone()),
            _ => None,
        };
        let nl = self.snap.limits.len();
        // 1. Peek every limit that applies with the route's cost.
        self.peeks.clear();
        let mut refusal: Option<(u16, u64)> = None;
        let mut shadowed = false;
        for (li, limit) in limits {
            let li = *li;
            let own = client.as_ref().and_then(|c| c.quota_for(&limit.name));
            let quota = match own {
                Some(q) => q,
                None => {
                    let at = tier as usize * nl + li as usize;
                    if self.quotas.len() <= at {
                        self.quotas.resize(at + 1, UNKNOWN);
                    }
                    if self.quotas[at] == UNKNOWN {
                        self.quotas[at] = limit.quota.get(tier_name).copied().unwrap_or(NONE);
                    }
                    match self.quotas[at] {
                        NONE => continue,
                        q => q,
                    }
                }
            };
            let mut policy = limit.policy(quota);
            let stats = slot(&mut self.stats, nl, li, tier);
            if limit.algorithm == Algorithm::Concurrency {
                match req.duration_ms {
                    // The slot is held while the request was: it "expires" at its end.
                    Some(d) => policy.window_ms = d.clamp(1, limit.window_ms),
                    None => {
                        stats.not_replayable += 1;
                        continue;
                    }
                }
            }
            stats.requests += 1;
            if stats.peak_quota == 0 {
                stats.peak_quota = policy.limit();
            }
            let key = subject_key(li, limit, req, &mut self.totals);
            let op = Op {
                kind: OpKind::Peek,
                cost: route.cost,
                id: 0,
            };
            let mut verdict = match self.states.get_mut(&key) {
                Some(state) => algorithm::apply(&policy, state, op, now),
                None => algorithm::apply(&policy, &mut State::Empty, op, now),
            };
            if !verdict.admitted {
                if enforced(limit, key) {
                    if policy.block_ms > 0 && !verdict.blocked {
                        // `block_for`: the refusal starts a block, as the gateway's
                        // BLOCK call does (`crate::limiter::block_for`).
                        let block = Op {
                            kind: OpKind::Block,
                            ..op
                        };
                        let state = self.states.entry(key).or_insert(State::Empty);
                        let b = algorithm::apply(&policy, state, block, now);
                        if b.blocked {
                            verdict = b;
                        }
                    }
                    if refusal.is_none_or(|(_, at)| verdict.retry_at_ms > at) {
                        refusal = Some((li, verdict.retry_at_ms));
                    }
                    if verdict.used > stats.peak_used {
                        stats.peak_used = verdict.used;
                        stats.peak_quota = policy.limit();
                    }
                } else {
                    stats.shadow_refused += 1;
                    shadowed = true;
                }
            }
            self.peeks.push(Step {
                limit: li,
                key,
                policy,
            });
        }
        if self.peeks.is_empty() {
            return Outcome::Unlimited;
        }
        self.totals.limited += 1;
        if let Some((li, _)) = refusal {
            self.totals.refused += 1;
            let stats = slot(&mut self.stats, nl, li, tier);
            stats.refused += 1;
            let c = stats.callers.entry(req.caller).or_insert((0, now));
            c.0 += 1;
            if let Some(series) = &mut self.series {
                if let Some(s) = series.get_mut(&(li, req.caller)) {
                    s.entry(now / 60_000).or_default().refused += 1;
                }
            }
            return Outcome::Refused(li);
        }
        if shadowed {
            self.totals.shadow_refused += 1;
        }
        // 2. Charge every limit (a concurrency limit: take the slot).
        let charged = Self::charges(route, req);
        let units = match req.logged_cost {
            // At most 10^8 units: the model's arithmetic stays within u64 for any
            // window, whatever a line says.
            Some(c) if c > 0 && route.upstream.cost_header.is_some() => c.min(MAX_COST),
            _ => route.cost,
        };
        for i in 0..self.peeks.len() {
            let step = self.peeks[i];
            let concurrency = step.policy.algorithm == Algorithm::Concurrency;
            if !charged && !concurrency {
                continue;
            }
            let op = Op {
                kind: if concurrency {
                    OpKind::Reserve
                } else {
                    OpKind::Charge
                },
                cost: units,
                id: req.seq + 1,
            };
            if self.states.len() >= self.sweep_at {
                self.sweep(now);
            }
            let state = self.states.entry(step.key).or_insert(State::Empty);
            let v = algorithm::apply(&step.policy, state, op, now);
            let stats = slot(&mut self.stats, nl, step.limit, tier);
            if v.used > stats.peak_used {
                stats.peak_used = v.used;
                stats.peak_quota = step.policy.limit();
            }
            if let Some(series) = &mut self.series {
                if let Some(s) = series.get_mut(&(step.limit, req.caller)) {
                    let m = s.entry(now / 60_000).or_default();
                    m.used = m.used.max(v.used);
                    m.quota = step.policy.limit();
                }
            }
        }
        Outcome::Admitted
    }

    /// How many limit states (windows) are held now.
    pub fn windows(&self) -> usize {
        self.states.len()
    }

    /// Drop the states whose window has passed at `now` (ms since the epoch): a state
    /// past [`State::expires_at`] decides as no state does. The next sweep comes when
    /// the states left have doubled (at least [`MIN_SWEEP`]), so that sweeping costs a
    /// constant time per state, and memory follows the windows that are open, not
    /// every caller the logs have named.
    fn sweep(&mut self, now: u64) {
        self.peak_windows = self.peak_windows.max(self.states.len());
        let limits = &self.snap.limits;
        let before = self.states.len();
        self.states.retain(|key, state| {
            let window_ms = limits
                .get((key >> 48) as usize)
                .map_or(u64::MAX / 4, |l| l.window_ms);
            state.expires_at(window_ms) > now
        });
        self.windows_dropped += (before - self.states.len()) as u64;
        self.sweep_at = (self.states.len() * 2).max(MIN_SWEEP);
        // The table's memory follows: a table far bigger than what is left shrinks.
        if self.states.capacity() > 4 * self.sweep_at {
            self.states.shrink_to(self.sweep_at);
        }
    }

    /// Whether the request's response is charged under this config: its status is not
    /// one of the route's `uncharged_statuses` (or is one of its `charged_statuses`, when
    /// it has that list), and (tollgate logs) the gateway did not
    /// find its upstream failing (admitted, nothing charged, 502-504). A request the log
    /// shows refused is assumed to have been served.
    fn charges(route: &Route, req: &Req) -> bool {
        let status = http::StatusCode::from_u16(req.status).unwrap_or(http::StatusCode::OK);
        let upstream_failed =
            !req.refused_in_log && req.logged_cost == Some(0) && (502..=504).contains(&req.status);
        (req.refused_in_log || route.charges(status)) && !upstream_failed
    }
}

/// The fewest states a sweep of expired windows waits for.
const MIN_SWEEP: usize = 4096;

/// Not looked up yet (in `Model::quotas`).
const UNKNOWN: u64 = u64::MAX;
/// No quota for the tier (quotas are at least 1).
const NONE: u64 = 0;

/// The numbers of limit `li` (of `nl`) for tier `tier`, made on first use.
fn slot(stats: &mut Vec<Option<LimitStats>>, nl: usize, li: u16, tier: u32) -> &mut LimitStats {
    let at = tier as usize * nl + li as usize;
    if stats.len() <= at {
        stats.resize_with(at + 1, || None);
    }
    stats[at].get_or_insert_with(LimitStats::default)
}

/// The key of a limit's state for the request's subject: the limit's index, the kind of
/// subject (caller id, client address, everyone) and its interned id.
fn subject_key(li: u16, limit: &Limit, req: &Req, totals: &mut Totals) -> u64 {
    const CLIENT: u64 = 0;
    const ADDRESS: u64 = 1;
    const GLOBAL: u64 = 2;
    let by_caller = || {
        if req.identified {
            (CLIENT, req.caller)
        } else {
            (ADDRESS, req.caller)
        }
    };
    let (kind, id) = match &limit.by {
        By::Caller => by_caller(),
        By::Ip => match req.client {
            Some(c) => (ADDRESS, c),
            None => by_caller(),
        },
        By::Global => (GLOBAL, 0),
        By::Header(_) | By::TrustedHeader(_) => {
            totals.header_as_caller += 1;
            by_caller()
        }
    };
    (u64::from(li) << 48) | (kind << 32) | u64::from(id)
}

/// Whether a refusal of `limit` is enforced for the subject `key` (`enforce_percent`:
/// for a partial percentage, a stable hash of the subject picks, like the gateway's
/// choice in proportion though not subject for subject).
fn enforced(limit: &Limit, key: u64) -> bool {
    match limit.enforce_percent {
        100 => true,
        0 => false,
        p => {
            // splitmix64
            let mut z = key.wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) % 100 < u64::from(p)
        }
    }
}
