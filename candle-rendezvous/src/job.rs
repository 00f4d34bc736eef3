//! [`JobStore`]: the key-value store every rank of a job reaches, whatever launched it, and the
//! exchange of rank 0's payload through it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::host::{Host, LocalStore};
use crate::store::{Store, TcpStoreClient};
use crate::stored::{ack_key, get_payload, set_payload, store_key};
use crate::{bail, client, secret, DistEnv, Error, Result, MAX_PAYLOAD};

/// Rendezvous number in a hello that asks for a session serving no rendezvous (a progress
/// board's connection): admitted whatever rendezvous rank 0 is at.
pub(crate) const SESSION: u64 = u64::MAX;

/// The key-value store every rank of a job reaches: under torchrun
/// (`TORCHELASTIC_USE_AGENT_STORE=True`) the TCPStore its agent serves; in any other launch
/// one that rank 0 hosts on `MASTER_ADDR:MASTER_PORT`, speaking the same requests behind an
/// admission (the run identity, and with a shared key, its proof), as PyTorch's `env://`
/// start-up hosts a `TCPStore` on rank 0. The exchange of NCCL's id ([`JobStore::share`]) and
/// the progress reports ([`crate::progress::ProgressBoard`]) go through it in every launch.
///
/// On rank 0 of a launch without torchrun, [`JobStore::open`] starts the store (or joins the
/// one this process already hosts on that port); it stops when the last `JobStore` of it is
/// dropped. Clones share it.
#[derive(Debug, Clone)]
pub struct JobStore {
    env: DistEnv,
    host: Option<Arc<Host>>,
}

impl JobStore {
    /// The store of `env`'s job: on rank 0 of a launch without torchrun (of more than one
    /// rank), listening by `timeout`; elsewhere nothing is done until the first request.
    ///
    /// # Errors
    /// A launch without torchrun and without a run id; on rank 0 without torchrun, a
    /// `MASTER_ADDR` that does not resolve or a port that cannot be bound (another process holds
    /// it), named.
    pub fn open(env: &DistEnv, timeout: Duration) -> Result<Self> {
        env.check_run_id()?;
        let hosts = env.rank == 0 && !env.agent_store && env.world_size > 1;
        let host = match hosts {
            true => Some(Host::get_or_start(env, Instant::now() + timeout)?),
            false => None,
        };
        Ok(Self {
            env: env.clone(),
            host,
        })
    }

    /// The job as this rank sees it.
    pub fn env(&self) -> &DistEnv {
        &self.env
    }

    /// A connection to the store, made by `deadline`: rank 0's own access to the store it
    /// hosts, a session admitted by it, or a client of torchrun's store.
    ///
    /// # Errors
    /// The store cannot be reached by `deadline`; rank 0 refuses this rank (another run or
    /// restart, a disagreement on the shared key), with its reason.
    pub fn connect(&self, deadline: Instant) -> Result<Box<dyn Store>> {
        let env = &self.env;
        Ok(match (&self.host, env.agent_store) {
            (Some(h), _) => Box::new(LocalStore(h.clone())),
            (None, true) => Box::new(
                TcpStoreClient::connect(&env.master_addr, env.master_port, deadline).map_err(
                    |e| {
                        Error::Msg(format!(
                            "bootstrap: rank {} cannot reach torchrun's store: {e}",
                            env.rank
                        ))
                    },
                )?,
            ),
            (None, false) => {
                let timeout = deadline.saturating_duration_since(Instant::now());
                Box::new(client::session(env, SESSION, deadline, timeout)?)
            }
        })
    }

    /// Hands rank 0's `payload` to every rank as rendezvous number `seq` of the job and
    /// returns it on every rank (see [`crate::share_bytes`], which opens a store for one
    /// exchange). Rank 0 of a launch without torchrun returns once every rank has
    /// acknowledged its copy (the store it hosts may stop after); under torchrun the agent's
    /// store outlives rank 0's return.
    ///
    /// # Errors
    /// As [`crate::share_bytes`].
    pub fn share(&self, seq: u64, payload: Option<&[u8]>, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let env = &self.env;
        if env.rank != 0 {
            return self.fetch(seq, deadline, timeout);
        }
        let payload = match payload {
            Some(p) if p.len() <= MAX_PAYLOAD => p,
            Some(p) => bail!(
                "bootstrap: the payload has {} bytes, at most {MAX_PAYLOAD} are allowed",
                p.len()
            ),
            None => bail!("bootstrap: rank 0 must provide the payload"),
        };
        if env.world_size == 1 && !env.agent_store {
            return Ok(payload.to_vec());
        }
        if let Some(h) = &self.host {
            h.begin(seq);
        }
        let mut store = self.connect(deadline)?;
        let set = set_payload(env, store.as_mut(), seq, payload, deadline);
        if let Some(h) = &self.host {
            let key = store_key(env, seq);
            let waited = set.is_ok()
                && (1..env.world_size).all(|r| store.wait(&ack_key(&key, r), deadline).is_ok());
            if !waited {
                let missing: Vec<usize> = (1..env.world_size)
                    .filter(|&r| !store.check(&ack_key(&key, r), deadline).unwrap_or(false))
                    .take(16)
                    .collect();
                return Err(timed_out(env, timeout, &missing, &h.dropped(), set.err()));
            }
        }
        set?;
        Ok(payload.to_vec())
    }

    /// A rank's side other than 0: the payload through the store, again over a new session
    /// when one is lost (rank 0 restarting its store between two rendezvous) until `deadline`.
    fn fetch(&self, seq: u64, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
        let env = &self.env;
        // One nonce for every attempt: a copy rank 0 sealed for an attempt cut short opens.
        let nonce = secret::nonce()?;
        if env.agent_store {
            let mut store = self.connect(deadline)?;
            return get_payload(env, store.as_mut(), (seq, &nonce), deadline, timeout);
        }
        loop {
            let mut store = client::session(env, seq, deadline, timeout)?;
            match get_payload(env, &mut store, (seq, &nonce), deadline, timeout) {
                Ok(p) => return Ok(p),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(e) => {
                    log::debug!("bootstrap: rank {}: {e}; reconnecting", env.rank);
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
}

/// Rank 0's error when the deadline passed before every rank acknowledged: the first missing
/// ranks, the first dropped connections, and what failed on rank 0's side.
fn timed_out(
    env: &DistEnv,
    timeout: Duration,
    missing: &[usize],
    dropped: &[String],
    cause: Option<Error>,
) -> Error {
    let dropped = &dropped[..dropped.len().min(4)];
    Error::Msg(format!(
        "bootstrap: rank 0 timed out after {timeout:?} waiting for ranks {missing:?} to connect to {}:{}{}{}",
        env.master_addr,
        env.master_port,
        match dropped.is_empty() {
            true => String::new(),
            false => format!(" (dropped connections: {})", dropped.join("; ")),
        },
        cause.map_or(String::new(), |e| format!(" ({e})")),
    ))
}
