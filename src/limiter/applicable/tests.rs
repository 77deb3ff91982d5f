//! Unit tests of `applicable.rs`: which limits apply, and the per-thread memo.

use crate::identity::Caller;
use crate::snapshot::Snapshot;
use http::{HeaderMap, HeaderValue, Method};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

const KEYS: &str = concat!(
    // sha256("acme-key"), sha256("beta-key"), sha256("gamma-key")
    "{\"id\": \"acme\", \"key_sha256\": \"ACME\", \"tier\": \"gold\"}\n",
    "{\"id\": \"beta\", \"key_sha256\": \"BETA\", \"tier\": \"gold\", \"quotas\": {\"per_ip\": 7}}\n",
);

fn sha(key: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

/// A snapshot with routes `/caller` (a per-caller and a global limit), `/ip` (a
/// per-IP limit) and `/tenant` (a limit keyed by `x-tenant`), quotas `quota` for
/// anonymous callers and `quota * 10` for gold, key prefix `prefix`.
fn snapshot(dir: &Path, prefix: &str, quota: u64) -> Snapshot {
    let keys = dir.join("keys.jsonl");
    let text = KEYS
        .replace("ACME", &sha("acme-key"))
        .replace("BETA", &sha("beta-key"));
    std::fs::write(&keys, text).expect("keys file");
    let gold = quota * 10;
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\
         [store]\nbackend = \"memory\"\nkey_prefix = \"{prefix}\"\n\
         [identity]\nclients_file = \"{}\"\n\
         [[upstreams]]\nname = \"api\"\ntargets = [\"http://127.0.0.1:9\"]\n\
         [[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = {{ anonymous = {quota}, gold = {gold} }}\n\
         [[limits]]\nname = \"all\"\nwindow = \"1h\"\nby = \"global\"\nquota = {{ anonymous = {quota}, gold = {gold} }}\n\
         [[limits]]\nname = \"per_ip\"\nwindow = \"1h\"\nby = \"ip\"\nquota = {{ anonymous = {quota}, gold = {gold} }}\n\
         [[limits]]\nname = \"tenant\"\nwindow = \"1h\"\nby = \"header:x-tenant\"\nquota = {{ anonymous = {quota}, gold = {gold} }}\n\
         [[routes]]\npath_prefix = \"/caller\"\nupstream = \"api\"\nlimits = [\"core\", \"all\"]\n\
         [[routes]]\npath_prefix = \"/ip\"\nupstream = \"api\"\nlimits = [\"per_ip\"]\n\
         [[routes]]\npath_prefix = \"/tenant\"\nupstream = \"api\"\nlimits = [\"tenant\"]\n",
        keys.display()
    );
    let file = crate::config::parse(&dir.join("t.toml"), toml).expect("config parses");
    let files = crate::load::Loaded::load(&file, None);
    Snapshot::build(&file, &files, None).expect("config is valid")
}

fn caller(snap: &Snapshot, key: Option<&str>, ip: &str) -> Caller {
    let mut headers = HeaderMap::new();
    if let Some(key) = key {
        let v = HeaderValue::from_str(&format!("Bearer {key}")).expect("header");
        headers.insert(http::header::AUTHORIZATION, v);
    }
    let ip: IpAddr = ip.parse().expect("ip");
    snap.identities.identify(&headers, ip).expect("caller")
}

/// (storage key, quota) of each limit that applies, remembered or not, after checking
/// that the remembered answer is the one worked out afresh.
fn applied(
    snap: &Snapshot,
    path: &str,
    caller: &Caller,
    headers: &HeaderMap,
) -> (Arc<[super::Applied]>, Vec<(String, u64)>) {
    let route = snap.router.find(None, path, &Method::GET).expect("route");
    let shared = snap.limiter.applicable_to(&route.limits, caller, headers);
    let fresh = snap.limiter.applicable(&route.limits, caller, headers);
    let view = |a: &[super::Applied]| -> Vec<(String, u64)> {
        a.iter()
            .map(|a| (a.key().key.to_string(), a.quota()))
            .collect()
    };
    assert_eq!(
        view(&shared),
        view(&fresh),
        "{path}: the memo's answer is the fresh one"
    );
    let v = view(&shared);
    (shared, v)
}

#[test]
fn a_caller_that_comes_back_shares_the_answer_and_no_other_caller_gets_it() {
    let dir = tempfile::tempdir().expect("dir");
    let snap = snapshot(dir.path(), "tg:", 5);
    let none = HeaderMap::new();
    let anon = caller(&snap, None, "192.0.2.1");
    let (first, keys) = applied(&snap, "/caller", &anon, &none);
    assert_eq!(keys.len(), 2);
    let (again, _) = applied(&snap, "/caller", &anon, &none);
    assert!(
        Arc::ptr_eq(&first, &again),
        "a repeat caller is answered from the memo"
    );

    // Another IP is another anonymous caller; the global window is shared.
    let (_, other) = applied(&snap, "/caller", &caller(&snap, None, "192.0.2.2"), &none);
    assert_ne!(other[0], keys[0]);
    assert_eq!(other[1], keys[1]);

    // A client is counted as itself from any IP, at its tier's quota...
    let (acme, acme_keys) = applied(
        &snap,
        "/caller",
        &caller(&snap, Some("acme-key"), "192.0.2.1"),
        &none,
    );
    assert_eq!(acme_keys[0].1, 50);
    let (moved, _) = applied(
        &snap,
        "/caller",
        &caller(&snap, Some("acme-key"), "198.51.100.9"),
        &none,
    );
    assert!(
        Arc::ptr_eq(&acme, &moved),
        "a limit by caller does not depend on the IP"
    );
    // ... but a limit by IP counts where it comes from.
    let (_, at_a) = applied(
        &snap,
        "/ip",
        &caller(&snap, Some("acme-key"), "192.0.2.1"),
        &none,
    );
    let (_, at_b) = applied(
        &snap,
        "/ip",
        &caller(&snap, Some("acme-key"), "198.51.100.9"),
        &none,
    );
    assert_ne!(at_a[0].0, at_b[0].0);
    // A client with its own quota: the same route, its own number.
    let (_, beta) = applied(
        &snap,
        "/ip",
        &caller(&snap, Some("beta-key"), "192.0.2.1"),
        &none,
    );
    assert_eq!(beta[0], (at_a[0].0.clone(), 7));
}

