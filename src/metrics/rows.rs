//! Families counted on the request path through a per-thread memo of their rows: a
//! thread keeps handles to the rows it counted last, found by comparing labels (no
//! hashing, no lock).

use super::labels::{RejectionLabels, RequestLabels, UpstreamLabels};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use std::sync::Arc;

/// `tollgate_requests_total`, counted through a per-thread memo of its rows
/// ([`RequestCounts::inc`]). Cloning it is cloning a reference to the same rows.
#[derive(Debug, Clone)]
pub struct RequestCounts {
    /// Which [`super::Metrics`] these rows belong to (unique in the process), for the memo.
    pub(super) id: u64,
    pub(super) family: Family<RequestLabels, Counter>,
}

/// How many rows of each memoised family a thread keeps handles to.
const MEMO_ROWS: usize = 32;

impl RequestCounts {
    /// Count one request of `route` answered with `status` after `decision`.
    ///
    /// A thread keeps handles to the last [`MEMO_ROWS`] rows it counted, found by
    /// comparing the labels (no hashing, no lock); a row it does not hold is looked up in
    /// the family (SipHash of the labels under the family's read lock) and kept.
    pub fn inc(&self, route: &Arc<str>, status: u16, decision: &'static str) {
        thread_local! {
            static ROWS: MemoRows<RequestLabels, Counter> = const { std::cell::RefCell::new(Vec::new()) };
        }
        count(
            &ROWS,
            self.id,
            &self.family,
            |l| l.status == status && l.decision == decision && l.route == *route,
            || RequestLabels {
                route: route.clone(),
                status,
                decision,
            },
        );
    }
}

/// `tollgate_upstream_latency_seconds`, observed through a per-thread memo of its rows
/// (as [`RequestCounts`]).
#[derive(Debug, Clone)]
pub struct UpstreamLatency {
    /// Which [`super::Metrics`] these rows belong to (unique in the process), for the memo.
    pub(super) id: u64,
    pub(super) family: Family<UpstreamLabels, Histogram, fn() -> Histogram>,
}

impl UpstreamLatency {
    /// Record that `upstream` took `seconds` to answer with its response head.
    pub fn observe(&self, upstream: &Arc<str>, seconds: f64) {
        thread_local! {
            static ROWS: std::cell::RefCell<Vec<(u64, Arc<str>, Histogram)>> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        ROWS.with(|rows| {
            held(
                &mut rows.borrow_mut(),
                self.id,
                |name| name == upstream,
                || {
                    let labels = UpstreamLabels {
                        upstream: upstream.clone(),
                    };
                    (upstream.clone(), self.family.get_or_create_owned(&labels))
                },
            )
            .observe(seconds);
        })
    }
}

/// `tollgate_rejections_total`, counted through a per-thread memo of its rows (as
/// [`RequestCounts`]): a 429 costs no hashing and no lock.
#[derive(Debug, Clone)]
pub struct RejectionCounts {
    /// Which [`super::Metrics`] these rows belong to (unique in the process), for the memo.
    pub(super) id: u64,
    pub(super) family: Family<RejectionLabels, Counter>,
}

impl RejectionCounts {
    /// Count one request refused with 429 by `limit` for a caller of `tier`.
    pub fn inc(&self, limit: &Arc<str>, tier: &Arc<str>) {
        thread_local! {
            static ROWS: MemoRows<RejectionLabels, Counter> = const { std::cell::RefCell::new(Vec::new()) };
        }
        count(
            &ROWS,
            self.id,
            &self.family,
            |l| l.limit == *limit && l.tier == *tier,
            || RejectionLabels {
                limit: limit.clone(),
                tier: tier.clone(),
            },
        );
    }
}

/// A thread's memo of one family's rows: per row, the gateway's id, the labels and the
/// row's handle.
type MemoRows<L, M> = std::cell::RefCell<Vec<(u64, L, M)>>;

/// Count one in the row of `family` (of gateway `id`) whose labels `matches`, through
/// the thread's memo `rows` ([`held`]); a row it does not hold is made from `labels`.
fn count<L>(
    rows: &'static std::thread::LocalKey<MemoRows<L, Counter>>,
    id: u64,
    family: &Family<L, Counter>,
    matches: impl Fn(&L) -> bool,
    labels: impl FnOnce() -> L,
) where
    L: Clone + std::hash::Hash + Eq,
{
    rows.with(|rows| {
        held(&mut rows.borrow_mut(), id, matches, || {
            let labels = labels();
            let counter = family.get_or_create_owned(&labels);
            (labels, counter)
        })
        .inc();
    })
}

/// The handle to the row of gateway `id` whose labels `matches` in a thread's memo
/// `rows`, or a new one from `make` (looked up in the family), kept in place of the
/// oldest when the memo holds [`MEMO_ROWS`].
fn held<L, M>(
    rows: &mut Vec<(u64, L, M)>,
    id: u64,
    matches: impl Fn(&L) -> bool,
    make: impl FnOnce() -> (L, M),
) -> &M {
    if let Some(i) = rows.iter().position(|(i, l, _)| *i == id && matches(l)) {
        return &rows[i].2;
    }
    let (labels, m) = make();
    if rows.len() == MEMO_ROWS {
        rows.remove(0);
    }
    rows.push((id, labels, m));
    &rows[rows.len() - 1].2
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    fn count_of(m: &Metrics, route: &str, status: u16) -> Option<String> {
        let line = format!("tollgate_requests_total{{route=\"{route}\",status=\"{status}\",decision=\"allowed\"}} ");
        m.render()
            .lines()
            .find_map(|l| l.strip_prefix(&line).map(str::to_string))
    }

    #[test]
    fn memoised_rows_count_into_their_own_gateway() {
        let (a, b) = (
            Metrics::new(Box::new(|| None)),
            Metrics::new(Box::new(|| None)),
        );
        let routes: Vec<Arc<str>> = (0..MEMO_ROWS + 8)
            .map(|i| format!("/r{i}").into())
            .collect();
        // More rows than the memo holds, each counted twice on `a`, once on `b`, and
        // interleaved so that rows leave the memo and come back.
        for _ in 0..2 {
            for r in &routes {
                a.requests.inc(r, 200, "allowed");
            }
        }
        for r in &routes {
            b.requests.inc(r, 200, "allowed");
        }
        a.requests.inc(&routes[0], 404, "allowed");
        for (i, r) in routes.iter().enumerate() {
            assert_eq!(count_of(&a, r, 200).as_deref(), Some("2"), "route {i} on a");
            assert_eq!(count_of(&b, r, 200).as_deref(), Some("1"), "route {i} on b");
        }
        assert_eq!(count_of(&a, "/r0", 404).as_deref(), Some("1"));
        assert_eq!(count_of(&b, "/r0", 404), None);

        let up: Arc<str> = "api".into();
        a.upstream_latency.observe(&up, 0.002);
        a.upstream_latency.observe(&up, 0.004);
        b.upstream_latency.observe(&up, 0.002);
        let count = |m: &Metrics| {
            m.render().lines().find_map(|l| {
                l.strip_prefix("tollgate_upstream_latency_seconds_count{upstream=\"api\"} ")
                    .map(str::to_string)
            })
        };
        assert_eq!(count(&a).as_deref(), Some("2"));
        assert_eq!(count(&b).as_deref(), Some("1"));
    }
}
