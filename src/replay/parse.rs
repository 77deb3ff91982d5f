//! Access log lines → requests: tollgate's own access lines (`log.format = "text"` or
//! `"json"`) and nginx's `combined` format, recognised line by line.
//!
//! - tollgate text: `2026-11-24T11:07:45.961756Z  INFO tollgate::access: request
//!   method=GET path="/a" route="/" status=200 client="…" caller="acme" tier="default"
//!   … cost=1 … total_ms=4.249 …`. The timestamp is when the line was written (the end
//!   of the response); the request began `total_ms` before it.
//! - tollgate JSON: the same fields in one object (`"timestamp"`, `"target"`, …).
//! - nginx `combined`: `ADDR - USER [24/Nov/2026:11:01:21 +0000] "GET /a HTTP/1.1" 200
//!   123 "REFERER" "USER_AGENT"`; the caller is the address. A custom `log_format` may
//!   add one quoted field, the caller id (e.g. `"$http_x_caller_id"`, `"-"` for none),
//!   and then `$request_time` (seconds), which gives the request's duration.
//!
//! Other lines of tollgate's log (other targets) are [`Parsed::Other`]; anything else
//! is an error (counted and shown by the replay, never fatal).

pub use super::time::{parse_nginx_time, parse_rfc3339_ms};

use std::borrow::Cow;

/// One request read from a log line. Strings borrow from the line where they can.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line<'a> {
    /// When the request began, ms since the Unix epoch (the line's time less the
    /// request's duration when the log has it).
    pub start_ms: u64,
    /// How long the request took, ms (`total_ms`, nginx `$request_time`), when logged.
    pub duration_ms: Option<u64>,
    /// The request method, e.g. `GET`.
    pub method: Cow<'a, str>,
    /// The path, without the query string.
    pub path: Cow<'a, str>,
    /// The response status.
    pub status: u16,
    /// The client as logged: its address or its keyed hash; `None` when not logged.
    pub client: Option<Cow<'a, str>>,
    /// The client id; `None` for an anonymous caller.
    pub caller: Option<Cow<'a, str>>,
    /// The caller's tier, when logged.
    pub tier: Option<Cow<'a, str>>,
    /// tollgate's decision (`allowed`, `rejected`, …), when logged.
    pub decision: Option<Cow<'a, str>>,
    /// Units the gateway charged (tollgate lines with a `cost` field).
    pub cost: Option<u64>,
    /// The limit the gateway reported (tollgate lines), e.g. `failed_auth` for a
    /// refusal of repeated unknown keys.
    pub limit: Option<Cow<'a, str>>,
}

/// What a log line holds.
// Nearly every line is a request: boxing it would allocate once per line, for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// A request.
    Request(Line<'a>),
    /// tollgate held back this many access lines of refused requests (its per-second
    /// line budget): those requests are missing from the log.
    HeldBack(u64),
    /// A tollgate log line that is not an access line, or an empty line.
    Other,
}

/// Why a line could not be read.
pub type ParseError = &'static str;

/// Read one line (without its line end), recognising its format.
///
/// Errors: a short reason when the line is none of the formats, or a field is missing
/// or malformed.
pub fn parse_line(line: &str) -> Result<Parsed<'_>, ParseError> {
    let line = line.trim_end_matches(['\r', '\n']);
    let b = line.as_bytes();
    if line.trim().is_empty() {
        return Ok(Parsed::Other);
    }
    if b[0] == b'{' {
        return parse_json(line);
    }
    if b.len() > 20 && b[4] == b'-' && b[10] == b'T' {
        return parse_text(line);
    }
    parse_nginx(line)
}

/// `total_ms` / `$request_time` → whole ms (rounded up: a request that took 0.2 ms
/// still held its slot).
fn duration_ms(ms: f64) -> Option<u64> {
    (ms.is_finite() && ms >= 0.0).then(|| ms.ceil() as u64)
}

