//! `FLOOR_CONTRACT=1`: the least work tollgate's contract asks of each proxied request of the
//! load cases, written as directly as it can be, with no configuration, no generality and no
//! other feature: what any gateway that honours the contract would spend, on this machine, on
//! top of hyper (BENCHMARKS.md, issue 16, sixteenth round). Per request:
//!
//! 1. **edge**: the request's hop-by-hop headers go (one pass over its names, as tollgate
//!    makes; the `Connection` list is read when there is one), and a request with two
//!    `Content-Length`s or not one `Host` is answered 400;
//! 2. **identity**: no `Authorization` header, so the caller is the peer's IP (a key, which
//!    this floor does not know, is answered 401);
//! 3. **route**: one route, `/`;
//! 4. **check**: one fixed window of `FLOOR_QUOTA` units (default 10^12) an hour per IP, in
//!    a store every worker shares (16 shards, each a `Mutex<HashMap>`); over it: a 429 with
//!    `Retry-After`, the five `X-RateLimit-*` lines, `X-Request-Id` and a JSON body, all
//!    computed;
//! 5. **forward**: `X-Request-Id` (a process prefix and a counter, as a UUID), `Via`,
//!    `X-Forwarded-For`, `-Proto`, `-Host` and `X-Real-IP` added; one response timeout per
//!    exchange; the upstream's latency observed in a histogram and the request counted;
//! 6. **charge** the window on the shard again once the response head is in;
//! 7. **headers**: the response's hop-by-hop headers go; `X-RateLimit-Limit`, `-Remaining`,
//!    `-Used`, `-Reset` (epoch seconds), `-Resource`, `X-Request-Id` and `Via` are added.
//!
//! Not here, though tollgate does them: access logs (off in the load cases anyway),
//! concurrency accounting across gateways, reloadable configuration, per-label metrics,
//! path normalisation, body limits and timeouts, HTTP/2, TLS.

