//! Durations in the config file: strings such as `"250ms"`, `"2s"`, `"1m"`, `"1h"`, `"1d"`.

use serde::{Deserialize, Deserializer};
use std::time::Duration;

/// A duration written as a human string in the config file (parsed with `humantime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dur(pub Duration);

impl Dur {
    /// A duration of `ms` milliseconds.
    pub const fn from_millis(ms: u64) -> Self {
        Dur(Duration::from_millis(ms))
    }

    /// A duration of `s` seconds.
    pub const fn from_secs(s: u64) -> Self {
        Dur(Duration::from_secs(s))
    }

    /// The length in whole milliseconds.
    pub fn as_millis(&self) -> u64 {
        self.0.as_millis() as u64
    }
}

/// Parse `"250ms"`, `"2s"`, `"1m"`, `"1h"`, `"1d"` (and combinations such as `"1h 30m"`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| {
        format!(
            "invalid duration {s:?} ({e}); write e.g. \"250ms\", \"2s\", \"1m\", \"1h\", \"1d\""
        )
    })
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s)
            .map(Dur)
            .map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for Dur {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(self.0).to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_contract_examples() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("1d").unwrap(), Duration::from_secs(86400));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("10").is_err());
    }
}
