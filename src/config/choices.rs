//! The string choices of the config file as enums: `limits.align`, `limits.mode`,
//! `limits.on_limit`, `limits.by`, `routes.path_match` and `routes.charge`.
//!
//! Each is read from its string by serde, so a bad value is a parse error at its line
//! and column, worded `"VALUE": expected "a" or "b"`; each is written back (in
//! `GET /config`) as the same string.

use serde::{Deserialize, Serialize};
use std::fmt;

/// An enum of unit variants read from and written as fixed strings. `$expected` is the
/// list of choices in an error message.
macro_rules! choice {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )+
        }
        expected $expected:literal
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
        #[serde(try_from = "String", into = "&'static str")]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// The value as written in the config file.
            pub fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }
        }

        impl From<$name> for &'static str {
            fn from(v: $name) -> &'static str {
                v.name()
            }
        }

        impl TryFrom<String> for $name {
            type Error = String;

            fn try_from(s: String) -> Result<Self, String> {
                match s.as_str() {
                    $( $text => Ok($name::$variant), )+
                    other => Err(format!(concat!("{:?}: expected ", $expected), other)),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

choice! {
    /// `limits.align`: where a fixed window starts.
    pub enum WindowAlign {
        /// At the caller's first charge (the default).
        #[default]
        FirstRequest = "first_request",
        /// At UTC boundaries: the hour, the day, the month for `window = "1mo"`.
        Calendar = "calendar",
    }
    expected "\"first_request\" or \"calendar\""
}

choice! {
    /// `limits.mode`: whether a limit refuses.
    pub enum LimitMode {
        /// Refuse what the limit does not admit (the default).
        #[default]
        Enforce = "enforce",
        /// Evaluate and report (log, metric, headers), never refuse.
        Shadow = "shadow",
    }
    expected "\"enforce\" or \"shadow\""
}

choice! {
    /// `limits.on_limit`: what a refused request gets.
    pub enum OnLimit {
        /// 429 at once (the default).
        #[default]
        Reject = "reject",
        /// Held until the limit would admit it, within `max_delay` and `max_waiting`.
        Delay = "delay",
    }
    expected "\"reject\" or \"delay\""
}

choice! {
    /// `routes.path_match`: how `path_prefix` matches.
    pub enum PathMatch {
        /// The path starts with `path_prefix`, character for character (the default).
        #[default]
        Prefix = "prefix",
        /// Whole path segments only.
        Segments = "segments",
    }
    expected "\"prefix\" or \"segments\""
}

choice! {
    /// `routes.charge`: when a request is charged.
    pub enum ChargeAt {
        /// Once the response status is known (the default).
        #[default]
        AfterResponse = "after_response",
        /// Reserved when the request is admitted, refunded for an uncharged status.
        OnRequest = "on_request",
    }
    expected "\"after_response\" or \"on_request\""
}

/// `limits.by`: what a window counts, read from `"caller"`, `"ip"`, `"global"` or
/// `"header:NAME"` (NAME a valid header name, in any case, surrounding white space
/// ignored).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub enum LimitBy {
    /// The client id for callers with a key, else the client IP (the default).
    #[default]
    Caller,
    /// The client IP, key or no key.
    Ip,
    /// One window shared by every caller.
    Global,
    /// The value of this request header, as written after `header:` (not yet trimmed
    /// or lowercased).
    Header(String),
}

impl LimitBy {
    /// The header name of `Header`, as written after `header:`.
    pub fn header(&self) -> Option<&str> {
        match self {
            LimitBy::Header(name) => Some(name),
            _ => None,
        }
    }
}

impl TryFrom<String> for LimitBy {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "caller" => Ok(LimitBy::Caller),
            "ip" => Ok(LimitBy::Ip),
            "global" => Ok(LimitBy::Global),
            other => match other.strip_prefix("header:") {
                Some(h)
                    if http::HeaderName::from_bytes(h.trim().to_ascii_lowercase().as_bytes())
                        .is_ok() =>
                {
                    Ok(LimitBy::Header(h.to_string()))
                }
                _ => Err(format!(
                    "{other:?}: expected \"caller\", \"ip\", \"global\" or \"header:NAME\""
                )),
            },
        }
    }
}

impl From<LimitBy> for String {
    fn from(by: LimitBy) -> String {
        by.to_string()
    }
}

impl fmt::Display for LimitBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitBy::Caller => f.write_str("caller"),
            LimitBy::Ip => f.write_str("ip"),
            LimitBy::Global => f.write_str("global"),
            LimitBy::Header(name) => write!(f, "header:{name}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_read_and_write_their_strings_and_name_the_bad_value() {
        assert_eq!(
            ChargeAt::try_from("on_request".to_string()),
            Ok(ChargeAt::OnRequest)
        );
        assert_eq!(
            ChargeAt::try_from("later".to_string()).unwrap_err(),
            "\"later\": expected \"after_response\" or \"on_request\""
        );
        assert_eq!(WindowAlign::default().name(), "first_request");
        assert_eq!(
            LimitBy::try_from("header:X-Tenant".to_string()),
            Ok(LimitBy::Header("X-Tenant".into()))
        );
        assert_eq!(
            LimitBy::Header("X-Tenant".into()).to_string(),
            "header:X-Tenant"
        );
        assert!(LimitBy::try_from("header:a b".to_string()).is_err());
        assert!(LimitBy::try_from("tenant".to_string()).is_err());
    }
}
