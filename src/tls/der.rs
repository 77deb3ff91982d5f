//! What is read from a DER X.509 certificate: its notAfter and its subject CN.

/// The notAfter of a DER X.509 certificate, UTC epoch seconds; `None` when it does not
/// parse. x509-parser reads it (a maintained parser, rather than more of our own DER).
pub fn not_after(der: &[u8]) -> Option<i64> {
    x509_parser::parse_x509_certificate(der)
        .ok()
        .map(|(_, cert)| cert.validity().not_after.timestamp())
}

/// The subject common name (OID 2.5.4.3) of a DER X.509 certificate: the last CN of the
/// subject, as text. `None` when the certificate has none or does not parse.
pub fn subject_cn(der: &[u8]) -> Option<String> {
    // Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL,
    //   serialNumber, signature, issuer, validity, subject, ... }, ... }
    let (cert, _) = der_item(der, 0x30)?;
    let (mut tbs, _) = der_item(cert, 0x30)?;
    if tbs.first() == Some(&0xa0) {
        tbs = der_item(tbs, 0xa0)?.1;
    }
    let rest = der_item(tbs, 0x02)?.1; // serialNumber
    let rest = der_item(rest, 0x30)?.1; // signature
    let rest = der_item(rest, 0x30)?.1; // issuer
    let rest = der_item(rest, 0x30)?.1; // validity
    let (mut subject, _) = der_item(rest, 0x30)?;
    let mut cn = None;
    // Name ::= SEQUENCE OF SET OF SEQUENCE { type OID, value ANY }
    while !subject.is_empty() {
        let (mut set, rest) = der_item(subject, 0x31)?;
        subject = rest;
        while !set.is_empty() {
            let (atv, rest) = der_item(set, 0x30)?;
            set = rest;
            let (oid, value) = der_item(atv, 0x06)?;
            if oid == [0x55, 0x04, 0x03] {
                let tag = *value.first()?;
                let (text, _) = der_item(value, tag)?;
                // UTF8String, PrintableString, IA5String, T61String (read as Latin-1 text).
                cn = match tag {
                    0x0c | 0x13 | 0x16 => std::str::from_utf8(text).ok().map(str::to_owned),
                    0x14 => Some(text.iter().map(|&b| b as char).collect()),
                    _ => None,
                };
            }
        }
    }
    cn
}

/// One DER item with tag `tag` at the start of `input`: (its contents, what follows).
fn der_item(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&t, rest) = input.split_first()?;
    if t != tag {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | b as usize);
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some(rest.split_at(len))
}
