//! Reading a file line by line with a cap on a line's length: a line longer than the
//! cap is skipped to its end without being held in memory, so that a file of one huge
//! line (or a sparse file of zeros) costs no more than the cap.

use std::io::BufRead;

/// One line read by [`read_capped`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capped {
    /// The end of the input: nothing was read.
    End,
    /// A whole line (with its `\n`, if any) is in the buffer.
    Line,
    /// The line was longer than the cap, in bytes (with its `\n`): the buffer holds its
    /// first `cap` bytes, the rest was read and dropped.
    TooLong(u64),
}

/// Read one line of `r` (up to and including `\n`, or to the end of the input) into
/// `buf` (cleared first), keeping at most `cap` bytes of it.
///
/// Errors: those of `r` (`Interrupted` is retried).
pub fn read_capped(r: &mut impl BufRead, buf: &mut Vec<u8>, cap: usize) -> std::io::Result<Capped> {
    buf.clear();
    let mut total: u64 = 0;
    loop {
        let chunk = match r.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            break;
        }
        let (used, done) = match memchr(chunk) {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        let room = cap.saturating_sub(buf.len());
        buf.extend_from_slice(&chunk[..used.min(room)]);
        total += used as u64;
        r.consume(used);
        if done {
            break;
        }
    }
    Ok(match total {
        0 => Capped::End,
        n if n > cap as u64 => Capped::TooLong(n),
        _ => Capped::Line,
    })
}

fn memchr(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|b| *b == b'\n')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lines_are_skipped_whole_and_the_next_line_is_read() {
        let mut text = vec![b'x'; 100_000];
        text.extend_from_slice(b"\nshort\nlast");
        let mut r = std::io::BufReader::with_capacity(4096, &text[..]);
        let mut buf = Vec::new();
        assert_eq!(
            read_capped(&mut r, &mut buf, 1000).unwrap(),
            Capped::TooLong(100_001)
        );
        assert_eq!(buf.len(), 1000);
        assert!(buf.capacity() < 10_000, "{}", buf.capacity());
        assert_eq!(read_capped(&mut r, &mut buf, 1000).unwrap(), Capped::Line);
        assert_eq!(buf, b"short\n");
        assert_eq!(read_capped(&mut r, &mut buf, 1000).unwrap(), Capped::Line);
        assert_eq!(buf, b"last");
        assert_eq!(read_capped(&mut r, &mut buf, 1000).unwrap(), Capped::End);
        // A line of exactly the cap (with its newline) is whole.
        let mut r = std::io::BufReader::new(&b"abc\n"[..]);
        assert_eq!(read_capped(&mut r, &mut buf, 4).unwrap(), Capped::Line);
    }
}
