//! JWT callers (`[identity.jwt]`): a bearer token shaped like a JWT is verified here
//! (signature, `exp`, `nbf`, and `iss` / `aud` when configured) and names the caller by
//! one claim and its tier by another.
//!
//! Keys are read by the loading step ([`crate::config::files`]) and built when the
//! config snapshot is built (so a reload re-reads the PEM or JWKS file); verifying a
//! token does no I/O.

use crate::config::{Files, JwtConfig, Problems};
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// Longest caller id taken from a token, in bytes (it appears in logs and messages).
const MAX_ID_LEN: usize = 256;

/// One verification key and the validation rules that go with it (the allowed
/// algorithms of the key's family).
struct Key {
    key: DecodingKey,
    validation: Validation,
}

/// Where the key of a token comes from.
enum Keys {
    /// One key (a secret or a PEM public key) for every token.
    Single(Box<Key>),
    /// A JWKS: the token's `kid` selects the key.
    ByKid(HashMap<String, Key>),
}

/// The verifier built from `[identity.jwt]`.
pub struct JwtVerifier {
    keys: Keys,
    id_claim: String,
    tier_claim: Option<String>,
    default_tier: Arc<str>,
    /// Tiers a token may name (filled in by [`super::Identities::build`]).
    pub(super) known_tiers: BTreeSet<Arc<str>>,
    /// Tiers this section declares: `default_tier` and `tiers`.
    pub(super) declared_tiers: Vec<Arc<str>>,
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = match &self.keys {
            Keys::Single(_) => 1,
            Keys::ByKid(m) => m.len(),
        };
        f.debug_struct("JwtVerifier")
            .field("keys", &keys)
            .field("id_claim", &self.id_claim)
            .field("tier_claim", &self.tier_claim)
            .finish_non_exhaustive()
    }
}

/// A verified token: the caller id and tier it gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtCaller {
    /// The value of `id_claim`.
    pub id: String,
    /// The value of `tier_claim`, or `default_tier`.
    pub tier: Arc<str>,
}

/// Whether a bearer token looks like a JWT: three base64url parts separated by dots
/// (the third, the signature, may be empty, so that unsigned tokens are rejected as
/// tokens rather than looked up as API keys).
pub fn looks_like_jwt(token: &[u8]) -> bool {
    let mut dots = 0;
    for &b in token {
        match b {
            b'.' => dots += 1,
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' => {}
            _ => return false,
        }
    }
    dots == 2 && !token.starts_with(b".") && !token.windows(2).any(|w| w == b"..")
}

impl JwtVerifier {
    /// Build from `[identity.jwt]`, with the key files the loading step read (`files`)
    /// and the secret's environment variable, recording problems under `identity.jwt.*`.
    pub fn build(cfg: &JwtConfig, files: &Files, problems: &mut Problems) -> Option<Self> {
        let at = "identity.jwt";
        let before = problems.errors.len();

        let mut algorithms = Vec::new();
        if cfg.algorithms.is_empty() {
            problems.error(
                format!("{at}.algorithms"),
                "must list at least one algorithm, e.g. [\"RS256\"]",
            );
        }
        for (i, name) in cfg.algorithms.iter().enumerate() {
            match name.parse::<Algorithm>() {
                Ok(alg) => algorithms.push(alg),
                Err(_) if name.eq_ignore_ascii_case("none") => problems.error(
                    format!("{at}.algorithms[{i}]"),
                    "\"none\" (unsigned tokens) is never accepted",
                ),
                Err(_) => problems.error(
                    format!("{at}.algorithms[{i}]"),
                    format!("unknown algorithm {name:?}; known: HS256, HS384, HS512, RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA"),
                ),
            }
        }

        // The library adds and subtracts the leeway from "now" in u64 seconds: a bounded
        // leeway keeps that arithmetic far from overflow.
        if cfg.leeway.0.as_secs() > 86_400 {
            problems.error(format!("{at}.leeway"), "must be at most \"1d\"");
        }
        let mut base = Validation::new(Algorithm::HS256);
        base.leeway = cfg.leeway.0.as_secs();
        base.validate_nbf = true;
        let mut required = vec!["exp"];
        if let Some(iss) = &cfg.issuer {
            base.set_issuer(&[iss]);
            required.push("iss");
        }
        match &cfg.audience {
            Some(aud) => {
                base.set_audience(&[aud]);
                required.push("aud");
            }
            None => base.validate_aud = false,
        }
        base.set_required_spec_claims(&required);
        if cfg.id_claim.trim().is_empty() {
            problems.error(format!("{at}.id_claim"), "must not be empty");
        }
        if cfg
            .tier_claim
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            problems.error(format!("{at}.tier_claim"), "must not be empty");
        }
        if cfg.default_tier.trim().is_empty() {
            problems.error(format!("{at}.default_tier"), "must not be empty");
        }
        for (i, t) in cfg.tiers.iter().enumerate() {
            if t.trim().is_empty() {
                problems.error(format!("{at}.tiers[{i}]"), "must not be empty");
            }
        }

