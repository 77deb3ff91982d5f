//! The Lua scripts of `lua/`, embedded in the binary, and how they are run: EVALSHA
//! with their arguments packed or in decimal, NOSCRIPT answered by loading the script
//! and calling once more, and their replies read back as integers and verdicts.

use super::batch;
use crate::limiter::algorithm::{OpKind, Verdict};
use crate::limiter::store::StoreError;

/// `lua/apply.lua`: one operation on each of several limits, every algorithm.
pub static APPLY_LUA: &str = include_str!("../../../../lua/apply.lua");
/// `lua/lease.lua`: take up to N units of a window for local admission.
pub static LEASE_LUA: &str = include_str!("../../../../lua/lease.lua");
/// `lua/refund.lua`: give back unused units of a window.
pub static REFUND_LUA: &str = include_str!("../../../../lua/refund.lua");
/// `lua/reset.lua`: delete a caller's windows (`POST /callers/{id}/reset`).
pub static RESET_LUA: &str = include_str!("../../../../lua/reset.lua");
/// `lua/heartbeat.lua`: this gateway is alive; how many are (`store.fleet_size = "auto"`).
pub static HEARTBEAT_LUA: &str = include_str!("../../../../lua/heartbeat.lua");

/// Integers per key in `lua/apply.lua`'s arguments: kind, algorithm, quota, window,
/// burst, align, block, cost, now, id (see `RedisStore::call_group`); the id last.
pub(super) const ARGS_PER_KEY: usize = 10;

/// Every script the store runs, loaded on each new connection.
#[derive(Debug)]
pub(crate) struct Scripts {
    pub(super) apply: LuaScript,
    pub(super) lease: LuaScript,
    pub(super) refund: LuaScript,
    pub(super) reset: LuaScript,
    pub(super) heartbeat: LuaScript,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            apply: LuaScript::new(APPLY_LUA, ArgStyle::Packed, ReplyStyle::Packed),
            lease: LuaScript::new(LEASE_LUA, ArgStyle::Decimal, ReplyStyle::Integers),
            refund: LuaScript::new(REFUND_LUA, ArgStyle::Decimal, ReplyStyle::Integers),
            reset: LuaScript::new(RESET_LUA, ArgStyle::Decimal, ReplyStyle::Integers),
            heartbeat: LuaScript::new(HEARTBEAT_LUA, ArgStyle::Decimal, ReplyStyle::Integers),
        }
    }

    pub(super) fn all(&self) -> [&LuaScript; 5] {
        [
            &self.apply,
            &self.lease,
            &self.refund,
            &self.reset,
            &self.heartbeat,
        ]
    }
}

/// How a script takes its integer arguments (ARGV).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArgStyle {
    /// One ARGV entry per integer, in decimal (`lease.lua`, `refund.lua`, `reset.lua`).
    Decimal,
    /// All the integers in ARGV[1], each as 8 bytes, unsigned, little-endian
    /// (`apply.lua`, which reads them with `struct.unpack`): two arguments a key instead
    /// of ten, and no decimal parsing, for the script every request runs.
    Packed,
}

/// How a script answers its integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReplyStyle {
    /// An array of integers (`lease.lua`, `refund.lua`, `reset.lua`).
    Integers,
    /// One bulk string holding every integer, each as 8 bytes, signed, little-endian
    /// (`apply.lua`, which writes them with `struct.pack`; read by [`unpack_integers`]):
    /// redis-rs parses one value per call instead of one per integer, about 800
    /// instructions apiece, for the script every request runs.
    Packed,
}

/// One script of `lua/`: its text (and SHA1), and how it takes its arguments and
/// answers.
#[derive(Debug)]
pub(crate) struct LuaScript {
    script: redis::Script,
    args: ArgStyle,
    reply: ReplyStyle,
}

impl LuaScript {
    fn new(code: &str, args: ArgStyle, reply: ReplyStyle) -> Self {
        Self {
            script: redis::Script::new(code),
            args,
            reply,
        }
    }

