#![allow(missing_docs)] // criterion_group! generates undocumented items
//! Issue 22's costs on the request path: the `/top` heavy-hitters sketch per request
//! (target ≤ 100 ns), and an API key lookup among 1,000,000 keys.
//!
//! `cargo bench --bench callers`

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use sha2::{Digest, Sha256};
use std::net::IpAddr;
use std::sync::Arc;
use tollgate::identity::keys::KeySource;
use tollgate::identity::Client;
use tollgate::limiter::top::{Top, WhoRef};

fn sketch(c: &mut Criterion) {
    let top = Top::default();
    let (core, gold): (Arc<str>, Arc<str>) = ("core".into(), "gold".into());
    let clients: Vec<Arc<Client>> = (0..1000)
        .map(|i| Arc::new(Client::new(format!("client-{i}").into(), gold.clone())))
        .collect();
    let now = 1_800_000_000;
    let mut i = 0usize;
    c.bench_function("top: one admitted request, 1000 clients", |b| {
        b.iter(|| {
            i = (i + 1) % clients.len();
            top.used(&core, WhoRef::Client(&clients[i]), &gold, 1, black_box(now));
        })
    });
    let mut n = 0u32;
    c.bench_function(
        "top: one admitted request, a new anonymous IP each time",
        |b| {
            b.iter(|| {
                n = n.wrapping_add(1);
                top.used(
                    &core,
                    WhoRef::Ip(IpAddr::from(n.to_be_bytes())),
                    &gold,
                    1,
                    black_box(now),
                );
            })
        },
    );
}

fn lookup(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.jsonl");
    let mut text = String::with_capacity(130 << 20);
    for i in 0..1_000_000 {
        let h = hex::encode(Sha256::digest(format!("key-{i}").as_bytes()));
        text.push_str(&format!(
            "{{\"id\": \"customer-{i:07}\", \"key_sha256\": \"{h}\"}}\n"
        ));
    }
    std::fs::write(&path, text).unwrap();
    let source = KeySource {
        inline: Vec::new(),
        file: Some(path),
        limits: None,
        tiers: None,
        by_id: false,
        max_bytes: u64::MAX,
    };
    let set = source.build(None).unwrap();
    let digests: Vec<[u8; 32]> = (0..1024)
        .map(|i| Sha256::digest(format!("key-{}", i * 977).as_bytes()).into())
        .collect();
    let mut i = 0;
    c.bench_function("keys: find among 1,000,000 (digest given)", |b| {
        b.iter(|| {
            i = (i + 1) % digests.len();
            black_box(set.find(&digests[i], || 0).is_some())
        })
    });
}

criterion_group!(benches, sketch, lookup);
criterion_main!(benches);