        let sources = [
            cfg.secret.is_some(),
            cfg.secret_env.is_some(),
            cfg.secret_file.is_some(),
            cfg.public_key.is_some(),
            cfg.jwks.is_some(),
        ];
        let keys = match sources.iter().filter(|s| **s).count() {
            0 => {
                problems.error(
                    at,
                    "no key: give one of `secret`, `secret_env`, `secret_file`, `public_key` or `jwks`",
                );
                None
            }
            1 => load_keys(cfg, &algorithms, &base, files, problems),
            _ => {
                problems.error(
                    at,
                    "give only one of `secret`, `secret_env`, `secret_file`, `public_key` and `jwks`",
                );
                None
            }
        };
        if problems.errors.len() != before {
            return None;
        }
        let mut declared_tiers: Vec<Arc<str>> = vec![cfg.default_tier.as_str().into()];
        declared_tiers.extend(cfg.tiers.iter().map(|t| Arc::from(t.as_str())));
        Some(Self {
            keys: keys?,
            id_claim: cfg.id_claim.clone(),
            tier_claim: cfg.tier_claim.clone(),
            default_tier: cfg.default_tier.as_str().into(),
            known_tiers: BTreeSet::new(),
            declared_tiers,
        })
    }

    /// Verify `token` and read the caller from its claims.
    ///
    /// Errors: the reason, as shown to the caller after `invalid token: ` (`expired`,
    /// `not yet valid`, `bad signature`, `wrong audience`, `wrong issuer`, `unknown kid`,
    /// `malformed`, also for a caller id with `,` or a control character, `critical
    /// header parameter "NAME" not understood` for any `crit` header, ...).
    pub fn verify(&self, token: &[u8]) -> Result<JwtCaller, String> {
        let token = std::str::from_utf8(token).map_err(|_| "malformed".to_string())?;
        let key = match &self.keys {
            Keys::Single(key) => key,
            Keys::ByKid(keys) => {
                let header = jsonwebtoken::decode_header(token).map_err(|e| reason(e.kind()))?;
                let kid = header.kid.ok_or_else(|| "no kid".to_string())?;
                keys.get(&kid).ok_or_else(|| "unknown kid".to_string())?
            }
        };
        let data = jsonwebtoken::decode::<HashMap<String, serde_json::Value>>(
            token,
            &key.key,
            &key.validation,
        )
        .map_err(|e| reason(e.kind()))?;
        // RFC 7515 §4.1.11: a recipient must refuse a token whose `crit` names an
        // extension it does not understand; tollgate understands none.
        if let Some(crit) = &data.header.crit {
            let shown: String = crit
                .first()
                .map(|c| c.chars().take(64).collect())
                .unwrap_or_default();
            return Err(format!(
                "critical header parameter {shown:?} not understood"
            ));
        }
        let claims = data.claims;
        let id = match claims.get(&self.id_claim) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) if n.is_u64() || n.is_i64() => n.to_string(),
            Some(_) => return Err(format!("claim {:?} is not a string", self.id_claim)),
            None => return Err(format!("missing claim {:?}", self.id_claim)),
        };
        // A comma would reach the upstream as a list of callers (`mallory, alice`); a
        // control character could split headers and log lines.
        if id.contains(',') || id.chars().any(char::is_control) {
            return Err("malformed".into());
        }
        if id.is_empty() || id.len() > MAX_ID_LEN {
            return Err(format!(
                "claim {:?} must be 1 to {MAX_ID_LEN} printable bytes",
                self.id_claim
            ));
        }
        let tier = match self.tier_claim.as_ref().and_then(|c| claims.get(c)) {
            None => self.default_tier.clone(),
            Some(serde_json::Value::String(t)) => {
                match self.known_tiers.get(t.as_str()) {
                    Some(tier) => tier.clone(),
                    None => {
                        // Tiers come from config, so showing at most 64 bytes of the
                        // claim keeps the answer small.
                        let shown: String = t.chars().take(64).collect();
                        return Err(format!("unknown tier {shown:?}"));
                    }
                }
            }
            Some(_) => return Err("tier claim is not a string".into()),
        };
        Ok(JwtCaller { id, tier })
    }
}

/// The reason shown for a failed verification.
fn reason(kind: &ErrorKind) -> String {
    match kind {
        ErrorKind::ExpiredSignature => "expired".into(),
        ErrorKind::ImmatureSignature => "not yet valid".into(),
        ErrorKind::InvalidSignature => "bad signature".into(),
        ErrorKind::InvalidAudience => "wrong audience".into(),
        ErrorKind::InvalidIssuer => "wrong issuer".into(),
        ErrorKind::InvalidAlgorithm | ErrorKind::MissingAlgorithm => "algorithm not allowed".into(),
        ErrorKind::MissingRequiredClaim(c) => format!("missing claim {c:?}"),
        ErrorKind::InvalidClaimFormat(c) => format!("claim {c:?} is malformed"),
        _ => "malformed".into(),
    }
}

