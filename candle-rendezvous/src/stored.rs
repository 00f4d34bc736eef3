//! The exchange through the job's key-value store (torchrun's agent store, or the one rank 0
//! hosts): rank 0 sets the payload, the others get it and acknowledge; with a shared key, one
//! sealed copy per rank.

use std::time::{Duration, Instant};

use crate::store::Store;
use crate::{bail, secret, DistEnv, Error, Result, Secret, SECRET_VAR};

/// Rank 0's side: `payload` under rendezvous `seq`'s key of `store` (with a key, the marker and
/// one sealed copy per rank, once every rank has left its nonce).
///
/// # Errors
/// The store's error, a rank's nonce not there by `deadline` or of the wrong size, or sealing
/// failing.
pub(crate) fn set_payload(
    env: &DistEnv,
    store: &mut dyn Store,
    seq: u64,
    payload: &[u8],
    deadline: Instant,
) -> Result<()> {
    let key = store_key(env, seq);
    match &env.secret {
        Some(k) => seal_per_rank(env, k, store, &key, payload, deadline),
        None => store.set(&key, payload, deadline),
    }
}

/// A rank's side other than 0: rank 0's payload of rendezvous `seq`, waiting for it until
/// `deadline` (`timeout` is named in the error), then the acknowledgement rank 0 may wait for
/// ([`ack_key`]). With a shared key, rank 0 seals this rank's copy for `nonce` (the same in
/// every attempt of one rendezvous, so that a copy sealed for an attempt cut short still opens).
///
/// # Errors
/// Nothing there by `deadline`, the store's error, or a value that does not match this rank's
/// key (or its absence).
pub(crate) fn get_payload(
    env: &DistEnv,
    store: &mut dyn Store,
    (seq, nonce): (u64, &[u8]),
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let payload = get_only(env, store, (seq, nonce), deadline, timeout)?;
    let ack = ack_key(&store_key(env, seq), env.rank);
    store.set(&ack, b"1", deadline)?;
    // A round trip, so that the acknowledgement has reached the store when this returns. It
    // may find the connection closed instead: rank 0, having every acknowledgement, stopped
    // the store it hosted; the SET had gone out whole.
    if let Err(e) = store.check(&ack, deadline) {
        log::debug!(
            "bootstrap: rank {}: after the acknowledgement: {e}",
            env.rank
        );
    }
    Ok(payload)
}

/// Where rank `r` acknowledges rendezvous `key`'s payload.
pub(crate) fn ack_key(key: &str, r: usize) -> String {
    format!("{key}/ack/{r}")
}

fn get_only(
    env: &DistEnv,
    store: &mut dyn Store,
    (seq, nonce): (u64, &[u8]),
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let key = store_key(env, seq);
    let waited = |e: Error| {
        Error::Msg(format!(
            "bootstrap: rank {} waited {timeout:?} for rank 0's payload: {e}",
            env.rank
        ))
    };
    let value = store.get(&key, deadline).map_err(waited)?;
    let (Some(_), true) = (&env.secret, value == secret::per_rank_marker()) else {
        return unseal_stored(env, &key, value);
    };
    // Rank 0 seals a copy for this rank's fresh nonce.
    store.set(&nonce_key(&key, env.rank), nonce, deadline)?;
    let mine = per_rank_key(&key, env.rank);
    let value = store.get(&mine, deadline).map_err(waited)?;
    open_per_rank(env, &mine, nonce, &value)
}

/// Where rank `r` leaves its nonce for rendezvous `key`.
fn nonce_key(key: &str, r: usize) -> String {
    format!("{key}/nonce/{r}")
}

/// Where rank 0 leaves rank `r`'s sealed copy of rendezvous `key`'s payload.
pub(crate) fn per_rank_key(key: &str, r: usize) -> String {
    format!("{key}/for/{r}")
}

/// What rank `r`'s copy is sealed with, besides the key: its store key and its nonce.
pub(crate) fn per_rank_context(key: &str, nonce: &[u8]) -> Vec<u8> {
    let mut ctx = key.as_bytes().to_vec();
    ctx.push(b'\n');
    ctx.extend_from_slice(nonce);
    ctx
}

/// Rank 0's side with a key: the marker under `key`, then for each rank its nonce read
/// (waiting for it) and its copy set.
fn seal_per_rank(
    env: &DistEnv,
    k: &Secret,
    store: &mut dyn Store,
    key: &str,
    payload: &[u8],
    deadline: Instant,
) -> Result<()> {
    store.set(key, &secret::per_rank_marker(), deadline)?;
    for r in 1..env.world_size {
        let nonce = store.get(&nonce_key(key, r), deadline).map_err(|e| {
            Error::Msg(format!(
                "bootstrap: rank 0 waited for rank {r}'s nonce in the job's store: {e} (does rank {r} run, with {SECRET_VAR} set?)"
            ))
        })?;
        if nonce.len() != secret::NONCE {
            bail!(
                "bootstrap: rank {r}'s nonce in the job's store has {} bytes, {} expected",
                nonce.len(),
                secret::NONCE
            )
        }
        let mine = per_rank_key(key, r);
        let sealed = k.seal(&per_rank_context(&mine, &nonce), payload)?;
        store.set(&mine, &sealed, deadline)?;
    }
    Ok(())
}

/// Rank `env.rank`'s copy, opened with its key and its own nonce.
pub(crate) fn open_per_rank(
    env: &DistEnv,
    key: &str,
    nonce: &[u8],
    value: &[u8],
) -> Result<Vec<u8>> {
    let k = env.secret.as_ref().expect("called with a secret");
    k.open(&per_rank_context(key, nonce), value).map_err(|e| {
        Error::Msg(format!(
            "bootstrap: rank {}: the value of {key} in the job's store: {e} (is {SECRET_VAR} the same on every rank?)",
            env.rank
        ))
    })
}

/// The payload of a store value without per-rank copies: as it is without a key; with one,
/// refused (rank 0 has no key, or the value is not ours).
pub(crate) fn unseal_stored(env: &DistEnv, key: &str, value: Vec<u8>) -> Result<Vec<u8>> {
    match &env.secret {
        Some(_) if secret::is_sealed(&value) => bail!(
            "bootstrap: rank {}: the value of {key} in the job's store is sealed but not for this rank (another protocol version, or not from this job's rank 0)",
            env.rank
        ),
        Some(_) => bail!(
            "bootstrap: rank {}: rank 0 has no shared secret and this rank has one: set {SECRET_VAR} on every rank or on none",
            env.rank
        ),
        None if secret::is_sealed(&value) => bail!(
            "bootstrap: rank {}: rank 0 sealed the value of {key} with a shared secret, and this rank has none: set {SECRET_VAR} on every rank",
            env.rank
        ),
        None => Ok(value),
    }
}

/// The store key of rendezvous `seq` of this job and restart.
pub(crate) fn store_key(env: &DistEnv, seq: u64) -> String {
    format!("candle-distributed/{}/{}/{seq}", env.run_id, env.restart)
}
