//! `tollgate healthcheck`: probe a running gateway's `GET /healthz` (for container
//! HEALTHCHECKs).

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

/// `tollgate healthcheck`: GET /healthz on the admin listener.
pub(crate) async fn healthcheck(path: &Path, url: Option<String>, timeout: Duration) -> ExitCode {
    let url = match url {
        Some(u) => u,
        None => match super::admin_listen(path, "healthcheck", "--url") {
            Ok(addr) => format!("http://{addr}/healthz"),
            Err(code) => return code,
        },
    };
    let uri: http::Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("tollgate healthcheck: {url:?}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    match tokio::time::timeout(timeout, client.get(uri)).await {
        Ok(Ok(resp)) if resp.status().is_success() => {
            println!("ok: {url} answered {}", resp.status());
            ExitCode::SUCCESS
        }
        Ok(Ok(resp)) => {
            eprintln!("unhealthy: {url} answered {}", resp.status());
            ExitCode::FAILURE
        }
        Ok(Err(e)) => {
            eprintln!("unhealthy: {url}: {e}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("unhealthy: {url}: no answer within {timeout:?}");
            ExitCode::FAILURE
        }
    }
}