    /// SCRIPT LOAD it on `conn` (in cluster mode, on every primary).
    pub(super) async fn load(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
    ) -> redis::RedisResult<()> {
        self.script
            .prepare_invoke()
            .load_async(conn)
            .await
            .map(drop)
    }

    /// The EVALSHA of `keys` and `args` (see [`ArgStyle`]).
    pub(super) fn command(&self, keys: &[&str], args: &[u64]) -> redis::Cmd {
        let (arg_count, arg_bytes) = match self.args {
            ArgStyle::Decimal => (args.len(), 20 * args.len()),
            ArgStyle::Packed => (1, 8 * args.len()),
        };
        let mut cmd = redis::Cmd::with_capacity(
            3 + keys.len() + arg_count,
            64 + keys.iter().map(|k| k.len()).sum::<usize>() + arg_bytes,
        );
        cmd.arg("EVALSHA")
            .arg(self.script.get_hash())
            .arg(keys.len());
        for k in keys {
            cmd.arg(*k);
        }
        match self.args {
            ArgStyle::Decimal => {
                for a in args {
                    cmd.arg(*a);
                }
            }
            ArgStyle::Packed => {
                use redis::RedisWrite;
                use std::io::Write;
                // Written straight into the command's buffer, one argument.
                let mut packed = cmd.writer_for_next_arg();
                for a in args {
                    // Into a `Vec`: cannot fail.
                    let _ = packed.write_all(&a.to_le_bytes());
                }
            }
        }
        cmd
    }
}

/// Run `script` with `keys` and integer arguments on `conn` (EVALSHA; on NOSCRIPT the
/// script is loaded and the call retried once), and answer its integers.
pub(super) async fn invoke(
    script: &LuaScript,
    keys: &[&str],
    args: &[u64],
    conn: &mut impl redis::aio::ConnectionLike,
) -> Result<Vec<i64>, StoreError> {
    let cmd = script.command(keys, args);
    let reply = match cmd.query_async::<redis::Value>(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load(conn).await?;
            cmd.query_async::<redis::Value>(conn).await?
        }
        answer => answer?,
    };
    decode(script, reply)
}

/// [`invoke`] on a cluster node that answered `ASK` (the slot is being migrated to
/// it): `ASKING` and the EVALSHA in one pipeline, so that the node takes the call for
/// the slot it is importing. No NOSCRIPT retry: the node's connection loaded every
/// script when it opened.
pub(super) async fn invoke_asking(
    script: &LuaScript,
    keys: &[&str],
    args: &[u64],
    conn: &mut impl redis::aio::ConnectionLike,
) -> Result<Vec<i64>, StoreError> {
    let mut pipe = redis::pipe();
    pipe.cmd("ASKING")
        .ignore()
        .add_command(script.command(keys, args));
    let (reply,): (redis::Value,) = pipe.query_async(conn).await?;
    decode(script, reply)
}

/// A script's reply as its integers (see [`ReplyStyle`]).
fn decode(script: &LuaScript, reply: redis::Value) -> Result<Vec<i64>, StoreError> {
    match (script.reply, reply) {
        (ReplyStyle::Packed, redis::Value::BulkString(bytes)) => unpack_integers(&bytes),
        (ReplyStyle::Integers, reply) => {
            Ok(redis::from_redis_value(reply).map_err(redis::RedisError::from)?)
        }
        (ReplyStyle::Packed, other) => Err(StoreError::BadReply(format!(
            "expected one string of packed integers, got {other:?}"
        ))),
    }
}

