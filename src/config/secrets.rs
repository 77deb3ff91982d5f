//! Secrets written inline (`x`) or kept in a file (`x_file`): Redis passwords,
//! `store.hash_key`, the JWT HMAC secret.
//!
//! A file is read at every load and reload, by the loading step ([`super::files`]). A
//! relative path is looked up in `$CREDENTIALS_DIRECTORY` first (set by systemd's
//! `LoadCredential=`), then relative to the config file's directory (like every other
//! path in the config). One trailing newline (`\n` or `\r\n`) is stripped, so
//! `echo "$SECRET" > file` works.

use super::{Files, Problems};
use std::path::{Path, PathBuf};

/// Where a secret file named `path` in the config is read from: `path` itself when
/// absolute; else `$CREDENTIALS_DIRECTORY/path` when that variable is set and the file
/// exists there; else `base_dir/path`.
pub fn secret_path(path: &str, base_dir: &Path) -> PathBuf {
    let p = Path::new(path);
    if p.is_absolute() {
        return p.to_path_buf();
    }
    if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY").filter(|d| !d.is_empty()) {
        let candidate = Path::new(&dir).join(p);
        if candidate.exists() {
            return candidate;
        }
    }
    base_dir.join(p)
}

/// The secret of key `at` (e.g. `store.password`): `value` as written, or the contents
/// of `file` as the loading step read them (from `files`, at `{at}_file`; see the module
/// documentation), or `None` when neither is given. Errors, recorded at `{at}_file`:
/// both given; the file missing, unreadable, not UTF-8 or empty.
pub fn secret(
    at: &str,
    value: Option<&str>,
    file: Option<&str>,
    files: &Files,
    problems: &mut Problems,
) -> Option<String> {
    let key = at.rsplit('.').next().unwrap_or(at);
    match (value, file) {
        (None, None) => None,
        (Some(v), None) => Some(v.to_string()),
        (Some(_), Some(_)) => {
            problems.error(
                format!("{at}_file"),
                format!("give either `{key}` or `{key}_file`, not both"),
            );
            None
        }
        (None, Some(_)) => file_text(&format!("{at}_file"), files, problems),
    }
}

/// The text of the secret file named at key `at` (e.g. `tracing.headers_file.NAME`), as
/// the loading step read it (from `files`), without one trailing newline. Errors,
/// recorded at `at`: the file missing, unreadable, not UTF-8 or empty.
pub fn file_text(at: &str, files: &Files, problems: &mut Problems) -> Option<String> {
    let (path, bytes) = files.bytes(at, problems)?;
    match String::from_utf8(bytes.to_vec()) {
        Err(_) => {
            problems.error(at, format!("{} is not UTF-8 text", path.display()));
            None
        }
        Ok(mut text) => {
            if text.ends_with('\n') {
                text.pop();
                if text.ends_with('\r') {
                    text.pop();
                }
            }
            if text.is_empty() {
                problems.error(at, format!("{} is empty", path.display()));
                return None;
            }
            Some(text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_file_loses_one_trailing_newline_and_errors_name_the_file_key() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pw"), "s3cret\n").unwrap();
        std::fs::write(dir.path().join("crlf"), "two\r\n\r\n").unwrap();
        std::fs::write(dir.path().join("empty"), "\n").unwrap();
        let mut p = Problems::default();
        // The loading step's part: the file named at `store.password_file`, read.
        let loaded = |f: &str| {
            Files::read([crate::config::files::Named {
                key: "store.password_file".into(),
                path: secret_path(f, dir.path()),
            }])
        };
        let read =
            |f: &str, p: &mut Problems| secret("store.password", None, Some(f), &loaded(f), p);
        assert_eq!(read("pw", &mut p).as_deref(), Some("s3cret"));
        assert_eq!(read("crlf", &mut p).as_deref(), Some("two\r\n"));
        assert!(p.is_ok());
        assert_eq!(read("empty", &mut p), None);
        assert_eq!(read("missing", &mut p), None);
        assert_eq!(
            secret(
                "store.password",
                Some("x"),
                Some("pw"),
                &loaded("pw"),
                &mut p
            ),
            None
        );
        let keys: Vec<&str> = p.errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(keys, ["store.password_file"; 3]);
        assert!(p.errors[0].message.ends_with("is empty"), "{:?}", p.errors);
        assert!(
            p.errors[1].message.starts_with("cannot read "),
            "{:?}",
            p.errors
        );
        assert!(p.errors[2].message.contains("not both"), "{:?}", p.errors);
    }
}
