//! Log timestamps → ms since the Unix epoch: tracing's RFC 3339 times (tollgate's
//! lines) and nginx's `$time_local`.

/// An RFC 3339 time as tracing writes it (`2026-11-24T11:07:45.961756Z`, or with an
/// offset `+01:00`) → ms since the Unix epoch.
pub fn parse_rfc3339_ms(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' {
        return None;
    }
    let y = num(&b[0..4])?;
    let mo = num(&b[5..7])?;
    let d = num(&b[8..10])?;
    let h = num(&b[11..13])?;
    let mi = num(&b[14..16])?;
    let sec = num(&b[17..19])?;
    let mut i = 19;
    let mut ms = 0u64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let mut digits = 0;
        while let Some(c) = b.get(i).filter(|c| c.is_ascii_digit()) {
            if digits < 3 {
                ms = ms * 10 + u64::from(c - b'0');
            }
            digits += 1;
            i += 1;
        }
        for _ in digits..3 {
            ms *= 10;
        }
    }
    let offset_s: i64 = match b.get(i) {
        Some(b'Z') | Some(b'z') => 0,
        Some(sign @ (b'+' | b'-')) if b.len() >= i + 6 => {
            let o = (num(&b[i + 1..i + 3])? * 3600 + num(&b[i + 4..i + 6])? * 60) as i64;
            if *sign == b'+' {
                o
            } else {
                -o
            }
        }
        _ => return None,
    };
    epoch_ms(y, mo, d, h, mi, sec, ms, offset_s)
}

/// `24/Nov/2026:11:01:21 +0000` → ms since the epoch.
pub fn parse_nginx_time(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 26 || b[2] != b'/' || b[6] != b'/' || b[11] != b':' || b[20] != b' ' {
        return None;
    }
    let d = num(&b[0..2])?;
    const MONTHS: [&[u8]; 12] = [
        b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov",
        b"Dec",
    ];
    let mo = MONTHS.iter().position(|m| *m == &b[3..6])? as u64 + 1;
    let y = num(&b[7..11])?;
    let h = num(&b[12..14])?;
    let mi = num(&b[15..17])?;
    let sec = num(&b[18..20])?;
    let off = (num(&b[22..24])? * 3600 + num(&b[24..26])? * 60) as i64;
    let off = match b[21] {
        b'+' => off,
        b'-' => -off,
        _ => return None,
    };
    epoch_ms(y, mo, d, h, mi, sec, 0, off)
}

/// Epoch milliseconds of a civil UTC time with an offset in seconds (local = UTC +
/// offset); `None` when out of range or before 1970.
#[allow(clippy::too_many_arguments)]
fn epoch_ms(
    y: u64,
    mo: u64,
    d: u64,
    h: u64,
    mi: u64,
    s: u64,
    ms: u64,
    offset_s: i64,
) -> Option<u64> {
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let days = crate::limiter::algorithm::days_from_civil(y as i64, mo as i64, d as i64);
    let secs = days * 86_400 + (h * 3600 + mi * 60 + s) as i64 - offset_s;
    u64::try_from(secs).ok().map(|s| s * 1000 + ms)
}

fn num(b: &[u8]) -> Option<u64> {
    if b.is_empty() || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(b.iter().fold(0, |n, c| n * 10 + u64::from(c - b'0')))
}
