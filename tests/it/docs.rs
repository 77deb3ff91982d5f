//! Every config key has an entry in docs/configuration.md, and every test file, test
//! function and test command the docs name exists.

use std::collections::BTreeSet;
use tollgate::config::*;

/// A config with every optional key present, written as a struct literal without
/// `..Default::default()`: a new field fails to compile here until it is listed.
fn full_config() -> Config {
    Config {
        server: ServerConfig {
            listen: "127.0.0.1:8080".into(),
            admin_listen: Some("127.0.0.1:9901".into()),
            admin_token_sha256: Some("ab".repeat(32)),
            shutdown_grace: Dur::from_secs(30),
            header_read_timeout: Dur::from_secs(10),
            idle_timeout: Dur::from_secs(60),
            send_timeout: Dur::from_secs(60),
            max_connections: 10_000,
            max_connections_per_ip: 256,
            descriptor_share_per_ip: 50,
            max_header_bytes: 32 * 1024,
            http2_max_streams: 100,
            max_delayed: 1_000,
            underscores_in_headers: false,
            max_tunnels: 1000,
            tunnel_idle_timeout: Some(Dur::from_secs(300)),
            body_timeout: Dur::from_secs(30),
            watch_config: true,
            tls: Some(TlsConfig {
                cert: "c.pem".into(),
                key: "k.pem".into(),
                sni: vec![SniCertConfig {
                    host: "api.example.com".into(),
                    cert: "api.pem".into(),
                    key: "api.key".into(),
                }],
                handshake_timeout: Dur::from_secs(10),
                client_ca: Some("ca.pem".into()),
                client_auth: Some(ClientAuth::Required),
                ocsp: Some("ocsp.der".into()),
                ticket_keys: Some("tickets.keys".into()),
            }),
            workers: Some(2),
            runtime: RuntimeShape::PerCore,
            via: Via::Named("edge-1".into()),
        },
        log: LogConfig {
            level: "info".into(),
            format: LogFormat::Text,
            client_ip: tollgate::config::LogClientIp::Ip,
        },
        store: StoreConfig {
            backend: Backend::Redis,
            timeout: Dur::from_millis(50),
            on_error: OnError::Allow,
            fleet_size: Some(FleetSize::Named("auto".into())),
            fleet_heartbeat: Dur::from_secs(1),
            key_prefix: "tollgate:".into(),
            hash_key: Some("s".into()),
            hash_key_file: Some("hash-key".into()),
            username: Some("tollgate".into()),
            password: Some("pw".into()),
            password_file: Some("redis-password".into()),
            sentinel_username: Some("sentinel-user".into()),
            sentinel_password: Some("spw".into()),
            sentinel_password_file: Some("sentinel-password".into()),
            tls: Some(StoreTlsConfig {
                ca: Some("redis-ca.pem".into()),
                roots: TlsRoots::System,
                client_cert: Some("redis-client.pem".into()),
                client_key: Some("redis-client.key".into()),
                server_name: Some("redis.internal".into()),
            }),
            read_from: Some(ReadFrom::Primary),
            sweep_interval: Dur::from_secs(5),
            max_callers: 1_000_000,
            reserve_in_flight: false,
            check_from_charge: Dur::from_millis(0),
            mode: StoreMode::Sharded,
            clock: StoreClock::Redis,
            breaker_failures: 3,
            breaker_cooloff: Dur::from_secs(1),
            local_cache_size: 10_000,
            shards: vec![ShardConfig {
                primary: Some("redis://a".into()),
                replicas: vec!["redis://b".into()],
                sentinel: Some(SentinelConfig {
                    master: "m".into(),
                    nodes: vec!["redis://s:26379".into()],
                }),
            }],
            nodes: vec!["redis://c:7000".into()],
        },
        identity: IdentityConfig {
            api_key_header: "authorization".into(),
            trusted_proxies: vec!["10.0.0.0/8".into()],
            ipv6_prefix_len: 64,
            anonymous_tier: "anonymous".into(),
            clients: vec![ClientConfig {
                id: "a".into(),
                key_sha256: "0".repeat(64).into(),
                tier: "default".into(),
            }],
            clients_file: Some("keys.jsonl".into()),
            clients_file_max_bytes: 256 << 20,
            clients_file_settle: Dur::from_secs(1),
            clients_file_max_removed_percent: 10,
            failed_auth_limit: tollgate::config::FailedAuthLimit::default(),
            client_cert_subject_as_caller: true,
            jwt: Some(JwtConfig {
                secret: Some("0123456789abcdef0123456789abcdef".into()),
                secret_env: Some("TOLLGATE_JWT_SECRET".into()),
                secret_file: Some("jwt-secret".into()),
                public_key: Some("jwt.pem".into()),
                jwks: Some("jwks.json".into()),
                algorithms: vec!["RS256".into()],
                leeway: Dur::from_secs(30),
                issuer: Some("https://issuer.example".into()),
                audience: Some("api".into()),
                id_claim: "sub".into(),
                tier_claim: Some("tier".into()),
                default_tier: "default".into(),
                tiers: vec!["gold".into()],
            }),
            auth_request: Some(AuthRequestConfig {
                url: "http://127.0.0.1:9100/auth".into(),
                forward_headers: vec!["x-tenant".into()],
                ..AuthRequestConfig::default()
            }),
            forward_caller_header: Some("x-consumer-id".into()),
            forward_tier_header: Some("x-consumer-tier".into()),
            strip_credentials: true,
        },
        upstreams: vec![UpstreamConfig {
            name: "api".into(),
            targets: vec!["http://127.0.0.1:9000".into()],
            connect_timeout: Dur::from_secs(2),
            response_timeout: Dur::from_secs(60),
            cost_header: Some("x-tollgate-cost".into()),
            protocol: tollgate::config::UpstreamProtocol::Http2,
            tls_roots: tollgate::config::TlsRoots::System,
            ca: Some("ca.pem".into()),
            client_cert: Some("client.pem".into()),
            client_key: Some("client.key".into()),
            eject_for: Dur::from_secs(10),
            max_response_header_bytes: 64 * 1024,
        }],
        limits: vec![LimitConfig {
            name: "core".into(),
            algorithm: tollgate::config::Algorithm::FixedWindow,
            burst: Some(10),
            align: WindowAlign::Calendar,
            window: Dur::from_secs(3600),
            quota: [("anonymous".to_string(), 60)].into(),
            by: LimitBy::Header("x-tenant".into()),
            trusted_only: true,
            lease: Some(100),
            lease_ttl: Dur::from_secs(5),
            block_for: Some(Dur::from_secs(900)),
            mode: LimitMode::Enforce,
            enforce_percent: 25,
            on_limit: OnLimit::Delay,
            max_delay: Dur::from_secs(2),
            max_waiting: 8,
        }],
        routes: vec![RouteConfig {
            host: Some("api.example.com".into()),
            path_prefix: "/".into(),
            path_match: PathMatch::Segments,
            methods: vec!["GET".into(), "POST".into()],
            max_request_bytes: Some(1 << 20),
            upstream: "api".into(),
            limits: vec!["core".into()],
            cost: 1,
            uncharged_statuses: Some(vec![304]),
            charged_statuses: Some(vec![401, 403]),
            charge: ChargeAt::AfterResponse,
            upgrades: vec!["websocket".into()],
            trust_method_override: false,
        }],
        headers: HeadersConfig {
            style: vec![HeaderStyle::Github, HeaderStyle::Ietf],
            problem_details: true,
            partition_key: true,
        },
        rate_limit_endpoint: tollgate::config::RateLimitEndpointConfig {
            path: Some("/rate_limit".into()),
        },
        tracing: TracingConfig {
            enabled: true,
            endpoint: "https://otel.example.com:4318".into(),
            sample_ratio: 0.01,
            sample_refusals: true,
            trust_incoming: TrustIncoming::TrustedProxies,
            service_name: "tollgate".into(),
            headers: [("x-scope-orgid".to_string(), "acme".to_string())].into(),
            headers_file: [("authorization".to_string(), "otel-token".to_string())].into(),
            ca: Some("otel-ca.pem".into()),
            queue_size: 2048,
            batch_size: 512,
            batch_timeout: Dur::from_secs(1),
            export_timeout: Dur::from_secs(10),
        },
    }
}

