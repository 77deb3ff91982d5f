//! JWT callers (`[identity.jwt]`) and what the upstream learns about the caller
//! (`forward_caller_header`, `forward_tier_header`, `strip_credentials`), end to end:
//! tokens are signed here with `jsonwebtoken`, sent through a real gateway to a real
//! upstream. The RSA and EC keys are fixed test keys in tests/fixtures/jwt.

use crate::support;
use crate::support::{get_with, sha256_hex, TestGateway, Upstream};
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::json;
use std::path::Path;

const SECRET: &str = "a-test-secret-of-32-bytes-length";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/jwt")
            .join(name),
    )
    .unwrap()
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// An HS256 token signed with `secret`.
fn hs256(secret: &str, claims: serde_json::Value) -> String {
    encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap()
}

/// An RS256 token signed with the fixture key `key` ("rsa-a" / "rsa-b"), with `kid`.
fn rs256(key: &str, kid: &str, claims: serde_json::Value) -> String {
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some(kid.into());
    let pem = fixture(&format!("{key}.key.pem"));
    encode(&header, &claims, &EncodingKey::from_rsa_pem(&pem).unwrap()).unwrap()
}

/// A JWKS holding the public halves of `keys`: (fixture name, kid).
fn jwks(keys: &[(&str, &str)]) -> String {
    let keys: Vec<serde_json::Value> = keys
        .iter()
        .map(|(name, kid)| {
            let mut jwk: serde_json::Value =
                serde_json::from_slice(&fixture(&format!("{name}.jwk.json"))).unwrap();
            jwk["kid"] = json!(kid);
            jwk["alg"] = json!("RS256");
            jwk
        })
        .collect();
    json!({ "keys": keys }).to_string()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// A gateway with `jwt` as its `[identity.jwt]` section, one API client `acme` (key
/// `sekrit`, tier gold) and a limit `core`: anonymous 3, default 10, gold 20, silver 7
/// per hour.
fn config(up: &Upstream, jwt: &str, identity_extra: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[identity]
failed_auth_limit = {{ quota = 3, window = "1m" }}
{identity_extra}

[identity.jwt]
{jwt}

[[identity.clients]]
id = "acme"
key_sha256 = "{key}"
tier = "gold"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 3, default = 10, gold = 20, silver = 7 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        key = sha256_hex("sekrit"),
        up = up.url(),
    )
}

fn hs_section() -> String {
    format!(
        r#"secret = "{SECRET}"
algorithms = ["HS256"]
audience = "tollgate-tests"
issuer = "https://issuer.test"
tier_claim = "plan"
tiers = ["silver"]"#
    )
}

fn claims(sub: &str, exp_in: i64) -> serde_json::Value {
    json!({
        "sub": sub,
        "exp": now() + exp_in,
        "aud": "tollgate-tests",
        "iss": "https://issuer.test",
    })
}

