//! The answers of `[identity.auth_request]`, kept per cache key until their TTL: bounded
//! in entries (`cache_size`) and in bytes (`cache_max_bytes`), and swept, so that the
//! memory of expired answers is given back rather than only skipped.

use super::answer::Answer;
use std::collections::HashMap;
use std::time::Instant;

/// A cached answer and when it stops being used.
#[derive(Debug)]
struct Entry {
    until: Instant,
    answer: Answer,
    /// What the entry is counted as, bytes ([`weight`]).
    bytes: usize,
}

/// See the module documentation. Not synchronized: the callout keeps it in a mutex.
#[derive(Debug, Default)]
pub(super) struct AnswerCache {
    entries: HashMap<[u8; 32], Entry>,
    /// The sum of the entries' weights, bytes.
    bytes: usize,
}

impl AnswerCache {
    /// The answer cached for `key`, if it is still live at `now`. An expired one is
    /// dropped.
    pub(super) fn get(&mut self, key: &[u8; 32], now: Instant) -> Option<Answer> {
        let entry = self.entries.get(key)?;
        if entry.until > now {
            return Some(entry.answer.clone());
        }
        self.remove(key);
        None
    }

    /// Keep `answer` for `key` until `until`, within `max_entries` entries and
    /// `max_bytes` bytes: when either would be exceeded, expired answers go first, then
    /// arbitrary live ones until an eighth of each bound is free. An answer heavier
    /// than `max_bytes` alone is not kept.
    pub(super) fn insert(
        &mut self,
        key: [u8; 32],
        answer: Answer,
        until: Instant,
        max_entries: usize,
        max_bytes: usize,
    ) {
        let bytes = weight(&answer);
        if bytes > max_bytes || max_entries == 0 {
            return;
        }
        self.remove(&key);
        let over = |c: &Self, entries: usize, total: usize| {
            c.entries.len() >= entries || c.bytes + bytes > total
        };
        if over(self, max_entries, max_bytes) {
            self.sweep(Instant::now());
        }
        if over(self, max_entries, max_bytes) {
            // Still full of live answers: make room for an eighth of each bound.
            let entries = max_entries - max_entries / 8;
            let total = max_bytes - max_bytes / 8;
            let victims: Vec<[u8; 32]> = self.entries.keys().copied().collect();
            for k in victims {
                if !over(self, entries, total) {
                    break;
                }
                self.remove(&k);
            }
        }
        self.bytes += bytes;
        self.entries.insert(
            key,
            Entry {
                until,
                answer,
                bytes,
            },
        );
    }

    /// Drop every answer expired at `now`, and give back the table's memory when it is
    /// mostly empty.
    pub(super) fn sweep(&mut self, now: Instant) {
        let mut freed = 0;
        self.entries.retain(|_, e| {
            let live = e.until > now;
            if !live {
                freed += e.bytes;
            }
            live
        });
        self.bytes -= freed;
        if self.entries.capacity() > 64 && self.entries.len() < self.entries.capacity() / 4 {
            self.entries.shrink_to_fit();
        }
    }

    /// The bytes the cached answers are counted as (`tollgate_auth_cache_bytes`).
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    fn remove(&mut self, key: &[u8; 32]) {
        if let Some(e) = self.entries.remove(key) {
            self.bytes -= e.bytes;
        }
    }
}

/// What one cached answer costs, bytes: its key and entry, the table's slot, and what
/// the answer holds on the heap (a caller's id and quotas, a refusal's body and
/// `Content-Type`).
pub(super) fn weight(answer: &Answer) -> usize {
    let fixed = 32 + std::mem::size_of::<Entry>() + 16;
    fixed
        + match answer {
            Answer::Caller(client) => {
                std::mem::size_of::<super::Client>()
                    + 16
                    + client.id.len()
                    + client
                        .quotas
                        .as_deref()
                        .map_or(0, |q| q.len() * (std::mem::size_of::<(String, u64)>() + 16))
            }
            Answer::Refused {
                content_type, body, ..
            } => body.len() + content_type.as_ref().map_or(0, |c| c.len()),
            Answer::Rejected(_) | Answer::Failed(_) | Answer::Busy { .. } => 0,
        }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::time::Duration;

    fn refusal(n: usize) -> Answer {
        Answer::Refused {
            status: 401,
            content_type: None,
            body: Bytes::from(vec![b'x'; n]),
        }
    }

    #[test]
    fn bytes_are_bounded_and_given_back_on_expiry() {
        let mut c = AnswerCache::default();
        let now = Instant::now();
        let soon = now + Duration::from_millis(10);
        for i in 0..1000u32 {
            let mut k = [0u8; 32];
            k[..4].copy_from_slice(&i.to_le_bytes());
            c.insert(k, refusal(1000), soon, 100_000, 64 * 1024);
            assert!(c.bytes() <= 64 * 1024, "{}", c.bytes());
        }
        assert!(c.bytes() > 32 * 1024);
        c.sweep(soon + Duration::from_millis(1));
        assert_eq!((c.bytes(), c.entries.len()), (0, 0));
    }

    #[test]
    fn an_answer_heavier_than_the_bound_is_not_kept() {
        let mut c = AnswerCache::default();
        let until = Instant::now() + Duration::from_secs(10);
        c.insert([1; 32], refusal(2000), until, 10, 1000);
        assert!(c.get(&[1; 32], Instant::now()).is_none());
        assert_eq!(c.bytes(), 0);
    }
}
