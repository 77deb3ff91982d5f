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

/// Parse `"250ms"`, `"2s"`, `"1m"`, `"1h"`, `"1d"`, `"1w"`, `"1mo"` (and combinations such
/// as `"1h 30m"`) with `humantime`, whose units are case-sensitive: `"1M"` would be a
/// month and `"1m"` a minute. A bare `M` is therefore refused with a hint, and `mo` is
/// accepted for a month.
///
/// Errors: a message that quotes the value and gives examples.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let text = s.trim();
    let mut spelled = String::with_capacity(text.len() + 8);
    for (i, token) in units(text) {
        match token {
            "M" => {
                let number: String = text[..i]
                    .chars()
                    .rev()
                    .take_while(|c| c.is_ascii_digit() || *c == '.')
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                return Err(format!(
                    "ambiguous duration {s:?}: \"{number}M\" is a month; write \"{number}mo\" for a month or \"{number}m\" for a minute"
                ));
            }
            "mo" => spelled.push_str("month"),
            other => spelled.push_str(other),
        }
    }
    humantime::parse_duration(&spelled).map_err(|e| {
        format!(
            "invalid duration {s:?} ({e}); write e.g. \"250ms\", \"2s\", \"1m\", \"1h\", \"1d\", \"1mo\""
        )
    })
}

/// `text` split into runs: alphabetic runs (units) and everything else, with the byte
/// offset of each run.
fn units(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut runs = Vec::new();
    let mut start = 0;
    let mut alpha = None;
    for (i, c) in text.char_indices() {
        let a = c.is_alphabetic();
        if alpha.is_some_and(|prev| prev != a) {
            runs.push((start, &text[start..i]));
            start = i;
        }
        alpha = Some(a);
    }
    if start < text.len() {
        runs.push((start, &text[start..]));
    }
    runs.into_iter()
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
        assert_eq!(parse_duration("1h 30m").unwrap(), Duration::from_secs(5400));
    }

    #[test]
    fn a_capital_m_is_refused_with_a_hint_and_mo_is_a_month() {
        let e = parse_duration("1M").unwrap_err();
        assert!(
            e.contains("\"1M\" is a month; write \"1mo\" for a month or \"1m\" for a minute"),
            "{e}"
        );
        assert!(parse_duration("2h 1M")
            .unwrap_err()
            .contains("\"1M\" is a month"));
        assert_eq!(
            parse_duration("1mo").unwrap(),
            humantime::parse_duration("1month").unwrap()
        );
        assert_eq!(parse_duration("1min").unwrap(), Duration::from_secs(60));
        assert_eq!(
            parse_duration("3months").unwrap(),
            humantime::parse_duration("3months").unwrap()
        );
    }
}