use http_body_util::{Either, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const WINDOW_MS: u64 = 3_600_000;
const SHARDS: usize = 16;
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(60);
/// Upper bounds of the latency histogram's buckets, in seconds (tollgate's).
const BUCKETS: [f64; 12] = [
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
const LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const USED: HeaderName = HeaderName::from_static("x-ratelimit-used");
const RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
const RESOURCE: HeaderName = HeaderName::from_static("x-ratelimit-resource");
const VIA: HeaderValue = HeaderValue::from_static("1.1 tollgate");

/// A fixed window: units used, and when it ends (epoch milliseconds, stored).
#[derive(Clone, Copy)]
struct Window {
    used: u64,
    reset_at_ms: u64,
}

/// One shard of the windows. Its hasher is a multiply (FxHash's), not SipHash: the floor's
/// least work, not a defence against chosen keys.
type Windows = HashMap<IpAddr, Window, std::hash::BuildHasherDefault<Fx>>;

#[derive(Default)]
struct Fx(u64);

impl std::hash::Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = (self.0.rotate_left(5) ^ u64::from(n)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// What every worker shares: the windows and the metrics.
struct Shared {
    quota: u64,
    shards: Vec<Mutex<Windows>>,
    requests: AtomicU64,
    latency: [AtomicU64; BUCKETS.len() + 1],
    latency_sum_us: AtomicU64,
    next_id: AtomicU64,
    id_prefix: u64,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| Shared {
        quota: std::env::var("FLOOR_QUOTA")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1_000_000_000_000),
        shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        requests: AtomicU64::new(0),
        latency: Default::default(),
        latency_sum_us: AtomicU64::new(0),
        next_id: AtomicU64::new(0),
        // Unique enough per process for a floor: the start time's nanoseconds.
        id_prefix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    })
}

/// `ip`'s window in `map` at `now_ms`: a new one when it has none or the last has ended.
fn live_window(map: &mut Windows, ip: IpAddr, now_ms: u64) -> &mut Window {
    let fresh = Window {
        used: 0,
        reset_at_ms: now_ms + WINDOW_MS,
    };
    let w = map.entry(ip).or_insert(fresh);
    if now_ms >= w.reset_at_ms {
        *w = fresh;
    }
    w
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Shared {
    fn shard(&self, ip: &IpAddr) -> &Mutex<Windows> {
        let h = match ip {
            IpAddr::V4(v4) => u32::from(*v4) as usize,
            IpAddr::V6(v6) => u128::from(*v6) as usize,
        };
        &self.shards[h.wrapping_mul(0x9E37_79B9) >> 7 & (SHARDS - 1)]
    }

    /// The window of `ip` now (a new one when the last has ended), and whether one more
    /// unit fits; nothing is counted.
    fn check(&self, ip: IpAddr, now_ms: u64) -> (Window, bool) {
        let mut map = self.shard(&ip).lock().unwrap_or_else(|e| e.into_inner());
        let w = *live_window(&mut map, ip, now_ms);
        (w, w.used < self.quota)
    }

    /// Count one unit of `ip`'s window; its usage after.
    fn charge(&self, ip: IpAddr, now_ms: u64) -> Window {
        let mut map = self.shard(&ip).lock().unwrap_or_else(|e| e.into_inner());
        let w = live_window(&mut map, ip, now_ms);
        w.used += 1;
        *w
    }

    fn observe(&self, took: Duration) {
        let s = took.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(BUCKETS.len());
        self.latency[i].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_us
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    fn request_id(&self) -> HeaderValue {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut hex = [0u8; 32];
        let digits = b"0123456789abcdef";
        for (i, b) in self
            .id_prefix
            .to_be_bytes()
            .iter()
            .chain(n.to_be_bytes().iter())
            .enumerate()
        {
            hex[2 * i] = digits[(b >> 4) as usize];
            hex[2 * i + 1] = digits[(b & 15) as usize];
        }
        let mut id = [b'-'; 36];
        id[..8].copy_from_slice(&hex[..8]);
        id[9..13].copy_from_slice(&hex[8..12]);
        id[14..18].copy_from_slice(&hex[12..16]);
        id[19..23].copy_from_slice(&hex[16..20]);
        id[24..].copy_from_slice(&hex[20..]);
        HeaderValue::from_maybe_shared(Bytes::from_owner(id))
            .unwrap_or(HeaderValue::from_static("-"))
    }
}

fn number(n: u64) -> HeaderValue {
    let mut buf = itoa::Buffer::new();
    HeaderValue::from_maybe_shared(Bytes::copy_from_slice(buf.format(n).as_bytes()))
        .unwrap_or(HeaderValue::from_static("0"))
}

/// [`number`] from a per-thread memo of the last value in `slot` (0: the quota, 1: the
/// reset), which most responses repeat: shared, not formatted and allocated again.
fn remembered(slot: usize, n: u64) -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<[Option<(u64, HeaderValue)>; 2]> =
            const { std::cell::RefCell::new([None, None]) };
    }
    LAST.with(|last| {
        let last = &mut last.borrow_mut()[slot];
        match last {
            Some((m, v)) if *m == n => v.clone(),
            _ => {
                let v = number(n);
                *last = Some((n, v.clone()));
                v
            }
        }
    })
}

/// Headers that never cross a proxy (RFC 9110 §7.6.1), besides those `Connection` lists.
fn hop_by_hop(name: &HeaderName) -> bool {
    *name == header::CONNECTION
        || *name == header::TE
        || *name == header::TRAILER
        || *name == header::TRANSFER_ENCODING
        || *name == header::UPGRADE
        || *name == header::PROXY_AUTHORIZATION
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Remove the hop-by-hop headers: one pass over the names; then, when the only one is a
/// `Connection` naming no header (`keep-alive`, `close`: what upstream responses carry), its
/// removal alone; else the removals, with whatever `Connection` lists.
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let mut connection = false;
    for name in h.keys() {
        if *name == header::CONNECTION {
            connection = true;
        } else if hop_by_hop(name) {
            return strip_listed(h);
        }
    }
    if !connection {
        return;
    }
    if h.get_all(header::CONNECTION).iter().all(|v| {
        let b = v.as_bytes();
        b.eq_ignore_ascii_case(b"keep-alive") || b.eq_ignore_ascii_case(b"close")
    }) {
        h.remove(header::CONNECTION);
        return;
    }
    strip_listed(h)
}

fn strip_listed(h: &mut HeaderMap) {
    let listed: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in listed {
        h.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        h.remove(name);
    }
}

/// What the contract asks of a request before it is forwarded; `Err`: the answer instead.
pub struct Admitted {
    ip: IpAddr,
    id: HeaderValue,
    started: Instant,
}

/// Steps 1 to 5 on `req` from `peer` (`peer_text`: its address, rendered once per connection).
// An answer is returned at most once per request and moved once: boxing it would add work.
#[allow(clippy::result_large_err)]
pub fn admit<B>(
    req: &mut Request<Incoming>,
    peer: SocketAddr,
    peer_text: &HeaderValue,
) -> Result<Admitted, Response<Either<B, Full<Bytes>>>> {
    let s = shared();
    let h = req.headers_mut();
    // 1. edge
    let mut hosts = h.get_all(header::HOST).iter();
    let one_host = hosts.next().is_some() && hosts.next().is_none();
    if !one_host || h.get_all(header::CONTENT_LENGTH).iter().nth(1).is_some() {
        return Err(plain(
            StatusCode::BAD_REQUEST,
            "{\"message\":\"bad request\"}",
        ));
    }
    strip_hop_by_hop(h);
    // 2. identity
    if h.contains_key(header::AUTHORIZATION) {
        return Err(plain(
            StatusCode::UNAUTHORIZED,
            "{\"message\":\"bad credentials\"}",
        ));
    }
    let ip = peer.ip();
    // 3. route: the one route, `/`.
    // 4. check
    let now = now_ms();
    let (w, fits) = s.check(ip, now);
    let id = s.request_id();
    if !fits {
        return Err(refusal(s.quota, w, now, &id, peer_text));
    }
    // 5. forward: what the upstream is told.
    let host = h.get(header::HOST).cloned();
    h.insert(X_REQUEST_ID, id.clone());
    h.insert(header::VIA, VIA);
    h.append(X_FORWARDED_FOR, peer_text.clone());
    h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    if let Some(host) = host {
        h.insert(X_FORWARDED_HOST, host);
    }
    h.insert(X_REAL_IP, peer_text.clone());
    Ok(Admitted {
        ip,
        id,
        started: Instant::now(),
    })
}

/// The response timeout every exchange runs under.
pub async fn within<F: std::future::Future>(f: F) -> Option<F::Output> {
    tokio::time::timeout(RESPONSE_TIMEOUT, f).await.ok()
}

/// Steps 5 (metrics) to 7 on the upstream's response.
pub fn answered(a: Admitted, h: &mut HeaderMap) {
    let s = shared();
    s.observe(a.started.elapsed());
    let now = now_ms();
    let w = s.charge(a.ip, now);
    strip_hop_by_hop(h);
    put_usage(h, s.quota, w);
    h.insert(X_REQUEST_ID, a.id);
    h.insert(header::VIA, VIA);
}

fn put_usage(h: &mut HeaderMap, quota: u64, w: Window) {
    h.insert(LIMIT, remembered(0, quota));
    h.insert(REMAINING, number(quota.saturating_sub(w.used)));
    h.insert(USED, number(w.used));
    h.insert(RESET, remembered(1, w.reset_at_ms.div_ceil(1000)));
    h.insert(RESOURCE, HeaderValue::from_static("core"));
}

fn plain<B>(status: StatusCode, body: &'static str) -> Response<Either<B, Full<Bytes>>> {
    let mut r = Response::new(Either::Right(Full::new(Bytes::from_static(
        body.as_bytes(),
    ))));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A 429 as the contract has it: `Retry-After`, the usage lines, the request id and a JSON
/// body naming the caller, all from this one read of the window.
fn refusal<B>(
    quota: u64,
    w: Window,
    now_ms: u64,
    id: &HeaderValue,
    peer_text: &HeaderValue,
) -> Response<Either<B, Full<Bytes>>> {
    let retry_after = w.reset_at_ms.saturating_sub(now_ms).div_ceil(1000);
    let caller = peer_text.to_str().unwrap_or("-");
    let body = format!(
        "{{\"message\":\"API rate limit exceeded for {caller}.\",\"limit\":{quota},\"remaining\":{},\"reset\":{},\"resource\":\"core\",\"retry_after\":{retry_after}}}",
        quota.saturating_sub(w.used),
        w.reset_at_ms.div_ceil(1000),
    );
    let mut r = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *r.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::RETRY_AFTER, number(retry_after));
    put_usage(h, quota, w);
    h.insert(X_REQUEST_ID, id.clone());
    r
}
