//! Spans into the OTLP protobuf messages (the official definitions of the
//! `opentelemetry-proto` crate), encoded in the exporter's task, never on the request
//! path. Attributes follow the HTTP semantic conventions; tollgate's own are
//! `tollgate.*`.

use super::span::{SpanData, Timed, UpstreamCall};
use crate::limiter::store::call::NodeRole;
use crate::limiter::store::CallNote;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::span::{Event, SpanKind};
use opentelemetry_proto::tonic::trace::v1::{status, ResourceSpans, ScopeSpans, Span, Status};
use prost::Message;

/// The span flags' "sampled" bit (W3C trace flags in the low byte).
const SAMPLED: u32 = 1;
/// The flags' bits that say whether the parent is remote (OTLP 1.4).
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// The protobuf body of one export request carrying `spans` of service
/// `service_name`: an `ExportTraceServiceRequest` with one `ResourceSpans` holding one
/// `ScopeSpans`. Each span is encoded once, as its own message, straight into the
/// `ScopeSpans`' repeated `spans` field; the three enclosing messages are written around
/// them with their lengths (encoding the whole request as one message would have prost
/// measure each span again at every level of nesting: the exporter's instructions per
/// span fell by about a third).
pub fn request(service_name: &str, spans: impl ExactSizeIterator<Item = SpanData>) -> Vec<u8> {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
    // ScopeSpans.spans (2), each a length-delimited Span: a request's spans take about
    // 1.5 KB, so the buffer rarely grows.
    let mut spans_bytes = Vec::with_capacity(spans.len() * 1536);
    let mut out = Vec::with_capacity(4);
    for s in spans {
        span_into(s, &mut out);
        for span in out.drain(..) {
            prost::encoding::message::encode(2, &span, &mut spans_bytes);
        }
    }
    let scope = ScopeSpans {
        scope: Some(InstrumentationScope {
            name: "tollgate".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            ..InstrumentationScope::default()
        }),
        spans: Vec::new(),
        schema_url: String::new(),
    }
    .encode_to_vec();
    let scope_len = scope.len() + spans_bytes.len();
    let resource = ResourceSpans {
        resource: Some(Resource {
            attributes: vec![
                text("service.name", service_name),
                text("service.version", env!("CARGO_PKG_VERSION")),
            ],
            ..Resource::default()
        }),
        scope_spans: Vec::new(),
        schema_url: String::new(),
    }
    .encode_to_vec();
    // ResourceSpans.scope_spans (2) after the resource.
    let resource_len =
        resource.len() + key_len(2) + encoded_len_varint(scope_len as u64) + scope_len;
    let mut body = Vec::with_capacity(resource_len + 16);
    // ExportTraceServiceRequest.resource_spans (1).
    encode_key(1, WireType::LengthDelimited, &mut body);
    encode_varint(resource_len as u64, &mut body);
    body.extend_from_slice(&resource);
    encode_key(2, WireType::LengthDelimited, &mut body);
    encode_varint(scope_len as u64, &mut body);
    body.extend_from_slice(&scope);
    body.extend_from_slice(&spans_bytes);
    body
}

/// The server span of `s` and its children, appended to `out`.
fn span_into(s: SpanData, out: &mut Vec<Span>) {
    let trace_id = s.trace_id.to_vec();
    let server_id = s.span_id.to_vec();
    let path = s.uri.path();
    let mut attributes = vec![
        text("http.request.method", s.method.as_str()),
        text("url.path", path),
        int("http.response.status_code", i64::from(s.status)),
        text("tollgate.decision", s.decision),
    ];
    if let Some(route) = &s.route {
        attributes.push(text("http.route", route));
    }
    // The Host header, else (HTTP/2) the request's authority.
    let host = s.host.as_ref().and_then(crate::http::authority::host_name);
    if let Some(host) = host.or(s.uri.host()) {
        attributes.push(text("server.address", host));
    }
    if let Some(client) = &s.client {
        attributes.push(text("client.address", client));
    }
    if let Some(u) = &s.usage {
        attributes.push(text("tollgate.limit", &u.resource));
        attributes.push(int("tollgate.quota", u.quota as i64));
        attributes.push(int("tollgate.remaining", u.remaining() as i64));
        attributes.push(int("tollgate.reset", u.reset_epoch_s() as i64));
    }
    if let Some(tier) = &s.tier {
        attributes.push(text("tollgate.tier", tier));
    }
    if let Some(hash) = &s.caller_hash {
        attributes.push(text("tollgate.caller.hash", hash));
    }
    if s.cost > 0 {
        attributes.push(int("tollgate.cost", s.cost as i64));
    }
    let name = match &s.route {
        Some(route) => format!("{} {route}", s.method),
        None => s.method.to_string(),
    };
    let remote = s.parent.is_some();
    out.push(Span {
        trace_id: trace_id.clone(),
        span_id: server_id.clone(),
        trace_state: s
            .state
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string(),
        parent_span_id: s.parent.map(|p| p.to_vec()).unwrap_or_default(),
        flags: SAMPLED | HAS_IS_REMOTE | if remote { IS_REMOTE } else { 0 },
        name,
        kind: SpanKind::Server as i32,
        start_time_unix_nano: s.start_ns,
        end_time_unix_nano: s.end_ns,
        attributes,
        status: (s.status >= 500).then(|| Status {
            message: String::new(),
            code: status::StatusCode::Error as i32,
        }),
        ..Span::default()
    });
    let child = |name: &str, t: &Timed, kind: SpanKind, attributes: Vec<KeyValue>| Span {
        trace_id: trace_id.clone(),
        span_id: t.span_id.to_vec(),
        parent_span_id: server_id.clone(),
        flags: SAMPLED | HAS_IS_REMOTE,
        name: name.into(),
        kind: kind as i32,
        start_time_unix_nano: t.start_ns,
        end_time_unix_nano: t.end_ns.max(t.start_ns),
        attributes,
        ..Span::default()
    };
    for (name, t) in [("check", &s.check), ("charge", &s.charge)] {
        if let Some(t) = t {
            let mut span = child(name, t, SpanKind::Internal, store(&t.store));
            span.events = store_events(&t.store);
            out.push(span);
        }
    }
    if let Some(u) = &s.upstream {
        let mut span = child("upstream", &u.timed, SpanKind::Client, upstream(u, &s));
        if u.retry_ns > 0 {
            span.events.push(Event {
                time_unix_nano: u.retry_ns,
                name: "retry".into(),
                attributes: vec![text(
                    "tollgate.retry.reason",
                    "failed before the request was sent",
                )],
                dropped_attributes_count: 0,
            });
        }
        out.push(span);
    }
}

