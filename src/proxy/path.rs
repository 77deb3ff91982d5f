//! One spelling per path, before routing: so that `//search`, `/./search`,
//! `/x/../search`, `/%73earch` and `/%2e/search` all match (and are limited by) the
//! `/search` route, and the upstream receives the path that was matched.
//!
//! The rules are RFC 3986's: percent-escapes of unreserved characters (letters, digits,
//! `-`, `.`, `_`, `~`) are decoded (section 6.2.2.2), other escapes get upper-case hex
//! digits (6.2.2.1), dot segments are removed (5.2.4), and runs of `/` are merged into
//! one. An escaped `/` (`%2F`) or `\` (`%5C`) is refused: servers disagree on whether
//! it separates segments, so no spelling of it is safe to route on.

/// Why a path cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// `%2F` or `%5C` in the path.
    #[error("the path contains an encoded slash or backslash ({0}); send it unencoded")]
    EncodedSeparator(&'static str),
    /// A `%` not followed by two hex digits.
    #[error("the path contains a malformed percent-escape")]
    BadEscape,
}

/// The normal form of `path` (the path only, without the query), or `None` when it is
/// already normal (the common case: no allocation).
///
/// Errors: [`PathError`] for an encoded separator or a malformed escape.
pub fn normalize(path: &str) -> Result<Option<String>, PathError> {
    if !suspicious(path.as_bytes()) {
        return Ok(None);
    }
    let decoded = decode_unreserved(path)?;
    let merged = merge_slashes(&decoded);
    let out = remove_dot_segments(&merged);
    Ok((out != path).then_some(out))
}

/// Whether `path` may not be in normal form: it does not start with `/`, or holds a
/// `%`, an empty segment (`//`) or a dot segment (`/./`, `/../`, or `/.`, `/..` at the
/// end). One pass over the bytes: every request's path goes through it.
fn suspicious(b: &[u8]) -> bool {
    if b.first() != Some(&b'/') {
        return true;
    }
    for (i, &c) in b.iter().enumerate() {
        if c == b'%' {
            return true;
        }
        if c == b'/' {
            let rest = &b[i + 1..];
            if rest.starts_with(b"/")
                || rest.starts_with(b"./")
                || rest.starts_with(b"../")
                || rest == b"."
                || rest == b".."
            {
                return true;
            }
        }
    }
    false
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Decode escapes of unreserved characters; upper-case the hex of the others.
fn decode_unreserved(path: &str) -> Result<String, PathError> {
    let b = path.as_bytes();
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'%' {
            // `path` is a str: copy whole UTF-8 sequences (only ASCII `%` is special).
            let next = path[i..].find('%').map_or(b.len(), |n| i + n);
            out.push_str(&path[i..next]);
            i = next;
            continue;
        }
        let (Some(hi), Some(lo)) = (
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) else {
            return Err(PathError::BadEscape);
        };
        let c = hi * 16 + lo;
        match c {
            b'/' => return Err(PathError::EncodedSeparator("%2F")),
            b'\\' => return Err(PathError::EncodedSeparator("%5C")),
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                out.push(c as char)
            }
            _ => {
                out.push('%');
                out.push_str(&format!("{c:02X}"));
            }
        }
        i += 3;
    }
    Ok(out)
}

/// `//a///b` → `/a/b`; a path that does not start with `/` gets one.
fn merge_slashes(path: &str) -> String {
    let mut out = String::with_capacity(path.len() + 1);
    if !path.starts_with('/') {
        out.push('/');
    }
    for c in path.chars() {
        if c == '/' && out.ends_with('/') {
            continue;
        }
        out.push(c);
    }
    out
}

/// RFC 3986 section 5.2.4 on an absolute path whose slashes are already merged.
fn remove_dot_segments(path: &str) -> String {
    let mut segments: Vec<&str> = Vec::new();
    let parts: Vec<&str> = path[1..].split('/').collect();
    let last = parts.len() - 1;
    let mut trailing_slash = false;
    for (i, seg) in parts.iter().enumerate() {
        match *seg {
            "." => trailing_slash = i == last,
            ".." => {
                segments.pop();
                trailing_slash = i == last;
            }
            s => {
                segments.push(s);
                trailing_slash = false;
            }
        }
    }
    let mut out = String::with_capacity(path.len());
    out.push('/');
    out.push_str(&segments.join("/"));
    if trailing_slash && !out.ends_with('/') {
        out.push('/');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(p: &str) -> String {
        normalize(p).unwrap().unwrap_or_else(|| p.to_string())
    }

    #[test]
    fn every_spelling_of_search_is_search() {
        for p in [
            "/search",
            "//search",
            "/./search",
            "/x/../search",
            "/%73earch",
            "/%2e/search",
            "/%2E%2E/search",
            "/a/b/../../search",
            "///search",
        ] {
            assert_eq!(n(p), "/search", "{p}");
        }
    }

    #[test]
    fn normal_paths_are_not_copied() {
        assert_eq!(normalize("/v1/orders/7").unwrap(), None);
        assert_eq!(normalize("/").unwrap(), None);
        assert_eq!(normalize("/a.b/c..d/").unwrap(), None);
    }

    #[test]
    fn dot_segments_keep_the_trailing_slash() {
        assert_eq!(n("/a/b/."), "/a/b/");
        assert_eq!(n("/a/b/.."), "/a/");
        assert_eq!(n("/.."), "/");
        assert_eq!(n("/a/%7Euser"), "/a/~user");
        assert_eq!(n("/a%20b/%c3%a9"), "/a%20b/%C3%A9");
    }

    #[test]
    fn encoded_separators_and_bad_escapes_are_refused() {
        assert_eq!(
            normalize("/%2Fsearch"),
            Err(PathError::EncodedSeparator("%2F"))
        );
        assert_eq!(normalize("/a%5cb"), Err(PathError::EncodedSeparator("%5C")));
        assert_eq!(normalize("/a%2"), Err(PathError::BadEscape));
        assert_eq!(normalize("/a%zz"), Err(PathError::BadEscape));
    }

    #[test]
    fn the_one_pass_check_finds_what_the_substring_checks_found() {
        let old = |path: &str| {
            path.as_bytes().contains(&b'%')
                || path.contains("//")
                || path.contains("/./")
                || path.contains("/../")
                || path.ends_with("/.")
                || path.ends_with("/..")
                || !path.starts_with('/')
        };
        // Every path of up to 6 characters over the alphabet that matters.
        let alphabet = ['/', '.', 'a', '%'];
        let mut paths = vec![String::new()];
        for _ in 0..6 {
            let longer: Vec<String> = paths
                .iter()
                .filter(|p| p.len() == paths.last().map_or(0, String::len))
                .flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}")))
                .collect();
            paths.extend(longer);
        }
        assert!(paths.len() > 5000);
        for p in &paths {
            assert_eq!(suspicious(p.as_bytes()), old(p), "{p:?}");
        }
    }
}
