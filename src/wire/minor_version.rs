//! Requests of a later HTTP/1 minor version (`HTTP/1.2` ... `HTTP/1.9`) served as
//! HTTP/1.1, as RFC 9112 §2.3 says a recipient should ("process the message as if it
//! were in the highest minor version ... to which the recipient is conformant").
//!
//! hyper's parser (httparse) knows `HTTP/1.0` and `HTTP/1.1` only and answers anything
//! else 400, so [`MinorVersion`] rewrites the digit in the bytes hyper reads: the `N` of
//! ` HTTP/1.N` (N from 2 to 9) on a request line becomes `1`. To know where request lines
//! are, it follows the messages of the connection: a request line, header lines up to
//! the empty line, then a body of `Content-Length` bytes (skipped without looking at
//! it). After a request it cannot frame as simply (`Transfer-Encoding`, `Upgrade`,
//! `CONNECT`, a `Content-Length` that is no number, a header line past
//! [`MAX_LINE`] bytes) it stops looking for the rest of the connection: later
//! requests are read as they come (an `HTTP/1.2` one then gets hyper's 400, as before),
//! and no byte of a body is ever changed.

use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The longest header line whose start is kept to be looked at, in bytes; a longer
/// line (a request hyper would refuse soon anyway) ends the rewriting.
pub(crate) const MAX_LINE: usize = 8192;

/// An HTTP/1 client connection whose request lines of a later minor version read as
/// HTTP/1.1 (see the module documentation).
#[derive(Debug)]
pub(crate) struct MinorVersion<T> {
    io: T,
    state: State,
    /// The first and last bytes of the request line (to find `CONNECT ` and ` HTTP/1.`),
    /// or the header line being read.
    line: Vec<u8>,
    /// What the head read so far says about the body.
    body: Framing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// At a message's start or in its request line.
    RequestLine,
    /// In the header lines.
    Headers,
    /// In a body of this many more bytes.
    Body(u64),
    /// Not looking any more.
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    None,
    Length(u64),
    /// Something else (see the module documentation).
    Unknown,
}

impl<T> MinorVersion<T> {
    /// Wrap an HTTP/1 client connection.
    pub(crate) fn new(io: T) -> Self {
        Self {
            io,
            state: State::RequestLine,
            line: Vec::new(),
            body: Framing::None,
        }
    }

    /// Follow (and rewrite) the bytes just read.
    fn follow(&mut self, bytes: &mut [u8]) {
        let mut i = 0;
        while i < bytes.len() {
            match self.state {
                State::Off => return,
                State::Body(left) => {
                    let n = left.min((bytes.len() - i) as u64);
                    i += n as usize;
                    self.state = if left == n {
                        State::RequestLine
                    } else {
                        State::Body(left - n)
                    };
                }
                State::RequestLine => {
                    let b = bytes[i];
                    if b == b'\n' {
                        // Empty lines before a request line are allowed (and skipped).
                        if !self.line.iter().all(|c| *c == b'\r') {
                            self.state = State::Headers;
                            self.body = Framing::None;
                            if self.line.starts_with(b"CONNECT ") {
                                self.state = State::Off;
                            }
                        }
                        self.line.clear();
                    } else {
                        if (b'2'..=b'9').contains(&b) && self.line.ends_with(b" HTTP/1.") {
                            bytes[i] = b'1';
                        }
                        // Kept: the first 8 bytes (`CONNECT `) and the last 8 (` HTTP/1.`).
                        if self.line.len() >= 32 {
                            self.line.drain(8..24);
                        }
                        self.line.push(b);
                    }
                    i += 1;
                }
                State::Headers => {
                    let b = bytes[i];
                    i += 1;
                    if b != b'\n' {
                        if self.line.len() >= MAX_LINE {
                            self.state = State::Off;
                            return;
                        }
                        self.line.push(b);
                        continue;
                    }
                    if self.line.is_empty() || self.line == b"\r" {
                        self.line.clear();
                        self.state = match self.body {
                            Framing::None | Framing::Length(0) => State::RequestLine,
                            Framing::Length(n) => State::Body(n),
                            Framing::Unknown => State::Off,
                        };
                        continue;
                    }
                    self.body = header(&self.line, self.body);
                    self.line.clear();
                }
            }
        }
    }
}

/// What one header line (without its `\n`) adds to what the head says of the body.
fn header(line: &[u8], so_far: Framing) -> Framing {
    let Some(colon) = line.iter().position(|b| *b == b':') else {
        return so_far;
    };
    let name = &line[..colon];
    let value = line[colon + 1..].trim_ascii();
    if name.eq_ignore_ascii_case(b"transfer-encoding") || name.eq_ignore_ascii_case(b"upgrade") {
        return Framing::Unknown;
    }
    if !name.eq_ignore_ascii_case(b"content-length") {
        return so_far;
    }
    let parsed = std::str::from_utf8(value)
        .ok()
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<u64>().ok());
    match (so_far, parsed) {
        (Framing::None, Some(n)) => Framing::Length(n),
        (Framing::Length(m), Some(n)) if m == n => so_far,
        _ => Framing::Unknown,
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for MinorVersion<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if this.state != State::Off {
            if let Poll::Ready(Ok(())) = polled {
                let filled = buf.filled_mut();
                this.follow(&mut filled[before..]);
            }
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for MinorVersion<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `input` fed in pieces of `step` bytes; what hyper would read.
    fn read_as(input: &[u8], step: usize) -> String {
        let mut m = MinorVersion::new(());
        let mut out = input.to_vec();
        for piece in out.chunks_mut(step) {
            m.follow(piece);
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn later_minor_versions_read_as_1_1_and_bodies_are_untouched() {
        let input = "\r\nGET /a HTTP/1.2\r\nhost: x\r\n\r\n\
                     POST /b HTTP/1.9\r\ncontent-length: 17\r\n\r\nGET / HTTP/1.2\r\n\
                     GET /c HTTP/1.0\r\nhost: x\r\n\r\n\
                     GET /d HTTP/1.3\r\nhost: x\r\n\r\n";
        let want = "\r\nGET /a HTTP/1.1\r\nhost: x\r\n\r\n\
                    POST /b HTTP/1.1\r\ncontent-length: 17\r\n\r\nGET / HTTP/1.2\r\n\
                    GET /c HTTP/1.0\r\nhost: x\r\n\r\n\
                    GET /d HTTP/1.1\r\nhost: x\r\n\r\n";
        for step in [1, 2, 3, 7, 64, 4096] {
            assert_eq!(read_as(input.as_bytes(), step), want, "step {step}");
        }
    }

    #[test]
    fn after_a_body_it_cannot_frame_it_stops_looking() {
        for head in [
            "POST /b HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n",
            "GET /b HTTP/1.1\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
            "POST /b HTTP/1.1\r\ncontent-length: 5, 6\r\n\r\n",
            "CONNECT a:443 HTTP/1.1\r\n\r\n",
        ] {
            let input = format!("{head}GET / HTTP/1.2\r\n\r\n");
            assert_eq!(read_as(input.as_bytes(), 5), input, "{head}");
        }
    }

    #[test]
    fn http_1_2_inside_a_target_or_http_2_is_left_alone() {
        let input = "GET /x/HTTP/1.2 HTTP/1.1\r\n\r\nGET / HTTP/2.0\r\n\r\n";
        assert_eq!(read_as(input.as_bytes(), 3), input);
    }
}
