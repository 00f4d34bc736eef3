//! What the exchange needs of sealing whether or not this build can seal: the sizes of nonces,
//! proofs and seals, fresh nonces, and what a sealed value looks like.

/// Bytes of a handshake nonce.
pub(crate) const NONCE: usize = 16;
/// Bytes of an HMAC-SHA256 proof.
pub(crate) const TAG: usize = 32;
/// Bytes of a sealing nonce (XChaCha20's).
pub(crate) const SEAL_NONCE: usize = 24;
/// Bytes of a Poly1305 tag.
pub(crate) const SEAL_TAG: usize = 16;
/// Bytes that open a sealed payload (format 2: XChaCha20-Poly1305).
pub(crate) const SEALED: &[u8; 8] = b"CDSEAL02";
/// What opened a payload sealed by versions before the AEAD.
pub(crate) const SEALED_V1: &[u8; 8] = b"CDSEAL01";
/// Bytes a sealed payload adds to the plain one.
pub(crate) const SEAL_OVERHEAD: usize = SEALED.len() + SEAL_NONCE + SEAL_TAG;

/// A fresh random handshake nonce from the operating system.
///
/// # Errors
/// When the operating system gives no random bytes.
pub(crate) fn nonce() -> crate::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n)
        .map_err(|e| crate::Error::Msg(format!("bootstrap: no random bytes for a nonce: {e}")))?;
    Ok(n)
}

/// What rank 0 sets under a rendezvous key in the job's store when it seals one copy of the
/// payload per rank: sealed-looking (a rank without the key says so), opening for nobody.
pub(crate) fn per_rank_marker() -> Vec<u8> {
    let mut m = SEALED.to_vec();
    m.extend_from_slice(&[0u8; SEAL_NONCE + SEAL_TAG]);
    m.extend_from_slice(b"one sealed copy per rank");
    m
}

/// Whether `bytes` looks like a sealed payload (of this version or an older one).
pub(crate) fn is_sealed(bytes: &[u8]) -> bool {
    (bytes.len() >= SEAL_OVERHEAD && bytes.starts_with(SEALED)) || bytes.starts_with(SEALED_V1)
}
