//! Redis Cluster's hash slots: the slot of a key, the map of which master serves each
//! slot, and `CLUSTER SLOTS` read into it.

use super::super::node::Node;
use redis::Value;
use std::sync::Arc;

/// Hash slots in a Redis Cluster.
pub(super) const SLOTS: u16 = 16384;

/// The hash slot of `key`: CRC16 (XMODEM) of its hash tag — the bytes between the first
/// `{` and the next `}`, when not empty — or of the whole key, modulo 16384.
pub(super) fn slot_of(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(key)) % SLOTS
}

/// One master of the map: its `HOST:PORT` and its node.
#[derive(Debug, Clone)]
pub(super) struct Master {
    pub(super) addr: String,
    pub(super) node: Arc<Node>,
}

/// The slot map: which master serves each slot.
#[derive(Debug, Default)]
pub(super) struct SlotMap {
    /// Slot ranges `(first, last, index into masters)`, sorted by `first`.
    pub(super) ranges: Vec<(u16, u16, usize)>,
    /// Every master known: those of the ranges, ordered by their first slot, then any
    /// that a redirection named before the next refresh.
    pub(super) masters: Vec<Master>,
}

impl SlotMap {
    /// The index in `masters` of the master serving `slot`.
    pub(super) fn index_of(&self, slot: u16) -> Option<usize> {
        let i = self
            .ranges
            .partition_point(|r| r.0 <= slot)
            .checked_sub(1)?;
        let (first, last, m) = self.ranges[i];
        (first..=last).contains(&slot).then_some(m)
    }

    pub(super) fn owner(&self, slot: u16) -> Option<&Master> {
        self.masters.get(self.index_of(slot)?)
    }

    pub(super) fn find(&self, addr: &str) -> Option<&Master> {
        self.masters.iter().find(|m| m.addr == addr)
    }

    /// The slot ranges each master serves, as `"0-5460,5462"`, by master index.
    pub(super) fn slots_of(&self, index: usize) -> String {
        self.ranges
            .iter()
            .filter(|r| r.2 == index)
            .map(|&(a, b, _)| {
                if a == b {
                    a.to_string()
                } else {
                    format!("{a}-{b}")
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// The ranges of a `CLUSTER SLOTS` reply asked of `asked` (`HOST:PORT`): `(first, last,
/// master HOST:PORT)`. A master whose host is empty or `?` (unknown to the node) is on
/// the asked node's host. Errors: a reply of another shape.
pub(super) fn parse_slots(reply: &Value, asked: &str) -> Result<Vec<(u16, u16, String)>, String> {
    let asked_host = asked.rsplit_once(':').map_or(asked, |(h, _)| h);
    let int = |v: &Value| match v {
        Value::Int(n) => u16::try_from(*n).ok().filter(|n| *n < SLOTS),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let Value::Array(entries) = reply else {
        return Err(format!("CLUSTER SLOTS: expected an array, got {reply:?}"));
    };
    entries
        .iter()
        .map(|entry| {
            let bad = || format!("CLUSTER SLOTS: unexpected entry {entry:?}");
            let Value::Array(fields) = entry else {
                return Err(bad());
            };
            let (Some(first), Some(last), Some(Value::Array(master))) = (
                fields.first().and_then(int),
                fields.get(1).and_then(int),
                fields.get(2),
            ) else {
                return Err(bad());
            };
            let host = master.first().and_then(text).ok_or_else(bad)?;
            let port = match master.get(1) {
                Some(Value::Int(p)) => u16::try_from(*p).map_err(|_| bad())?,
                _ => return Err(bad()),
            };
            let host = if host.is_empty() || host == "?" {
                asked_host.to_string()
            } else {
                host
            };
            if first > last {
                return Err(bad());
            }
            Ok((first, last, format!("{host}:{port}")))
        })
        .collect()
}
