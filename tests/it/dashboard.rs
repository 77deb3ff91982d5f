//! The shipped dashboard and alerts against a live gateway: every metric name that
//! `config/grafana/tollgate.json` and `config/prometheus/alerts.yml` use appears in a real
//! `/metrics` scrape (TLS, a Redis store, an auth callout, 429s, shadow refusals,
//! reloads), the dashboard is importable (a `${DS_PROMETHEUS}` input on every panel, and
//! PromQL that `promtool` accepts), and `tollgate_tls_cert_not_after_seconds` shows each
//! served certificate's real notAfter, through reloads.

use crate::support;
use crate::support::{get, RedisServer, TestGateway, Upstream};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, ServerName};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const DASHBOARD: &str = include_str!("../../config/grafana/tollgate.json");
const ALERTS: &str = include_str!("../../config/prometheus/alerts.yml");

/// 2030-01-01T00:00:00Z, 2031-05-17T00:00:00Z, 2032-02-29T00:00:00Z as UTC epoch seconds.
const JAN_2030: i64 = 1_893_456_000;
const MAY_2031: i64 = 1_936_742_400;
const FEB_2032: i64 = 1_961_625_600;

/// A test CA and the leaf certificates it signs.
struct Ca {
    issuer: Issuer<'static, KeyPair>,
    der: CertificateDer<'static>,
}

impl Ca {
    fn new() -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "dashboard test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Ca {
            der: cert.der().clone(),
            issuer: Issuer::new(params, key),
        }
    }

    /// Write a certificate for `host` valid until `(year, month, day)` (midnight UTC) as
    /// `dir/NAME.pem` and its key as `dir/NAME.key`; returns the certificate's path.
    fn write_leaf(&self, dir: &Path, name: &str, host: &str, until: (i32, u8, u8)) -> PathBuf {
        let mut params = CertificateParams::new(vec![host.to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, host);
        params.not_after = rcgen::date_time_ymd(until.0, until.1, until.2);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let (c, k) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        c
    }
}

/// `GET path` over TLS (SNI `localhost`, HTTP/1.1) with extra headers: the status.
async fn https_get(addr: SocketAddr, ca: &Ca, path: &str, headers: &[(&str, &str)]) -> u16 {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der.clone()).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("TLS handshake");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = Request::get(path).header("host", "localhost");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = sender
        .send_request(req.body(Empty::<Bytes>::new()).unwrap())
        .await
        .expect("response");
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    status
}

