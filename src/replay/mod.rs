//! `tollgate replay`: what a config would have refused, decided offline over access logs.
//!
//! Every request of the logs (tollgate's text or JSON access lines, nginx `combined`;
//! gzip-compressed or not: see [`parse`]) is routed, identified and decided with the
//! config's routes, clients and limits on the reference model of the algorithms
//! ([`model`]), with the log's timestamps as the clock: no store, no network, no
//! upstream. With `--compare OLD.toml`, both configs decide every request and the
//! callers whose verdicts change are listed. The result ([`report::Report`]) is a text
//! table or one JSON document; `--plot` draws the top callers ([`plot`]).
//!
//! Lines are written when a response ends, so they are not quite in the order requests
//! began: requests are decided in order of their start, through a buffer that holds
//! each one until the log has moved [`REORDER_MS`] past it. Memory grows with the
//! number of distinct callers (their limit states and refusal counts) and with the
//! requests in that buffer, not with the length of the logs. Limit states whose window
//! has passed are dropped as the log moves on, so that they follow the windows open at
//! once rather than every caller ever seen. A line longer than [`MAX_LINE`] is counted
//! as unparsed.

mod files;
pub mod model;
pub mod parse;
pub mod plot;
pub mod report;
mod stats;
mod time;

pub use files::in_time_order;

use files::{open, Counted};
use model::{Model, Outcome};
use parse::{Line, Parsed};
use report::Report;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How far the log may run ahead of a request's start before it is decided, at most,
/// in ms: the longest duration seen so far, up to this. A request that took longer is
/// decided late (with the clock it is decided at, never earlier than a decided request).
pub const REORDER_MS: u64 = 10_000;

/// The longest log line read, in bytes: a longer one is counted as unparsed (and read
/// past without being held whole).
pub const MAX_LINE: usize = 64 * 1024;

/// Unparsed lines shown (all are counted).
pub const SHOWN_UNPARSED: usize = 10;

/// A route index that is no route.
pub const NO_ROUTE: u32 = u32::MAX;

/// What `tollgate replay` was asked.
#[derive(Debug, Clone)]
pub struct Options {
    /// The config whose limits decide (`--config`).
    pub config: PathBuf,
    /// The config to compare with (`--compare`).
    pub compare: Option<PathBuf>,
    /// The access logs, in any order (they are read in the order of their first
    /// request, see [`in_time_order`]); gzip files (by content) are decompressed.
    pub logs: Vec<PathBuf>,
    /// Top callers listed per limit and tier.
    pub top: usize,
    /// Draw the top callers to this SVG file.
    pub plot: Option<PathBuf>,
    /// Show a progress bar on stderr.
    pub progress: bool,
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A config file is invalid: its rendered report (`PATH:LINE:COLUMN: key: what`).
    #[error("{0}")]
    Config(String),
    /// A log file cannot be opened.
    #[error("{path}: {error}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The error.
        error: std::io::Error,
    },
    /// The plot cannot be written.
    #[error("plot: {0}")]
    Plot(String),
}

/// A request as read from a log, with what each config made of it.
#[derive(Debug, Clone)]
pub struct Req {
    /// When it began, ms since the epoch.
    pub start_ms: u64,
    /// Its position in the logs (0, 1, …): orders requests that began together.
    pub seq: u64,
    /// How long it took, ms, when logged.
    pub duration_ms: Option<u64>,
    /// The caller: its client id (`identified`), else its address, interned.
    pub caller: u32,
    /// Whether `caller` is a client id.
    pub identified: bool,
    /// The client's address (or its keyed hash), interned, when logged.
    pub client: Option<u32>,
    /// The response status.
    pub status: u16,
    /// Units the gateway charged, when logged.
    pub logged_cost: Option<u64>,
    /// Whether the log shows it refused (429 with decision `rejected`, or 429 in an
    /// nginx log).
    pub refused_in_log: bool,
    /// Per config (the one replayed, then the one compared): its route index
    /// ([`NO_ROUTE`]: none) and its tier, interned.
    pub per_config: [(u32, u32); 2],
}