#[tokio::test]
async fn a_valid_hs256_token_gets_its_tiers_quota() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(&up, &hs_section(), "")).await;

    // No tier claim: default_tier ("default", 10 an hour).
    let token = hs256(SECRET, claims("user-1", 300));
    let r = get_with(&gw.url("/x"), &[("authorization", &bearer(&token))]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-limit"), "10");
    assert_eq!(r.header("x-ratelimit-remaining"), "9");

    // A tier claim naming a declared tier.
    let mut c = claims("user-2", 300);
    c["plan"] = json!("silver");
    let r = get_with(
        &gw.url("/x"),
        &[("authorization", &bearer(&hs256(SECRET, c)))],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-limit"), "7");

    // A tier nobody declared: 401 with the reason, not forwarded.
    let hits = up.hits();
    let mut c = claims("user-3", 300);
    c["plan"] = json!("platinum");
    let r = get_with(
        &gw.url("/x"),
        &[("authorization", &bearer(&hs256(SECRET, c)))],
    )
    .await;
    assert_eq!(r.status, 401);
    assert_eq!(
        r.json()["message"],
        "invalid token: unknown tier \"platinum\""
    );
    assert_eq!(up.hits(), hits);
}

#[tokio::test]
async fn invalid_tokens_are_401_with_the_reason_and_count_as_failed_auth() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(&up, &hs_section(), "")).await;
    let hits = up.hits();

    let expired = hs256(SECRET, claims("u", -120)); // past the 30 s leeway
    let mut wrong_aud = claims("u", 300);
    wrong_aud["aud"] = json!("someone-else");
    let mut wrong_iss = claims("u", 300);
    wrong_iss["iss"] = json!("https://evil.test");
    let mut early = claims("u", 300);
    early["nbf"] = json!(now() + 600);
    let cases = [
        (expired, "invalid token: expired"),
        (hs256(SECRET, wrong_aud), "invalid token: wrong audience"),
        (
            hs256("another-secret-of-32-bytes-long!", claims("u", 300)),
            "invalid token: bad signature",
        ),
    ];
    for (token, message) in &cases {
        let r = get_with(&gw.url("/x"), &[("authorization", &bearer(token))]).await;
        assert_eq!(r.status, 401, "{message}");
        assert_eq!(r.header("content-type"), "application/json");
        assert_eq!(r.json()["message"], *message);
    }
    // failed_auth_limit is 3 a minute per client IP: the 4th bad token is refused.
    let r = get_with(
        &gw.url("/x"),
        &[("authorization", &bearer(&hs256(SECRET, wrong_iss)))],
    )
    .await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(up.hits(), hits, "no invalid token reaches the upstream");

    // Another gateway (fresh failed-auth budget) shows the remaining reasons.
    let gw = TestGateway::start(&config(&up, &hs_section(), "")).await;
    let r = get_with(
        &gw.url("/x"),
        &[("authorization", &bearer(&hs256(SECRET, early)))],
    )
    .await;
    assert_eq!(r.json()["message"], "invalid token: not yet valid");
    let r = get_with(
        &gw.url("/x"),
        &[("authorization", "Bearer eyJhbGciOi.eyJzdWIi.c2ln")],
    )
    .await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["message"], "invalid token: malformed");
}

