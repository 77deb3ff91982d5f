//! A replica that lags: a TCP forwarder between a replica and its primary that holds
//! the replication stream (bytes from the primary to the replica) for a fixed delay.
//! The replica does `REPLICAOF 127.0.0.1 <forwarder port>`; what it sends to the primary
//! (PSYNC, REPLCONF ACK) goes through at once. The forwarder runs on a thread of its
//! own (its own Tokio runtime), so a test that blocks its runtime does not stop
//! replication; it stops when dropped.

use super::redis::RedisServer;
use super::topology::info_field;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// See the module documentation.
pub struct LagForwarder {
    pub port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LagForwarder {
    /// Forward 127.0.0.1:`port` (a free port) to 127.0.0.1:`primary_port`, holding the
    /// bytes from the primary for `delay`.
    pub fn start(primary_port: u16, delay: Duration) -> LagForwarder {
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind forwarder");
        std_listener.set_nonblocking(true).unwrap();
        let port = std_listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener).unwrap();
                let accept = async {
                    loop {
                        let Ok((replica, _)) = listener.accept().await else {
                            continue;
                        };
                        tokio::spawn(forward(replica, primary_port, delay));
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stopped => {}
                }
            });
        });
        LagForwarder {
            port,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for LagForwarder {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Pipe one replica connection to the primary: replica → primary at once, primary →
/// replica `delay` late (each chunk is written `delay` after it was read).
async fn forward(replica: TcpStream, primary_port: u16, delay: Duration) {
    let Ok(primary) = TcpStream::connect(("127.0.0.1", primary_port)).await else {
        return;
    };
    let _ = replica.set_nodelay(true);
    let _ = primary.set_nodelay(true);
    let (mut r_read, mut r_write) = replica.into_split();
    let (mut p_read, mut p_write) = primary.into_split();
    let up = async move {
        let _ = tokio::io::copy(&mut r_read, &mut p_write).await;
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read_down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match p_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    };
    let write_down = async move {
        while let Some((at, bytes)) = rx.recv().await {
            tokio::time::sleep_until(at.into()).await;
            if r_write.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(up, read_down, write_down);
}

/// A primary and one replica that replicates from it through a [`LagForwarder`] with
/// `delay`, linked (`master_link_status:up`, waited for ≤ 10 s) when this returns.
pub struct LaggingShard {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub forwarder: LagForwarder,
}

impl LaggingShard {
    pub fn start(delay: Duration) -> LaggingShard {
        let primary = RedisServer::start_with(&["--repl-diskless-sync-delay", "0"]);
        let forwarder = LagForwarder::start(primary.port, delay);
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
