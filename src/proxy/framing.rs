//! What an upstream's response head says about the length of its body, made into one
//! reading before the response goes on to the client, whatever HTTP version each side
//! speaks:
//!
//! - `Transfer-Encoding` and `Content-Length` both: the transfer coding framed the body
//!   (hyper's HTTP/1.1 client read it so), and `Content-Length` is removed (RFC 9112
//!   §6.3, as nginx does). Passed on, the length would promise bytes that never come.
//! - `Content-Length` on a 1xx, a 204 or a 304: removed (RFC 9110 §8.6: a server MUST
//!   NOT send one on a 1xx or 204; HTTP/2 clients such as nghttp2 reject the response).
//!   On a 304 it would be allowed (the length of the representation), but hyper's
//!   HTTP/1.1 server drops it there anyway, and HTTP/2 clients get none either, so that
//!   both protocols see the same head.
//! - Several `Content-Length` values (`5, 5`, or two fields): one value when they are all
//!   the same number (RFC 9110 §8.6), [`InvalidLength`] (the client gets 502) when not.
//!   An HTTP/1.1 upstream's unequal values are refused by hyper's client already; this
//!   check is what catches an HTTP/2 upstream's.

use http::header::{self, HeaderMap, HeaderValue};
use http::StatusCode;

/// A response whose `Content-Length` values disagree (or are no numbers): its length is
/// unknown, and it cannot be passed on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Content-Length values that disagree or are no numbers: {0:?}")]
pub struct InvalidLength(pub String);

/// Settle the framing headers of a response with `status`, `upstream_chunked` telling
/// whether the upstream framed it with a transfer coding (read before the hop-by-hop
/// headers are removed).
pub fn settle(
    headers: &mut HeaderMap,
    status: StatusCode,
    upstream_chunked: bool,
) -> Result<(), InvalidLength> {
    let no_length = upstream_chunked
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    if no_length {
        headers.remove(header::CONTENT_LENGTH);
        return Ok(());
    }
    let mut values = headers.get_all(header::CONTENT_LENGTH).iter();
    let (Some(first), None) = (values.next(), values.next()) else {
        // None (nothing to do), or several fields: folded below.
        return fold(headers);
    };
    let digits = !first.is_empty() && first.as_bytes().iter().all(u8::is_ascii_digit);
    if digits && first.to_str().is_ok_and(|v| v.parse::<u64>().is_ok()) {
        // The usual case: one field holding one number.
        return Ok(());
    }
    fold(headers)
}

/// Every `Content-Length` value (fields and the comma-separated items in each) as one
/// field holding the one number they all are; [`InvalidLength`] when they differ or
/// one is not a number. No field: nothing to do.
fn fold(headers: &mut HeaderMap) -> Result<(), InvalidLength> {
    let mut length: Option<u64> = None;
    let mut any = false;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        any = true;
        let invalid = || InvalidLength(String::from_utf8_lossy(value.as_bytes()).into_owned());
        let text = value.to_str().map_err(|_| invalid())?;
        for item in text.split(',') {
            let item = item.trim();
            if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
                return Err(invalid());
            }
            let n: u64 = item.parse().map_err(|_| invalid())?;
            match length {
                Some(known) if known != n => return Err(invalid()),
                _ => length = Some(n),
            }
        }
    }
    if let (true, Some(n)) = (any, length) {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::CONTENT_LENGTH, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn lengths(h: &HeaderMap) -> Vec<&str> {
        h.get_all(header::CONTENT_LENGTH)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect()
    }

    #[test]
    fn equal_lengths_become_one_and_unequal_ones_are_refused() {
        for (values, want) in [
            (&["5"][..], Ok(vec!["5"])),
            (&["5, 5"][..], Ok(vec!["5"])),
            (&["5", "5"][..], Ok(vec!["5"])),
            (&["5,5", " 5 "][..], Ok(vec!["5"])),
            (&["5, 6"][..], Err(())),
            (&["5", "6"][..], Err(())),
            (&["5, "][..], Err(())),
            (&["-5"][..], Err(())),
            (&["x"][..], Err(())),
            (&["99999999999999999999999"][..], Err(())),
        ] {
            let mut h = head(values);
            let got = settle(&mut h, StatusCode::OK, false);
            match want {
                Ok(want) => {
                    assert!(got.is_ok(), "{values:?}");
                    assert_eq!(lengths(&h), want, "{values:?}");
                }
                Err(()) => assert!(got.is_err(), "{values:?}"),
            }
        }
    }

    #[test]
    fn chunked_1xx_204_and_304_have_no_length() {
        for (status, chunked, kept) in [
            (StatusCode::OK, true, false),
            (StatusCode::NO_CONTENT, false, false),
            (StatusCode::EARLY_HINTS, false, false),
            (StatusCode::NOT_MODIFIED, false, false),
            (StatusCode::OK, false, true),
            (StatusCode::NOT_FOUND, false, true),
        ] {
            let mut h = head(&["100"]);
            settle(&mut h, status, chunked).unwrap();
            assert_eq!(
                h.contains_key(header::CONTENT_LENGTH),
                kept,
                "{status} chunked={chunked}"
            );
        }
    }
}
