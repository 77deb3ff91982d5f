//! What `tollgate key new` and `tollgate key add` need: a new random key with its
//! keys-file line, and appending a line to the keys file.

use std::path::Path;

/// What `tollgate key new` makes: a new random key and its keys-file line.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// The key: `tg_` and 256 random bits in URL-safe base64 without padding (46
    /// characters). Shown once; only its hash is stored.
    pub key: String,
    /// The JSON line of the keys file for it (no newline).
    pub line: String,
}

/// Prefix of keys made by [`new_key`], so that a leaked one is recognisable.
pub const KEY_PREFIX: &str = "tg_";

/// A new random key (256 bits from the operating system's generator) for client `id`
/// in `tier`, with its keys-file line; `label` goes into the line when given.
///
/// Errors: the operating system's random generator failed.
pub fn new_key(id: &str, tier: &str, label: Option<&str>) -> std::io::Result<NewKey> {
    use base64::Engine;
    use ring::rand::SecureRandom;
    use sha2::{Digest, Sha256};
    let mut random = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut random)
        .map_err(|_| std::io::Error::other("the system's random generator failed"))?;
    let key = format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random)
    );
    let mut line = serde_json::Map::new();
    line.insert("id".into(), id.into());
    line.insert(
        "key_sha256".into(),
        hex::encode(Sha256::digest(key.as_bytes())).into(),
    );
    line.insert("tier".into(), tier.into());
    if let Some(label) = label {
        line.insert("label".into(), label.into());
    }
    Ok(NewKey {
        key,
        line: serde_json::Value::Object(line).to_string(),
    })
}

/// Append `line` to the keys file at `path` (created if missing), on a line of its own.
///
/// Errors: the file could not be opened, read or written.
pub fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)?;
    let len = f.metadata()?.len();
    let mut text = String::with_capacity(line.len() + 2);
    if len > 0 {
        let mut last = [0u8; 1];
        f.seek(SeekFrom::End(-1))?;
        std::io::Read::read_exact(&mut f, &mut last)?;
        if last[0] != b'\n' {
            text.push('\n');
        }
    }
    text.push_str(line);
    text.push('\n');
    f.write_all(text.as_bytes())
}
