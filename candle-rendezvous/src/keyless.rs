//! The shared key, absent: this build has no `keys` feature, so it carries none of the key's
//! cryptography. A launch without a key runs as with the feature; a key set in the environment
//! ([`SECRET_VAR`], [`SECRET_FILE_VAR`]) is refused by name rather than ignored, so that no rank
//! believes its start-up authenticated when it is not.

pub(crate) use crate::sealed::{is_sealed, nonce, per_rank_marker, NONCE, SEAL_OVERHEAD, TAG};
use crate::{bail, Result, SECRET_FILE_VAR, SECRET_VAR};

/// No shared key can exist in this build (it has no `keys` feature): the type has no value, so
/// [`crate::DistEnv::secret`] is always `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Secret {}

impl Secret {
    pub(crate) fn prove(&self, _parts: &[&[u8]]) -> [u8; TAG] {
        match *self {}
    }

    pub(crate) fn check(&self, _parts: &[&[u8]], _tag: &[u8]) -> bool {
        match *self {}
    }

    pub(crate) fn seal(&self, _context: &[u8], _payload: &[u8]) -> Result<Vec<u8>> {
        match *self {}
    }

    pub(crate) fn open(
        &self,
        _context: &[u8],
        _sealed: &[u8],
    ) -> std::result::Result<Vec<u8>, String> {
        match *self {}
    }
}

/// `None` when neither key variable is set, else the refusal.
pub(crate) fn from_vars(get: &impl Fn(&str) -> Option<String>) -> Result<Option<Secret>> {
    match (get(SECRET_VAR), get(SECRET_FILE_VAR)) {
        (None, None) => Ok(None),
        _ => bail!(
            "bootstrap: {SECRET_VAR} or {SECRET_FILE_VAR} is set, but candle-rendezvous was built without its `keys` feature, which holds the shared key's cryptography: build with it (the `nccl` feature of candle-collective and candle-distributed turns it on) or unset the variable"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key set either way is refused, naming the feature; no key is no error.
    #[test]
    fn a_key_is_refused_by_name_without_the_keys_feature() {
        for var in [SECRET_VAR, SECRET_FILE_VAR] {
            let e = from_vars(&|k: &str| (k == var).then(|| "00".repeat(32))).unwrap_err();
            assert!(e.to_string().contains("without its `keys` feature"), "{e}");
        }
        assert!(from_vars(&|_: &str| None).unwrap().is_none());
    }

    /// Without the feature, the exchange through the store rank 0 hosts runs as with it when
    /// no key is set: 3 ranks over loopback get rank 0's payload.
    #[test]
    fn the_standalone_exchange_runs_without_the_keys_feature() {
        let port = std::net::TcpListener::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let env = |rank: usize| {
            crate::DistEnv::from_vars(|k| match k {
                "RANK" => Some(rank.to_string()),
                "WORLD_SIZE" => Some("3".into()),
                "MASTER_ADDR" => Some("127.0.0.1".into()),
                "MASTER_PORT" => Some(port.to_string()),
                crate::RUN_ID_VAR => Some("keyless-run".into()),
                _ => None,
            })
            .unwrap()
        };
        let timeout = std::time::Duration::from_secs(20);
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let env = env(r);
                    let payload = (r == 0).then_some(&b"rank 0's payload"[..]);
                    s.spawn(move || crate::share_bytes_round(&env, 0, payload, timeout))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert!(got.iter().all(|g| g == b"rank 0's payload"), "{got:?}");
    }
}