/// Strings seen in the logs (caller ids, addresses, tiers) by number.
#[derive(Debug, Default)]
pub struct Interner {
    ids: HashMap<Arc<str>, u32, foldhash::fast::FixedState>,
    names: Vec<Arc<str>>,
}

impl Interner {
    /// The number of `s`, given on first sight.
    pub fn id(&mut self, s: &str) -> u32 {
        if let Some(i) = self.ids.get(s) {
            return *i;
        }
        let name: Arc<str> = Arc::from(s);
        let i = self.names.len() as u32;
        self.ids.insert(name.clone(), i);
        self.names.push(name);
        i
    }

    /// The string numbered `i`.
    pub fn name(&self, i: u32) -> &str {
        self.names.get(i as usize).map_or("?", |n| n)
    }
}

/// A line that could not be read.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Unparsed {
    /// The file.
    pub file: String,
    /// Its line number (1-based).
    pub line: u64,
    /// Why.
    pub reason: String,
    /// The line (at most 200 characters).
    pub text: String,
}

/// What reading the logs found besides requests.
#[derive(Debug, Default)]
pub struct Reading {
    /// Lines read.
    pub lines: u64,
    /// Requests read.
    pub requests: u64,
    /// tollgate log lines that are not access lines (and empty lines).
    pub other_lines: u64,
    /// Access lines the gateway held back (its budget for refused requests' lines).
    pub held_back: u64,
    /// Lines that could not be read.
    pub unparsed_lines: u64,
    /// The first [`SHOWN_UNPARSED`] of them.
    pub unparsed: Vec<Unparsed>,
    /// Files that failed part-way (e.g. a truncated gzip file): what was read counts.
    pub read_errors: Vec<String>,
    /// Requests the gateway answered before its limits (401, 400, 421, the rate-limit
    /// endpoint, `Max-Forwards: 0`, refusals of `identity.failed_auth_limit`): not
    /// replayed, a new config would answer them the same.
    pub skipped: u64,
    /// Requests whose duration is logged.
    pub with_duration: u64,
    /// The first and last request start, ms since the epoch.
    pub span_ms: Option<(u64, u64)>,
}

/// The state of one pass over the logs.
struct Pass {
    models: Vec<Model>,
    names: Interner,
    tiers: Interner,
    reading: Reading,
    pending: BinaryHeap<Reverse<Pending>>,
    latest_ms: u64,
    /// The longest duration seen, ms (how far lines can be out of start order).
    longest_ms: u64,
    seq: u64,
    /// Per caller whose verdict differs between the configs: (refused only by the
    /// replayed config, refused only by the compared one).
    changed: HashMap<u32, (u64, u64), foldhash::fast::FixedState>,
}

struct Pending(Req);

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.0.start_ms, self.0.seq) == (other.0.start_ms, other.0.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0.start_ms, self.0.seq).cmp(&(other.0.start_ms, other.0.seq))
    }
}

/// Read and build a config the way the gateway does (`tollgate check`'s rules).
///
/// Errors: [`Error::Config`] with every problem of the file.
pub fn load(path: &Path) -> Result<crate::snapshot::Snapshot, Error> {
    let file = crate::config::read(path).map_err(|r| Error::Config(r.to_string()))?;
    let files = crate::load::Loaded::load(&file, None);
    crate::snapshot::Snapshot::build(&file, &files, None).map_err(|r| {
        let mut s = String::new();
        for l in r.error_lines() {
            s.push_str(&l);
            s.push('\n');
        }
        Error::Config(s.trim_end().to_string())
    })
}

