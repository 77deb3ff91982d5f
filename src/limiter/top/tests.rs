//! Unit tests of the heavy-hitter counts.

use super::*;

fn client(id: &str) -> Who {
    Who::Client(Arc::new(Client::new(id.into(), "gold".into())))
}

fn who(w: &Who) -> WhoRef<'_> {
    match w {
        Who::Client(c) => WhoRef::Client(c),
        Who::Ip(ip) => WhoRef::Ip(*ip),
    }
}

#[test]
fn heavy_hitters_are_found_among_many_callers_and_memory_stays_bounded() {
    let top = Top::default();
    let (core, tier): (Arc<str>, Arc<str>) = ("core".into(), "gold".into());
    // 100,000 callers once each, and three heavy callers often.
    for i in 0..100_000u32 {
        let ip = IpAddr::from(i.to_be_bytes());
        top.used(&core, WhoRef::Ip(ip), &tier, 1, 600);
        if i % 100 == 0 {
            for (name, n) in [("a", 30), ("b", 20), ("c", 10)] {
                top.used(&core, who(&client(name)), &tier, n, 600);
            }
        }
    }
    let t = top.top(3, 610);
    let names: Vec<_> = t[&core].used.iter().map(|h| h.who.clone()).collect();
    assert_eq!(names, [client("a"), client("b"), client("c")]);
    assert!(t[&core].used[0].count >= 30_000);
    let entries: usize = top
        .shards
        .iter()
        .map(|s| s.lock().unwrap().used[0].entries.len())
        .sum();
    assert!(entries <= SHARDS * CAPACITY);
    // Two minutes later, forgotten.
    assert!(top.top(3, 740).is_empty());
}

#[test]
fn every_entry_stays_reachable_through_evictions() {
    let mut sketch = Sketch::default();
    let (core, tier): (Arc<str>, Arc<str>) = ("core".into(), "gold".into());
    let mut x = 1u32;
    for round in 0..20_000u32 {
        // A few callers often, many once: entries are replaced all the time.
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let ip = IpAddr::from((if round % 3 == 0 { x % 8 } else { x }).to_be_bytes());
        let who = WhoRef::Ip(ip);
        sketch.add(&core, who, who.hash(&core), &tier, 1);
        let filled = sketch.slots.iter().filter(|s| **s != 0).count();
        assert_eq!(filled, sketch.entries.len());
    }
    for (e, counted) in sketch.entries.iter().enumerate() {
        let who = who(&counted.key.who);
        let i = sketch.probe(who.hash(&core), &core, who).unwrap();
        assert_eq!(usize::from(sketch.slots[i]), e + 1);
    }
    // The frequent callers are there, with at least their true counts.
    let total: u64 = sketch.counts.iter().sum();
    assert_eq!(total, 20_000);
    let frequent = sketch
        .entries
        .iter()
        .filter(|c| matches!(c.key.who, Who::Ip(IpAddr::V4(ip)) if ip.to_bits() < 8))
        .count();
    assert_eq!(frequent, 8);
}
