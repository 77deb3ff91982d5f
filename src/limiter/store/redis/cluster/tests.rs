use super::slots::*;
use super::*;

/// Redis's own examples (CLUSTER KEYSLOT) and the hash-tag rule.
#[test]
fn slots_follow_redis_and_its_hash_tags() {
    assert_eq!(slot_of(b"foo"), 12182);
    assert_eq!(slot_of(b"123456789"), 0x31c3 % SLOTS);
    assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
    assert_eq!(slot_of(b"tollgate:core:{abc}"), slot_of(b"abc"));
    // An empty tag hashes the whole key; only the first `{` counts.
    assert_eq!(slot_of(b"{}x"), slot_of(b"{}x"));
    assert_ne!(slot_of(b"{}x"), slot_of(b""));
    assert_eq!(slot_of(b"a{b}{c}"), slot_of(b"b"));
}

#[test]
fn cluster_slots_replies_parse_and_bad_ones_are_errors() {
    let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
    let reply = Value::Array(vec![
        Value::Array(vec![
            Value::Int(0),
            Value::Int(5460),
            Value::Array(vec![bulk("10.0.0.1"), Value::Int(7000), bulk("id1")]),
            Value::Array(vec![bulk("10.0.0.4"), Value::Int(7003), bulk("id4")]),
        ]),
        Value::Array(vec![
            Value::Int(5461),
            Value::Int(16383),
            Value::Array(vec![bulk(""), Value::Int(7001), bulk("id2")]),
        ]),
    ]);
    assert_eq!(
        parse_slots(&reply, "10.0.0.2:7001").unwrap(),
        vec![
            (0, 5460, "10.0.0.1:7000".to_string()),
            (5461, 16383, "10.0.0.2:7001".to_string())
        ]
    );
    let bad = Value::Array(vec![Value::Array(vec![Value::Int(0), Value::Int(99999)])]);
    assert!(parse_slots(&bad, "h:1").is_err());
    assert!(parse_slots(&Value::Nil, "h:1").is_err());
}

#[test]
fn a_map_finds_each_slots_owner() {
    let map = SlotMap {
        ranges: vec![(0, 99, 0), (200, 16383, 1)],
        masters: Vec::new(),
    };
    let idx = |slot| map.index_of(slot);
    assert_eq!(idx(0), Some(0));
    assert_eq!(idx(99), Some(0));
    assert_eq!(idx(100), None);
    assert_eq!(idx(16383), Some(1));
}