/// The integers of a packed reply ([`ReplyStyle::Packed`], `lua/apply.lua`'s): 8 bytes
/// each, signed, little-endian. Errors: a length that is not a multiple of 8.
pub fn unpack_integers(bytes: &[u8]) -> Result<Vec<i64>, StoreError> {
    if !bytes.len().is_multiple_of(8) {
        return Err(StoreError::BadReply(format!(
            "{} bytes, not a whole number of 8-byte integers",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|b| {
            let mut le = [0; 8];
            le.copy_from_slice(b);
            i64::from_le_bytes(le)
        })
        .collect())
}

/// The integers per key that `lua/apply.lua` answers ([`batch::REPLY_WIDTH`]), as
/// verdicts: `[used, reset_at ms, epoch, more_at ms]` when admitted, `[-(used + 1),
/// reset_at ms, retry_at ms, more_at ms]` when refused (a refusal's epoch is 0, an
/// admission's retry_at 0). A refusal by a `block_for` block answers `-reset_at`, and
/// the refusal that started it also `-retry_at` (see the top of `lua/apply.lua`).
pub(super) fn verdicts(reply: &[i64]) -> Vec<Result<Verdict, StoreError>> {
    reply
        .chunks(batch::REPLY_WIDTH)
        .map(|v| match *v {
            [signed_used, reset_at, third, more_at]
                if more_at >= 0 && (signed_used < 0 || (reset_at >= 0 && third >= 0)) =>
            {
                let admitted = signed_used >= 0;
                let (used, retry_at, epoch) = if admitted {
                    (signed_used, 0, third)
                } else {
                    (-(signed_used + 1), third.unsigned_abs() as i64, 0)
                };
                Ok(Verdict {
                    admitted,
                    used: used as u64,
                    reset_at_ms: reset_at.unsigned_abs(),
                    retry_at_ms: retry_at as u64,
                    epoch: epoch as u64,
                    blocked: !admitted && reset_at < 0,
                    block_started: !admitted && third < 0,
                    more_at_ms: more_at as u64,
                })
            }
            ref other => Err(StoreError::BadReply(format!("{other:?}"))),
        })
        .collect()
}

/// Whether a `lua/apply.lua` call's arguments ([`ARGS_PER_KEY`] per key, the
/// operation's kind first) hold anything but peeks.
pub(super) fn apply_writes(args: &[u64]) -> bool {
    args.chunks(ARGS_PER_KEY)
        .any(|a| a.first() != Some(&OpKind::Peek.code()))
}

/// Whether a `lua/apply.lua` call with these arguments carries a reservation.
pub(super) fn reserves(args: &[u64]) -> bool {
    args.chunks(ARGS_PER_KEY)
        .any(|a| a.first() == Some(&OpKind::Reserve.code()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard's primary batch is a write unless every key's operation is a peek: only a
    /// batch of peeks is refused while the primary's writes fail (and cannot clear it).
    #[test]
    fn a_batch_writes_unless_every_operation_is_a_peek() {
        let key = |kind: OpKind| [kind.code(), 0, 3, 60_000, 0, 0, 0, 1, 1_800_000_000_000, 7];
        let peeks: Vec<u64> = [key(OpKind::Peek), key(OpKind::Peek)].concat();
        let mixed: Vec<u64> = [key(OpKind::Peek), key(OpKind::Charge)].concat();
        assert!(!apply_writes(&peeks));
        assert!(apply_writes(&mixed));
        assert!(apply_writes(&key(OpKind::Reserve)));
        assert!(!apply_writes(&[]));
    }

    /// `lua/apply.lua`'s reply as `struct.pack("<i8i8i8", ...)` writes it: every integer
    /// back, negative ones (a refusal's `-(used + 1)`) and epoch milliseconds included;
    /// a length that is not whole integers is a bad reply, not a panic.
    #[test]
    fn a_packed_reply_unpacks_to_its_integers() {
        let sent = [-6_i64, 1_800_000_000_123, 0, 41, 1_800_000_060_000, 7];
        let bytes: Vec<u8> = sent.iter().flat_map(|n| n.to_le_bytes()).collect();
        assert_eq!(unpack_integers(&bytes).unwrap(), sent);
        assert_eq!(unpack_integers(&[]).unwrap(), Vec::<i64>::new());
        match unpack_integers(&bytes[..13]) {
            Err(StoreError::BadReply(why)) => assert!(why.contains("13 bytes"), "{why}"),
            other => panic!("expected a bad reply, got {other:?}"),
        }
    }
}
