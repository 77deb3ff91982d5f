//! Unit tests of the rate-limit headers' formatting.

use super::*;

fn usage(name: &str, quota: u64, used: u64, reset_at_ms: u64) -> Usage {
    Usage {
        resource: name.into(),
        quota,
        used,
        reset_at_ms,
        retry_at_ms: 0,
        more_at_ms: 0,
        blocked_until_ms: 0,
    }
}

fn policy(name: &str, quota: u64, window_ms: u64) -> Policy<'_> {
    Policy {
        name,
        quota,
        window_ms,
        unit: None,
        partition: None,
    }
}

#[test]
fn policy_lists_every_limit() {
    let v = policy_value(
        [
            policy("burst", 100, 60_000),
            policy("daily", 1000, 86_400_000),
        ],
        false,
    );
    assert_eq!(
        v.unwrap().to_str().unwrap(),
        r#""burst";q=100;w=60, "daily";q=1000;w=86400"#
    );
    assert_eq!(policy_value([], false), None);
    // Whole seconds, rounded up.
    let v = policy_value([policy("x", 1, 1_500)], false).unwrap();
    assert_eq!(v.to_str().unwrap(), r#""x";q=1;w=2"#);
}

#[test]
fn ratelimit_counts_seconds_up_and_never_below_zero() {
    let u = usage("burst", 100, 58, 17_000);
    assert_eq!(
        ratelimit_value(&u, 0, None).unwrap(),
        r#""burst";r=42;t=17"#
    );
    assert_eq!(
        ratelimit_value(&u, 16_001, None).unwrap(),
        r#""burst";r=42;t=1"#
    );
    assert_eq!(
        ratelimit_value(&u, 17_000, None).unwrap(),
        r#""burst";r=42;t=0"#
    );
    assert_eq!(
        ratelimit_value(&u, 20_000, None).unwrap(),
        r#""burst";r=42;t=0"#
    );
    let over = usage("burst", 100, 130, 17_000);
    assert_eq!(
        ratelimit_value(&over, 0, None).unwrap(),
        r#""burst";r=0;t=17"#
    );
}

#[test]
fn names_are_escaped_and_non_ascii_is_refused() {
    let v = policy_value([policy(r#"a"b\c"#, 1, 1_000)], false).unwrap();
    assert_eq!(v.to_str().unwrap(), r#""a\"b\\c";q=1;w=1"#);
    assert_eq!(policy_value([policy("café", 1, 1_000)], false), None);
    assert_eq!(ratelimit_value(&usage("café", 1, 0, 0), 0, None), None);
}

#[test]
fn integers_are_clamped_to_the_sf_integer_range() {
    let v = policy_value([policy("x", u64::MAX, u64::MAX)], false).unwrap();
    assert_eq!(
        v.to_str().unwrap(),
        r#""x";q=999999999999999;w=999999999999999"#
    );
}

#[test]
fn styles_select_the_fields() {
    let u = usage("core", 10, 3, 5_000);
    let p = [policy("core", 10, 60_000)];
    let mut h = HeaderMap::new();
    h.insert("ratelimit", HeaderValue::from_static("upstream"));
    put(&mut h, Styles::new(&[HeaderStyle::Ietf]), &u, p, 1_000);
    assert_eq!(h["ratelimit"], r#""core";r=7;t=4"#, "replaced");
    assert_eq!(h["ratelimit-policy"], r#""core";q=10;w=60"#);
    assert!(h.get("x-ratelimit-limit").is_none());

    let mut h = HeaderMap::new();
    put(&mut h, Styles::new(&[]), &u, p, 1_000);
    assert!(h.is_empty());

    let mut h = HeaderMap::new();
    put(&mut h, Styles::default(), &u, p, 1_000);
    assert_eq!(h["x-ratelimit-remaining"], "7");
    assert!(h.get("ratelimit").is_none());
}

#[test]
fn numbers_are_written_as_http_writes_them() {
    for n in [
        0,
        1,
        9,
        10,
        99,
        1000,
        4_294_967_296,
        999_999_999_999_999,
        u64::MAX,
    ] {
        assert_eq!(number(n), HeaderValue::from(n), "{n}");
    }
}

#[test]
fn remembered_numbers_are_the_numbers() {
    for n in [60, 60, 61, 60, 0, u64::MAX, u64::MAX, 1_700_000_000] {
        assert_eq!(remembered(Remembered::Quota, n), number(n));
        assert_eq!(remembered(Remembered::Reset, n / 2), number(n / 2));
    }
}

#[test]
fn the_resource_memo_gives_each_name_its_own_value() {
    let (a, b): (Arc<str>, Arc<str>) = ("burst".into(), "daily".into());
    for name in [&a, &a, &b, &a, &b, &b] {
        assert_eq!(resource_value(name).unwrap(), name.as_ref());
    }
    // The same text in another allocation (a reload) gives the same value.
    assert_eq!(resource_value(&Arc::from("daily")).unwrap(), "daily");
    // A name that cannot be a header value gives none, and forgets nothing wrong.
    assert!(resource_value(&Arc::from("bad\nname")).is_none());
    assert_eq!(resource_value(&b).unwrap(), "daily");
}

#[test]
fn t_counts_to_more_quota_and_never_past_retry_after() {
    // Admitted, with the next unit back at 2.5 s although the reset is at 17 s.
    let u = Usage {
        more_at_ms: 2_500,
        ..usage("g", 10, 4, 17_000)
    };
    assert_eq!(ratelimit_value(&u, 0, None).unwrap(), r#""g";r=6;t=3"#);
    assert_eq!(u.more_at_s(2_500), 0);
    // Refused: t is the instant more quota arrives, capped by Retry-After.
    let refused = Usage {
        more_at_ms: 9_000,
        retry_at_ms: 4_000,
        ..usage("g", 10, 10, 17_000)
    };
    assert_eq!(refused.retry_after_s(0), 4);
    assert_eq!(
        ratelimit_value(&refused, 0, None).unwrap(),
        r#""g";r=0;t=4"#
    );
    // Unknown (0): the reset, as before.
    assert_eq!(usage("g", 10, 4, 17_000).more_at_s(0), 17);
}

#[test]
fn a_concurrency_limit_names_its_unit() {
    let p = Policy {
        unit: Some(QU_CONCURRENT),
        ..policy("inflight", 5, 60_000)
    };
    let v = policy_value([policy("core", 100, 60_000), p], false).unwrap();
    assert_eq!(
        v.to_str().unwrap(),
        r#""core";q=100;w=60, "inflight";q=5;qu="concurrent-requests";w=60"#
    );
}

#[test]
fn the_partition_key_is_the_digest_as_a_byte_sequence() {
    let key = "tollgate:core:{000102030405060708090a0b0c0d0e0f}";
    let p = Policy {
        partition: Some(key),
        ..policy("core", 100, 60_000)
    };
    // base64 of bytes 0..16.
    let pk = "AAECAwQFBgcICQoLDA0ODw==";
    assert_eq!(
        policy_value([p], true).unwrap().to_str().unwrap(),
        format!(r#""core";q=100;w=60;pk=:{pk}:"#)
    );
    assert_eq!(
        policy_value([p], false).unwrap().to_str().unwrap(),
        r#""core";q=100;w=60"#
    );
    let u = usage("core", 100, 1, 5_000);
    assert_eq!(
        ratelimit_value(&u, 0, Some(key)).unwrap().to_str().unwrap(),
        format!(r#""core";r=99;t=5;pk=:{pk}:"#)
    );
    // put: pk only with `headers.partition_key`, on both fields, for the limit described.
    let other = Policy {
        partition: Some("tollgate:daily:{ffffffffffffffffffffffffffffffff}"),
        ..policy("daily", 1000, 86_400_000)
    };
    let styles = Styles {
        partition_key: true,
        ..Styles::new(&[HeaderStyle::Ietf])
    };
    let mut h = HeaderMap::new();
    put(&mut h, styles, &u, [other, p], 0);
    assert_eq!(
        h["ratelimit-policy"],
        format!(
            r#""daily";q=1000;w=86400;pk=://///////////////////w==:, "core";q=100;w=60;pk=:{pk}:"#
        )
        .as_str()
    );
    assert_eq!(
        h["ratelimit"],
        format!(r#""core";r=99;t=5;pk=:{pk}:"#).as_str()
    );
    let mut h = HeaderMap::new();
    put(&mut h, Styles::new(&[HeaderStyle::Ietf]), &u, [other, p], 0);
    assert!(!h["ratelimit"].to_str().unwrap().contains("pk="));
    assert!(!h["ratelimit-policy"].to_str().unwrap().contains("pk="));
    // A key without a digest gives no pk.
    let odd = Policy {
        partition: Some("tollgate:core"),
        ..p
    };
    assert_eq!(
        policy_value([odd], true).unwrap().to_str().unwrap(),
        r#""core";q=100;w=60"#
    );
}

#[test]
fn a_storage_key_gives_its_digest() {
    assert_eq!(
        partition_of("tollgate:core:{000102030405060708090a0b0c0d0e0f}"),
        Some("000102030405060708090a0b0c0d0e0f")
    );
    assert_eq!(partition_of("tollgate:core:{short}"), None);
    assert_eq!(partition_of("tollgate:core"), None);
}
