//! The keys and values of the store rank 0 hosts, shared by its sessions and by rank 0 itself,
//! with the bounds that keep a client from exhausting rank 0's memory.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::store::remaining;
use crate::{bail, Result};

/// Longest key the store takes (a key holds the run id, chosen by the user).
pub(crate) const MAX_KEY: usize = 4096;
/// Largest value the store takes: a sealed payload of [`crate::MAX_PAYLOAD`] bytes fits.
pub(crate) const MAX_VALUE: usize = crate::MAX_PAYLOAD + 256;
/// Keys a WAIT or a CHECK may name at once.
pub(crate) const MAX_KEYS_PER_REQUEST: usize = 1024;
/// Bytes of keys and values the store holds at most: a job's start-up and progress reports
/// need kilobytes per rank; a client that sets more is refused.
pub(crate) const MAX_BYTES: usize = 64 << 20;

/// The store's contents, and a signal for the waiters.
#[derive(Debug, Default)]
pub(crate) struct Table {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    values: HashMap<String, Vec<u8>>,
    bytes: usize,
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores `value` under `key`, replacing any value there.
    ///
    /// # Errors
    /// A key or value over its bound, or the store full ([`MAX_BYTES`]).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        insert(&mut self.lock(), key, value)?;
        self.changed.notify_all();
        Ok(())
    }

    /// The value under `key`, if set.
    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.lock().values.get(key).cloned()
    }

    /// Whether every key of `keys` is set.
    pub fn all_set(&self, keys: &[String]) -> bool {
        let s = self.lock();
        keys.iter().all(|k| s.values.contains_key(k))
    }

    /// Adds `delta` to the integer under `key` (0 when absent; stored as decimal text, as
    /// PyTorch's TCPStore stores it) and returns the new value, atomically.
    ///
    /// # Errors
    /// The value there is not an integer, the sum overflows, or the key is over its bound.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut s = self.lock();
        let old = match s.values.get(key) {
            None => 0,
            Some(v) => match std::str::from_utf8(v)
                .ok()
                .and_then(|t| t.parse::<i64>().ok())
            {
                Some(n) => n,
                None => bail!("store: ADD to {key:?}, whose value is not an integer"),
            },
        };
        let Some(now) = old.checked_add(delta) else {
            bail!("store: ADD of {delta} to {old} under {key:?} overflows")
        };
        insert(&mut s, key, now.to_string().as_bytes())?;
        drop(s);
        self.changed.notify_all();
        Ok(now)
    }

    /// Waits until every key of `keys` is set (true) or `until` passes (false), waking at the
    /// latest at `until`.
    pub fn wait_until(&self, keys: &[String], until: Instant) -> bool {
        let mut s = self.lock();
        loop {
            if keys.iter().all(|k| s.values.contains_key(k)) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            s = self
                .changed
                .wait_timeout(s, remaining(until))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// `value` under `key` in `s`, within the bounds.
fn insert(s: &mut State, key: &str, value: &[u8]) -> Result<()> {
    if key.len() > MAX_KEY || value.len() > MAX_VALUE {
        bail!(
            "store: a key of {} bytes or a value of {} (at most {MAX_KEY} and {MAX_VALUE})",
            key.len(),
            value.len()
        )
    }
    let old = s.values.get(key).map_or(0, |v| key.len() + v.len());
    let bytes = s.bytes - old + key.len() + value.len();
    if bytes > MAX_BYTES {
        bail!("store: full ({MAX_BYTES} bytes of keys and values)")
    }
    s.bytes = bytes;
    s.values.insert(key.to_string(), value.to_vec());
    Ok(())
}
