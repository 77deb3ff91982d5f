//! The admin listener (`server.admin_listen`):
//!
//! - `GET /healthz`: 200 while the process serves (liveness).
//! - `GET /readyz`: 200 when a config is loaded and every shard's primary is reachable
//!   (connected, breaker not open) and takes writes; 503 otherwise. JSON with per-shard
//!   state, and each unready shard's reason in `unready`.
//! - `GET /metrics`: Prometheus text format ([`crate::metrics`]).
//! - `GET /config`: the active config as JSON, secrets and key hashes redacted (`[server]`
//!   and `[log]` as they run, with reloaded values that wait for a restart under
//!   `pending_restart`), with its
//!   generation and content hash.
//! - `GET /top[?n=N]`: who is being limited now ([`top_view`]).
//! - `GET /callers/{id}`: every limit that applies to one caller, read from the store
//!   without charging, with `server.admin_token_sha256` ([`callers`]).
//! - `POST /callers/{id}/reset[?limit=NAME]`: clear a client's windows, with
//!   `server.admin_token_sha256` ([`write`]).

mod callers;
mod write;

use crate::limiter::store::StoreStatus;
use crate::metrics::Metrics;
use crate::response::{json_response, Body};
use crate::snapshot::Snapshot;
use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Serve the admin endpoints on `listener` until `shutdown` fires; then stop accepting
/// and let open connections finish their requests (up to `grace`), like the proxy
/// listener.
pub(crate) async fn serve(
    listener: TcpListener,
    snapshot: Arc<ArcSwap<Snapshot>>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10));
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let (snapshot, metrics) = (snapshot.clone(), metrics.clone());
                let service = service_fn(move |req: Request<Incoming>| {
                    let (snapshot, metrics) = (snapshot.clone(), metrics.clone());
                    async move {
                        let snap = snapshot.load_full();
                        let path = req.uri().path();
                        if write::is_write(path) {
                            let (method, query) = (req.method(), req.uri().query());
                            return Ok::<_, Infallible>(
                                write::handle(method, path, query, req.headers(), &snap, peer).await,
                            );
                        }
                        if path.starts_with("/callers/") {
                            let (method, query) = (req.method(), req.uri().query());
                            return Ok(
                                callers::handle(method, path, query, req.headers(), &snap, peer).await,
                            );
                        }
                        if path == "/top" && matches!(*req.method(), Method::GET | Method::HEAD) {
                            let n = top_n(req.uri().query());
                            let now_ms = std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .map_or(0, |d| d.as_millis() as u64);
                            return Ok(json_response(StatusCode::OK, &top_view(&snap, n, now_ms).await));
                        }
                        Ok(route(&req, &snap, &metrics))
                    }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            _ = shutdown.changed() => break,
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(grace, graceful.shutdown()).await;
}

fn route(req: &Request<Incoming>, snap: &Snapshot, metrics: &Metrics) -> Response<Body> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({ "message": "use GET" }),
        );
    }
    match req.uri().path() {
        "/healthz" => json_response(StatusCode::OK, &json!({ "status": "ok" })),
        "/readyz" => readyz(snap),
        "/metrics" => {
            let mut r = Response::new(
                Full::new(Bytes::from(metrics.render()))
                    .map_err(|never| match never {})
                    .boxed(),
            );
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        "/config" => json_response(StatusCode::OK, &config_view(snap)),
        _ => json_response(
            StatusCode::NOT_FOUND,
            &json!({ "message": "not found; try /healthz, /readyz, /metrics, /config, /top, GET /callers/{id}, POST /callers/{id}/reset" }),
        ),
    }
}

/// `?n=N` of `GET /top`: callers per list, 1 to 100, default 10.
fn top_n(query: Option<&str>) -> usize {
    query
        .unwrap_or("")
        .split('&')
        .find_map(|p| p.strip_prefix("n="))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(10)
        .clamp(1, 100)
}