/// Replay `opts.logs` under `opts.config` (and `opts.compare`), and write the plot if
/// asked.
///
/// Errors: an invalid config, a log that cannot be opened, a plot that cannot be
/// written. Lines that cannot be read are counted in the report, never an error.
pub fn run(opts: &Options) -> Result<Report, Error> {
    let mut paths = vec![opts.config.clone()];
    paths.extend(opts.compare.iter().cloned());
    let models =
        || -> Result<Vec<Model>, Error> { paths.iter().map(|p| load(p).map(Model::new)).collect() };
    for log in &opts.logs {
        std::fs::File::open(log).map_err(|error| Error::Open {
            path: log.clone(),
            error,
        })?;
    }
    let pass = replay(models()?, opts, None)?;
    let report = Report::build(
        opts,
        &pass.models,
        &pass.names,
        &pass.tiers,
        &pass.reading,
        &pass.changed,
    );
    if let Some(svg) = &opts.plot {
        // A second pass records, minute by minute, the callers the first found on top.
        let picked = report.plotted(plot::CALLERS);
        let mut models = models()?;
        let mut series: HashMap<_, _, _> = HashMap::default();
        for (limit, caller) in &picked {
            let li = models[0]
                .snapshot()
                .limits
                .iter()
                .position(|l| &*l.name == limit.as_str());
            if let (Some(li), Some(id)) = (li, pass.names.ids.get(caller.as_str())) {
                series.insert((li as u16, *id), Default::default());
            }
        }
        models[0].series = Some(series);
        let second = replay(models, opts, Some(pass.names))?;
        plot::write(svg, &second.models[0], &second.names, &picked).map_err(Error::Plot)?;
    }
    Ok(report)
}

/// One pass over the logs.
fn replay(models: Vec<Model>, opts: &Options, names: Option<Interner>) -> Result<Pass, Error> {
    let mut pass = Pass {
        models,
        names: names.unwrap_or_default(),
        tiers: Interner::default(),
        reading: Reading::default(),
        pending: BinaryHeap::new(),
        latest_ms: 0,
        longest_ms: 0,
        seq: 0,
        changed: HashMap::default(),
    };
    let total: u64 = opts
        .logs
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let bar = if opts.progress {
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(bar)
    } else {
        None
    };
    for path in &in_time_order(&opts.logs) {
        let file = std::fs::File::open(path).map_err(|error| Error::Open {
            path: path.clone(),
            error,
        })?;
        let counted = Counted {
            inner: file,
            bar: bar.clone(),
        };
        let mut reader = open(counted).map_err(|error| Error::Open {
            path: path.clone(),
            error,
        })?;
        let name = path.display().to_string();
        let mut buf = Vec::with_capacity(1024);
        let mut n = 0u64;
        loop {
            let too_long = match crate::lines::read_capped(&mut reader, &mut buf, MAX_LINE) {
                Ok(crate::lines::Capped::End) => break,
                Ok(crate::lines::Capped::Line) => None,
                Ok(crate::lines::Capped::TooLong(len)) => Some(len),
                Err(e) => {
                    pass.reading
                        .read_errors
                        .push(format!("{name}: read error after line {n}: {e}"));
                    break;
                }
            };
            n += 1;
            match too_long {
                None => pass.line(&name, n, &buf),
                Some(len) => pass.unparsed(
                    &name,
                    n,
                    &format!("longer than {MAX_LINE} bytes ({len})"),
                    &buf,
                ),
            }
        }
    }
    pass.drain(true);
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(pass)
}

impl Pass {
    fn line(&mut self, file: &str, n: u64, bytes: &[u8]) {
        self.reading.lines += 1;
        let parsed = match std::str::from_utf8(bytes) {
            Ok(text) => parse::parse_line(text),
            Err(_) => Err("not UTF-8"),
        };
        match parsed {
            Ok(Parsed::Request(line)) => self.request(&line),
            Ok(Parsed::HeldBack(k)) => self.reading.held_back += k,
            Ok(Parsed::Other) => self.reading.other_lines += 1,
            Err(reason) => self.unparsed(file, n, reason, bytes),
        }
    }

