//! gRPC callers get the gateway's own answers (429, 401, 502, ...) as gRPC statuses: a
//! gRPC client reads `grpc-status`, never a JSON body, so an HTTP error with a body
//! reaches its application as a protocol error instead of the refusal it is.

use super::Body;
use http::header::{self, HeaderValue};
use http::{HeaderMap, Response, StatusCode};

static GRPC_STATUS: header::HeaderName = header::HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: header::HeaderName = header::HeaderName::from_static("grpc-message");

/// Whether a request is a gRPC call (`Content-Type: application/grpc`, `+proto` and
/// the like).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// The gRPC status code for the gateway's HTTP status (as gRPC's
/// `http-grpc-status-mapping` reads them, with 429 as `RESOURCE_EXHAUSTED`, what
/// quota refusals are in gRPC).
fn code(status: StatusCode) -> u16 {
    match status.as_u16() {
        400 | 413 | 431 => 3, // INVALID_ARGUMENT
        401 => 16,            // UNAUTHENTICATED
        403 => 7,             // PERMISSION_DENIED
        404 => 12,            // UNIMPLEMENTED
        408 | 504 => 4,       // DEADLINE_EXCEEDED
        429 => 8,             // RESOURCE_EXHAUSTED
        502 | 503 => 14,      // UNAVAILABLE
        _ => 2,               // UNKNOWN
    }
}

/// A gateway error (a JSON answer, or problem details with `headers.problem_details`,
/// with a status that is not 2xx) as a gRPC
/// "trailers-only" response: HTTP 200, `grpc-status` and `grpc-message` (the HTTP
/// status and reason), no body, its other headers (`X-RateLimit-*`, `Retry-After`)
/// kept. Any other response (the upstream's own) is returned as it is.
pub fn gateway_error(response: Response<Body>) -> Response<Body> {
    let status = response.status();
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| {
            v.as_bytes() == b"application/json" || v.as_bytes() == b"application/problem+json"
        });
    if status.is_success() || !json {
        return response;
    }
    let (mut parts, _) = response.into_parts();
    parts.status = StatusCode::OK;
    let h = &mut parts.headers;
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    h.remove(header::CONTENT_LENGTH);
    h.insert(GRPC_STATUS.clone(), HeaderValue::from(code(status)));
    let message = format!(
        "{} {} (tollgate)",
        status.as_u16(),
        status.canonical_reason().unwrap_or("")
    );
    if let Ok(v) = HeaderValue::from_str(&message) {
        h.insert(GRPC_MESSAGE.clone(), v);
    }
    Response::from_parts(parts, crate::response::bytes_body(Vec::new()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_errors_become_grpc_statuses_and_upstream_answers_stay() {
        let mut refused = crate::response::json_response(
            StatusCode::TOO_MANY_REQUESTS,
            &serde_json::json!({"message": "over"}),
        );
        refused
            .headers_mut()
            .insert("x-ratelimit-remaining", HeaderValue::from_static("0"));
        let r = gateway_error(refused);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["grpc-status"], "8");
        assert_eq!(
            r.headers()["grpc-message"],
            "429 Too Many Requests (tollgate)"
        );
        assert_eq!(r.headers()["x-ratelimit-remaining"], "0");
        // With `headers.problem_details`, the same refusal as problem details.
        let u = crate::limiter::Usage {
            resource: "core".into(),
            quota: 10,
            used: 10,
            reset_at_ms: 2_000_000_000_000,
            retry_at_ms: 0,
            blocked_until_ms: 0,
            more_at_ms: 0,
        };
        let styles = crate::proxy::headers::Styles {
            problem_details: true,
            ..Default::default()
        };
        let problem =
            crate::proxy::refusal::over_limit(&u, 3, "acme", styles, std::iter::empty(), 0);
        assert_eq!(
            problem.headers()["content-type"],
            "application/problem+json"
        );
        let r = gateway_error(problem);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["grpc-status"], "8");
        assert_eq!(r.headers()["content-type"], "application/grpc");
        assert_eq!(r.headers()["x-ratelimit-remaining"], "0");
        let unavailable =
            gateway_error(super::super::ProxyError::StoreUnavailable.into_response_with(true));
        assert_eq!(unavailable.headers()["grpc-status"], "14");
        let mut upstream = Response::new(crate::response::bytes_body(Vec::new()));
        *upstream.status_mut() = StatusCode::NOT_FOUND;
        assert_eq!(gateway_error(upstream).status(), StatusCode::NOT_FOUND);
    }
}
