//! The bodies of the gateway's 429: the default (GitHub-style) JSON, written by hand,
//! and RFC 9457 problem details (`headers.problem_details`).

use crate::limiter::Usage;
use http::StatusCode;

/// The 429 body, byte for byte what serde_json writes for a struct of these fields:
/// `{"message":"API rate limit exceeded for CALLER.","limit":QUOTA,"remaining":0,
/// "reset":EPOCH_S,"resource":"NAME","retry_after":SECONDS}`. Written by hand because
/// a refused caller may send thousands of requests a second: about a third of the
/// instructions of the serializer, whose per-byte escaping dominated a 429's own work
/// (callgrind, BENCHMARKS.md).
pub(in crate::proxy) fn over_limit_body(
    usage: &Usage,
    retry_after_s: u64,
    caller: &str,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + caller.len() + usage.resource.len());
    let mut n = itoa::Buffer::new();
    out.extend_from_slice(b"{\"message\":\"API rate limit exceeded for ");
    push_json_text(&mut out, caller);
    out.extend_from_slice(b".\",\"limit\":");
    out.extend_from_slice(n.format(usage.quota).as_bytes());
    out.extend_from_slice(b",\"remaining\":0,\"reset\":");
    out.extend_from_slice(n.format(usage.reset_epoch_s()).as_bytes());
    out.extend_from_slice(b",\"resource\":\"");
    push_json_text(&mut out, &usage.resource);
    out.extend_from_slice(b"\",\"retry_after\":");
    out.extend_from_slice(n.format(retry_after_s).as_bytes());
    out.push(b'}');
    out
}

/// `Content-Type` of a problem-details body (RFC 9457), `headers.problem_details`.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The problem type of a caller over a quota, as draft-ietf-httpapi-ratelimit-headers
/// defines it (its "Quota Exceeded" problem type).
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// The draft's title for [`QUOTA_EXCEEDED`] (its example spells "satisifed"; the
/// spelling is corrected here).
pub const QUOTA_EXCEEDED_TITLE: &str =
    "Request cannot be satisfied as assigned quota has been exceeded";

/// The problem type of a server that cannot serve the request for now, as the draft
/// defines it (its "Temporary Reduced Capacity" problem type): a failed store.
pub const TEMPORARY_REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// The draft's title for [`TEMPORARY_REDUCED_CAPACITY`] (spelling corrected as for
/// [`QUOTA_EXCEEDED_TITLE`]).
pub const TEMPORARY_REDUCED_CAPACITY_TITLE: &str =
    "Request cannot be satisfied due to temporary server capacity constraints";

/// The 429 body as RFC 9457 problem details (`headers.problem_details = true`): the
/// draft's `quota-exceeded` type and title, `status`, the default body's message as
/// `detail`, the draft's `violated-policies` (the limit's name, as `RateLimit-Policy`
/// names it), then the default body's members as extension members. Written by
/// serde_json: a choice off the default path, which [`over_limit_body`] keeps.
pub(in crate::proxy) fn over_limit_problem_body(
    usage: &Usage,
    retry_after_s: u64,
    caller: &str,
) -> Vec<u8> {
    let detail = format!("API rate limit exceeded for {caller}.");
    let body = OverLimitProblem {
        kind: QUOTA_EXCEEDED,
        title: QUOTA_EXCEEDED_TITLE,
        status: StatusCode::TOO_MANY_REQUESTS.as_u16(),
        detail: &detail,
        violated_policies: [&usage.resource],
        limit: usage.quota,
        remaining: 0,
        reset: usage.reset_epoch_s(),
        resource: &usage.resource,
        retry_after: retry_after_s,
    };
    // Serializing a struct of plain fields cannot fail.
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The members of [`over_limit_problem_body`], in order.
#[derive(serde::Serialize)]
struct OverLimitProblem<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    title: &'static str,
    status: u16,
    detail: &'a str,
    #[serde(rename = "violated-policies")]
    violated_policies: [&'a str; 1],
    limit: u64,
    remaining: u64,
    reset: u64,
    resource: &'a str,
    retry_after: u64,
}

/// The members of a problem-details body without extension members.
#[derive(serde::Serialize)]
pub(super) struct Problem<'a> {
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) title: &'static str,
    pub(super) status: u16,
    pub(super) detail: &'a str,
}

/// Append `s` to a JSON string being written (without the quotes), escaped as
/// serde_json escapes it: text with nothing to escape (no `"`, `\\` or control
/// character, the usual case) is copied as it is; any other goes through serde_json.
fn push_json_text(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.extend_from_slice(s.as_bytes());
        return;
    }
    let start = out.len();
    if serde_json::to_writer(&mut *out, s).is_ok() && out.len() >= start + 2 {
        // Drop the quotes serde_json put around it.
        out.remove(start);
        out.pop();
    } else {
        out.truncate(start);
    }
}

