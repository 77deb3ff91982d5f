//! A raw HTTP/1.1 upstream that records what crosses the gateway byte for byte, and a
//! raw client that reads one answer: for the tests of the edge's rules.

use super::TestGateway;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Generous bound for "does not hang" on a loaded machine.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// A raw HTTP/1.1 upstream: it records every byte it receives, answers `200 ok` with
/// a length, and answers a request that carries an `Upgrade` header with `101` (echoing
/// the protocol, as stock hypercorn does for `h2c`), after which it only records.
pub struct Recorder {
    addr: std::net::SocketAddr,
    bytes: Arc<Mutex<Vec<u8>>>,
    heads: Arc<Mutex<Vec<String>>>,
    requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    pub async fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let bytes = Arc::new(Mutex::new(Vec::new()));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(AtomicUsize::new(0));
        let (b, h, r) = (bytes.clone(), heads.clone(), requests.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, b.clone(), h.clone(), r.clone()));
            }
        });
        Recorder {
            addr,
            bytes,
            heads,
            requests,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Everything received so far, as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes.lock().unwrap()).into_owned()
    }

    /// Requests received so far.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// Forget what was received so far.
    pub fn clear(&self) {
        self.bytes.lock().unwrap().clear();
        self.heads.lock().unwrap().clear();
    }

    /// The heads of the requests received so far, one each.
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// One header's value in a raw head (first match, name in any case).
pub fn header_of(head: &str, name: &str) -> Option<String> {
    head.split("\r\n").skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}

async fn serve(
    mut s: TcpStream,
    record: Arc<Mutex<Vec<u8>>>,
    heads: Arc<Mutex<Vec<String>>>,
    requests: Arc<AtomicUsize>,
) {
    let mut pending = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // The head.
        let end = loop {
            if let Some(i) = find(&pending, b"\r\n\r\n") {
                break i + 4;
            }
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    record.lock().unwrap().extend_from_slice(&buf[..n]);
                    pending.extend_from_slice(&buf[..n]);
                }
            }
        };
        let head = String::from_utf8_lossy(&pending[..end]).into_owned();
        heads.lock().unwrap().push(head.clone());
        // The body: by length, or chunked up to the last chunk.
        let length: usize = header_of(&head, "content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let chunked = header_of(&head, "transfer-encoding").is_some();
        let total = loop {
            if chunked {
                if let Some(i) = find(&pending[end..], b"0\r\n\r\n") {
                    break end + i + 5;
                }
            } else if pending.len() >= end + length {
                break end + length;
            }
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    record.lock().unwrap().extend_from_slice(&buf[..n]);
                    pending.extend_from_slice(&buf[..n]);
                }
            }
        };
        pending.drain(..total);
        requests.fetch_add(1, Ordering::SeqCst);
        if let Some(protocol) = header_of(&head, "upgrade") {
            let answer = format!(
                "HTTP/1.1 101 Switching Protocols\r\nconnection: Upgrade\r\nupgrade: {protocol}\r\n\r\n"
            );
            if s.write_all(answer.as_bytes()).await.is_err() {
                return;
            }
            // A tunnel now: record whatever comes, answer nothing.
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    return;
                }
                record.lock().unwrap().extend_from_slice(&buf[..n]);
            }
            return;
        }
        if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            .await
            .is_err()
        {
            return;
        }
    }
}

/// What the client saw: status, head (lowercase) and body.
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<String> {
        header_of(&self.head, name)
    }
}

/// Send `bytes` on `s` and read one answer: its head, and a body of `Content-Length`
/// bytes (none for 101). Panics when no answer comes within [`PATIENCE`].
pub async fn exchange(s: &mut TcpStream, bytes: &[u8]) -> Answer {
    s.write_all(bytes).await.unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let read = async {
        let end = loop {
            if let Some(i) = find(&got, b"\r\n\r\n") {
                break i + 4;
            }
            let n = s.read(&mut buf).await.unwrap();
            assert!(
                n > 0,
                "closed before an answer: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
        let length: usize = header_of(&head, "content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while got.len() < end + length {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed in the body");
            got.extend_from_slice(&buf[..n]);
        }
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        Answer {
            status,
            body: String::from_utf8_lossy(&got[end..end + length]).into_owned(),
            head,
        }
    };
    tokio::time::timeout(PATIENCE, read)
        .await
        .expect("an answer within the patience bound")
}

/// [`exchange`] on a new connection.
pub async fn ask(gw: &TestGateway, bytes: &[u8]) -> Answer {
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    exchange(&mut s, bytes).await
}

/// Wait until the recorder has received `n` requests (bounded).
pub async fn requests_reach(rec: &Recorder, n: usize) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while rec.requests() < n && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every value of a header in a raw head (name in any case).
pub fn values_of(head: &str, name: &str) -> Vec<String> {
    head.split("\r\n")
        .skip(1)
        .filter_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
        .collect()
}