fn none_if_dash(v: Cow<'_, str>) -> Option<Cow<'_, str>> {
    (v != "-" && !v.is_empty()).then_some(v)
}

/// The caller as logged: `anonymous` is no client; `-` (an unknown key) too.
fn caller_of(v: Cow<'_, str>) -> Option<Cow<'_, str>> {
    none_if_dash(v).filter(|v| v != "anonymous")
}

const ACCESS: &str = "tollgate::access";

fn parse_text(line: &str) -> Result<Parsed<'_>, ParseError> {
    let (ts, rest) = line.split_once(' ').ok_or("no timestamp")?;
    let end_ms = parse_rfc3339_ms(ts).ok_or("bad timestamp")?;
    let rest = rest.trim_start();
    // The level, then the target.
    let (_level, rest) = rest.split_once(' ').ok_or("no level")?;
    let rest = rest.trim_start();
    let (target, rest) = rest.split_once(": ").ok_or("no target")?;
    if target != ACCESS {
        return Ok(Parsed::Other);
    }
    let Some(fields) = rest.strip_prefix("request ") else {
        if let Some(at) = rest.find(" held_back=") {
            let n = rest[at + 11..].split(' ').next().unwrap_or("");
            return n.parse().map(Parsed::HeldBack).map_err(|_| "bad held_back");
        }
        return Err("an access line that is not a request");
    };
    let mut l = Fields::default();
    let mut s = fields;
    while !s.is_empty() {
        let (key, after) = s.split_once('=').ok_or("a field without `=`")?;
        let key = key.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            let (v, n) = quoted(q).ok_or("an unterminated quoted value")?;
            (v, n)
        } else {
            match after.split_once(' ') {
                Some((v, n)) => (Cow::Borrowed(v), n),
                None => (Cow::Borrowed(after), ""),
            }
        };
        l.set(key, value);
        s = next.trim_start();
    }
    l.finish(end_ms)
}