    /// Count line `n` of `file` as unparsed, for `reason`; `bytes` is (its start).
    fn unparsed(&mut self, file: &str, n: u64, reason: &str, bytes: &[u8]) {
        self.reading.unparsed_lines += 1;
        if self.reading.unparsed.len() < SHOWN_UNPARSED {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(800)]);
            self.reading.unparsed.push(Unparsed {
                file: file.to_string(),
                line: n,
                reason: reason.to_string(),
                text: text.trim_end().chars().take(200).collect(),
            });
        }
    }

    fn request(&mut self, line: &Line<'_>) {
        self.reading.requests += 1;
        let before_limits = matches!(
            line.decision.as_deref(),
            Some(
                "unauthenticated"
                    | "rate_limit_status"
                    | "bad_request"
                    | "misdirected"
                    | "last_hop"
            )
        ) || line.limit.as_deref() == Some(crate::limiter::FAILED_AUTH);
        if before_limits {
            self.reading.skipped += 1;
            return;
        }
        if line.duration_ms.is_some() {
            self.reading.with_duration += 1;
        }
        self.reading.span_ms = Some(match self.reading.span_ms {
            None => (line.start_ms, line.start_ms),
            Some((a, b)) => (a.min(line.start_ms), b.max(line.start_ms)),
        });
        let client = line.client.as_deref().map(|c| self.names.id(c));
        let (caller_name, identified) = match (&line.caller, &line.client) {
            (Some(id), _) => (&**id, true),
            (None, Some(c)) => (&**c, false),
            (None, None) => ("anonymous", false),
        };
        let caller = self.names.id(caller_name);
        let mut per_config = [(NO_ROUTE, 0); 2];
        for (i, m) in self.models.iter_mut().enumerate() {
            let route = m.route(&line.method, &line.path);
            let tier = m.tier(
                caller,
                caller_name,
                identified,
                line.tier.as_deref(),
                &mut self.tiers,
            );
            per_config[i] = (route, tier);
        }
        let refused_in_log =
            line.status == 429 && line.decision.as_deref().is_none_or(|d| d == "rejected");
        let req = Req {
            start_ms: line.start_ms,
            seq: self.seq,
            duration_ms: line.duration_ms,
            caller,
            identified,
            client,
            status: line.status,
            logged_cost: line.cost,
            refused_in_log,
            per_config,
        };
        self.seq += 1;
        let duration = line.duration_ms.unwrap_or(0);
        self.longest_ms = self.longest_ms.max(duration.min(REORDER_MS));
        self.latest_ms = self.latest_ms.max(line.start_ms + duration);
        self.pending.push(Reverse(Pending(req)));
        self.drain(false);
    }

    /// Decide the requests that no line still to come can precede (they began at least
    /// the longest duration seen before the latest time seen), or `all`.
    fn drain(&mut self, all: bool) {
        while let Some(Reverse(Pending(top))) = self.pending.peek() {
            if !all && top.start_ms + self.longest_ms > self.latest_ms {
                break;
            }
            let Some(Reverse(Pending(req))) = self.pending.pop() else {
                break;
            };
            let mut outcomes = [Outcome::Unrouted; 2];
            for (i, m) in self.models.iter_mut().enumerate() {
                let (route, tier) = req.per_config[i];
                outcomes[i] = m.decide(&req, route, tier, self.tiers.name(tier));
            }
            if self.models.len() == 2 {
                let refused = |o: Outcome| matches!(o, Outcome::Refused(_));
                match (refused(outcomes[0]), refused(outcomes[1])) {
                    (true, false) => self.changed.entry(req.caller).or_default().0 += 1,
                    (false, true) => self.changed.entry(req.caller).or_default().1 += 1,
                    _ => {}
                }
            }
        }
    }
}
