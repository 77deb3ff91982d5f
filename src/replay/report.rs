//! What a replay found: per limit and tier, requests, refusals, the callers refused and
//! the peak use of a window; as a text table or one JSON document
//! (`{"limits": [{"name", "tier", "requests", "refused", "callers_refused", "top": [...]}],
//! "unparsed_lines": N, ...}`).

use super::model::{LimitStats, Model, Totals};
use super::{Interner, Options, Reading, Unparsed};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

/// The result of a replay.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The config replayed (`--config`).
    pub config: String,
    /// The log files, in the order read (of their first request).
    pub logs: Vec<String>,
    /// Lines read.
    pub lines: u64,
    /// Requests read.
    pub requests: u64,
    /// The first and last request start, RFC 3339 (UTC); absent without requests.
    pub from: Option<String>,
    /// See `from`.
    pub to: Option<String>,
    /// tollgate log lines that are not access lines.
    pub other_lines: u64,
    /// Requests the gateway answered before its limits (401, 400, 421, the rate-limit
    /// endpoint, refusals of `identity.failed_auth_limit`): not replayed.
    pub skipped: u64,
    /// Lines that could not be read.
    pub unparsed_lines: u64,
    /// The first of them, with file and line number.
    pub unparsed: Vec<Unparsed>,
    /// Files that could not be read to the end.
    pub read_errors: Vec<String>,
    /// Counts over every request.
    pub totals: Totals,
    /// The limit states (windows) the replay held: memory follows `peak`.
    pub windows: Windows,
    /// Per limit (config order) and tier.
    pub limits: Vec<LimitReport>,
    /// What a reader should know about the numbers (e.g. lines the gateway held back).
    pub notes: Vec<String>,
    /// With `--compare`: the other config's numbers and the callers whose verdicts
    /// change.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compare: Option<Compare>,
}

/// The limit states (one per limit and caller with an open window) of a replay.
#[derive(Debug, Serialize, Clone, Copy)]
pub struct Windows {
    /// The most held at once.
    pub peak: usize,
    /// Those dropped because their window had passed.
    pub dropped: u64,
}

/// One limit for one tier.
#[derive(Debug, Serialize, Clone)]
pub struct LimitReport {
    /// The limit's name.
    pub name: String,
    /// The tier.
    pub tier: String,
    /// The algorithm.
    pub algorithm: &'static str,
    /// The window, seconds.
    pub window_s: f64,
    /// The tier's quota (a client's own quota may differ); absent when the tier has
    /// none (only clients' own quotas applied).
    pub quota: Option<u64>,
    /// Requests the limit applied to.
    pub requests: u64,
    /// Requests it refused.
    pub refused: u64,
    /// `refused / requests`, percent.
    pub refused_percent: f64,
    /// Distinct callers refused at least once.
    pub callers_refused: u64,
    /// Requests it would refuse but lets through (shadow mode, `enforce_percent`).
    pub shadow_refused: u64,
    /// The most units used in one window, and the quota it was used against.
    pub peak_used: u64,
    /// See `peak_used`.
    pub peak_quota: u64,
    /// Concurrency limits over a log without durations: requests not replayed.
    pub not_replayable: u64,
    /// The callers refused most, most first.
    pub top: Vec<TopCaller>,
}

/// A caller refused by a limit.
#[derive(Debug, Serialize, Clone)]
pub struct TopCaller {
    /// The client id, else the client's address (or its hash) as logged.
    pub caller: String,
    /// Its refused requests.
    pub refused: u64,
    /// When it was first refused, RFC 3339 (UTC).
    pub first_refused: String,
    /// The same, ms since the epoch.
    pub first_refused_ms: u64,
}

/// `--compare`: the compared config's numbers and what changes.
#[derive(Debug, Serialize)]
pub struct Compare {
    /// The compared config (`--compare`).
    pub config: String,
    /// Its counts over every request.
    pub totals: Totals,
    /// Its numbers per limit and tier.
    pub limits: Vec<LimitReport>,
    /// Callers whose verdicts differ, the most changes first (at most 50).
    pub changed_callers: Vec<Changed>,
    /// How many callers' verdicts differ in all.
    pub changed_callers_total: u64,
}

/// A caller whose verdicts differ between the two configs.
#[derive(Debug, Serialize)]
pub struct Changed {
    /// The caller.
    pub caller: String,
    /// Requests refused under `--config` and admitted under `--compare`.
    pub newly_refused: u64,
    /// Requests admitted under `--config` and refused under `--compare`.
    pub newly_admitted: u64,
}

/// `ms` since the epoch as RFC 3339 UTC with milliseconds.
pub fn rfc3339(ms: u64) -> String {
    let days = (ms / 86_400_000) as i64;
    let (y, m, d) = crate::limiter::algorithm::civil_from_days(days);
    let rem = ms % 86_400_000;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3_600_000,
        rem / 60_000 % 60,
        rem / 1000 % 60,
        rem % 1000
    )
}

