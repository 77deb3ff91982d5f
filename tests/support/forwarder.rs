//! A TCP forwarder on 127.0.0.1 whose target can be switched at runtime: what a DNS
//! name, a Kubernetes Service or HAProxy is to a client, a stable address in front of a
//! Redis that may change. It runs on a thread with its own Tokio runtime, so a test's
//! gateway and the forwarder never share fate. Stopped when dropped.

use std::net::TcpListener as StdListener;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
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
                        tokio::spawn(pipe(client, to, reset_rx.clone(), b.clone()));
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
/// forwarder resets its connections; while blackholed, hold the bytes.
async fn pipe(
    mut client: TcpStream,
    to: u16,
    mut reset: watch::Receiver<u64>,
    blackholed: Arc<AtomicBool>,
) {
    reset.borrow_and_update();
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", to)).await else {
        let _ = client.shutdown().await;
        return;
    };
    let (mut cr, mut cw) = client.split();
    let (mut sr, mut sw) = server.split();
    tokio::select! {
        _ = one_way(&mut cr, &mut sw, &blackholed) => {}
        _ = one_way(&mut sr, &mut cw, &blackholed) => {}
        _ = reset.changed() => {}
    }
}

/// Copy from `r` to `w` until `r` ends or a write fails, holding bytes while blackholed.
async fn one_way(
    r: &mut tokio::net::tcp::ReadHalf<'_>,
    w: &mut tokio::net::tcp::WriteHalf<'_>,
    blackholed: &AtomicBool,
) {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while blackholed.load(Ordering::SeqCst) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
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