/// A gateway with TLS (`cert`, and `sni` as `(host, cert)` pairs; keys beside them),
/// an admin listener, one per_core worker, the `store` table, an auth service at
/// `auth_url`, an enforcing limit `core` (3 a minute for anonymous callers) and a shadow
/// limit `shadow` (1 a minute).
fn config(
    up: &Upstream,
    cert: &Path,
    sni: &[(&str, &Path)],
    store: &str,
    auth_url: &str,
) -> String {
    let key = |c: &Path| c.with_extension("key").display().to_string();
    let mut sni_tables = String::new();
    for (host, c) in sni {
        sni_tables.push_str(&format!(
            "[[server.tls.sni]]\nhost = \"{host}\"\ncert = \"{}\"\nkey = \"{}\"\n\n",
            c.display(),
            key(c)
        ));
    }
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
runtime = "per_core"
workers = 1

[server.tls]
cert = "{cert}"
key = "{key}"

{sni_tables}
{store}

[identity.auth_request]
url = "{auth_url}"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
algorithm = "fixed_window"
window = "1m"
quota = {{ anonymous = 3, default = 100 }}

[[limits]]
name = "shadow"
algorithm = "fixed_window"
window = "1m"
mode = "shadow"
quota = {{ anonymous = 1, default = 100 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core", "shadow"]
"#,
        cert = cert.display(),
        key = key(cert),
        up = up.url(),
    )
}

/// The `tollgate_*` names in `text`: each `tollgate_` not preceded by a name character,
/// with the `[a-z0-9_]` characters after it.
fn names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    for (at, _) in text.match_indices("tollgate_") {
        if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
            continue;
        }
        let end = bytes[at..]
            .iter()
            .position(|b| !(b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_'))
            .map_or(text.len(), |n| at + n);
        names.insert(text[at..end].to_string());
    }
    names
}

/// Every string under an `expr` or `definition` key of the dashboard JSON (panel
/// targets and template variables).
fn dashboard_queries(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, x) in map {
                match (k.as_str(), x) {
                    ("expr" | "definition", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => dashboard_queries(x, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|x| dashboard_queries(x, out)),
        _ => {}
    }
}

/// The sample names of a Prometheus text exposition (histograms as their `_bucket`,
/// `_sum` and `_count` series, counters with `_total`), each with its lines.
fn scraped(text: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut out = std::collections::BTreeMap::<String, Vec<String>>::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        out.entry(name.to_string())
            .or_default()
            .push(line.to_string());
    }
    out
}

/// The value of the sample whose line starts with `series` (name and labels as
/// rendered), or `None`.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

fn admin(gw: &TestGateway, path: &str) -> String {
    format!("http://{}{path}", gw.gateway.admin_addr().expect("admin"))
}

#[tokio::test]
async fn every_metric_the_dashboard_and_alerts_use_is_in_a_live_scrape() {
    let redis = RedisServer::start();
    let up = Upstream::start().await;
    let ca = Ca::new();
    let dir = tempfile::tempdir().unwrap();
    let cert = ca.write_leaf(dir.path(), "default", "localhost", (2030, 1, 1));
    let store = format!(
        "[store]\nbackend = \"redis\"\ntimeout = \"2s\"\n[[store.shards]]\nprimary = \"{}\"\n",
        redis.url()
    );
    // The auth service refuses every key it is asked about (the upstream's 403 page).
    let auth = format!("{}/status/403", up.url());
    let toml = config(&up, &cert, &[], &store, &auth);
    let gw = TestGateway::start(&toml).await;

    // Allowed, then refused by `core` (3 a minute); `shadow` (1 a minute) would have
    // refused all but the first.
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(https_get(gw.addr, &ca, "/", &[]).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    // An unknown API key: one callout, whose 403 the client receives.
    let status = https_get(gw.addr, &ca, "/", &[("authorization", "Bearer unknown")]).await;
    assert_eq!(status, 403);
    // One reload that takes, one that does not.
    let outcome = gw.reload(&toml.replace("anonymous = 3", "anonymous = 4"));
    assert!(outcome.is_ok(), "{outcome:?}");
    std::fs::write(&gw.path, "[server\n").unwrap();
    assert!(gw.gateway.reloader().reload_from(&gw.path, false).is_err());

    let scrape = get(&admin(&gw, "/metrics")).await;
    assert_eq!(scrape.status, 200);
    let text = scrape.text();
    // The labelled series the traffic above made.
    for (series, expected) in [
        (
            r#"tollgate_requests_total{route="/",status="200",decision="allowed"}"#,
            1.0,
        ),
        (
            r#"tollgate_requests_total{route="/",status="200",decision="shadow_rejected"}"#,
            2.0,
        ),
        (
            r#"tollgate_requests_total{route="/",status="429",decision="rejected"}"#,
            2.0,
        ),
        (
            r#"tollgate_rejections_total{limit="core",tier="anonymous"}"#,
            2.0,
        ),
        (
            r#"tollgate_shadow_rejections_total{limit="shadow",tier="anonymous"}"#,
            2.0,
        ),
        (r#"tollgate_auth_requests_total{result="refused"}"#, 1.0),
        (r#"tollgate_reloads_total{result="ok"}"#, 1.0),
        (r#"tollgate_reloads_total{result="failed"}"#, 1.0),
        ("tollgate_config_generation", 2.0),
        (
            &format!(
                r#"tollgate_tls_cert_not_after_seconds{{cert="{}",sni="default"}}"#,
                cert.display()
            ),
            JAN_2030 as f64,
        ),
    ] {
        assert_eq!(value(&text, series), Some(expected), "{series} in\n{text}");
    }

    let samples = scraped(&text);
    let mut queries = Vec::new();
    let dashboard: serde_json::Value = serde_json::from_str(DASHBOARD).unwrap();
    dashboard_queries(&dashboard, &mut queries);
    let in_dashboard = names_in(&queries.join("\n"));
    let in_alerts = names_in(ALERTS);
    // Not vacuous: the files name the metrics they are about.
    assert!(in_dashboard.len() >= 20, "{in_dashboard:?}");
    for name in [
        "tollgate_store_breaker_state",
        "tollgate_reloads_total",
        "tollgate_rejections_total",
        "tollgate_tls_cert_not_after_seconds",
        "tollgate_requests_total",
    ] {
        assert!(in_alerts.contains(name), "{name} not in alerts.yml");
    }
    // A histogram is used through its `_bucket` (or `_sum`, `_count`) series, which are
    // what the scrape holds: a bare histogram name in a query matches no series, and
    // fails here.
    let missing: Vec<_> = in_dashboard
        .iter()
        .map(|n| ("config/grafana/tollgate.json", n))
        .chain(
            in_alerts
                .iter()
                .map(|n| ("config/prometheus/alerts.yml", n)),
        )
        .filter(|(_, n)| !samples.contains_key(n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "used but not in the scrape: {missing:?}\nscrape:\n{text}"
    );
}

#[test]
fn the_dashboard_is_importable_and_its_promql_parses() {
    let dashboard: serde_json::Value = serde_json::from_str(DASHBOARD).expect("valid JSON");
    let inputs = dashboard["__inputs"].as_array().expect("__inputs");
    assert!(
        inputs.iter().any(|i| i["name"] == "DS_PROMETHEUS"
            && i["type"] == "datasource"
            && i["pluginId"] == "prometheus"),
        "{inputs:?}"
    );
    assert_eq!(dashboard["uid"], "tollgate");
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut exprs = Vec::new();
    for p in panels {
        let title = p["title"].as_str().unwrap_or("?");
        assert!(ids.insert(p["id"].as_u64().expect("id")), "id of {title}");
        for k in ["h", "w", "x", "y"] {
            assert!(p["gridPos"][k].is_u64(), "{title}: gridPos.{k}");
        }
        let Some(targets) = p["targets"].as_array() else {
            continue;
        };
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
        assert!(!targets.is_empty(), "{title}");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${DS_PROMETHEUS}", "{title}");
            let expr = t["expr"].as_str().expect("expr");
            assert!(expr.contains("tollgate_"), "{title}: {expr}");
            exprs.push((title.to_string(), expr.to_string()));
        }
    }
    assert!(exprs.len() >= 20, "{exprs:?}");
    // The PromQL parses: each query as a recording rule (Grafana's variables replaced by
    // what they become), checked by promtool.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in exprs.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$instance", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:query{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dashboard_rules.yml");
    std::fs::write(&path, rules).unwrap();
    let promtool = support::redis::find_bin("promtool", "PROMTOOL").unwrap_or_else(|| {
        panic!("promtool not found: install Debian's prometheus package (.ci/run does) or set PROMTOOL=/path/to/promtool")
    });
    let out = std::process::Command::new(promtool)
        .args(["check", "rules"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn the_tls_gauge_shows_each_certificates_not_after_and_follows_reloads() {
    let up = Upstream::start().await;
    let ca = Ca::new();
    let dir = tempfile::tempdir().unwrap();
    let default = ca.write_leaf(dir.path(), "default", "localhost", (2030, 1, 1));
    let api = ca.write_leaf(dir.path(), "api", "api.example.com", (2031, 5, 17));
    let store = "[store]\nbackend = \"memory\"\n";
    let auth = format!("{}/auth", up.url());
    let gw = TestGateway::start(&config(
        &up,
        &default,
        &[("API.example.com", &api)],
        store,
        &auth,
    ))
    .await;
    let series = |cert: &Path, sni: &str| {
        format!(
            r#"tollgate_tls_cert_not_after_seconds{{cert="{}",sni="{sni}"}}"#,
            cert.display()
        )
    };
    let text = get(&admin(&gw, "/metrics")).await.text();
    assert_eq!(
        value(&text, &series(&default, "default")),
        Some(JAN_2030 as f64),
        "{text}"
    );
    assert_eq!(
        value(&text, &series(&api, "api.example.com")),
        Some(MAY_2031 as f64),
        "{text}"
    );
    // The certificate really served is the one the gauge describes.
    assert_eq!(https_get(gw.addr, &ca, "/", &[]).await, 200);

    // Renewed in place, and the SNI entry dropped: the new date, and no row for the
    // certificate no longer served.
    ca.write_leaf(dir.path(), "default", "localhost", (2032, 2, 29));
    let outcome = gw.reload(&config(&up, &default, &[], store, &auth));
    assert!(outcome.is_ok(), "{outcome:?}");
    let text = get(&admin(&gw, "/metrics")).await.text();
    assert_eq!(
        value(&text, &series(&default, "default")),
        Some(FEB_2032 as f64),
        "{text}"
    );
    assert!(!text.contains("api.example.com"), "{text}");

    // A certificate file that does not load: the reload fails, the running certificate
    // and its row stay.
    std::fs::write(&default, "not a certificate").unwrap();
    let failed = gw
        .gateway
        .reloader()
        .reload_from(&gw.path, false)
        .expect_err("a broken certificate is rejected");
    assert!(failed.to_string().contains("server.tls.cert"), "{failed}");
    let text = get(&admin(&gw, "/metrics")).await.text();
    assert_eq!(
        value(&text, &series(&default, "default")),
        Some(FEB_2032 as f64),
        "{text}"
    );
    assert_eq!(
        value(&text, r#"tollgate_reloads_total{result="failed"}"#),
        Some(1.0)
    );
}