#[cfg(test)]
mod tests {
    use super::super::ProxyError;
    use super::*;
    use http::header;
    use std::sync::Arc;

    /// The 429 body's fields, in order, as serde_json would serialize them.
    #[derive(serde::Serialize)]
    struct OverLimitBody<'a> {
        message: &'a str,
        limit: u64,
        remaining: u64,
        reset: u64,
        resource: &'a str,
        retry_after: u64,
    }

    /// What serde_json writes for a 429's body.
    fn serialized(usage: &Usage, retry_after_s: u64, caller: &str) -> Vec<u8> {
        let message = format!("API rate limit exceeded for {caller}.");
        serde_json::to_vec(&OverLimitBody {
            message: &message,
            limit: usage.quota,
            remaining: 0,
            reset: usage.reset_epoch_s(),
            resource: &usage.resource,
            retry_after: retry_after_s,
        })
        .expect("serializes")
    }

    #[test]
    fn the_problem_details_429_body_has_the_drafts_members_and_the_default_bodys() {
        for (caller, resource) in [
            ("127.0.0.1", "core"),
            ("client \"quoted\"", "back\\slash"),
            ("caf\u{e9}", "per-minute"),
        ] {
            let usage = Usage {
                resource: Arc::from(resource),
                quota: 5000,
                used: 5001,
                reset_at_ms: 1_767_225_600_123,
                retry_at_ms: 0,
                blocked_until_ms: 0,
                more_at_ms: 0,
            };
            let body = over_limit_problem_body(&usage, 42, caller);
            let v: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
            let want = serde_json::json!({
                "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
                "title": "Request cannot be satisfied as assigned quota has been exceeded",
                "status": 429,
                "detail": format!("API rate limit exceeded for {caller}."),
                "violated-policies": [resource],
                "limit": 5000,
                "remaining": 0,
                "reset": usage.reset_epoch_s(),
                "resource": resource,
                "retry_after": 42,
            });
            assert_eq!(v, want, "caller {caller:?}, resource {resource:?}");
            // Exactly these members (the comparison above), `type` first.
            assert!(String::from_utf8_lossy(&body).starts_with("{\"type\":"));
        }
    }

    #[tokio::test]
    async fn a_failed_store_answers_problem_details_only_when_asked() {
        use http_body_util::BodyExt;
        let plain = ProxyError::StoreUnavailable.into_response_with(false);
        assert_eq!(plain.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(plain.headers()[header::CONTENT_TYPE], "application/json");
        let body = plain.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], br#"{"message":"rate limit store unavailable"}"#);

        let problem = ProxyError::StoreUnavailable.into_response_with(true);
        assert_eq!(problem.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            problem.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        assert_eq!(problem.headers().len(), 1);
        let body = problem.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
        assert_eq!(
            v,
            serde_json::json!({
                "type": "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity",
                "title": "Request cannot be satisfied due to temporary server capacity constraints",
                "status": 503,
                "detail": "rate limit store unavailable",
            })
        );

        // Other answers keep their JSON.
        let other = ProxyError::NoRoute.into_response_with(true);
        assert_eq!(other.headers()[header::CONTENT_TYPE], "application/json");
    }

    #[test]
    fn the_429_body_is_what_serde_json_writes_for_any_caller_and_limit_name() {
        for (caller, resource) in [
            ("127.0.0.1", "core"),
            ("2001:db8::1", "per-minute"),
            ("client \"quoted\"", "back\\slash"),
            ("tab\there\nnewline\u{1}", "ctl\u{1f}"),
            ("caf\u{e9} \u{1F600}", "r\u{e9}sum\u{e9}"),
            ("", ""),
            ("del\u{7f}", "\"\""),
        ] {
            let usage = Usage {
                resource: Arc::from(resource),
                quota: 5000,
                used: 5001,
                reset_at_ms: 1_767_225_600_123,
                retry_at_ms: 0,
                blocked_until_ms: 0,
                more_at_ms: 0,
            };
            for retry in [0, 1, 3600, u64::MAX] {
                let ours = over_limit_body(&usage, retry, caller);
                let theirs = serialized(&usage, retry, caller);
                assert_eq!(
                    String::from_utf8_lossy(&ours),
                    String::from_utf8_lossy(&theirs),
                    "caller {caller:?}, resource {resource:?}"
                );
                let v: serde_json::Value = serde_json::from_slice(&ours).expect("valid JSON");
                assert_eq!(
                    v["message"],
                    format!("API rate limit exceeded for {caller}.")
                );
                assert_eq!(v["resource"], resource);
            }
        }
    }
}