/// The allowed algorithms usable with `key`: those of its family (and, for a JWK that
/// names its algorithm, only that one).
fn key_with(
    key: DecodingKey,
    allowed: &[Algorithm],
    only: Option<Algorithm>,
    base: &Validation,
) -> Option<Key> {
    let algorithms: Vec<Algorithm> = allowed
        .iter()
        .copied()
        .filter(|a| a.family() == key.family() && only.is_none_or(|o| o == *a))
        .collect();
    if algorithms.is_empty() {
        return None;
    }
    let mut validation = base.clone();
    validation.algorithms = algorithms;
    Some(Key { key, validation })
}

fn load_keys(
    cfg: &JwtConfig,
    allowed: &[Algorithm],
    base: &Validation,
    files: &Files,
    problems: &mut Problems,
) -> Option<Keys> {
    let at = "identity.jwt";
    let no_alg = |problems: &mut Problems, key: &str, family: &str| {
        problems.error(
            format!("{at}.algorithms"),
            format!("none of these algorithms can be used with the {family} in `{key}`"),
        );
    };
    let secret = match (&cfg.secret, &cfg.secret_env) {
        (Some(s), _) => Some(("secret", s.clone())),
        (None, Some(var)) => match std::env::var(var) {
            Ok(s) => Some(("secret_env", s)),
            Err(_) => {
                problems.error(
                    format!("{at}.secret_env"),
                    format!("the environment variable {var:?} is not set (or not UTF-8)"),
                );
                return None;
            }
        },
        (None, None) => crate::config::secrets::secret(
            &format!("{at}.secret"),
            None,
            cfg.secret_file.as_deref(),
            files,
            problems,
        )
        .map(|s| ("secret_file", s)),
    };
    if cfg.secret_file.is_some() && secret.is_none() {
        return None;
    }
    if let Some((name, secret)) = secret {
        if secret.len() < 16 {
            problems.error(
                format!("{at}.{name}"),
                "an HMAC secret must be at least 16 bytes (32 or more recommended)",
            );
            return None;
        }
        let key = key_with(
            DecodingKey::from_secret(secret.as_bytes()),
            allowed,
            None,
            base,
        );
        if key.is_none() {
            no_alg(problems, name, "HMAC secret");
        }
        return key.map(|k| Keys::Single(Box::new(k)));
    }
    if let Some(path) = &cfg.public_key {
        let (_, pem) = files.bytes(&format!("{at}.public_key"), problems)?;
        let decoded = DecodingKey::from_rsa_pem(pem)
            .or_else(|_| DecodingKey::from_ec_pem(pem))
            .or_else(|_| DecodingKey::from_ed_pem(pem));
        let Ok(key) = decoded else {
            problems.error(
                format!("{at}.public_key"),
                format!("{path:?} holds no RSA, EC or Ed25519 public key in PEM"),
            );
            return None;
        };
        let key = key_with(key, allowed, None, base);
        if key.is_none() {
            no_alg(problems, "public_key", "key");
        }
        return key.map(|k| Keys::Single(Box::new(k)));
    }
    let path = cfg.jwks.as_ref()?;
    let (_, bytes) = files.bytes(&format!("{at}.jwks"), problems)?;
    let set: JwkSet = match serde_json::from_slice(bytes) {
        Ok(set) => set,
        Err(e) => {
            problems.error(
                format!("{at}.jwks"),
                format!("{path:?} is not a JWKS ({{\"keys\": [...]}}): {e}"),
            );
            return None;
        }
    };
    let mut keys = HashMap::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        let Some(kid) = jwk.common.key_id.clone() else {
            problems.error(
                format!("{at}.jwks"),
                format!("{path:?}: key {i} has no \"kid\""),
            );
            continue;
        };
        let only = match &jwk.common.key_algorithm {
            None => None,
            Some(ka) => match format!("{ka:?}").parse::<Algorithm>() {
                Ok(alg) => Some(alg),
                Err(_) => {
                    problems.error(
                        format!("{at}.jwks"),
                        format!("{path:?}: key {kid:?} has an unsupported \"alg\""),
                    );
                    continue;
                }
            },
        };
        let key = match DecodingKey::from_jwk(jwk) {
            Ok(key) => key,
            Err(e) => {
                problems.error(
                    format!("{at}.jwks"),
                    format!("{path:?}: key {kid:?} is not usable: {e}"),
                );
                continue;
            }
        };
        match key_with(key, allowed, only, base) {
            Some(key) => {
                if keys.insert(kid.clone(), key).is_some() {
                    problems.error(
                        format!("{at}.jwks"),
                        format!("{path:?}: kid {kid:?} appears twice"),
                    );
                }
            }
            None => problems.warn(
                format!("{at}.jwks"),
                format!("{path:?}: key {kid:?} matches none of `algorithms`; ignored"),
            ),
        }
    }
    if keys.is_empty() {
        problems.error(
            format!("{at}.jwks"),
            format!("{path:?} has no key usable with `algorithms`"),
        );
        return None;
    }
    Some(Keys::ByKid(keys))
}

#[cfg(test)]
mod tests;
