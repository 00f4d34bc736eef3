//! The job's optional shared key (`CANDLE_DISTRIBUTED_SECRET`, or a file named by
//! `CANDLE_DISTRIBUTED_SECRET_FILE`): HMAC-SHA256 proofs for the challenge–response of the
//! admission to the store rank 0 hosts, and the payload sealed with XChaCha20-Poly1305, so that
//! the key itself never crosses the wire and a party without it can neither join, nor read or
//! forge rank 0's payload.
//!
//! **A generated key, not a passphrase.** Rank 0 sends a proof over a client's hello to anyone
//! who connects, and every exchange shows one to an eavesdropper: either is enough to test
//! guesses of the key offline, at HMAC speed. So the variable must hold at least 128 random
//! bits written in hexadecimal (32 or more digits); the key file may also hold at least 256
//! random bits in base64 (`openssl rand -base64 32`: 43 or more characters, standard or
//! URL-safe, padded or not, mixing upper- and lower-case letters and holding a digit or a
//! symbol, as random ones do). Anything else is refused with the command that makes one:
//! `openssl rand -hex 32`. Base64 is not read from the variable: a CamelCase passphrase
//! (`CorrectHorseBatteryStapleCorrect`) is valid base64 of enough bytes. Whatever its form,
//! a key whose bytes are all printable text (a passphrase, hex- or base64-encoded) is refused
//! too, here and by [`Secret::new`]. A format check cannot measure randomness (32 zeros pass);
//! it refuses passphrases and words.
//!
//! Two keys are derived from it with HKDF-SHA256 (salt `candle-distributed/v1`), one for the
//! proofs (`auth`), one for sealing (`seal`); both are wiped from memory when dropped.

use base64::alphabet;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

pub(crate) use crate::sealed::{is_sealed, nonce, per_rank_marker, NONCE, SEAL_OVERHEAD, TAG};
use crate::sealed::{SEALED, SEALED_V1, SEAL_NONCE};
use crate::{bail, Result, SECRET_FILE_VAR, SECRET_VAR};

type HmacSha256 = Hmac<Sha256>;

/// Fewest key bytes accepted (128 bits).
pub const MIN_SECRET: usize = 16;
/// The command the errors suggest for making a key.
pub const MAKE_A_KEY: &str = "openssl rand -hex 32";

/// A shared key, held as its two derived subkeys. Its `Debug` form hides it, so that a logged
/// [`super::DistEnv`] does not give it away; `==` compares in constant time.
#[derive(Clone)]
pub struct Secret {
    /// HKDF-SHA256 `auth` subkey: the HMAC proofs.
    auth: Zeroizing<[u8; 32]>,
    /// HKDF-SHA256 `seal` subkey: XChaCha20-Poly1305.
    seal: Zeroizing<[u8; 32]>,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(hidden)")
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        (self.auth[..].ct_eq(&other.auth[..]) & self.seal[..].ct_eq(&other.seal[..])).into()
    }
}

impl Eq for Secret {}

impl Secret {
    /// A secret from the bytes of a key of at least [`MIN_SECRET`] random bytes (the raw bytes,
    /// not text: [`Secret::from_text`] reads the form the environment variable takes).
    ///
    /// # Errors
    /// When `key` is shorter than [`MIN_SECRET`], or when every byte of it is printable text
    /// (a passphrase handed over as bytes: 16 random bytes are all printable one time in
    /// about 10⁷); the error never shows the key.
    pub fn new(key: impl Into<Vec<u8>>) -> Result<Self> {
        let key = Zeroizing::new(key.into());
        if key.len() < MIN_SECRET {
            crate::bail!(
                "bootstrap: the shared key has {} bytes, at least {MIN_SECRET} are needed (make one with `{MAKE_A_KEY}`)",
                key.len()
            )
        }
        if key
            .iter()
            .all(|&b| (0x20..0x7f).contains(&b) || b"\t\r\n".contains(&b))
        {
            crate::bail!(
                "bootstrap: the shared key's {} bytes are all printable text: a passphrase, not a generated key (give the key's random bytes, or its hexadecimal form to Secret::from_text; make one with `{MAKE_A_KEY}`)",
                key.len()
            )
        }
        let kdf = Hkdf::<Sha256>::new(Some(b"candle-distributed/v1"), &key);
        let derive = |info: &[u8]| {
            let mut k = Zeroizing::new([0u8; 32]);
            kdf.expand(info, &mut *k)
                .expect("32 bytes is within HKDF-SHA256's output limit");
            k
        };
        Ok(Self {
            auth: derive(b"auth"),
            seal: derive(b"seal"),
        })
    }