/// `GET /top`: per limit (in config order), the `n` callers with the most refusals and
/// the `n` callers with the most units used in their current window:
/// `{"since": S, "limits": [{"name": "core", "refused": [{"caller": "acme", "tier":
/// "gold", "count": 1234, "error": 0, "quota": 5000, "used": 5000, "remaining": 0,
/// "reset": R}], "used": [...]}]}`.
///
/// - `count` and `error` come from this gateway's bounded heavy-hitters sketch and cover
///   the current and the previous minute (since `since`, epoch seconds): in `refused`,
///   the caller's refusals by the limit; in `used`, the units it was admitted. `error`
///   bounds how much of `count` may belong to callers the sketch forgot.
/// - `quota`, `used`, `remaining` and `reset` are the caller's current window of the
///   limit in the store at `now_ms` (epoch milliseconds), as its `X-RateLimit-*`
///   headers would show them (`reset`: epoch seconds; with Redis, the whole fleet's
///   numbers): one read per shard for the whole answer. They are `null` when the store
///   did not answer or the caller's window cannot be told from the sketch (a limit by
///   header, or by IP for an identified caller).
///
/// The candidates of the `used` list are the sketch's heaviest callers of the last
/// minutes (up to `4n`), ranked by `used` in their current window (callers whose window
/// is unknown after the others, by `count`). Anonymous callers appear as the access
/// log shows them (`log.client_ip`: the keyed hash, or the IP).
pub async fn top_view(snap: &Snapshot, n: usize, now_ms: u64) -> Value {
    use crate::limiter::top::{Hitter, Who};
    use crate::limiter::Usage;
    let now_s = now_ms / 1000;
    let candidates = n.saturating_mul(4).min(400);
    let mut top = snap.limiter.top().top(candidates, now_s);
    let gate = snap.gate();
    // Each limit's two lists, and the window of each caller in them, read at once.
    let lists: Vec<(&std::sync::Arc<crate::limiter::Limit>, [Vec<Hitter>; 2])> = snap
        .limits
        .iter()
        .map(|l| {
            let mut t = top.remove(&l.name).unwrap_or_default();
            t.refused.truncate(n);
            (l, [t.refused, t.used])
        })
        .collect();
    let mut applied = Vec::new();
    let windows: Vec<Option<usize>> = lists
        .iter()
        .flat_map(|(l, both)| both.iter().flatten().map(move |h| (l, h)))
        .map(|(l, h)| {
            let a = snap.limiter.applied_for(l, &h.who, &h.tier)?;
            applied.push(a);
            Some(applied.len() - 1)
        })
        .collect();
    let usages = snap.limiter.peek(&applied, now_ms).await;
    let mut windows = windows.into_iter();
    let mut with_usage = |list: Vec<Hitter>| -> Vec<(Hitter, Option<Usage>)> {
        list.into_iter()
            .map(|h| {
                let usage = windows
                    .next()
                    .flatten()
                    .and_then(|i| usages.get(i).cloned().flatten());
                (h, usage)
            })
            .collect()
    };
    let render = |list: &[(Hitter, Option<Usage>)]| -> Vec<Value> {
        list.iter()
            .map(|(h, usage)| {
                let caller = match &h.who {
                    Who::Client(c) => c.id.to_string(),
                    Who::Ip(ip) => gate
                        .log_client(*ip)
                        .unwrap_or_else(|| snap.limiter.ip_hash(*ip)),
                };
                json!({
                    "caller": caller,
                    "tier": &*h.tier,
                    "count": h.count,
                    "error": h.error,
                    "quota": usage.as_ref().map(|u| u.quota),
                    "used": usage.as_ref().map(|u| u.used),
                    "remaining": usage.as_ref().map(|u| u.remaining()),
                    "reset": usage.as_ref().map(|u| u.reset_epoch_s()),
                })
            })
            .collect()
    };
    let mut limits = Vec::with_capacity(lists.len());
    for (l, [refused, used]) in lists {
        let refused = with_usage(refused);
        let mut used = with_usage(used);
        // By units used in the current window; unknown windows last, by recent count.
        used.sort_by_key(|(h, u)| std::cmp::Reverse((u.as_ref().map(|u| u.used), h.count)));
        used.truncate(n);
        limits.push(json!({
            "name": &*l.name,
            "refused": render(&refused),
            "used": render(&used),
        }));
    }
    json!({ "since": (now_s / 60).saturating_sub(1) * 60, "limits": limits })
}

/// Readiness and per-shard state.
pub fn readiness(snap: &Snapshot) -> (bool, Value) {
    let store: &dyn StoreStatus = &**snap.limiter.store();
    let ready = store.ready();
    let shards: Vec<Value> = store
        .report()
        .iter()
        .map(|s| {
            let nodes: Vec<Value> = s
                .nodes
                .iter()
                .map(|n| {
                    let mut node = json!({
                        "role": n.role,
                        "addr": n.addr,
                        "connected": n.connected,
                        "serving": n.serving,
                        "breaker": n.breaker.as_str(),
                    });
                    // Cluster mode: the master's hash slots.
                    if let (Some(slots), Some(map)) = (&n.slots, node.as_object_mut()) {
                        map.insert("slots".into(), json!(slots));
                    }
                    node
                })
                .collect();
            json!({
                "shard": s.index,
                "nodes": nodes,
                "replica_fallbacks": s.replica_fallbacks,
                "writable": s.writable,
                "unready": crate::limiter::store::shard_unready(s),
            })
        })
        .collect();
    let body = json!({
        "ready": ready,
        "generation": snap.generation,
        "store": store.kind(),
        "shards": shards,
    });
    (ready, body)
}

fn readyz(snap: &Snapshot) -> Response<Body> {
    let (ready, body) = readiness(snap);
    json_response(
        if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        &body,
    )
}

