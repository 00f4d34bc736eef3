//! The job's optional shared secret (`CANDLE_DISTRIBUTED_SECRET`): HMAC-SHA256 proofs for the
//! challenge–response of the standalone exchange, and sealing (encrypt, then authenticate) of
//! the payload, so that the secret itself never crosses the wire and a party without it can
//! neither join, nor read or forge rank 0's payload.
//!
//! Sealing uses HMAC-SHA256 as a pseudo-random function in counter mode for the key stream and
//! HMAC-SHA256 over the ciphertext for the tag, each under a label of its own; every message
//! gets a fresh random 16-byte nonce from the operating system.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Shortest secret accepted, in bytes.
pub const MIN_SECRET: usize = 16;
/// Bytes of a nonce.
pub(super) const NONCE: usize = 16;
/// Bytes of an HMAC-SHA256 tag.
pub(super) const TAG: usize = 32;
/// Bytes that open a sealed payload.
const SEALED: &[u8; 8] = b"CDSEAL01";
/// Bytes a sealed payload adds to the plain one.
pub(super) const SEAL_OVERHEAD: usize = SEALED.len() + NONCE + TAG;

/// A shared secret. Its `Debug` form hides it, so that a logged [`super::DistEnv`] does not
/// give it away.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(hidden)")
    }
}

impl Secret {
    /// A secret of at least [`MIN_SECRET`] bytes (for example 32 random bytes in hexadecimal,
    /// `openssl rand -hex 32`).
    ///
    /// # Errors
    /// When `bytes` is shorter than [`MIN_SECRET`].
    pub fn new(bytes: impl Into<Vec<u8>>) -> candle_core::Result<Self> {
        let bytes = bytes.into();
        if bytes.len() < MIN_SECRET {
            candle_core::bail!(
                "bootstrap: the shared secret has {} bytes, at least {MIN_SECRET} are needed",
                bytes.len()
            )
        }
        Ok(Self(bytes))
    }

    fn hmac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        // Each part length-prefixed: no two different lists of parts hash alike.
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }

    /// The HMAC-SHA256 of `parts` (the first one a label naming its purpose).
    pub(super) fn prove(&self, parts: &[&[u8]]) -> [u8; TAG] {
        self.hmac(parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is [`Secret::prove`] of `parts`, compared in constant time.
    pub(super) fn check(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.hmac(parts).verify_slice(tag).is_ok()
    }

    /// XORs `data` with the key stream of `nonce` under `context`.
    fn stream(&self, context: &[u8], nonce: &[u8], data: &mut [u8]) {
        for (i, chunk) in data.chunks_mut(TAG).enumerate() {
            let block = self.prove(&[b"stream", context, nonce, &(i as u64).to_le_bytes()]);
            for (d, k) in chunk.iter_mut().zip(block) {
                *d ^= k;
            }
        }
    }

    /// `payload` encrypted and authenticated for `context` (what the receiver also knows: the
    /// store key, or the exchange's hello and challenge): `SEALED`, nonce, tag, ciphertext.
    ///
    /// # Errors
    /// When the operating system gives no random bytes.
    pub(super) fn seal(&self, context: &[u8], payload: &[u8]) -> candle_core::Result<Vec<u8>> {
        let nonce = nonce()?;
        let mut body = payload.to_vec();
        self.stream(context, &nonce, &mut body);
        let tag = self.prove(&[b"seal", context, &nonce, &body]);
        let mut out = SEALED.to_vec();
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&tag);
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// The payload of [`Secret::seal`]`(context, ..)`, or why not: not sealed, or sealed with
    /// another secret or for another context, or altered on the way.
    pub(super) fn open(&self, context: &[u8], sealed: &[u8]) -> Result<Vec<u8>, String> {
        if !is_sealed(sealed) {
            return Err("the payload is not sealed with a shared secret".into());
        }
        let (nonce, rest) = sealed[SEALED.len()..].split_at(NONCE);
        let (tag, body) = rest.split_at(TAG);
        if !self.check(&[b"seal", context, nonce, body], tag) {
            return Err(
                "the payload fails authentication (another secret, or altered on the way)".into(),
            );
        }
        let mut out = body.to_vec();
        self.stream(context, nonce, &mut out);
        Ok(out)
    }
}

/// Whether `bytes` looks like a sealed payload.
pub(super) fn is_sealed(bytes: &[u8]) -> bool {
    bytes.len() >= SEAL_OVERHEAD && bytes.starts_with(SEALED)
}

/// A fresh random nonce from the operating system.
///
/// # Errors
/// When the operating system gives no random bytes.
pub(super) fn nonce() -> candle_core::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| {
        candle_core::Error::Msg(format!("bootstrap: no random bytes for a nonce: {e}"))
    })?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> Secret {
        Secret::new(vec![b; 20]).unwrap()
    }

    /// RFC 4231's test case 2 ("Jefe"), through the same HMAC the proofs use (without the
    /// length prefixes, which `prove` adds).
    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        let mut m = HmacSha256::new_from_slice(b"Jefe").unwrap();
        m.update(b"what do ya want for nothing?");
        let hex: String = m
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn a_sealed_payload_opens_only_with_its_secret_and_context() {
        let payload: Vec<u8> = (0..200u32).map(|i| (i * 31 + 7) as u8).collect();
        let sealed = key(1).seal(b"ctx", &payload).unwrap();
        assert_eq!(sealed.len(), payload.len() + SEAL_OVERHEAD);
        // The ciphertext does not show the payload.
        assert!(!sealed.windows(16).any(|w| w == &payload[..16]));
        assert_eq!(key(1).open(b"ctx", &sealed).unwrap(), payload);
        assert!(key(2)
            .open(b"ctx", &sealed)
            .unwrap_err()
            .contains("authentication"));
        assert!(key(1).open(b"other", &sealed).is_err());
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(key(1).open(b"ctx", &flipped).is_err());
        assert!(key(1)
            .open(b"ctx", &payload)
            .unwrap_err()
            .contains("not sealed"));
        // Two seals of one payload differ (fresh nonces).
        assert_ne!(sealed, key(1).seal(b"ctx", &payload).unwrap());
    }

    #[test]
    fn proofs_depend_on_every_part_and_the_secret() {
        let p = key(1).prove(&[b"a", b"bc"]);
        assert!(key(1).check(&[b"a", b"bc"], &p));
        assert!(!key(1).check(&[b"ab", b"c"], &p));
        assert!(!key(2).check(&[b"a", b"bc"], &p));
        assert!(!key(1).check(&[b"a", b"bc"], &p[..31]));
    }

    #[test]
    fn a_short_secret_is_refused_and_never_printed() {
        assert!(Secret::new("short")
            .unwrap_err()
            .to_string()
            .contains("at least 16"));
        let s = Secret::new("a-secret-of-enough-bytes").unwrap();
        assert_eq!(format!("{s:?}"), "Secret(hidden)");
    }
}