#[test]
fn a_limit_keyed_by_a_header_is_worked_out_for_each_request() {
    let dir = tempfile::tempdir().expect("dir");
    let snap = snapshot(dir.path(), "tg:", 5);
    let anon = caller(&snap, None, "192.0.2.1");
    let mut seen = std::collections::HashSet::new();
    for tenant in ["t1", "t2", "t1", "t3"] {
        let mut headers = HeaderMap::new();
        headers.insert("x-tenant", HeaderValue::from_static(tenant));
        let (_, keys) = applied(&snap, "/tenant", &anon, &headers);
        seen.insert((tenant, keys[0].0.clone()));
    }
    assert_eq!(seen.len(), 3, "one window per tenant: {seen:?}");
}

#[test]
fn a_reload_is_never_answered_from_the_memo_of_the_config_before() {
    let dir = tempfile::tempdir().expect("dir");
    let before = snapshot(dir.path(), "tg:", 5);
    let none = HeaderMap::new();
    let anon = caller(&before, None, "192.0.2.1");
    let (_, old) = applied(&before, "/caller", &anon, &none);
    assert_eq!(old[0].1, 5);
    // The same file again: same keys and numbers, worked out for the new snapshot.
    let same = snapshot(dir.path(), "tg:", 5);
    let (_, keys) = applied(&same, "/caller", &caller(&same, None, "192.0.2.1"), &none);
    assert_eq!(keys, old);
    // A new quota, a new key prefix.
    let after = snapshot(dir.path(), "gw:", 6);
    let (_, new) = applied(&after, "/caller", &caller(&after, None, "192.0.2.1"), &none);
    assert_eq!(new[0].1, 6);
    assert!(new[0].0.starts_with("gw:core:{"), "{new:?}");
}

#[test]
fn a_client_with_other_quotas_or_another_tier_is_another_caller() {
    let dir = tempfile::tempdir().expect("dir");
    let snap = snapshot(dir.path(), "tg:", 5);
    let none = HeaderMap::new();
    let with = |c: &Caller, client: crate::identity::Client| Caller {
        tier: client.tier.clone(),
        client: Some(Arc::new(client)),
        ..c.clone()
    };
    // beta has its own quota in per_ip (7); a client of the same id and tier without
    // it (as a keys file reloaded without the quota gives) gets gold's 50.
    let beta = caller(&snap, Some("beta-key"), "192.0.2.1");
    let (_, own) = applied(&snap, "/ip", &beta, &none);
    assert_eq!(own[0].1, 7);
    let plain = crate::identity::Client::new("beta".into(), "gold".into());
    let (_, tiered) = applied(&snap, "/ip", &with(&beta, plain), &none);
    assert_eq!(tiered[0].1, 50);
    let (_, own) = applied(&snap, "/ip", &beta, &none);
    assert_eq!(own[0].1, 7);
    // acme in another tier: that tier's quota.
    let acme = caller(&snap, Some("acme-key"), "192.0.2.1");
    let (_, gold) = applied(&snap, "/caller", &acme, &none);
    assert_eq!(gold[0].1, 50);
    let moved = crate::identity::Client::new("acme".into(), "anonymous".into());
    let (_, anon) = applied(&snap, "/caller", &with(&acme, moved), &none);
    assert_eq!(anon[0], (gold[0].0.clone(), 5));
    // A caller made anew for each request (a JWT's), alike in every respect, is
    // answered from the memo.
    let (first, _) = applied(&snap, "/caller", &acme, &none);
    let jwt = crate::identity::Client::new("acme".into(), "gold".into());
    let (again, _) = applied(&snap, "/caller", &with(&acme, jwt), &none);
    assert!(Arc::ptr_eq(&first, &again));
}

#[test]
fn each_route_and_tier_has_its_own_answer() {
    let dir = tempfile::tempdir().expect("dir");
    let snap = snapshot(dir.path(), "tg:", 5);
    let none = HeaderMap::new();
    // Two routes' answers for one caller share a memo slot for some callers: each
    // route must still get its own.
    for n in 0..1_000u32 {
        let ip = std::net::Ipv4Addr::from(0x0a00_0000 + n).to_string();
        let anon = caller(&snap, None, &ip);
        let (_, by_caller) = applied(&snap, "/caller", &anon, &none);
        let (_, by_ip) = applied(&snap, "/ip", &anon, &none);
        assert!(by_caller[0].0.starts_with("tg:core:{"), "{by_caller:?}");
        assert!(by_ip[0].0.starts_with("tg:per_ip:{"), "{by_ip:?}");
    }
    // The tier a caller is judged by (a JWT's tier claim, say) is part of the question.
    let acme = caller(&snap, Some("acme-key"), "192.0.2.1");
    let (_, gold) = applied(&snap, "/caller", &acme, &none);
    let lowered = Caller {
        tier: "anonymous".into(),
        ..acme.clone()
    };
    let (_, anon) = applied(&snap, "/caller", &lowered, &none);
    assert_eq!((gold[0].1, anon[0].1), (50, 5));
}
