#![allow(missing_docs)]
//! tollgate's own work for one proxied request, with no I/O (issue 16: target ≤ 2 µs).
//!
//! `cargo bench --bench own_work` (benches/load.sh runs it and judges the target on
//! `own work/proxied request (memory store, 1 limit)`).
//!
//! One iteration is what `proxy::handle` and `proxy::serve` do for an anonymous caller's
//! `GET` on a route with one limit on the memory store, in their order, minus hyper and
//! the sockets: the in-flight gauge and the request id ([`AccessLog::start`]), the path's
//! normal form, the edge's header rules, the one authority, identity, the access-log
//! decision (`access::enabled`: off at `log.level = "warn"`, as in the load runs), route,
//! upgrade decision, the limiter's applicable (`applicable_to`, answered from the
//! thread's memo for this repeat caller, as in the gateway) + check (`check_or_delay`), the /top
//! sketch (`count_used`), concurrency
//! slots and the pending charge, the headers to the upstream (`to_upstream`, hop-by-hop
//! stripping, `X-Forwarded-*`, `X-Real-IP`, the upstream URI and Host), the upstream
//! latency histogram (`upstream_took` for a response that is already there), the
//! response's hop-by-hop stripping, the cost header, the charge, the rate-limit headers,
//! the request counter and the response's guards, and dropping it all as the end of the
//! response body does.
//!
//! What the public API does not expose is done here the way `proxy::forward` does it
//! (it is private there): `append_forwarded_for` (no `X-Forwarded-For` from the client:
//! the peer's IP, rendered once per connection), `address` (origin-form URI, Host) and
//! `respond` (hop-by-hop stripping of the response, boxing its body).
//! The allocator is the gateway's (mimalloc).
//! Not included: hyper's parsing and writing, the upstream pool and every system call.
//! The request and the upstream's response are built in the untimed setup (hyper parses
//! them in the real path), in the header maps a keep-alive connection recycles, as
//! hyper does (see `Recycled`): the map of the response last sent carries the next
//! request, the map of the request last forwarded the next upstream response.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use std::cell::RefCell;
use std::future::Future;
use std::hint::black_box;
use std::net::IpAddr;
use std::path::Path;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tollgate::clock::{SharedClock, SystemClock};
use tollgate::limiter::{most_constrained, Applied};
use tollgate::metrics::Metrics;
use tollgate::proxy::access::{self, AccessLog, Decision, InFlight};
use tollgate::proxy::headers::Policy;
use tollgate::proxy::Body;

/// What `proxy::handle` hands back with the response ([`tollgate::proxy::Finished`]): the
/// in-flight count and the access line, dropped when the body has been sent.
type Finished = (InFlight, Option<Box<access::AccessLine>>);
use tollgate::snapshot::Snapshot;

/// The gateway's allocator (`src/main.rs`): the bench times the allocations the binary
/// makes, not glibc's.
#[global_allocator]
static GLOBAL: tollgate::alloc::Mimalloc = tollgate::alloc::Mimalloc;

/// A quota no benchmark run can use up, so every request is admitted.
const HUGE_QUOTA: u64 = 1_000_000_000_000_000;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The config of the load runs' `tg_memory` case: memory store, one limit for anonymous
/// callers, one route.
fn snapshot() -> Snapshot {
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\
         [log]\nlevel = \"warn\"\n\
         [store]\nbackend = \"memory\"\n\
         [[upstreams]]\nname = \"nginx\"\ntargets = [\"http://127.0.0.1:9\"]\n\
         [[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = {{ anonymous = {HUGE_QUOTA} }}\n\
         [[routes]]\npath_prefix = \"/\"\nupstream = \"nginx\"\nlimits = [\"core\"]\n"
    );
    let file = tollgate::config::parse(Path::new("bench.toml"), toml)
        .unwrap_or_else(|r| panic!("bench config does not parse:\n{r}"));
    let files = tollgate::load::Loaded::load(&file, None);
    Snapshot::build(&file, &files, None).unwrap_or_else(|r| panic!("bench config is invalid:\n{r}"))
}