    /// A secret from a generated key written as text, as the environment variable holds it: at
    /// least 128 bits in hexadecimal (32 or more digits); surrounding whitespace is ignored.
    /// `source` names where the text came from, for the error.
    ///
    /// # Errors
    /// When the text is not that (a passphrase, a word, a short key, base64), or encodes
    /// printable text (see [`Secret::new`]): the error names `source` and the command that
    /// makes a key, never the text.
    pub fn from_text(text: &str, source: &str) -> Result<Self> {
        match decode_hex(text.trim()) {
            Some(key) => Self::new(key.to_vec()).map_err(|e| refused(source, &e.to_string())),
            None => Err(refused(
                source,
                "it needs at least 128 random bits in hexadecimal (32 or more digits; base64 is read from a key file only)",
            )),
        }
    }

    /// A secret from the text of a key file: the hexadecimal [`Secret::from_text`] reads, or at
    /// least 256 bits in base64 (standard or URL-safe alphabet, padding optional) that mixes
    /// upper- and lower-case letters and holds a digit or a symbol, as the base64 of random
    /// bytes does (all but about one key in 7,000).
    ///
    /// # Errors
    /// As [`Secret::from_text`].
    pub fn from_key_file(text: &str, source: &str) -> Result<Self> {
        let text = text.trim();
        match decode_hex(text).or_else(|| decode_base64(text)) {
            Some(key) => Self::new(key.to_vec()).map_err(|e| refused(source, &e.to_string())),
            None => Err(refused(
                source,
                "it needs at least 128 random bits in hexadecimal (32 or more digits) or 256 in base64 (43 or more characters)",
            )),
        }
    }

    fn hmac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut m = <HmacSha256 as Mac>::new_from_slice(&*self.auth)
            .expect("HMAC takes a key of any length");
        // Each part length-prefixed: no two different lists of parts hash alike.
        for p in parts {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }

    /// The HMAC-SHA256 of `parts` (the first one a label naming its purpose).
    pub(crate) fn prove(&self, parts: &[&[u8]]) -> [u8; TAG] {
        self.hmac(parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is [`Secret::prove`] of `parts`, compared in constant time.
    pub(crate) fn check(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.hmac(parts).verify_slice(tag).is_ok()
    }

    /// `payload` sealed for `context` (what the receiver also knows: the store key, or the
    /// exchange's hello and challenge) with XChaCha20-Poly1305, `context` as associated data:
    /// `SEALED`, a random 24-byte nonce, the ciphertext and its 16-byte tag.
    ///
    /// # Errors
    /// When the operating system gives no random bytes.
    pub(crate) fn seal(&self, context: &[u8], payload: &[u8]) -> Result<Vec<u8>> {
        let mut nonce = [0u8; SEAL_NONCE];
        getrandom::fill(&mut nonce).map_err(|e| {
            crate::Error::Msg(format!("bootstrap: no random bytes for a nonce: {e}"))
        })?;
        let body = self
            .cipher()
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: payload,
                    aad: context,
                },
            )
            .map_err(|_| crate::Error::Msg("bootstrap: sealing failed".into()))?;
        let mut out = SEALED.to_vec();
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// The payload of [`Secret::seal`]`(context, ..)`, or why not: not sealed, sealed by an
    /// older version, sealed with another key or for another context, or altered on the way.
    pub(crate) fn open(
        &self,
        context: &[u8],
        sealed: &[u8],
    ) -> std::result::Result<Vec<u8>, String> {
        if sealed.starts_with(SEALED_V1) {
            return Err("the payload is sealed by an older candle-distributed (before XChaCha20-Poly1305): run the same version on every rank".into());
        }
        if !is_sealed(sealed) {
            return Err("the payload is not sealed with a shared secret".into());
        }
        let (nonce, body) = sealed[SEALED.len()..].split_at(SEAL_NONCE);
        self.cipher()
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: body,
                    aad: context,
                },
            )
            .map_err(|_| {
                "the payload fails authentication (another secret, another launch or rendezvous, or altered on the way)".into()
            })
    }

    fn cipher(&self) -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new(Key::from_slice(&*self.seal))
    }
}