/// The active config with secrets and key hashes replaced by `"<redacted>"`.
pub fn config_view(snap: &Snapshot) -> Value {
    let mut config = serde_json::to_value(&snap.config).unwrap_or(Value::Null);
    // `[server]` and `[log]` as they run; the file's values, when a reload changed them,
    // wait for a restart and are shown apart.
    let (server, log) = &*snap.running;
    // The admin token reloads: it runs as the file has it.
    let server = crate::config::ServerConfig {
        admin_token_sha256: snap.config.server.admin_token_sha256.clone(),
        ..server.clone()
    };
    let mut pending = serde_json::Map::new();
    for (section, running, in_file) in [
        (
            "server",
            serde_json::to_value(&server),
            serde_json::to_value(&snap.config.server),
        ),
        (
            "log",
            serde_json::to_value(log),
            serde_json::to_value(&snap.config.log),
        ),
    ] {
        let (Ok(running), Ok(in_file)) = (running, in_file) else {
            continue;
        };
        if running != in_file {
            pending.insert(section.into(), in_file);
        }
        config[section] = running;
    }
    let mut pending = Value::Object(pending);
    redact(&mut config);
    redact(&mut pending);
    json!({
        "generation": snap.generation,
        "content_hash": snap.content_hash,
        "config": config,
        "pending_restart": pending,
    })
}

const REDACTED: &str = "<redacted>";

fn redact(v: &mut Value) {
    // The collector's headers (`tracing.headers`) carry its credentials: every value is
    // a secret.
    if let Some(Value::Object(headers)) = v.get_mut("tracing").and_then(|t| t.get_mut("headers")) {
        headers
            .values_mut()
            .for_each(|v| *v = Value::String(REDACTED.into()));
    }
    match v {
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                if matches!(
                    k.as_str(),
                    "key_sha256"
                        | "hash_key"
                        | "key"
                        | "secret"
                        | "password"
                        | "sentinel_password"
                        | "admin_token_sha256"
                ) {
                    if !v.is_null() {
                        *v = Value::String(REDACTED.into());
                    }
                } else {
                    redact(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        Value::String(s) if s.contains("://") => *s = crate::config::redact_url(s),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_secrets() {
        let mut v = json!({
            "identity": { "clients": [{ "id": "a", "key_sha256": "ab" }] },
            "store": { "hash_key": "s", "shards": [{ "primary": "redis://u:pw@h:1" }] },
            "tracing": { "headers": { "authorization": "Bearer t0ken" }, "service_name": "gw" },
        });
        redact(&mut v);
        assert_eq!(v["tracing"]["headers"]["authorization"], REDACTED);
        assert_eq!(v["tracing"]["service_name"], "gw");
        assert_eq!(v["identity"]["clients"][0]["key_sha256"], REDACTED);
        assert_eq!(v["store"]["hash_key"], REDACTED);
        assert_eq!(
            v["store"]["shards"][0]["primary"],
            "redis://u:<redacted>@h:1"
        );
        assert_eq!(v["identity"]["clients"][0]["id"], "a");
    }

    #[test]
    fn redacts_the_jwt_secret_and_odd_redis_passwords() {
        let mut v = json!({
            "identity": { "jwt": { "secret": "hmac-secret-0123456789", "algorithms": ["HS256"] } },
            "store": { "shards": [
                { "primary": "redis://:p@ss@h:1" },
                { "primary": "redis://h:2?password=pw" },
            ] },
        });
        redact(&mut v);
        assert_eq!(v["identity"]["jwt"]["secret"], REDACTED);
        assert_eq!(v["identity"]["jwt"]["algorithms"][0], "HS256");
        let text = v.to_string();
        assert!(!text.contains("ss@h") && !text.contains("=pw"), "{text}");
    }

    /// Redis passwords written inline never show; the `_file` keys show their paths
    /// (the secrets are in the files, which `GET /config` does not read).
    #[test]
    fn redacts_redis_passwords_and_shows_secret_file_paths() {
        let mut v = json!({
            "store": {
                "username": "tollgate",
                "password": "data-pw",
                "sentinel_password": "sentinel-pw",
                "password_file": "redis-password",
                "hash_key_file": "hash-key",
                "tls": { "ca": "ca.pem", "client_key": "client.key" },
            },
        });
        redact(&mut v);
        assert_eq!(v["store"]["password"], REDACTED);
        assert_eq!(v["store"]["sentinel_password"], REDACTED);
        assert_eq!(v["store"]["username"], "tollgate");
        assert_eq!(v["store"]["password_file"], "redis-password");
        assert_eq!(v["store"]["hash_key_file"], "hash-key");
        // A path, not a key.
        assert_eq!(v["store"]["tls"]["client_key"], "client.key");
        let text = v.to_string();
        assert!(
            !text.contains("data-pw") && !text.contains("sentinel-pw"),
            "{text}"
        );
    }
}
