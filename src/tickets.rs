//! TLS session-ticket keys shared by a fleet (`server.tls.ticket_keys`): every gateway
//! that reads the same key file encrypts tickets the others can decrypt, so a client
//! that a load balancer sends to another gateway still resumes its session.
//!
//! The file holds one key a line, 64 hex digits (32 random bytes: `openssl rand -hex
//! 32`); blank lines and `#` comments are ignored. The first key encrypts new tickets,
//! every key decrypts: to rotate, put a new key on top everywhere, then drop the last
//! one once tickets made with it have expired ([`LIFETIME_S`]). Tickets are
//! ChaCha20-Poly1305 (ring, as rustls' own ticketer): `key id (4 bytes) ‖ nonce (12) ‖
//! ciphertext ‖ tag (16)`, the key id being the first 4 bytes of the key's SHA-256.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};

/// How long a ticket may be used to resume, in seconds (12 hours), as rustls' own.
pub const LIFETIME_S: u32 = 12 * 60 * 60;

/// Ticket keys read from a `server.tls.ticket_keys` file.
pub struct SharedTicketer {
    /// The keys and their ids; the first encrypts.
    keys: Vec<([u8; 4], LessSafeKey)>,
    random: SystemRandom,
}

impl std::fmt::Debug for SharedTicketer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys themselves.
        f.debug_struct("SharedTicketer")
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl SharedTicketer {
    /// The keys of a key file's `text`.
    ///
    /// Errors: a message naming the line of a key that is not 64 hex digits, or "no
    /// key" for a file without one.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut keys = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bytes = hex::decode(line)
                .ok()
                .filter(|b| b.len() == 32)
                .ok_or_else(|| {
                    format!(
                        "line {}: a key is 64 hex digits (32 random bytes: `openssl rand -hex 32`)",
                        i + 1
                    )
                })?;
            let digest = Sha256::digest(&bytes);
            let id = [digest[0], digest[1], digest[2], digest[3]];
            let key = UnboundKey::new(&CHACHA20_POLY1305, &bytes)
                .map_err(|_| format!("line {}: not a usable key", i + 1))?;
            keys.push((id, LessSafeKey::new(key)));
        }
        if keys.is_empty() {
            return Err("no key in the file (one a line, 64 hex digits)".into());
        }
        Ok(Self {
            keys,
            random: SystemRandom::new(),
        })
    }
}

impl rustls::server::ProducesTickets for SharedTicketer {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        LIFETIME_S
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        let (id, key) = self.keys.first()?;
        let mut nonce = [0u8; NONCE_LEN];
        self.random.fill(&mut nonce).ok()?;
        let mut sealed = plain.to_vec();
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::empty(),
            &mut sealed,
        )
        .ok()?;
        let mut ticket = Vec::with_capacity(4 + NONCE_LEN + sealed.len());
        ticket.extend_from_slice(id);
        ticket.extend_from_slice(&nonce);
        ticket.extend_from_slice(&sealed);
        Some(ticket)
    }

    fn decrypt(&self, ticket: &[u8]) -> Option<Vec<u8>> {
        let id = ticket.get(..4)?;
        let nonce = ticket.get(4..4 + NONCE_LEN)?;
        let (_, key) = self.keys.iter().find(|(k, _)| k == id)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut sealed = ticket.get(4 + NONCE_LEN..)?.to_vec();
        let plain = key.open_in_place(nonce, Aad::empty(), &mut sealed).ok()?;
        Some(plain.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::server::ProducesTickets;

    const A: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    const B: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

    #[test]
    fn the_first_key_encrypts_and_every_key_decrypts() {
        let old = SharedTicketer::parse(A).unwrap();
        let rotated = SharedTicketer::parse(&format!("# new on top\n{B}\n\n{A} # old\n")).unwrap();
        let t = old.encrypt(b"session").unwrap();
        assert_eq!(rotated.decrypt(&t).unwrap(), b"session");
        let t = rotated.encrypt(b"session").unwrap();
        assert_eq!(old.decrypt(&t), None, "made with the new key");
        assert_eq!(rotated.decrypt(&t).unwrap(), b"session");
        let mut tampered = t.clone();
        *tampered.last_mut().unwrap() ^= 1;
        assert_eq!(rotated.decrypt(&tampered), None);
        assert_eq!(rotated.decrypt(&t[..10]), None);
    }

    #[test]
    fn bad_files_say_which_line() {
        assert!(SharedTicketer::parse("").unwrap_err().contains("no key"));
        let e = SharedTicketer::parse(&format!("{A}\nabc\n")).unwrap_err();
        assert!(e.starts_with("line 2"), "{e}");
        assert!(!format!("{:?}", SharedTicketer::parse(A).unwrap()).contains("0011"));
    }
}