/// The shared key from [`SECRET_VAR`] or the file [`SECRET_FILE_VAR`] names, if either is set.
pub(crate) fn from_vars(get: &impl Fn(&str) -> Option<String>) -> Result<Option<Secret>> {
    match (get(SECRET_VAR), get(SECRET_FILE_VAR)) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => {
            bail!("bootstrap: both {SECRET_VAR} and {SECRET_FILE_VAR} are set: set one")
        }
        (Some(text), None) => {
            let text = Zeroizing::new(text);
            Secret::from_text(&text, &format!("environment variable {SECRET_VAR}")).map(Some)
        }
        (None, Some(path)) => {
            let text = Zeroizing::new(std::fs::read_to_string(path.trim()).map_err(|e| {
                crate::Error::Msg(format!(
                    "bootstrap: the key file {path:?} ({SECRET_FILE_VAR}) cannot be read: {e}"
                ))
            })?);
            Secret::from_key_file(&text, &format!("the key file {path:?} ({SECRET_FILE_VAR})"))
                .map(Some)
        }
    }
}

/// The error of a refused key: where it came from and why, never the text.
fn refused(source: &str, why: &str) -> crate::Error {
    crate::Error::Msg(format!(
        "bootstrap: {source} is not a generated key: {why}; make one with `{MAKE_A_KEY}`. Passphrases are refused: anyone who reaches rank 0's port, or sees one exchange, could test guesses of one offline"
    ))
}

/// The key bytes of hexadecimal `text`, at least [`MIN_SECRET`] of them.
fn decode_hex(text: &str) -> Option<Zeroizing<Vec<u8>>> {
    let hex = text.len().is_multiple_of(2) && text.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex {
        return None;
    }
    let digit = |b: u8| (b as char).to_digit(16).expect("checked hex digit") as u8;
    let bytes = text.as_bytes().chunks_exact(2);
    let key = Zeroizing::new(
        bytes
            .map(|p| digit(p[0]) << 4 | digit(p[1]))
            .collect::<Vec<u8>>(),
    );
    (key.len() >= MIN_SECRET).then_some(key)
}

/// Bytes of a base64 key (256 bits: `openssl rand -base64 32`).
const MIN_BASE64_KEY: usize = 32;

