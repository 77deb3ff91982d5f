//! One request's trace: what is recorded while it passes ([`Recording`], kept in its
//! access log) and the span handed to the exporter when it ends ([`SpanData`]).

use super::context::{self, SpanId, TraceId};
use crate::limiter::store::CallNote;
use http::{HeaderMap, HeaderValue, Method, Uri};
use std::net::IpAddr;
use std::sync::Arc;

/// Now, nanoseconds since the Unix epoch (span times).
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A child span's times and outcome.
#[derive(Debug, Clone, Default)]
pub struct Timed {
    /// Its span id.
    pub span_id: SpanId,
    /// Start, nanoseconds since the Unix epoch.
    pub start_ns: u64,
    /// End, nanoseconds since the Unix epoch (0 while under way).
    pub end_ns: u64,
    /// Its store calls (check and charge spans): shard, node, script, batch, events.
    pub store: CallNote,
}

impl Timed {
    fn starts() -> Self {
        Self {
            span_id: context::new_span_id(),
            start_ns: now_ns(),
            end_ns: 0,
            store: CallNote::default(),
        }
    }
}

/// The upstream call of a forwarded request (a client span).
#[derive(Debug, Clone, Default)]
pub struct UpstreamCall {
    /// Its times and span id (the parent named in the upstream's `traceparent`).
    pub timed: Timed,
    /// The upstream's name.
    pub upstream: Option<Arc<str>>,
    /// The target that answered last, as `HOST:PORT`.
    pub target: Option<Arc<str>>,
    /// Attempts made (2 when a failure was retried on another target).
    pub attempts: u32,
    /// `"1.1"` or `"2"`.
    pub protocol: &'static str,
    /// When the retry began, nanoseconds since the Unix epoch (0: no retry).
    pub retry_ns: u64,
}

/// What the forwarder tells the trace about its attempts (kept on the forward phase's
/// stack; `None` in [`crate::proxy::downstream::Downstream`] when the call is not
/// recorded).
#[derive(Debug, Default)]
pub struct Attempts {
    /// The index of the target tried last.
    target: std::sync::atomic::AtomicUsize,
    /// Attempts so far.
    count: std::sync::atomic::AtomicU32,
    /// When the second attempt began, nanoseconds since the Unix epoch (0: none).
    retry_ns: std::sync::atomic::AtomicU64,
}

impl Attempts {
    /// An attempt on target `index` begins.
    pub fn attempt(&self, index: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        self.target.store(index, Relaxed);
        if self.count.fetch_add(1, Relaxed) == 1 {
            self.retry_ns.store(now_ns(), Relaxed);
        }
    }

    /// (target index, attempts, when the retry began or 0).
    pub fn read(&self) -> (usize, u32, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.target.load(Relaxed),
            self.count.load(Relaxed),
            self.retry_ns.load(Relaxed),
        )
    }
}

/// The caller as the identify phase found it (hashed and shown when the span is
/// exported, not before).
#[derive(Debug)]
pub struct Identified {
    /// The client id; `None` for anonymous callers.
    pub id: Option<Arc<str>>,
    /// The client IP.
    pub ip: IpAddr,
    /// What per-IP limits count it as.
    pub ip_key: IpAddr,
    /// Its tier.
    pub tier: Arc<str>,
}

/// What a request's trace records as it passes, from the start of the request: its
/// ids, and the details of a span to export (`None` until it is known to be exported:
/// an unsampled request keeps the small part only).
#[derive(Debug)]
pub struct Recording {
    /// The trace (continued, or new).
    pub trace_id: TraceId,
    /// The server span of this request.
    pub span_id: SpanId,
    /// The remote parent's span, when a trusted caller's trace is continued.
    pub parent: Option<SpanId>,
    /// Its `tracestate`, carried on unchanged.
    pub state: Option<HeaderValue>,
    /// Sampled at the start (by the parent's flag or the ratio): exported whatever
    /// happens, told upstream, and recorded as it passes (child spans, caller).
    pub sampled: bool,
    /// Not sampled, but exported if a limit refuses it (`tracing.sample_refusals`):
    /// only the start time is kept until then, and the rest is noted at the refusal.
    pub refusal_watch: bool,
    /// Start of the server span, nanoseconds since the Unix epoch (0: not recorded).
    pub start_ns: u64,
    /// What the span shows: from the start when sampled, from a refusal of the check
    /// when watched for one.
    pub details: Option<Box<Details>>,
}

/// The attributes and child spans of a span to export.
#[derive(Debug)]
pub struct Details {
    pub(super) method: Method,
    pub(super) uri: Uri,
    pub(super) host: Option<HeaderValue>,
    pub(super) caller: Option<Identified>,
    /// The check (a store read, or a reservation).
    pub check: Option<Timed>,
    /// The charge after the response.
    pub charge: Option<Timed>,
    /// The upstream call.
    pub upstream: Option<UpstreamCall>,
}

impl Details {
    /// The details of `req` as it arrives.
    pub fn of<B>(req: &http::Request<B>) -> Box<Self> {
        Box::new(Details {
            method: req.method().clone(),
            uri: req.uri().clone(),
            host: req.headers().get(http::header::HOST).cloned(),
            caller: None,
            check: None,
            charge: None,
            upstream: None,
        })
    }

    fn note_caller(&mut self, caller: &crate::identity::Caller) {
        self.caller = Some(Identified {
            id: caller.client.as_ref().map(|c| c.id.clone()),
            ip: caller.ip,
            ip_key: caller.ip_key,
            tier: caller.tier.clone(),
        });
    }
}

