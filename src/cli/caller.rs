//! `tollgate caller ID`: one caller's limits, from a running gateway's
//! `GET /callers/{id}` (read from the store, nothing charged).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// Where the admin token comes from when `--token-file` is not given.
pub(crate) const TOKEN_ENV: &str = "TOLLGATE_ADMIN_TOKEN";

/// `tollgate caller ID`: GET /callers/{id} on the admin listener with the admin token,
/// printed as a table (or the JSON answer, pretty, with `json`). Exit 1 with a message
/// on any error: no admin listener, no token, no answer, or a status other than 200.
pub(crate) async fn caller(
    path: &Path,
    id: &str,
    admin: Option<String>,
    token_file: Option<PathBuf>,
    json: bool,
) -> ExitCode {
    let admin = match admin {
        Some(a) => a,
        None => match super::admin_listen(path, "caller", "--admin") {
            Ok(a) => a,
            Err(code) => return code,
        },
    };
    let token = match &token_file {
        Some(f) => match std::fs::read_to_string(f) {
            Ok(t) => t.trim().to_string(),
            Err(e) => {
                eprintln!("tollgate caller: {}: {e}", f.display());
                return ExitCode::FAILURE;
            }
        },
        None => std::env::var(TOKEN_ENV).unwrap_or_default(),
    };
    if token.is_empty() {
        eprintln!(
            "tollgate caller: no admin token: set ${TOKEN_ENV} or pass --token-file (the token whose SHA-256 is server.admin_token_sha256)"
        );
        return ExitCode::FAILURE;
    }
    let url = format!("http://{admin}/callers/{}", encode_segment(id));
    let req = match http::Request::get(&url)
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tollgate caller: {admin:?} is not HOST:PORT ({e})");
            return ExitCode::FAILURE;
        }
    };
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        use http_body_util::BodyExt;
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, body))
    })
    .await;
    let (status, body) = match answer {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => {
            eprintln!("tollgate caller: {url}: {e}");
            return ExitCode::FAILURE;
        }
        Err(_) => {
            eprintln!("tollgate caller: {url}: no answer within 10s");
            return ExitCode::FAILURE;
        }
    };
    let v = serde_json::from_slice::<serde_json::Value>(&body).ok();
    if status != http::StatusCode::OK {
        let message = v.as_ref().and_then(|v| v["message"].as_str()).map_or_else(
            || String::from_utf8_lossy(&body).into_owned(),
            str::to_string,
        );
        eprintln!("tollgate caller: {url} answered {status}: {message}");
        return ExitCode::FAILURE;
    }
    let Some(v) = v else {
        eprintln!("tollgate caller: {url}: not a /callers answer");
        return ExitCode::FAILURE;
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        print!("{}", table(&v));
    }
    ExitCode::SUCCESS
}

/// `id` as one path segment: every byte but unreserved characters (and `:`, for IPv6
/// addresses) percent-encoded.
fn encode_segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b':') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The answer as text: a line for the caller, then one row per limit (`-` where the
/// window is unknown).
fn table(v: &serde_json::Value) -> String {
    let s = |v: &serde_json::Value| match v {
        serde_json::Value::Null => "-".to_string(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut out = format!(
        "caller {} (tier {}{})\n",
        s(&v["caller"]),
        s(&v["tier"]),
        if v["anonymous"] == true {
            ", anonymous"
        } else {
            ""
        }
    );
    out.push_str(&format!(
        "{:<16} {:<14} {:<12} {:>10} {:>10} {:>10} {:>12} {:>8} {:>7} {:>13}\n",
        "LIMIT",
        "ALGORITHM",
        "BY",
        "QUOTA",
        "USED",
        "REMAINING",
        "RESET",
        "WINDOW",
        "LEASES",
        "BLOCKED_UNTIL"
    ));
    for l in v["limits"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{:<16} {:<14} {:<12} {:>10} {:>10} {:>10} {:>12} {:>8} {:>7} {:>13}\n",
            s(&l["name"]),
            s(&l["algorithm"]),
            s(&l["by"]),
            s(&l["quota"]),
            s(&l["used"]),
            s(&l["remaining"]),
            s(&l["reset"]),
            s(&l["window"]),
            s(&l["leases"]),
            s(&l["blocked_until"]),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_one_encoded_segment() {
        assert_eq!(encode_segment("acme"), "acme");
        assert_eq!(encode_segment("a/b c"), "a%2Fb%20c");
        assert_eq!(encode_segment("2001:db8::1"), "2001:db8::1");
        assert_eq!(encode_segment("café"), "caf%C3%A9");
    }

    #[test]
    fn the_table_has_a_row_per_limit() {
        let v = serde_json::json!({
            "caller": "acme", "anonymous": false, "tier": "gold",
            "limits": [
                {"name": "core", "algorithm": "fixed_window", "by": "caller", "quota": 5,
                 "used": 2, "remaining": 3, "reset": 1700000000, "window": 3600,
                 "blocked_until": 1700000900, "leases": 0},
                {"name": "perip", "algorithm": "fixed_window", "by": "ip", "quota": 100,
                 "used": null, "remaining": null, "reset": null, "window": 3600,
                 "blocked_until": null, "leases": 0},
            ],
        });
        let t = table(&v);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "caller acme (tier gold)");
        assert!(lines[2].starts_with("core ") && lines[2].contains(" 1700000000 "));
        assert!(lines[1].ends_with(" BLOCKED_UNTIL"), "{}", lines[1]);
        assert!(lines[2].ends_with(" 1700000900"), "{}", lines[2]);
        assert!(lines[3].starts_with("perip ") && lines[3].contains(" - "));
    }
}
