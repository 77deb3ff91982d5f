//! W3C Trace Context Level 1: the `traceparent` and `tracestate` request headers, read
//! strictly and written for the upstream, and new trace and span ids.

use http::{HeaderMap, HeaderName, HeaderValue};

/// `traceparent`: version, trace id, parent span id and flags.
pub static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// `tracestate`: vendors' entries, carried unchanged when a trace is continued.
pub static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The longest `tracestate` carried on, bytes (the spec's 32 entries fit in 512
/// characters as vendors are asked to keep them); a longer one is dropped.
pub const MAX_TRACESTATE: usize = 512;

/// A trace id: 16 bytes, never all zero.
pub type TraceId = [u8; 16];
/// A span id: 8 bytes, never all zero.
pub type SpanId = [u8; 8];

/// An incoming trace context that was read whole and valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    /// The trace it belongs to.
    pub trace_id: TraceId,
    /// The caller's span, the parent of tollgate's.
    pub span_id: SpanId,
    /// The caller sampled the trace (flag `01`).
    pub sampled: bool,
    /// Its `tracestate`, when there was exactly one field of at most
    /// [`MAX_TRACESTATE`] bytes.
    pub state: Option<HeaderValue>,
}

/// Remove the trace context from `headers` and return it when
/// `continued` (the peer is trusted with it) and it is valid (see [`read`]).
pub fn take(headers: &mut HeaderMap, continued: bool) -> Option<Parent> {
    // Most requests carry neither: a plain lookup each (an entry would reserve room).
    let parent = match headers.contains_key(&TRACEPARENT) {
        false => None,
        true => {
            let parent = continued.then(|| read(headers)).flatten();
            headers.remove(&TRACEPARENT);
            parent
        }
    };
    if headers.contains_key(&TRACESTATE) {
        headers.remove(&TRACESTATE);
    }
    parent
}

/// The trace context of `headers`, or `None` when there is none or it is not exactly
/// one well-formed version-00 `traceparent` (lowercase hex, ids not all zero).
pub fn read(headers: &HeaderMap) -> Option<Parent> {
    let mut values = headers.get_all(&TRACEPARENT).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let (trace_id, span_id, flags) = parse(value.as_bytes())?;
    let mut states = headers.get_all(&TRACESTATE).iter();
    let state = match (states.next(), states.next()) {
        (Some(s), None) if s.len() <= MAX_TRACESTATE && !s.is_empty() => Some(s.clone()),
        _ => None,
    };
    Some(Parent {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
        state,
    })
}

/// `00-TRACEID-SPANID-FLAGS` (55 bytes) into its parts.
fn parse(v: &[u8]) -> Option<(TraceId, SpanId, u8)> {
    if v.len() != 55 || &v[..3] != b"00-" || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let mut trace_id = [0u8; 16];
    let mut span_id = [0u8; 8];
    let mut flags = [0u8; 1];
    hex_into(&v[3..35], &mut trace_id)?;
    hex_into(&v[36..52], &mut span_id)?;
    hex_into(&v[53..55], &mut flags)?;
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some((trace_id, span_id, flags[0]))
}

/// Lowercase hex digits into bytes; `None` for anything else (uppercase included, as
/// the spec requires).
fn hex_into(hex: &[u8], out: &mut [u8]) -> Option<()> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(())
}

/// `bytes` as lowercase hex into `out` (twice as long).
pub fn hex_write(bytes: &[u8], out: &mut [u8]) {
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair.copy_from_slice(&HEX_PAIRS[usize::from(*b)]);
    }
}

/// Each byte's two lowercase hex digits (one lookup per byte instead of two).
static HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut t = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = [DIGITS[i >> 4], DIGITS[i & 15]];
        i += 1;
    }
    t
};

/// The `traceparent` value for a request whose parent span is `span_id` in `trace_id`.
pub fn traceparent(trace_id: &TraceId, span_id: &SpanId, sampled: bool) -> HeaderValue {
    let mut v = *b"00-00000000000000000000000000000000-0000000000000000-00";
    hex_write(trace_id, &mut v[3..35]);
    hex_write(span_id, &mut v[36..52]);
    if sampled {
        v[54] = b'1';
    }
    // Built from hex digits and dashes only: always a valid value.
    HeaderValue::from_bytes(&v).unwrap_or(HeaderValue::from_static(""))
}

/// A new trace id from the thread's generator (never all zero).
pub fn new_trace_id() -> TraceId {
    loop {
        let id = fastrand::u128(..).to_be_bytes();
        if id != [0; 16] {
            return id;
        }
    }
}

/// A new span id from the thread's generator (never all zero).
pub fn new_span_id() -> SpanId {
    loop {
        let id = fastrand::u64(..).to_be_bytes();
        if id != [0; 8] {
            return id;
        }
    }
}

/// Ids as lowercase hex, written without allocating (`%` in a log line).
#[derive(Debug, Clone, Copy)]
pub struct Hex<'a>(pub &'a [u8]);

impl std::fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut buf = [0u8; 32];
        let n = self.0.len().min(16);
        hex_write(&self.0[..n], &mut buf[..2 * n]);
        f.write_str(std::str::from_utf8(&buf[..2 * n]).unwrap_or("-"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(parent: &str, state: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.append(&TRACEPARENT, HeaderValue::from_str(parent).unwrap());
        for s in state {
            h.append(&TRACESTATE, HeaderValue::from_str(s).unwrap());
        }
        h
    }

    #[test]
    fn a_valid_traceparent_is_read_and_written_back_the_same() {
        let text = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let p = read(&with(text, &["congo=t61rcWkgMzE"])).unwrap();
        assert!(p.sampled);
        assert_eq!(p.state.unwrap(), "congo=t61rcWkgMzE");
        assert_eq!(traceparent(&p.trace_id, &p.span_id, true), text);
        assert_eq!(
            Hex(&p.trace_id).to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(!read(&with(unsampled, &[])).unwrap().sampled);
    }

    #[test]
    fn a_malformed_traceparent_is_ignored() {
        for bad in [
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "",
        ] {
            assert_eq!(read(&with(bad, &[])), None, "{bad}");
        }
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut two = with(good, &[]);
        two.append(&TRACEPARENT, HeaderValue::from_static(good));
        assert_eq!(read(&two), None);
        let long = "a=".to_string() + &"b".repeat(MAX_TRACESTATE);
        assert_eq!(read(&with(good, &[&long])).unwrap().state, None);
        assert_eq!(read(&with(good, &["a=1", "b=2"])).unwrap().state, None);
    }

    #[test]
    fn new_ids_are_never_zero_and_differ() {
        assert_ne!(new_trace_id(), new_trace_id());
        assert_ne!(new_span_id(), [0; 8]);
    }
}