fn limits_of(model: &Model, names: &Interner, tiers: &Interner, top: usize) -> Vec<LimitReport> {
    let snap = model.snapshot();
    let mut by_key: BTreeMap<(u16, String), &LimitStats> = BTreeMap::new();
    for ((li, tier), stats) in model.stats() {
        by_key.insert((li, tiers.name(tier).to_string()), stats);
    }
    by_key
        .into_iter()
        .filter_map(|((li, tier), s)| {
            let limit = snap.limits.get(li as usize)?;
            let mut callers: Vec<(&u32, &(u64, u64))> = s.callers.iter().collect();
            callers.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.1 .1.cmp(&b.1 .1)));
            Some(LimitReport {
                name: limit.name.to_string(),
                algorithm: limit.algorithm.name(),
                window_s: limit.window_ms as f64 / 1000.0,
                quota: limit.quota.get(tier.as_str()).copied(),
                tier,
                requests: s.requests,
                refused: s.refused,
                refused_percent: if s.requests == 0 {
                    0.0
                } else {
                    (10_000.0 * s.refused as f64 / s.requests as f64).round() / 100.0
                },
                callers_refused: s.callers.len() as u64,
                shadow_refused: s.shadow_refused,
                peak_used: s.peak_used,
                peak_quota: s.peak_quota,
                not_replayable: s.not_replayable,
                top: callers
                    .into_iter()
                    .take(top)
                    .map(|(c, (n, first))| TopCaller {
                        caller: names.name(*c).to_string(),
                        refused: *n,
                        first_refused: rfc3339(*first),
                        first_refused_ms: *first,
                    })
                    .collect(),
            })
        })
        .collect()
}

impl Report {
    /// The report of a pass: `models[0]` replayed `opts.config`, `models[1]` (if any)
    /// `opts.compare`; `changed` holds, per caller, (refused only by the first, refused
    /// only by the second).
    pub fn build(
        opts: &Options,
        models: &[Model],
        names: &Interner,
        tiers: &Interner,
        reading: &Reading,
        changed: &HashMap<u32, (u64, u64), foldhash::fast::FixedState>,
    ) -> Report {
        let mut notes = Vec::new();
        if reading.held_back > 0 {
            notes.push(format!(
                "the gateway held back {} access lines of refused requests (more than {} a second): those requests are not in the logs, so refusals are undercounted",
                reading.held_back,
                crate::proxy::access::REFUSED_LINES_PER_SECOND
            ));
        }
        let main = &models[0];
        if main.totals.unknown_callers > 0 {
            notes.push(format!("{} requests came from caller ids this config does not know, with no tier logged: judged under the anonymous tier", main.totals.unknown_callers));
        }
        if main.totals.header_as_caller > 0 {
            notes.push("limits with by = \"header:NAME\" count by caller: access logs do not carry header values".to_string());
        }
        let limits = limits_of(main, names, tiers, opts.top);
        if limits.iter().any(|l| l.not_replayable > 0) {
            notes.push("concurrency limits need each request's duration (tollgate's total_ms, nginx's $request_time): not replayed over lines without one".to_string());
        }
        let compare = opts.compare.as_ref().and_then(|path| {
            let other = models.get(1)?;
            let mut list: Vec<Changed> = changed
                .iter()
                .map(|(c, (r, a))| Changed {
                    caller: names.name(*c).to_string(),
                    newly_refused: *r,
                    newly_admitted: *a,
                })
                .collect();
            list.sort_by(|a, b| {
                (b.newly_refused + b.newly_admitted)
                    .cmp(&(a.newly_refused + a.newly_admitted))
                    .then(a.caller.cmp(&b.caller))
            });
            let total = list.len() as u64;
            list.truncate(50);
            Some(Compare {
                config: path.display().to_string(),
                totals: other.totals.clone(),
                limits: limits_of(other, names, tiers, opts.top),
                changed_callers: list,
                changed_callers_total: total,
            })
        });
        Report {
            config: opts.config.display().to_string(),
            logs: super::in_time_order(&opts.logs)
                .iter()
                .map(|p| p.display().to_string())
                .collect(),
            lines: reading.lines,
            requests: reading.requests,
            from: reading.span_ms.map(|s| rfc3339(s.0)),
            to: reading.span_ms.map(|s| rfc3339(s.1)),
            other_lines: reading.other_lines,
            skipped: reading.skipped,
            unparsed_lines: reading.unparsed_lines,
            unparsed: reading.unparsed.clone(),
            read_errors: reading.read_errors.clone(),
            totals: main.totals.clone(),
            windows: Windows {
                peak: main.peak_windows.max(main.windows()),
                dropped: main.windows_dropped,
            },
            limits,
            notes,
            compare,
        }
    }