fn keys(prefix: &str, v: &toml::Value, out: &mut BTreeSet<String>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                // Quota keys are tier names chosen by the operator, not config keys;
                // so are the names of the collector's headers.
                if ["limits.quota", "tracing.headers", "tracing.headers_file"].contains(&prefix) {
                    continue;
                }
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.insert(path.clone());
                keys(&path, v, out);
            }
        }
        toml::Value::Array(items) => {
            for item in items {
                keys(prefix, item, out);
            }
        }
        _ => {}
    }
}

#[test]
fn every_config_key_is_documented() {
    let value = toml::Value::try_from(full_config()).unwrap();
    let mut all = BTreeSet::new();
    keys("", &value, &mut all);
    assert!(all.contains("store.shards.primary") && all.contains("routes.uncharged_statuses"));
    let doc = std::fs::read_to_string("docs/configuration.md").unwrap();
    let missing: Vec<_> = all
        .iter()
        .filter(|k| !doc.contains(&format!("`{k}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "keys without an entry in docs/configuration.md: {missing:?}"
    );
}

#[test]
fn the_full_config_is_valid_toml_for_the_parser() {
    let text = toml::to_string(&full_config()).unwrap();
    let parsed: Config = toml::from_str(&text).unwrap();
    assert_eq!(parsed, full_config());
}

/// The texts that name test files: the docs, README, BENCHMARKS, CI and the alert rules.
fn texts_naming_tests() -> Vec<(std::path::PathBuf, String)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    for f in [
        "README.md",
        "BENCHMARKS.md",
        ".ci/run",
        "config/prometheus/alerts.yml",
    ] {
        paths.push(root.join(f));
    }
    paths
        .into_iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, text)
        })
        .collect()
}