impl Recording {
    /// Note the caller the identify phase found: its client id, IP and IP key (hashed,
    /// never sent as they are, unless `log.client_ip = "ip"` shows the IP) and tier.
    pub fn identified(&mut self, caller: &crate::identity::Caller) {
        if let Some(d) = self.details.as_deref_mut() {
            d.note_caller(caller);
        }
    }

    /// The check begins.
    pub fn check_starts(&mut self) {
        if let Some(d) = self.details.as_deref_mut() {
            d.check = Some(Timed::starts());
        }
    }

    /// The check of `req` for `caller` has answered; `admitted`: the request goes on,
    /// so it will not be a refusal. An unsampled request that was not admitted notes
    /// what its span shows now, in case it is a refusal to export.
    #[inline]
    pub fn checked<B>(
        &mut self,
        admitted: bool,
        req: &http::Request<B>,
        caller: &crate::identity::Caller,
    ) {
        if let Some(c) = self.details.as_deref_mut().and_then(|d| d.check.as_mut()) {
            c.end_ns = now_ns();
        }
        if self.refusal_watch {
            self.refusal_watch = false;
            if !admitted {
                let mut d = Details::of(req);
                d.note_caller(caller);
                self.details = Some(d);
            }
        }
    }

    /// Where the check's (`check`) or the charge's store calls are noted: `None` when
    /// the request is not sampled (then nothing is noted).
    pub fn store_note(&mut self, check: bool) -> Option<&mut CallNote> {
        let d = self.details.as_deref_mut()?;
        let span = if check { &mut d.check } else { &mut d.charge };
        span.as_mut().map(|t| &mut t.store)
    }

    /// The charge begins.
    pub fn charge_starts(&mut self) {
        if let Some(d) = self.details.as_deref_mut() {
            d.charge = Some(Timed::starts());
        }
    }

    /// The charge has answered.
    pub fn charged(&mut self) {
        if let Some(c) = self.details.as_deref_mut().and_then(|d| d.charge.as_mut()) {
            c.end_ns = now_ns();
        }
    }

    /// The request goes to `upstream`: put this trace's `traceparent` (parent: the
    /// upstream call's span) and the continued `tracestate` on `headers`, replacing
    /// any the client sent. Whether the call is recorded.
    pub fn to_upstream(
        &mut self,
        upstream: &Arc<str>,
        http2: bool,
        headers: &mut HeaderMap,
    ) -> bool {
        let call_id = context::new_span_id();
        headers.insert(
            &context::TRACEPARENT,
            context::traceparent(&self.trace_id, &call_id, self.sampled),
        );
        if let Some(state) = &self.state {
            headers.insert(&context::TRACESTATE, state.clone());
        }
        let Some(d) = self.details.as_deref_mut() else {
            return false;
        };
        d.upstream = Some(UpstreamCall {
            timed: Timed {
                span_id: call_id,
                start_ns: now_ns(),
                end_ns: 0,
                store: CallNote::default(),
            },
            upstream: Some(upstream.clone()),
            protocol: if http2 { "2" } else { "1.1" },
            attempts: 1,
            ..UpstreamCall::default()
        });
        true
    }

    /// The upstream call has answered (or failed) after `attempts` tries, the last one
    /// to `target`; `retry_ns`: when a second try began (0: none).
    pub fn upstream_done(&mut self, target: Option<&Arc<str>>, attempts: u32, retry_ns: u64) {
        if let Some(u) = self
            .details
            .as_deref_mut()
            .and_then(|d| d.upstream.as_mut())
        {
            u.timed.end_ns = now_ns();
            u.target = target.cloned();
            u.attempts = attempts.max(1);
            u.retry_ns = retry_ns;
        }
    }
}

impl SpanData {
    /// The spans it is exported as: the server span and its children.
    pub fn count(&self) -> u64 {
        1 + u64::from(self.check.is_some())
            + u64::from(self.charge.is_some())
            + u64::from(self.upstream.is_some())
    }
}

/// A finished request's span, handed to the exporter (encoded there, off the request
/// path).
#[derive(Debug)]
pub struct SpanData {
    /// The trace.
    pub trace_id: TraceId,
    /// The server span.
    pub span_id: SpanId,
    /// The remote parent, when continued.
    pub parent: Option<SpanId>,
    /// The continued `tracestate`.
    pub state: Option<HeaderValue>,
    /// Start and end, nanoseconds since the Unix epoch.
    pub start_ns: u64,
    /// End (set when the response has been sent).
    pub end_ns: u64,
    /// `http.request.method`.
    pub method: Method,
    /// The request target (`url.path` is its path).
    pub uri: Uri,
    /// `server.address` (the request's Host, without the port).
    pub host: Option<HeaderValue>,
    /// `http.route`: the route's path prefix.
    pub route: Option<Arc<str>>,
    /// `http.response.status_code`.
    pub status: u16,
    /// `client.address` as `log.client_ip` shows it.
    pub client: Option<String>,
    /// `tollgate.decision`.
    pub decision: &'static str,
    /// `tollgate.limit`, `.quota`, `.remaining`, `.reset` (epoch seconds).
    pub usage: Option<crate::limiter::Usage>,
    /// `tollgate.tier`.
    pub tier: Option<Arc<str>>,
    /// `tollgate.caller.hash`: the keyed digest of the caller.
    pub caller_hash: Option<String>,
    /// `tollgate.cost`: units charged.
    pub cost: u64,
    /// The store's check, the charge and the upstream call: child spans.
    pub check: Option<Timed>,
    /// The charge.
    pub charge: Option<Timed>,
    /// The upstream call.
    pub upstream: Option<UpstreamCall>,
}