    /// The (limit, caller) pairs to plot: the callers refused most, over every limit,
    /// at most `n`.
    pub fn plotted(&self, n: usize) -> Vec<(String, String)> {
        let mut all: Vec<(u64, &str, &str)> = self
            .limits
            .iter()
            .flat_map(|l| l.top.iter().map(move |t| (t.refused, &*l.name, &*t.caller)))
            .collect();
        all.sort_by(|a, b| b.0.cmp(&a.0).then(a.2.cmp(b.2)));
        let mut out: Vec<(String, String)> = Vec::new();
        for (_, l, c) in all {
            if out.len() == n {
                break;
            }
            if !out.iter().any(|(a, b)| a == l && b == c) {
                out.push((l.to_string(), c.to_string()));
            }
        }
        out
    }

    /// The report as text: a summary, the table per limit and tier with its top
    /// callers, and with `--compare` both configs side by side and the changed callers.
    pub fn text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "replayed {} requests ({} lines{}) under {}",
            self.requests,
            self.lines,
            match (&self.from, &self.to) {
                (Some(a), Some(b)) => format!(", {a} to {b}"),
                _ => String::new(),
            },
            self.config
        );
        let t = &self.totals;
        let _ = writeln!(
            o,
            "limited {}, refused {} ({:.2}%), shadow-refused {}, no route {}",
            t.limited,
            t.refused,
            pct(t.refused, t.limited),
            t.shadow_refused,
            t.unrouted
        );
        if self.skipped > 0 {
            let _ = writeln!(
                o,
                "skipped {} requests answered before the limits (401, 400, 421, the rate-limit endpoint, failed_auth)",
                self.skipped
            );
        }
        let _ = writeln!(o, "unparsed lines: {}", self.unparsed_lines);
        for u in &self.unparsed {
            let _ = writeln!(o, "  {}:{}: {}: {}", u.file, u.line, u.reason, u.text);
        }
        for e in &self.read_errors {
            let _ = writeln!(o, "  {e}");
        }
        match &self.compare {
            None => table(&mut o, &self.limits),
            Some(c) => {
                let _ = writeln!(o, "\n--config {}:", self.config);
                table(&mut o, &self.limits);
                let _ = writeln!(o, "\n--compare {}:", c.config);
                table(&mut o, &c.limits);
                let _ = writeln!(
                    o,
                    "\nrefused: {} under --config, {} under --compare",
                    self.totals.refused, c.totals.refused
                );
                let _ = writeln!(
                    o,
                    "callers whose verdicts change: {}",
                    c.changed_callers_total
                );
                if !c.changed_callers.is_empty() {
                    let w = c
                        .changed_callers
                        .iter()
                        .map(|c| c.caller.len())
                        .max()
                        .unwrap_or(6)
                        .max(6);
                    let _ = writeln!(
                        o,
                        "  {:w$}  {:>13}  {:>14}",
                        "caller", "newly refused", "newly admitted"
                    );
                    for ch in &c.changed_callers {
                        let _ = writeln!(
                            o,
                            "  {:w$}  {:>13}  {:>14}",
                            ch.caller, ch.newly_refused, ch.newly_admitted
                        );
                    }
                }
            }
        }
        for n in &self.notes {
            let _ = writeln!(o, "note: {n}");
        }
        o
    }
}

fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        100.0 * a as f64 / b as f64
    }
}

fn table(o: &mut String, limits: &[LimitReport]) {
    if limits.is_empty() {
        let _ = writeln!(o, "no limit applied to any request");
        return;
    }
    let wn = limits
        .iter()
        .map(|l| l.name.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let wt = limits
        .iter()
        .map(|l| l.tier.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(
        o,
        "{:wn$}  {:wt$}  {:>10}  {:>10}  {:>8}  {:>15}  {:>6}  {:>15}",
        "limit",
        "tier",
        "requests",
        "refused",
        "refused%",
        "callers refused",
        "shadow",
        "peak/quota"
    );
    for l in limits {
        let _ = writeln!(
            o,
            "{:wn$}  {:wt$}  {:>10}  {:>10}  {:>7.2}%  {:>15}  {:>6}  {:>15}",
            l.name,
            l.tier,
            l.requests,
            l.refused,
            l.refused_percent,
            l.callers_refused,
            l.shadow_refused,
            format!("{}/{}", l.peak_used, l.peak_quota)
        );
        if l.not_replayable > 0 {
            let _ = writeln!(
                o,
                "    not replayable (no durations logged): {} requests",
                l.not_replayable
            );
        }
        for t in &l.top {
            let _ = writeln!(
                o,
                "    {:>8} refused  {}  first {}",
                t.refused, t.caller, t.first_refused
            );
        }
    }
}
