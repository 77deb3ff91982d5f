//! A replica that lags: a [`Forwarder`] between a replica and its primary that holds
//! the replication stream (bytes from the primary to the replica) for a fixed delay.
//! The replica does `REPLICAOF 127.0.0.1 <forwarder port>`; what it sends to the primary
//! (PSYNC, REPLCONF ACK) goes through at once. The forwarder runs on a thread of its
//! own (its own Tokio runtime), so a test that blocks its runtime does not stop
//! replication; it stops when dropped.

use super::forwarder::Forwarder;
use super::redis::RedisServer;
use super::topology::info_field;
use std::time::{Duration, Instant};

/// A primary and one replica that replicates from it through a [`Forwarder`] with
/// `delay`, linked (`master_link_status:up`, waited for ≤ 10 s) when this returns.
pub struct LaggingShard {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub forwarder: Forwarder,
}

impl LaggingShard {
    pub fn start(delay: Duration) -> LaggingShard {
        let primary = RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]);
        let forwarder = Forwarder::with_delay(primary.port, delay);
        let fport = forwarder.port.to_string();
        let replica = RedisServer::start_with(&[
            "--repl-diskless-sync-delay",
            "0",
            "--replicaof",
            "127.0.0.1",
            &fport,
        ]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while info_field(&replica, "replication", "master_link_status").as_deref() != Some("up") {
            assert!(
                Instant::now() < deadline,
                "replica on port {} never linked to primary {} through the forwarder on {}",
                replica.port,
                primary.port,
                forwarder.port
            );
            std::thread::sleep(Duration::from_millis(25));
        }
        LaggingShard {
            primary,
            replica,
            forwarder,
        }
    }

    /// The replica's processed offset is behind the primary's right after a write:
    /// the lag is real. Returns (primary offset, replica offset) read one after the other.
    pub fn offsets(&self) -> (u64, u64) {
        let p = info_field(&self.primary, "replication", "master_repl_offset")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let r = info_field(&self.replica, "replication", "slave_repl_offset")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        (p, r)
    }
}
