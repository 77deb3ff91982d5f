//! Log files as read: each opened as a buffered reader (gzip decompressed when the
//! content starts with its magic bytes, the progress bar advanced by the bytes read
//! from the file), and the files put in the order of their first request.

use super::parse::{self, Parsed};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// How many lines of a file [`in_time_order`] reads at most to find its first request.
const FIRST_REQUEST_LINES: usize = 1_000;

/// `logs` in the order of the start of their first request (rotated logs given as
/// `access.log*` come newest first), files without one (in their first
/// [`FIRST_REQUEST_LINES`] lines, or unreadable) last, in the order given.
pub fn in_time_order(logs: &[PathBuf]) -> Vec<PathBuf> {
    let first = |path: &Path| -> Option<u64> {
        let file = std::fs::File::open(path).ok()?;
        let reader = open(Counted {
            inner: file,
            bar: None,
        })
        .ok()?;
        reader
            .split(b'\n')
            .take(FIRST_REQUEST_LINES)
            .map_while(Result::ok)
            .find_map(
                |line| match parse::parse_line(std::str::from_utf8(&line).ok()?) {
                    Ok(Parsed::Request(l)) => Some(l.start_ms),
                    _ => None,
                },
            )
    };
    let mut keyed: Vec<(u64, usize, &PathBuf)> = logs
        .iter()
        .enumerate()
        .map(|(i, p)| (first(p).unwrap_or(u64::MAX), i, p))
        .collect();
    keyed.sort();
    keyed.into_iter().map(|(_, _, p)| p.clone()).collect()
}

/// A reader that advances the progress bar by the bytes read from the file.
pub(super) struct Counted {
    /// The log file.
    pub(super) inner: std::fs::File,
    /// Advanced by the bytes read, when shown.
    pub(super) bar: Option<indicatif::ProgressBar>,
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(bar) = &self.bar {
            bar.inc(n as u64);
        }
        Ok(n)
    }
}

/// A buffered reader of a log file, decompressing it when it starts with the gzip
/// magic bytes (whatever its name; concatenated gzip members are read in turn).
pub(super) fn open(file: Counted) -> std::io::Result<Box<dyn BufRead>> {
    let mut reader = BufReader::with_capacity(256 * 1024, file);
    let head = reader.fill_buf()?;
    if head.starts_with(&[0x1f, 0x8b]) {
        let gz = flate2::bufread::MultiGzDecoder::new(reader);
        Ok(Box::new(BufReader::with_capacity(256 * 1024, gz)))
    } else {
        Ok(Box::new(reader))
    }
}
