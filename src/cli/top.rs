//! `tollgate top`: who is being limited now, from a running gateway's `GET /top`.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

/// `tollgate top`: GET /top every second, as a table: per limit and caller, refusals a
/// second (since the previous poll), refusals in the current and the previous minute,
/// and the units used and left in the caller's current window (`-`: unknown).
pub(crate) async fn top(path: &Path, admin: Option<String>, n: usize, once: bool) -> ExitCode {
    let admin = match admin {
        Some(a) => a,
        None => match super::admin_listen(path, "top", "--admin") {
            Ok(a) => a,
            Err(code) => return code,
        },
    };
    let url = format!("http://{admin}/top?n={n}");
    let Ok(uri) = url.parse::<http::Uri>() else {
        eprintln!("tollgate top: {admin:?} is not HOST:PORT");
        return ExitCode::FAILURE;
    };
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let mut before: std::collections::HashMap<(String, String), (u64, std::time::Instant)> =
        std::collections::HashMap::new();
    loop {
        use http_body_util::BodyExt;
        let body = match client.get(uri.clone()).await {
            Ok(r) => r.into_body().collect().await.map(|b| b.to_bytes()).ok(),
            Err(e) => {
                eprintln!("tollgate top: {url}: {e}");
                return ExitCode::FAILURE;
            }
        };
        let Some(v) = body.and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        else {
            eprintln!("tollgate top: {url}: not a /top answer");
            return ExitCode::FAILURE;
        };
        let now = std::time::Instant::now();
        let mut out = String::new();
        if !once {
            out.push_str("\x1b[H\x1b[2J");
        }
        out.push_str(&format!(
            "{:<16} {:<32} {:<12} {:>10} {:>10} {:>12} {:>10}\n",
            "LIMIT", "CALLER", "TIER", "REFUSED/S", "REFUSED", "USED", "REMAINING"
        ));
        for limit in v["limits"].as_array().into_iter().flatten() {
            let name = limit["name"].as_str().unwrap_or("");
            // Per caller: tier, refusals, units used and left in its current window.
            type Row = (String, u64, Option<u64>, Option<u64>);
            let mut rows: std::collections::BTreeMap<String, Row> =
                std::collections::BTreeMap::new();
            for (list, refused) in [("refused", true), ("used", false)] {
                for h in limit[list].as_array().into_iter().flatten() {
                    let caller = h["caller"].as_str().unwrap_or("").to_string();
                    let row = rows.entry(caller).or_default();
                    row.0 = h["tier"].as_str().unwrap_or("").to_string();
                    row.2 = row.2.or(h["used"].as_u64());
                    row.3 = row.3.or(h["remaining"].as_u64());
                    if refused {
                        row.1 = h["count"].as_u64().unwrap_or(0);
                    }
                }
            }
            let mut rows: Vec<_> = rows.into_iter().collect();
            rows.sort_by_key(|(_, (_, refused, used, _))| std::cmp::Reverse((*refused, *used)));
            for (caller, (tier, refused, used, remaining)) in rows {
                let key = (name.to_string(), caller.clone());
                let rate = match before.insert(key, (refused, now)) {
                    Some((was, at)) if refused >= was => {
                        (refused - was) as f64 / now.duration_since(at).as_secs_f64().max(0.001)
                    }
                    _ => 0.0,
                };
                let used = used.map_or("-".to_string(), |u| u.to_string());
                let remaining = remaining.map_or("-".to_string(), |r| r.to_string());
                out.push_str(&format!(
                    "{name:<16} {caller:<32} {tier:<12} {rate:>10.1} {refused:>10} {used:>12} {remaining:>10}\n"
                ));
            }
        }
        print!("{out}");
        if once {
            return ExitCode::SUCCESS;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