/// A request as hyper hands it over (wrk's, plus what a typical client sends), its
/// headers parsed into `map` (see [`Recycled`]).
fn request(map: HeaderMap) -> Request<()> {
    let mut req = Request::new(());
    *req.method_mut() = Method::GET;
    *req.uri_mut() = Uri::from_static("/v1/orders/123?page=2");
    *req.headers_mut() = map;
    let h = req.headers_mut();
    h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
    h.insert(header::USER_AGENT, HeaderValue::from_static("wrk/4.1.0"));
    h.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
    req
}

/// The upstream's response as the pool hands it over (nginx's `return 200 "ok"`), its
/// headers parsed into `map` (see [`Recycled`]).
fn upstream_response(map: HeaderMap) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(Bytes::from_static(b"ok")));
    *res.headers_mut() = map;
    let h = res.headers_mut();
    h.insert(header::SERVER, HeaderValue::from_static("nginx/1.22.1"));
    h.insert(
        header::DATE,
        HeaderValue::from_static("Tue, 14 Nov 2023 22:13:20 GMT"),
    );
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
    h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
    res
}

/// The header maps hyper hands over on a keep-alive connection. hyper's HTTP/1 encoder
/// empties the map of each message it writes and parses the connection's next message
/// into it (`cached_headers` in hyper's `proto::h1::conn`), so a map keeps its capacity:
/// the client connection's next request comes in the map of the response just sent,
/// the upstream connection's next response in the map of the request just forwarded.
/// A fresh map per message would charge the bench two map growths per request that a
/// served connection does not make (its first request aside). Stacks, not one map each:
/// criterion builds a batch of inputs before timing the batch.
#[derive(Default)]
struct Recycled {
    /// Maps of responses sent to the client: the next requests'.
    downstream: RefCell<Vec<HeaderMap>>,
    /// Maps of requests sent upstream: the next upstream responses'.
    upstream: RefCell<Vec<HeaderMap>>,
}

impl Recycled {
    fn take(stack: &RefCell<Vec<HeaderMap>>) -> HeaderMap {
        stack.borrow_mut().pop().unwrap_or_default()
    }

    /// What hyper's encoder does with a message's map once written.
    fn give(stack: &RefCell<Vec<HeaderMap>>, mut map: HeaderMap) {
        map.clear();
        stack.borrow_mut().push(map);
    }
}

/// Run `fut` to completion: polled once in place (the memory store never waits, so
/// that is all it takes, with no runtime hop), else on the runtime.
fn drive<F: Future>(rt: &tokio::runtime::Runtime, fut: F) -> F::Output {
    let mut fut = pin!(fut);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => rt.block_on(fut),
    }
}

/// Everything one request needs that lives longer than the request.
struct Gateway {
    snap: Snapshot,
    metrics: Arc<Metrics>,
    clock: SharedClock,
    delayed: tollgate::limiter::delayed::DelayBudget,
    rt: tokio::runtime::Runtime,
    peer: IpAddr,
    /// The peer's IP as a header value, rendered once per connection (as `Peer` does).
    peer_header: HeaderValue,
    recycled: Recycled,
}

impl Gateway {
    fn new() -> Self {
        let peer: IpAddr = "127.0.0.1".parse().expect("ip");
        let metrics = Metrics::new(Box::new(|| None));
        let delayed = metrics.delay_budget(1024);
        Self {
            snap: snapshot(),
            metrics,
            clock: Arc::new(SystemClock),
            delayed,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime"),
            peer,
            peer_header: HeaderValue::from_str(&peer.to_string()).expect("ip header"),
            recycled: Recycled::default(),
        }
    }

    /// The next request on the client connection, in its recycled map.
    fn request(&self) -> Request<()> {
        request(Recycled::take(&self.recycled.downstream))
    }

