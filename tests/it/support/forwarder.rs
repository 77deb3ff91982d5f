//! A TCP forwarder on 127.0.0.1 whose target can be switched at runtime: what a DNS
//! name, a Kubernetes Service or HAProxy is to a client, a stable address in front of a
//! Redis that may change. It runs on a thread with its own Tokio runtime, so a test's
//! gateway and the forwarder never share fate. Stopped when dropped.
//!
//! With a delay ([`Forwarder::with_delay`]) it holds every byte from the target for
//! that long (what the client sends goes through at once): between a replica and its
//! primary, a replica that lags.

use std::net::TcpListener as StdListener;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// See the module documentation.
pub struct Forwarder {
    /// The stable address's port.
    pub port: u16,
    target: Arc<AtomicU16>,
    /// Bumped to close every connection open now (a switch that resets them).
    reset: watch::Sender<u64>,
    /// While true, connections are accepted and kept, but no byte passes either way (a
    /// network partition without resets).
    blackholed: Arc<AtomicBool>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Forwarder {
    /// Forward 127.0.0.1:`self.port` to 127.0.0.1:`target`.
    pub fn start(target: u16) -> Forwarder {
        Self::with_delay(target, Duration::ZERO)
    }

    /// Forward as [`Forwarder::start`], holding the bytes from the target for `delay`
    /// (each chunk is written to the client `delay` after it was read).
    pub fn with_delay(target: u16, delay: Duration) -> Forwarder {
        let listener = StdListener::bind("127.0.0.1:0").expect("bind the forwarder");
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(AtomicU16::new(target));
        let blackholed = Arc::new(AtomicBool::new(false));
        let (reset, reset_rx) = watch::channel(0u64);
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        let (t, b) = (target.clone(), blackholed.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).unwrap();
                let accept = async {
                    loop {
                        let Ok((client, _)) = listener.accept().await else {
                            continue;
                        };
                        let to = t.load(Ordering::SeqCst);
                        tokio::spawn(pipe(client, to, delay, reset_rx.clone(), b.clone()));
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stop_rx => {}
                }
            });
        });
        Forwarder {
            port,
            target,
            reset,
            blackholed,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// `redis://127.0.0.1:PORT` of the stable address.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// New connections go to `target` from now on. With `close_existing`, the connections
    /// open now are closed (a Service endpoint change that resets them); without, they
    /// stay with the old target (conntrack keeping established flows, HAProxy keeping
    /// sessions).
    pub fn switch(&self, target: u16, close_existing: bool) {
        self.target.store(target, Ordering::SeqCst);
        if close_existing {
            self.reset.send_modify(|g| *g += 1);
        }
    }

    /// Stop (`true`) or resume (`false`) passing bytes, on every connection, without
    /// closing any: the client sees a node that never answers.
    pub fn blackhole(&self, on: bool) {
        self.blackholed.store(on, Ordering::SeqCst);
    }
}

/// Copy both ways between `client` and 127.0.0.1:`to` until either side closes or the
/// forwarder resets its connections; bytes from `to` are held for `delay`; while
/// blackholed, hold the bytes.
async fn pipe(
    client: TcpStream,
    to: u16,
    delay: Duration,
    mut reset: watch::Receiver<u64>,
    blackholed: Arc<AtomicBool>,
) {
    reset.borrow_and_update();
    let Ok(server) = TcpStream::connect(("127.0.0.1", to)).await else {
        let mut client = client;
        let _ = client.shutdown().await;
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::select! {
        _ = one_way(cr, sw, Duration::ZERO, &blackholed) => {}
        _ = one_way(sr, cw, delay, &blackholed) => {}
        _ = reset.changed() => {}
    }
}

/// Copy from `r` to `w` until `r` ends or a write fails, each chunk written `delay`
/// after it was read (reading goes on meanwhile), holding bytes while blackholed.
async fn one_way(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
    blackholed: &AtomicBool,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match r.read(&mut buf).await {
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
    let write = async move {
        while let Some((at, bytes)) = rx.recv().await {
            tokio::time::sleep_until(at.into()).await;
            while blackholed.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if w.write_all(&bytes).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(read, write);
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
