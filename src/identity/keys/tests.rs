use super::*;
use crate::config::ClientConfig;
use sha2::{Digest, Sha256};
use std::sync::Arc;

fn digest(i: usize) -> [u8; 32] {
    Sha256::digest(format!("key-{i}").as_bytes()).into()
}

/// A source of the keys file `text` (in `dir`) and the inline `clients`.
fn source_of(dir: &tempfile::TempDir, text: &str, inline: Vec<ClientConfig>) -> KeySource {
    let path = dir.path().join("keys.jsonl");
    std::fs::write(&path, text).unwrap();
    KeySource {
        inline,
        file: Some(path),
        limits: None,
        tiers: None,
        by_id: false,
        max_bytes: u64::MAX,
    }
}

#[test]
fn labels_and_expiry_belong_to_their_key_and_a_reload_shares_the_labels() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::new();
    for i in 0..3000usize {
        let mut line =
            serde_json::json!({"id": format!("c{}", i / 3), "key_sha256": hex::encode(digest(i))});
        if i % 3 == 0 {
            line["label"] = format!("key {i}").into();
        }
        if i % 5 == 0 {
            line["expires_at"] = (1_000_000 + i).into();
        }
        text.push_str(&format!("{line}\n"));
    }
    let source = source_of(&dir, &text, Vec::new());
    let set = source.build(None).unwrap();
    assert_eq!((set.keys(), set.clients()), (3000, 1000));
    for i in 0..3000usize {
        let expires = 1_000_000 + i as u64;
        let found = set.find(&digest(i), || expires - 1).unwrap();
        assert_eq!(&*found.client.id, format!("c{}", i / 3));
        assert!(found.active);
        assert_eq!(
            found.label.map(|l| &**l),
            (i % 3 == 0).then(|| format!("key {i}")).as_deref()
        );
        let later = set.find(&digest(i), || expires).unwrap();
        assert_eq!(later.active, i % 5 != 0, "key {i}");
    }
    let again = source.build(Some(&set)).unwrap();
    assert_eq!(again.labels.len(), 1000);
    assert!(set
        .labels
        .iter()
        .zip(&again.labels)
        .all(|(a, b)| Arc::ptr_eq(a, b)));
}

#[test]
fn errors_that_name_an_earlier_line_name_it() {
    let dir = tempfile::tempdir().unwrap();
    let line = |id: &str, k: usize, extra: &str| {
        format!(
            "{{\"id\": \"{id}\", \"key_sha256\": \"{}\"{extra}}}\n",
            hex::encode(digest(k))
        )
    };
    let text = [
        line("acme", 1, r#", "tier": "gold", "quotas": {"core": 5}"#),
        line("acme", 2, r#", "quotas": {"core": 6}"#),
        line("acme", 3, r#", "disabled": true"#),
        line("acme", 4, r#", "disabled": false"#),
        line("bob", 1, ""),
        line("bob", 5, r#", "tier": "silver""#),
    ]
    .concat();
    let inline = vec![ClientConfig {
        id: "bob".into(),
        tier: "gold".into(),
        key_sha256: crate::config::KeyHashes::One(hex::encode(digest(6))),
    }];
    let source = source_of(&dir, &text, inline);
    let p = source.file.as_deref().unwrap().display().to_string();
    let lines = source.build(None).unwrap_err().lines();
    assert_eq!(
            lines,
            [
                format!("{p}:2: quotas differ from those given at line 1 for client \"acme\" (give them on one line, or the same on each)"),
                format!("{p}:4: disabled false differs from true given at line 3 for client \"acme\" (disabling a client disables all its keys; to retire one key, remove it or give it an expires_at)"),
                format!("{p}:6: tier \"silver\" differs from \"gold\" given at identity.clients[0] for client \"bob\" (a client has one tier: give it on one line, or the same on each)"),
                format!("{p}:5: the same key is already given at line 1 (a key hash must be unique across identity.clients and identity.clients_file)"),
            ]
        );

    // A repeated key alone (found when the table is made, after the whole file).
    let text = [
        line("acme", 1, ""),
        line("bob", 2, ""),
        line("carol", 1, ""),
    ]
    .concat();
    let lines = source_of(&dir, &text, Vec::new())
        .build(None)
        .unwrap_err()
        .lines();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
            lines[0].ends_with(":3: the same key is already given at line 1 (a key hash must be unique across identity.clients and identity.clients_file)"),
            "{lines:?}"
        );
}

#[test]
fn every_key_is_found_and_no_other() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.jsonl");
    let mut text = String::new();
    for i in 0..5000 {
        text.push_str(&format!(
            "{{\"id\": \"c{}\", \"key_sha256\": \"{}\"}}\n",
            i / 2,
            hex::encode(digest(i))
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
    // Built again over itself: every client is shared.
    let again = source.build(Some(&set)).unwrap();
    assert!(set
        .clients
        .iter()
        .zip(&again.clients)
        .all(|(a, b)| Arc::ptr_eq(a, b)));
    assert_eq!((set.keys(), set.clients()), (5000, 2500));
    for i in 0..5000 {
        let found = set.find(&digest(i), || 0).unwrap();
        assert_eq!(&*found.client.id, format!("c{}", i / 2));
        assert!(found.active);
    }
    for i in 5000..10000 {
        assert!(set.find(&digest(i), || 0).is_none());
    }
}