    /// The next response on the upstream connection, in its recycled map.
    fn upstream_response(&self) -> Response<Full<Bytes>> {
        upstream_response(Recycled::take(&self.recycled.upstream))
    }

    /// hyper's server has written `response`'s head (keeping its map for the next
    /// request) and the end of its body drops the rest, with the guards.
    fn sent(&self, (response, finished): (Response<Body>, Finished)) {
        let (parts, body) = response.into_parts();
        Recycled::give(&self.recycled.downstream, parts.headers);
        drop(body);
        drop(finished);
    }

    /// One proxied request: `req` in, `upstream` as the upstream's answer; returns the
    /// response as it would go to hyper.
    fn proxied(
        &self,
        mut req: Request<()>,
        upstream: Response<Full<Bytes>>,
    ) -> (Response<Body>, Finished) {
        let gate = self.snap.gate();
        let clock = &*self.clock;
        let metrics = &*self.metrics;

        // proxy::handle
        let in_flight = InFlight::new(&metrics.in_flight);
        let mut log = AccessLog::start(&mut req, metrics);

        // 0. path, edge, authority
        if let Some(normal) = tollgate::proxy::path::normalize(req.uri().path()).expect("path") {
            let pq = match req.uri().query() {
                Some(q) => format!("{normal}?{q}"),
                None => normal,
            };
            *req.uri_mut() = pq.parse().expect("normal path");
        }
        let peer_trusted = gate.identities.trusts(self.peer);
        gate.edge
            .admit(req.headers_mut(), peer_trusted)
            .expect("edge");
        let settled = tollgate::http::authority::settle(&mut req).expect("authority");
        let host = settled
            .as_ref()
            .and_then(tollgate::http::authority::host_name);

        // 1. identity, and what the access line would need
        let caller = gate
            .identities
            .identify_with_cert(req.headers(), self.peer, None)
            .expect("caller");
        if access::enabled() {
            log.client = gate.log_client(caller.ip);
        }
        log.caller = caller.client.as_ref().map(|c| c.id.clone());
        log.set_tier(&caller.tier);
        assert!(
            !(req.method() == Method::GET && gate.rate_limit_path == Some(req.uri().path())),
            "not the rate-limit endpoint"
        );

        // 2. route
        let routing_path = tollgate::http::target::routing_path(req.uri().path());
        let route = match tollgate::http::target::requested(req.headers()) {
            tollgate::http::target::Override::None => {
                gate.router.find(host, &routing_path, req.method())
            }
            _ => panic!("no override headers in the bench request"),
        }
        .expect("route");
        log.route = Some(route.path_prefix.clone());
        let upgrade =
            tollgate::http::upgrade::decide(&req, &route.upgrades).expect("upgrade decision");
        if let Some(max) = route.max_request_bytes {
            let declared = req
                .headers()
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            assert!(declared.is_none_or(|n| n <= max), "not too large");
        }

        // 3. check
        let applied: Arc<[Applied]> =
            gate.limiter
                .applicable_to(&route.limits, &caller, req.headers());
        let reserve = gate.limiter.reserves(route.on_request);
        let now_ms = clock.now_ms();
        let mut ticket = drive(
            &self.rt,
            gate.limiter.check_or_delay(
                &applied,
                route.cost,
                reserve,
                &self.clock,
                &self.delayed,
                now_ms,
                None,
            ),
        )
        .unwrap_or_else(|_| panic!("admitted"));
        gate.limiter
            .count_used(&applied, &caller, route.cost, now_ms);
        if ticket.usages().iter().any(Option::is_none) {
            log.decision = Decision::StoreErrorAllowed;
        }
        assert!(ticket.shadowed().is_empty());
        let slots = ticket.slots();

        // 4. the request as it goes upstream (proxy::forward), and the response back
        gate.identities.to_upstream(&caller, req.headers_mut());
        let (mut parts, ()) = req.into_parts();
        let downstream_version = parts.version;
        let host_value = settled.clone();
        let path = parts.uri.path_and_query().cloned().expect("path and query");
        assert!(!tollgate::http::hop::strip_request_hop_by_hop(
            &mut parts.headers
        ));
        let h = &mut parts.headers;
        assert!(upgrade.is_none());
        if let http::header::Entry::Vacant(v) = h.entry(&X_FORWARDED_FOR) {
            v.insert(self.peer_header.clone());
        }
        if !peer_trusted || !h.contains_key(&X_FORWARDED_PROTO) {
            h.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
        }
        if let Some(host) = &host_value {
            if !peer_trusted || !h.contains_key(&X_FORWARDED_HOST) {
                h.insert(X_FORWARDED_HOST.clone(), host.clone());
            }
        }
        if caller.ip == self.peer {
            h.insert(tollgate::http::X_REAL_IP.clone(), self.peer_header.clone());
        }
        parts.uri = Uri::from(path);
        parts.version = Version::HTTP_11;
        if let Some(host) = host_value {
            parts.headers.insert(header::HOST, host);
        }
        let upstream_req = Request::from_parts(parts, ());
        let upstream_started = std::time::Instant::now();
        black_box(&upstream_req);
        // hyper's client encodes the request and keeps its map for the response.
        Recycled::give(&self.recycled.upstream, upstream_req.into_parts().0.headers);
        let forwarded = upstream;
        log.upstream_took(&route.upstream.name, metrics, upstream_started);
        let (mut parts, body) = forwarded.into_parts();
        parts.version = downstream_version;
        tollgate::http::strip_hop_by_hop(&mut parts.headers);
        let body: Body = body.map_err(|never| match never {}).boxed();
        let mut response = Response::from_parts(parts, body);

        // 5. charge
        let cost = route
            .upstream
            .take_cost(response.headers_mut())
            .unwrap_or(route.cost);
        let now_ms = clock.now_ms();
        let usages = if route.charges(response.status()) && cost > 0 {
            log.cost = cost;
            drive(&self.rt, ticket.charge(cost, now_ms))
        } else {
            ticket.release(now_ms)
        };

        // 6. rate-limit headers
        if let Some(usage) = most_constrained(&usages) {
            tollgate::proxy::headers::put(
                response.headers_mut(),
                gate.headers,
                usage,
                applied.iter().map(Policy::of),
                now_ms,
            );
            log.usage = Some(usage.clone());
        }
        if let Some(guard) = slots {
            response = response.map(|body| tollgate::response::with_guard(body, guard));
        }

        // proxy::handle: count, and the access line (none at warn) to end with the body.
        let line = log.finish(&mut response);
        (response, (in_flight, line.map(Box::new)))
    }
}