/// The key bytes of base64 `text` as random bytes encode, at least [`MIN_BASE64_KEY`]: both
/// letter cases and a digit or symbol (the base64 of 32 random bytes lacks one of these about
/// one time in 7,000, a CamelCase passphrase always does).
fn decode_base64(text: &str) -> Option<Zeroizing<Vec<u8>>> {
    let has = |f: fn(&u8) -> bool| text.as_bytes().iter().any(f);
    let looks_random = has(u8::is_ascii_uppercase)
        && has(u8::is_ascii_lowercase)
        && has(|b| b.is_ascii_digit() || b"+/-_".contains(b));
    if !looks_random {
        return None;
    }
    let config = GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(false);
    let key = [alphabet::STANDARD, alphabet::URL_SAFE]
        .iter()
        .find_map(|a| GeneralPurpose::new(a, config).decode(text).ok())
        .map(Zeroizing::new)?;
    (key.len() >= MIN_BASE64_KEY).then_some(key)
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
        let mut m = <HmacSha256 as Mac>::new_from_slice(b"Jefe").unwrap();
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

    /// The derivation is RFC 5869's HKDF-SHA256 (its test case 1 through the same crate call),
    /// and the two subkeys differ from each other and from the key.
    #[test]
    fn subkeys_are_hkdf_sha256() {
        let ikm = [0x0bu8; 22];
        let salt: Vec<u8> = (0x00..=0x0c).collect();
        let info: Vec<u8> = (0xf0..=0xf9).collect();
        let mut okm = [0u8; 42];
        Hkdf::<Sha256>::new(Some(&salt), &ikm)
            .expand(&info, &mut okm)
            .unwrap();
        let hex: String = okm.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
        );
        let k = key(7);
        assert_ne!(*k.auth, *k.seal);
        assert_ne!(&k.auth[..20], &[7u8; 20][..]);
    }

    #[test]
    fn a_sealed_payload_opens_only_with_its_secret_and_context() {
        let payload: Vec<u8> = (0..200u32).map(|i| (i * 31 + 7) as u8).collect();
        let sealed = key(1).seal(b"ctx", &payload).unwrap();
        assert_eq!(sealed.len(), payload.len() + SEAL_OVERHEAD);
        assert!(sealed.starts_with(SEALED));
        // The ciphertext does not show the payload.
        assert!(!sealed.windows(16).any(|w| w == &payload[..16]));
        assert_eq!(key(1).open(b"ctx", &sealed).unwrap(), payload);
        assert!(key(2)
            .open(b"ctx", &sealed)
            .unwrap_err()
            .contains("authentication"));
        assert!(key(1).open(b"other", &sealed).is_err());
        for at in [SEALED.len(), SEALED.len() + SEAL_NONCE, sealed.len() - 1] {
            let mut flipped = sealed.clone();
            flipped[at] ^= 1;
            assert!(key(1).open(b"ctx", &flipped).is_err(), "byte {at} altered");
        }
        assert!(key(1)
            .open(b"ctx", &payload)
            .unwrap_err()
            .contains("not sealed"));
        let mut old = b"CDSEAL01".to_vec();
        old.extend_from_slice(&[0u8; 80]);
        assert!(is_sealed(&old));
        assert!(key(1).open(b"ctx", &old).unwrap_err().contains("older"));
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
        assert!(Secret::new(vec![0x80u8; 5])
            .unwrap_err()
            .to_string()
            .contains("at least 16"));
        let bytes: Vec<u8> = (0..24u8).map(|i| i.wrapping_mul(91) ^ 0xc3).collect();
        let s = Secret::new(bytes.clone()).unwrap();
        assert_eq!(format!("{s:?}"), "Secret(hidden)");
        assert_eq!(s, Secret::new(bytes.clone()).unwrap());
        let mut other = bytes;
        other[3] ^= 1;
        assert_ne!(s, Secret::new(other).unwrap());
    }

    /// A passphrase handed over as bytes, or hex- or base64-encoded, is refused: every byte of
    /// it is printable text. The error does not show it.
    #[test]
    fn a_passphrase_in_any_encoding_is_refused() {
        let phrase = "a-secret-of-enough-bytes";
        let e = Secret::new(phrase).unwrap_err().to_string();
        assert!(e.contains("printable text") && !e.contains(phrase), "{e}");
        let hex: String = phrase.bytes().map(|b| format!("{b:02x}")).collect();
        let e = Secret::from_text(&hex, "K").unwrap_err().to_string();
        assert!(e.contains("printable text") && e.contains("K"), "{e}");
        let long = "this passphrase is long enough for 256 bits";
        let b64 = base64::engine::general_purpose::STANDARD.encode(long);
        let e = Secret::from_key_file(&b64, "F").unwrap_err().to_string();
        assert!(e.contains("printable text"), "{e}");
    }

    /// Generated keys are read as the bytes they encode: hexadecimal from the variable and the
    /// file, base64 (both alphabets, padded or not, 256 bits) from the file only. Passphrases,
    /// CamelCase passphrases that are valid base64, words, short keys and other text are refused
    /// with the command that makes a key, without echoing the text.
    #[test]
    fn only_generated_keys_are_accepted_as_text() {
        let bytes: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(37) ^ 0xa5).collect();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        let b64_url = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&bytes);
        let want = Secret::new(bytes.clone()).unwrap();
        for text in [hex.clone(), hex.to_uppercase(), format!("  {hex}\n")] {
            assert_eq!(Secret::from_text(&text, "the key").unwrap(), want, "{text}");
            assert_eq!(
                Secret::from_key_file(&text, "the key").unwrap(),
                want,
                "{text}"
            );
        }
        for text in [b64.clone(), b64_url.clone(), format!("{b64}\n")] {
            assert_eq!(Secret::from_key_file(&text, "f").unwrap(), want, "{text}");
            let e = Secret::from_text(&text, "CANDLE_DISTRIBUTED_SECRET").unwrap_err();
            assert!(e.to_string().contains("key file only"), "{e}");
        }
        // 16 bytes is enough in hexadecimal: 32 digits.
        assert!(Secret::from_text(&hex[..32], "k").is_ok());
        let b64_16 = base64::engine::general_purpose::STANDARD_NO_PAD.encode(&bytes[..16]);
        assert!(
            Secret::from_key_file(&b64_16, "k").is_err(),
            "base64 needs 256 bits"
        );
        for bad in [
            "correct horse battery staple",
            "correcthorsebatterystaplecorrecthorse",
            "CORRECTHORSEBATTERYSTAPLECORRECT",
            "CorrectHorseBatteryStapleCorrect",
            "CorrectHorseBatteryStapleCorrectHorseBatteryStaple",
            "ThisIsMyTrainingClusterKey20",
            "MyVerySecretTrainingPassword",
            "a-secret-of-enough-bytes",
            &hex[..30],
            &b64[..20],
            "",
            "zz0123456789abcdef0123456789abcdef",
        ] {
            for e in [
                Secret::from_text(bad, "CANDLE_DISTRIBUTED_SECRET").unwrap_err(),
                Secret::from_key_file(bad, "CANDLE_DISTRIBUTED_SECRET").unwrap_err(),
            ] {
                let e = e.to_string();
                assert!(
                    e.contains("CANDLE_DISTRIBUTED_SECRET") && e.contains(MAKE_A_KEY),
                    "{bad:?}: {e}"
                );
                if bad.len() > 8 {
                    assert!(!e.contains(bad), "the error echoes the text: {e}");
                }
            }
        }
    }
}