/// The attributes of a check or charge span: its (first) store call's shard, node,
/// script and batch, and how many calls it made.
fn store(n: &CallNote) -> Vec<KeyValue> {
    let Some(c) = &n.first else {
        // Nothing asked of the store (answered from the over-limit cache, a lease held
        // here, or the recent-charge view).
        return vec![int("tollgate.store.calls", 0)];
    };
    let mut a = vec![
        text(
            "db.system.name",
            if c.node == NodeRole::Memory {
                "tollgate"
            } else {
                "redis"
            },
        ),
        text("tollgate.store.node", &n.node),
        text("tollgate.store.role", c.node.as_str()),
        text("tollgate.store.script", c.script.as_str()),
        int("tollgate.store.batch.operations", i64::from(c.operations)),
        int("tollgate.store.batch.requests", i64::from(c.requests)),
        int("tollgate.store.calls", i64::from(n.calls)),
    ];
    if c.node != NodeRole::Memory {
        a.push(text("tollgate.store.shard", &c.shard.to_string()));
    }
    a
}

/// The events of a check or charge span: each breaker its calls found open, and the
/// lease refill.
fn store_events(n: &CallNote) -> Vec<Event> {
    let mut events: Vec<Event> = n
        .breakers
        .iter()
        .map(|b| Event {
            time_unix_nano: b.at_ns,
            name: "breaker_open".into(),
            attributes: vec![
                text("tollgate.store.shard", &b.shard.to_string()),
                text("tollgate.store.node", &b.node),
                text(
                    "tollgate.breaker.cause",
                    if b.opened { "opened" } else { "refused" },
                ),
            ],
            dropped_attributes_count: 0,
        })
        .collect();
    if let Some(l) = &n.lease {
        events.push(Event {
            time_unix_nano: l.at_ns,
            name: "lease_refill".into(),
            attributes: vec![
                int("tollgate.lease.wanted", l.wanted as i64),
                int("tollgate.lease.granted", l.granted as i64),
            ],
            dropped_attributes_count: 0,
        });
    }
    events
}

/// The attributes of an upstream call.
fn upstream(u: &UpstreamCall, s: &SpanData) -> Vec<KeyValue> {
    let mut a = vec![
        text("http.request.method", s.method.as_str()),
        text("network.protocol.version", u.protocol),
        int("tollgate.upstream.attempts", i64::from(u.attempts)),
    ];
    if let Some(name) = &u.upstream {
        a.push(text("tollgate.upstream", name));
    }
    if let Some(target) = &u.target {
        match target.rsplit_once(':') {
            Some((host, port)) if port.parse::<u16>().is_ok() => {
                a.push(text("server.address", host.trim_matches(['[', ']'])));
                a.push(int("server.port", port.parse::<i64>().unwrap_or(0)));
            }
            _ => a.push(text("server.address", target)),
        }
    }
    a
}

fn text(key: &str, value: &str) -> KeyValue {
    attribute(key, any_value::Value::StringValue(value.into()))
}

fn int(key: &str, value: i64) -> KeyValue {
    attribute(key, any_value::Value::IntValue(value))
}

fn attribute(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(value) }),
        ..KeyValue::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;

    fn span(path: &str) -> SpanData {
        SpanData {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent: Some([3; 8]),
            state: None,
            start_ns: 10,
            end_ns: 20,
            method: http::Method::GET,
            uri: path.parse().unwrap(),
            host: None,
            route: Some("/".into()),
            status: 200,
            client: None,
            decision: "allowed",
            usage: None,
            tier: Some("anonymous".into()),
            caller_hash: None,
            cost: 1,
            check: Some(Timed {
                span_id: [4; 8],
                start_ns: 11,
                end_ns: 12,
                store: CallNote::default(),
            }),
            charge: None,
            upstream: None,
        }
    }

    #[test]
    fn the_framed_request_is_the_messages_own_encoding() {
        let body = request("svc", [span("/a"), span("/b")].into_iter());
        let decoded = ExportTraceServiceRequest::decode(&body[..]).unwrap();
        // Byte for byte what prost writes for the whole message.
        assert_eq!(decoded.encode_to_vec(), body);
        let spans = &decoded.resource_spans[0].scope_spans[0].spans;
        assert_eq!(spans.len(), 4);
        assert_eq!(spans[0].name, "GET /");
        assert_eq!(spans[1].name, "check");
        assert_eq!(spans[1].parent_span_id, vec![2; 8]);
        assert_eq!(spans[2].trace_id, vec![1; 16]);
    }
}