fn own_work(c: &mut Criterion) {
    let gw = Gateway::new();
    let _entered = gw.rt.enter();
    assert!(
        !access::enabled(),
        "no tracing subscriber here: access lines are off, as at log.level = \"warn\""
    );

    // The path must be the one claimed: admitted, charged, headers set, counted.
    for i in 1..=3u64 {
        let (response, _finished) = gw.proxied(gw.request(), gw.upstream_response());
        assert_eq!(response.status(), StatusCode::OK);
        let h = response.headers();
        assert_eq!(h["x-ratelimit-limit"], HUGE_QUOTA.to_string().as_str());
        assert_eq!(h["x-ratelimit-used"], i.to_string().as_str());
        assert!(h.contains_key(&access::REQUEST_ID));
        assert!(!h.contains_key(header::CONNECTION), "hop-by-hop stripped");
    }
    let rendered = gw.metrics.render();
    assert!(
        rendered
            .contains("tollgate_requests_total{route=\"/\",status=\"200\",decision=\"allowed\"} 3"),
        "three requests counted:\n{rendered}"
    );

    let mut g = c.benchmark_group("own work");
    g.bench_function("proxied request (memory store, 1 limit)", |b| {
        b.iter_batched(
            || (gw.request(), gw.upstream_response()),
            |(req, up)| gw.sent(black_box(gw.proxied(req, up))),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = own_work
}
criterion_main!(benches);
