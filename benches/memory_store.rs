#![allow(missing_docs)]
//! Memory store throughput: CHECK and CHARGE of one hot key, and charges spread over
//! many keys. Run with `cargo bench --bench memory_store`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tollgate::limiter::key::KeyScheme;
use tollgate::limiter::store::memory::MemoryStore;

fn bench(c: &mut Criterion) {
    let store = MemoryStore::new();
    let scheme = KeyScheme::new("tollgate:", None);
    let hot = scheme.key("core", "client:acme");
    let keys: Vec<_> = (0..100_000)
        .map(|i| {
            scheme.key(
                "core",
                &format!("ip:10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255),
            )
        })
        .collect();
    let now = 1_700_000_000_000u64;

    c.bench_function("memory check (hot key)", |b| {
        b.iter(|| black_box(store.check_now(&hot, now)))
    });
    c.bench_function("memory charge (hot key)", |b| {
        b.iter(|| black_box(store.charge_now(&hot, 1, 3_600_000, now)))
    });
    let mut i = 0usize;
    c.bench_function("memory charge (100k keys)", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            black_box(store.charge_now(&keys[i], 1, 3_600_000, now))
        })
    });
    c.bench_function("key derivation (HMAC-SHA256)", |b| {
        b.iter(|| black_box(scheme.key("core", "ip:203.0.113.7")))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