/// A Rust-`Debug`-quoted string's content (after its opening quote), unescaped, and
/// what follows its closing quote.
fn quoted(s: &str) -> Option<(Cow<'_, str>, &str)> {
    let b = s.as_bytes();
    let close = memchr_quote(b)?;
    if !s[..close].contains('\\') {
        return Some((Cow::Borrowed(&s[..close]), &s[close + 1..]));
    }
    let mut out = String::with_capacity(close);
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((Cow::Owned(out), &s[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => out.push('\n'),
                'r' => out.push('\r'),
                't' => out.push('\t'),
                '0' => out.push('\0'),
                'u' => {
                    // \u{XXXX}
                    let rest = &s[i + 2..];
                    let end = rest.find('}')?;
                    let code = u32::from_str_radix(rest.get(1..end)?, 16).ok()?;
                    out.push(char::from_u32(code)?);
                    for _ in 0..=end {
                        chars.next();
                    }
                }
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

/// The index of the first `"` not escaped by a backslash.
fn memchr_quote(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// The fields of a tollgate access line, as they are read.
#[derive(Default)]
struct Fields<'a> {
    method: Option<Cow<'a, str>>,
    path: Option<Cow<'a, str>>,
    status: Option<u16>,
    client: Option<Cow<'a, str>>,
    caller: Option<Cow<'a, str>>,
    tier: Option<Cow<'a, str>>,
    decision: Option<Cow<'a, str>>,
    cost: Option<u64>,
    limit: Option<Cow<'a, str>>,
    total_ms: Option<f64>,
    bad: bool,
}

impl<'a> Fields<'a> {
    fn set(&mut self, key: &str, value: Cow<'a, str>) {
        match key {
            "method" => self.method = Some(value),
            "path" => self.path = Some(value),
            "status" => match value.parse() {
                Ok(s) => self.status = Some(s),
                Err(_) => self.bad = true,
            },
            "client" => self.client = Some(value),
            "caller" => self.caller = Some(value),
            "tier" => self.tier = Some(value),
            "decision" => self.decision = Some(value),
            "cost" => self.cost = value.parse().ok(),
            "limit" => self.limit = Some(value),
            "total_ms" => self.total_ms = value.parse().ok(),
            _ => {}
        }
    }

    fn finish(self, end_ms: u64) -> Result<Parsed<'a>, ParseError> {
        if self.bad {
            return Err("bad status");
        }
        let duration_ms = self.total_ms.and_then(duration_ms);
        Ok(Parsed::Request(Line {
            start_ms: end_ms.saturating_sub(duration_ms.unwrap_or(0)),
            duration_ms,
            method: self.method.ok_or("no method")?,
            path: self.path.ok_or("no path")?,
            status: self.status.ok_or("no status")?,
            client: self.client.and_then(none_if_dash),
            caller: self.caller.and_then(caller_of),
            tier: self.tier.and_then(none_if_dash),
            decision: self.decision,
            cost: self.cost,
            limit: self.limit.and_then(none_if_dash),
        }))
    }
}

#[derive(serde::Deserialize)]
struct JsonLine<'a> {
    #[serde(borrow)]
    timestamp: Option<Cow<'a, str>>,
    #[serde(borrow)]
    target: Option<Cow<'a, str>>,
    #[serde(borrow)]
    message: Option<Cow<'a, str>>,
    #[serde(borrow)]
    method: Option<Cow<'a, str>>,
    #[serde(borrow)]
    path: Option<Cow<'a, str>>,
    status: Option<u16>,
    #[serde(borrow)]
    client: Option<Cow<'a, str>>,
    #[serde(borrow)]
    caller: Option<Cow<'a, str>>,
    #[serde(borrow)]
    tier: Option<Cow<'a, str>>,
    #[serde(borrow)]
    decision: Option<Cow<'a, str>>,
    cost: Option<u64>,
    #[serde(borrow)]
    limit: Option<Cow<'a, str>>,
    total_ms: Option<f64>,
    held_back: Option<u64>,
}

fn parse_json(line: &str) -> Result<Parsed<'_>, ParseError> {
    let j: JsonLine<'_> = serde_json::from_str(line).map_err(|_| "not a JSON object")?;
    if j.target.as_deref() != Some(ACCESS) {
        return Ok(Parsed::Other);
    }
    if let Some(n) = j.held_back {
        return Ok(Parsed::HeldBack(n));
    }
    if j.message.as_deref().is_some_and(|m| m != "request") {
        return Err("an access line that is not a request");
    }
    let end_ms =
        parse_rfc3339_ms(j.timestamp.as_deref().ok_or("no timestamp")?).ok_or("bad timestamp")?;
    Fields {
        method: j.method,
        path: j.path,
        status: j.status,
        client: j.client,
        caller: j.caller,
        tier: j.tier,
        decision: j.decision,
        cost: j.cost,
        limit: j.limit,
        total_ms: j.total_ms,
        bad: false,
    }
    .finish(end_ms)
}

/// The next `"…"` field of an nginx line (nginx escapes `"` inside as `\x22`) and what
/// follows it.
fn nginx_quoted(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start().strip_prefix('"')?;
    let end = s.find('"')?;
    Some((&s[..end], &s[end + 1..]))
}

fn parse_nginx(line: &str) -> Result<Parsed<'_>, ParseError> {
    let (addr, rest) = line.split_once(' ').ok_or("not an access line")?;
    let open = rest.find('[').ok_or("not a known access log format")?;
    let rest = &rest[open + 1..];
    let close = rest.find(']').ok_or("no closing `]` after the time")?;
    let end_ms = parse_nginx_time(&rest[..close]).ok_or("bad time")?;
    let (request, rest) = nginx_quoted(&rest[close + 1..]).ok_or("no quoted request")?;
    let mut parts = request.split(' ');
    let method = parts.next().filter(|m| !m.is_empty()).ok_or("no method")?;
    let target = parts.next().ok_or("no request target")?;
    let path = target.split('?').next().unwrap_or(target);
    let mut rest = rest.trim_start();
    let (status, after) = rest.split_once(' ').unwrap_or((rest, ""));
    let status: u16 = status.parse().map_err(|_| "bad status")?;
    rest = after.trim_start();
    // $body_bytes_sent
    rest = rest.split_once(' ').map_or("", |(_, r)| r);
    // "$http_referer" "$http_user_agent", then an optional caller field and
    // $request_time.
    let (_, rest) = nginx_quoted(rest).ok_or("no quoted referer")?;
    let (_, rest) = nginx_quoted(rest).ok_or("no quoted user agent")?;
    let (caller, rest) = match nginx_quoted(rest) {
        Some((c, r)) => (caller_of(Cow::Borrowed(c)), r),
        None => (None, rest),
    };
    let duration = match rest.trim() {
        "" => None,
        t => Some(
            t.parse::<f64>()
                .ok()
                .and_then(|s| duration_ms(s * 1000.0))
                .ok_or("bad $request_time after the quoted fields")?,
        ),
    };
    Ok(Parsed::Request(Line {
        start_ms: end_ms.saturating_sub(duration.unwrap_or(0)),
        duration_ms: duration,
        method: Cow::Borrowed(method),
        path: Cow::Borrowed(path),
        status,
        client: Some(Cow::Borrowed(addr)),
        caller,
        tier: None,
        decision: None,
        cost: None,
        limit: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(line: &str) -> Line<'_> {
        match parse_line(line) {
            Ok(Parsed::Request(l)) => l,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tollgate_text_line() {
        let l = request(
            r#"2026-11-24T11:07:45.961756Z  INFO tollgate::access: request method=GET path="/a%20b\"c" route="/" status=502 client="945c" caller="acme" tier="gold" key="-" decision="allowed" limit="core" remaining=3 cost=2 upstream_ms=3.664 total_ms=4.249 request_id="c5""#,
        );
        assert_eq!(l.start_ms, 1_795_518_465_961 - 5);
        assert_eq!(l.duration_ms, Some(5));
        assert_eq!(l.path, "/a%20b\"c");
        assert_eq!(l.status, 502);
        assert_eq!(l.caller.as_deref(), Some("acme"));
        assert_eq!(l.tier.as_deref(), Some("gold"));
        assert_eq!(l.cost, Some(2));
        let other = "2026-11-24T11:07:44.906922Z  INFO tollgate::server: tollgate listening listen=127.0.0.1:18931 tls=false";
        assert_eq!(parse_line(other), Ok(Parsed::Other));
        let held = r#"2026-11-24T11:07:44.906922Z  WARN tollgate::access: access lines held back: more than 100 a second of this decision decision="rejected" held_back=7"#;
        assert_eq!(parse_line(held), Ok(Parsed::HeldBack(7)));
    }

    #[test]
    fn tollgate_json_line() {
        let l = request(
            r#"{"timestamp":"2026-11-24T11:07:45.961Z","level":"INFO","method":"POST","path":"/x","route":"/","status":429,"client":"-","caller":"anonymous","decision":"rejected","total_ms":0.5,"message":"request","target":"tollgate::access"}"#,
        );
        assert_eq!(l.start_ms, 1_795_518_465_960);
        assert_eq!(l.method, "POST");
        assert_eq!(l.caller, None);
        assert_eq!(l.client, None);
        assert_eq!(l.decision.as_deref(), Some("rejected"));
    }

    #[test]
    fn nginx_combined_line() {
        let l = request(
            r#"192.0.2.7 - - [24/Nov/2026:12:07:45 +0100] "GET /v1/x?k=secret HTTP/1.1" 200 12 "-" "curl/8""#,
        );
        assert_eq!(l.start_ms, 1_795_518_465_000);
        assert_eq!(l.path, "/v1/x");
        assert_eq!(l.client.as_deref(), Some("192.0.2.7"));
        assert_eq!(l.caller, None);
        let l = request(
            r#"192.0.2.7 - - [24/Nov/2026:11:07:45 +0000] "GET / HTTP/1.1" 404 0 "-" "ua" "acme" 0.250"#,
        );
        assert_eq!(l.caller.as_deref(), Some("acme"));
        assert_eq!(l.duration_ms, Some(250));
        assert_eq!(l.start_ms, 1_795_518_464_750);
    }

    #[test]
    fn escaped_values_are_unescaped() {
        let (v, rest) = quoted(r#"a\"b\\c\u{7f}d\te" next"#).unwrap();
        assert_eq!(v, "a\"b\\c\u{7f}d\te");
        assert_eq!(rest, " next");
        assert_eq!(quoted(r#"\u{zz}""#), None);
        assert_eq!(quoted(r#"open"#), None);
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(parse_line("hello world").is_err());
        assert!(parse_line("{\"target\":").is_err());
        assert!(parse_line(
            "2026-11-24T11:07:45.961756Z  INFO tollgate::access: request method=GET status=abc"
        )
        .is_err());
    }
}