#[tokio::test]
async fn an_api_key_still_works_beside_jwts_and_shares_limits_with_the_same_id() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(&up, &hs_section(), "")).await;

    let r = get_with(&gw.url("/x"), &[("authorization", "Bearer sekrit")]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-limit"), "20");
    assert_eq!(r.header("x-ratelimit-used"), "1");

    // A JWT whose subject is "acme" is the same caller: its window already holds 1.
    let mut c = claims("acme", 300);
    c["plan"] = json!("gold");
    let r = get_with(
        &gw.url("/x"),
        &[("authorization", &bearer(&hs256(SECRET, c)))],
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-used"), "2");

    let r = get_with(&gw.url("/x"), &[("authorization", "Bearer wrong-key")]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["message"], "Bad credentials");
}

#[tokio::test]
async fn rs256_from_a_jwks_follows_key_rotation_on_reload() {
    let up = Upstream::start().await;
    let keys = tempfile::tempdir().unwrap();
    let file = keys.path().join("jwks.json");
    std::fs::write(&file, jwks(&[("rsa-a", "old"), ("rsa-b", "new")])).unwrap();
    let section = format!(
        "jwks = \"{}\"\nalgorithms = [\"RS256\"]\ntiers = [\"silver\"]",
        file.display()
    );
    let gw = TestGateway::start(&config(&up, &section, "")).await;

    let old = rs256("rsa-a", "old", json!({"sub": "svc-1", "exp": now() + 300}));
    let new = rs256("rsa-b", "new", json!({"sub": "svc-1", "exp": now() + 300}));
    for token in [&old, &new] {
        let r = get_with(&gw.url("/x"), &[("authorization", &bearer(token))]).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-ratelimit-limit"), "10");
    }
    // A token signed by key b but claiming kid "old": bad signature.
    let forged = rs256("rsa-b", "old", json!({"sub": "svc-1", "exp": now() + 300}));
    let r = get_with(&gw.url("/x"), &[("authorization", &bearer(&forged))]).await;
    assert_eq!(r.json()["message"], "invalid token: bad signature");

    // Rotate: the old kid is gone from the JWKS; reloading the same config re-reads it.
    std::fs::write(&file, jwks(&[("rsa-b", "new")])).unwrap();
    gw.reload(&config(&up, &section, "")).unwrap();
    let r = get_with(&gw.url("/x"), &[("authorization", &bearer(&old))]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["message"], "invalid token: unknown kid");
    let r = get_with(&gw.url("/x"), &[("authorization", &bearer(&new))]).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test]
async fn es256_with_a_pem_public_key() {
    let up = Upstream::start().await;
    let pem = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jwt/ec.pub.pem");
    let section = format!(
        "public_key = \"{}\"\nalgorithms = [\"ES256\"]\ntiers = [\"silver\"]",
        pem.display()
    );
    let gw = TestGateway::start(&config(&up, &section, "")).await;
    let token = encode(
        &Header::new(Algorithm::ES256),
        &json!({"sub": "edge", "exp": now() + 300}),
        &EncodingKey::from_ec_pem(&fixture("ec.key.pem")).unwrap(),
    )
    .unwrap();
    let r = get_with(&gw.url("/x"), &[("authorization", &bearer(&token))]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    // An HS256 token is refused: only ES256 is allowed.
    let hs = hs256(SECRET, json!({"sub": "edge", "exp": now() + 300}));
    let r = get_with(&gw.url("/x"), &[("authorization", &bearer(&hs))]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["message"], "invalid token: algorithm not allowed");
}

#[tokio::test]
async fn the_upstream_learns_the_caller_and_cannot_be_spoofed() {
    let up = Upstream::start().await;
    let extra = r#"forward_caller_header = "x-consumer-id"
forward_tier_header = "x-consumer-tier""#;
    let gw = TestGateway::start(&config(&up, &hs_section(), extra)).await;
    let spoof = [("x-consumer-id", "admin"), ("x-consumer-tier", "gold")];

    let token = hs256(SECRET, claims("user-9", 300));
    let auth = bearer(&token);
    let r = get_with(
        &gw.url("/echo"),
        &[("authorization", auth.as_str()), spoof[0], spoof[1]],
    )
    .await;
    assert_eq!(r.status, 200);
    let h = &r.json()["headers"];
    assert_eq!(h["x-consumer-id"], "user-9");
    assert_eq!(h["x-consumer-tier"], "default");
    assert_eq!(
        h["authorization"],
        auth.as_str(),
        "kept without strip_credentials"
    );

    // Listing the header in Connection (hop-by-hop) does not keep it from the upstream.
    let r = get_with(
        &gw.url("/echo"),
        &[
            ("authorization", "Bearer sekrit"),
            ("connection", "x-consumer-id, x-consumer-tier"),
        ],
    )
    .await;
    let h = &r.json()["headers"];
    assert_eq!(h["x-consumer-id"], "acme");
    assert_eq!(h["x-consumer-tier"], "gold");

    // Anonymous callers: the spoofed headers are removed, nothing is set.
    let r = get_with(&gw.url("/echo"), &spoof).await;
    assert_eq!(r.status, 200);
    let h = &r.json()["headers"];
    assert!(h.get("x-consumer-id").is_none(), "{h}");
    assert!(h.get("x-consumer-tier").is_none(), "{h}");
}

#[tokio::test]
async fn strip_credentials_removes_authorization_upstream() {
    let up = Upstream::start().await;
    let extra = "strip_credentials = true\nforward_caller_header = \"x-consumer-id\"";
    let gw = TestGateway::start(&config(&up, &hs_section(), extra)).await;
    let token = hs256(SECRET, claims("user-4", 300));
    for auth in [bearer(&token), "Bearer sekrit".to_string()] {
        let r = get_with(&gw.url("/echo"), &[("authorization", &auth)]).await;
        assert_eq!(r.status, 200);
        let h = &r.json()["headers"];
        assert!(h.get("authorization").is_none(), "{h}");
        assert!(h.get("x-consumer-id").is_some(), "{h}");
    }
}

#[test]
fn check_reports_jwt_config_errors_with_key_paths() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let write = |jwt: &str| {
        std::fs::write(
            &path,
            format!(
                r#"
[server]
listen = "127.0.0.1:0"

[identity]
forward_caller_header = "connection"

[identity.jwt]
{jwt}
"#
            ),
        )
        .unwrap();
    };
    write("jwks = \"missing.json\"\nalgorithms = [\"RS256\", \"none\", \"HS999\"]");
    let (code, _, err) = support::check(&path);
    assert_eq!(code, 1, "{err}");
    for key in [
        "identity.jwt.algorithms[1]: \"none\" (unsigned tokens) is never accepted",
        "identity.jwt.algorithms[2]: unknown algorithm \"HS999\"",
        "identity.jwt.jwks: cannot read",
        "identity.forward_caller_header:",
    ] {
        assert!(err.contains(key), "{key} in:\n{err}");
    }
    write("algorithms = []");
    let (code, _, err) = support::check(&path);
    assert_eq!(code, 1);
    assert!(
        err.contains("identity.jwt.algorithms: must list at least one"),
        "{err}"
    );
    assert!(err.contains("identity.jwt: no key"), "{err}");
    write("public_key = \"bad.pem\"\nalgorithms = [\"RS256\"]");
    std::fs::write(dir.path().join("bad.pem"), "not a key").unwrap();
    let (_, _, err) = support::check(&path);
    assert!(
        err.contains("identity.jwt.public_key: \"bad.pem\" holds no"),
        "{err}"
    );
}

/// A token whose header marks an extension critical (`crit`, RFC 7515
/// §4.1.11) is invalid, since tollgate understands none; a caller id with `,` or a
/// control character (it would reach the upstream as a list, or split a log line) is
/// malformed. Both are 401 and never reach the upstream.
#[tokio::test]
async fn crit_headers_and_ids_with_commas_or_controls_are_refused() {
    let up = Upstream::start().await;
    let extra = "forward_caller_header = \"x-consumer-id\"";
    let hits = up.hits();

    let mut crit = Header::new(Algorithm::HS256);
    crit.crit = Some(vec!["exp-ext".into()]);
    crit.extras.insert("exp-ext".into(), "1".into());
    let mut crit_known = Header::new(Algorithm::HS256);
    crit_known.crit = Some(vec!["alg".into()]);
    let signed = |header: &Header, sub: &str| {
        encode(
            header,
            &claims(sub, 300),
            &EncodingKey::from_secret(SECRET.as_bytes()),
        )
        .unwrap()
    };
    let plain = Header::new(Algorithm::HS256);
    let cases = [
        (
            signed(&crit, "user-1"),
            "invalid token: critical header parameter \"exp-ext\" not understood",
        ),
        (
            signed(&crit_known, "user-1"),
            "invalid token: critical header parameter \"alg\" not understood",
        ),
        (signed(&plain, "mallory, alice"), "invalid token: malformed"),
        (signed(&plain, "mallory,alice"), "invalid token: malformed"),
        (signed(&plain, "mallory\talice"), "invalid token: malformed"),
        (signed(&plain, "mallory\u{7f}"), "invalid token: malformed"),
        (signed(&plain, "mallory\u{85}"), "invalid token: malformed"),
    ];
    for (token, message) in &cases {
        // A fresh gateway per case: failed_auth_limit allows 3 a minute per client IP.
        let gw = TestGateway::start(&config(&up, &hs_section(), extra)).await;
        let r = get_with(&gw.url("/echo"), &[("authorization", &bearer(token))]).await;
        assert_eq!(r.status, 401, "{message}: {}", r.text());
        assert_eq!(r.header("content-type"), "application/json");
        assert_eq!(r.json()["message"], *message);
    }
    assert_eq!(up.hits(), hits, "no refused token reaches the upstream");

    // The same token without crit, and a plain id, pass.
    let gw = TestGateway::start(&config(&up, &hs_section(), extra)).await;
    let r = get_with(
        &gw.url("/echo"),
        &[("authorization", &bearer(&signed(&plain, "mallory alice")))],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["headers"]["x-consumer-id"], "mallory alice");
}