/// Whether the test file `path` (relative to the package) defines a function `name`.
fn defines(path: &str, name: &str) -> bool {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join(path)).unwrap_or_default();
    text.contains(&format!("fn {name}(")) || text.contains(&format!("fn {name}<"))
}

/// Each `tests/...rs` path the docs name is a file; a test function named with it
/// ("`tests/it/x.rs`'s `name`", "`tests/it/x.rs::name`", "the test `name` in
/// `tests/it/x.rs`") is defined there; and each
/// `cargo test --test it MODULE::NAME` names a module file that defines a function
/// starting with NAME.
#[test]
fn the_test_files_functions_and_commands_the_docs_name_exist() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let (mut files, mut functions, mut commands) = (0, 0, 0);
    for (doc, text) in texts_naming_tests() {
        let doc = doc.display();
        for (at, _) in text.match_indices("tests/") {
            if text[..at].ends_with(|c: char| word(c) || c == '/') {
                continue;
            }
            let tail = &text[at..];
            let len = tail
                .find(|c: char| !(word(c) || c == '/' || c == '.'))
                .unwrap_or(tail.len());
            let path = tail[..len].trim_end_matches('.');
            if !path.ends_with(".rs") {
                continue;
            }
            assert!(
                root.join(path).is_file(),
                "{doc} names {path}, which does not exist"
            );
            files += 1;
            let after = &tail[path.len()..];
            let name = if let Some(after) = after.strip_prefix("`'s `").or(after.strip_prefix("::"))
            {
                after.split(|c: char| !word(c)).next()
            } else {
                // "the test `name` in `tests/it/x.rs`"
                let before = text[..at].strip_suffix("` in `");
                before
                    .and_then(|b| b.rsplit_once('`'))
                    .and_then(|(head, name)| head.ends_with("test ").then_some(name))
            };
            if let Some(name) = name.filter(|n| !n.is_empty() && n.chars().all(word)) {
                assert!(
                    defines(path, name),
                    "{doc} names {path}'s {name}, which is not there"
                );
                functions += 1;
            }
        }
        for (at, command) in text.match_indices("cargo test ") {
            let args = &text[at + command.len()..];
            let args = args.split(['`', '\n']).next().unwrap();
            let Some(filter) = args.split("--test it ").nth(1) else {
                continue;
            };
            let filter = filter.split_whitespace().next().unwrap();
            let (module, name) = filter.split_once("::").unwrap_or((filter, ""));
            let path = format!("tests/it/{module}.rs");
            assert!(root.join(&path).is_file(), "{doc}: `{args}`: no {path}");
            let tests = std::fs::read_to_string(root.join(&path)).unwrap();
            assert!(
                tests.contains(&format!("fn {name}")),
                "{doc}: `{args}`: no test in {path} starts with {name}"
            );
            commands += 1;
        }
    }
    assert!(
        files >= 20 && functions >= 3 && commands >= 5,
        "found {files} file names, {functions} function names, {commands} commands"
    );
}
