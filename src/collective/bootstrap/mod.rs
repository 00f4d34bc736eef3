//! Start-up of multi-process groups from the environment that `torchrun` and similar launchers
//! set, and the exchange with which rank 0 hands a small secret (NCCL's 128-byte unique id) to
//! every other rank. Pure Rust, no GPU: the NCCL backend builds on it.
//!
//! Two ways, chosen by the environment:
//! - **Under torchrun** (`TORCHELASTIC_USE_AGENT_STORE=True`): torchrun's agent already serves a
//!   TCPStore at `MASTER_ADDR:MASTER_PORT`; rank 0 `set`s the payload there and the others `get`
//!   it, through [`super::store::TcpStoreClient`], under the key
//!   `candle-distributed/<TORCHELASTIC_RUN_ID>/<restart>/<n>`, where `n` counts this process's
//!   rendezvous (every rank creates its communicators in the same order).
//! - **Standalone** (any other launcher, or none): rank 0 listens on `MASTER_ADDR:MASTER_PORT`
//!   (every address the name resolves to, IPv4 and IPv6) and serves clients concurrently, each
//!   with a short deadline of its own. A client sends `MAGIC`, the job identity, the number of
//!   the rendezvous, its rank and the world size; rank 0 answers `MAGIC`, a status byte and a
//!   length-prefixed payload (or, for a client of another job or an impossible rank, the reason
//!   it is refused; for a client already at the next rendezvous, "retry"), and the client
//!   acknowledges with one byte. Rank 0 returns once every rank has acknowledged; a
//!   rank that retries is answered again, an idle, garbled or foreign connection is dropped
//!   without failing the job, and every length read is bounded.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use candle_core::{bail, Result};

use super::store::{remaining, TcpStoreClient};

mod server;
#[cfg(test)]
mod tests;
mod wire;

use server::serve;
use wire::{read_by, write_by};

/// Bytes that open every message of the standalone exchange (protocol name and version).
const MAGIC: &[u8; 8] = b"CDBOOT02";
/// Longest payload either side accepts: rendezvous payloads are tiny (NCCL's id is 128 bytes).
pub const MAX_PAYLOAD: usize = 1 << 16;
/// Time one client connection may take on rank 0 before it is dropped: an idle or slow
/// connection costs this much of one serving thread, never the job.
const CLIENT_DEADLINE: Duration = Duration::from_secs(5);
/// Answer status: the payload follows.
const OK: u8 = 0;
/// Answer status: refused, the reason follows.
const REFUSED: u8 = 1;
/// Answer status: this rank 0 serves another rendezvous of the job (the client is one ahead,
/// the previous server has not closed yet): try again.
const RETRY: u8 = 2;

/// Where a process sits in a multi-process job, as launchers describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// `RANK`: this process's rank in `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's index on its machine (its GPU), 0 when unset.
    pub local_rank: usize,
    /// `MASTER_ADDR`: host name or address of rank 0 (or of torchrun's agent store).
    pub master_addr: String,
    /// `MASTER_PORT`: port rank 0 listens on (or torchrun's agent store).
    pub master_port: u16,
    /// The job's identity: `TORCHELASTIC_RUN_ID`, else `CANDLE_DISTRIBUTED_JOB_ID`, else `""`.
    /// Rank 0 refuses a rank of another job (a leftover of an earlier run that reaches the
    /// port); two jobs cannot share one port at once, since only one rank 0 can listen there.
    pub job_id: String,
    /// `TORCHELASTIC_RESTART_COUNT` (0 when unset): torchrun's restart of the job.
    pub restart: u64,
    /// `TORCHELASTIC_USE_AGENT_STORE=True`: torchrun's agent serves a TCPStore at
    /// `MASTER_ADDR:MASTER_PORT`, and rank 0 must not listen there itself.
    pub agent_store: bool,
}

impl DistEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (optional), `MASTER_ADDR`, `MASTER_PORT` and
    /// torchrun's `TORCHELASTIC_*` variables from the process environment.
    ///
    /// # Errors
    /// When a required variable is missing or not a number, or `RANK ≥ WORLD_SIZE`.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Like [`DistEnv::from_env`], with the variables looked up by `get`.
    ///
    /// # Errors
    /// As [`DistEnv::from_env`].
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        fn parse<T: std::str::FromStr>(name: &str, v: Option<String>) -> Result<T> {
            let v = match v {
                Some(v) => v,
                None => bail!(
                    "bootstrap: environment variable {name} is not set (launch with torchrun or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
                ),
            };
            v.trim().parse().map_err(|_| {
                candle_core::Error::Msg(format!("bootstrap: {name}={v:?} is not a valid number"))
            })
        }
        let rank: usize = parse("RANK", get("RANK"))?;
        let world_size: usize = parse("WORLD_SIZE", get("WORLD_SIZE"))?;
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => parse("LOCAL_RANK", Some(v))?,
            None => 0,
        };
        let master_addr = match get("MASTER_ADDR") {
            Some(a) if !a.trim().is_empty() => a.trim().to_string(),
            _ => bail!("bootstrap: environment variable MASTER_ADDR is not set"),
        };
        let master_port: u16 = parse("MASTER_PORT", get("MASTER_PORT"))?;
        if world_size == 0 || rank >= world_size {
            bail!("bootstrap: RANK={rank} must be below WORLD_SIZE={world_size}")
        }
        let restart = match get("TORCHELASTIC_RESTART_COUNT") {
            Some(v) => parse("TORCHELASTIC_RESTART_COUNT", Some(v))?,
            None => 0,
        };
        let job_id = get("TORCHELASTIC_RUN_ID")
            .or_else(|| get("CANDLE_DISTRIBUTED_JOB_ID"))
            .unwrap_or_default();
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "1");
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            job_id,
            restart,
            agent_store,
        })
    }
}

/// Rendezvous of this process so far: numbers the store keys (see the module documentation).
static RENDEZVOUS: AtomicU64 = AtomicU64::new(0);

/// Hands rank 0's `payload` to every rank of `env`'s job and returns it on every rank: through
/// torchrun's agent store when `env.agent_store`, else over the standalone TCP exchange.
///
/// Rank 0 passes `Some(payload)` (at most [`MAX_PAYLOAD`] bytes), the others `None` (what they
/// pass is ignored). Collective: every rank calls it the same number of times, in the same
/// order.
///
/// # Errors
/// On every rank that does not complete within `timeout`, naming what it waited for (standalone
/// rank 0 waits until every rank has its copy). On rank 0, also when it passes no payload or
/// one of more than [`MAX_PAYLOAD`] bytes (the others then time out), when it cannot listen on
/// `master_port` (standalone), or when it cannot reach torchrun's store or write the payload
/// there. On the other ranks, also when rank 0 refuses them (another job or restart, a rank
/// outside the world), with its reason, when the address answering announces more than
/// [`MAX_PAYLOAD`] bytes (not a rank 0 of ours), and, through torchrun's store, when the store
/// cannot be reached or answers outside its protocol.
pub fn share_bytes(env: &DistEnv, payload: Option<&[u8]>, timeout: Duration) -> Result<Vec<u8>> {
    share_bytes_round(
        env,
        RENDEZVOUS.fetch_add(1, Ordering::SeqCst),
        payload,
        timeout,
    )
}

/// [`share_bytes`] as rendezvous number `seq` of the job, for callers that number their
/// rendezvous themselves (several ranks simulated in one process, where the process-wide count
/// of [`share_bytes`] would differ between them). Every rank passes the same `seq`.
///
/// # Errors
/// As [`share_bytes`].
pub fn share_bytes_round(
    env: &DistEnv,
    seq: u64,
    payload: Option<&[u8]>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    if env.rank == 0 {
        let payload = match payload {
            Some(p) if p.len() <= MAX_PAYLOAD => p,
            Some(p) => bail!(
                "bootstrap: the payload has {} bytes, at most {MAX_PAYLOAD} are allowed",
                p.len()
            ),
            None => bail!("bootstrap: rank 0 must provide the payload"),
        };
        if env.agent_store {
            let mut store = TcpStoreClient::connect(&env.master_addr, env.master_port, deadline)?;
            store.set(&store_key(env, seq), payload, deadline)?;
        } else {
            serve(env, seq, payload, deadline, timeout)?;
        }
        Ok(payload.to_vec())
    } else if env.agent_store {
        let mut store = TcpStoreClient::connect(&env.master_addr, env.master_port, deadline)
            .map_err(|e| {
                candle_core::Error::Msg(format!(
                    "bootstrap: rank {} cannot reach torchrun's store: {e}",
                    env.rank
                ))
            })?;
        store.get(&store_key(env, seq), deadline).map_err(|e| {
            candle_core::Error::Msg(format!(
                "bootstrap: rank {} waited {timeout:?} for rank 0's payload: {e}",
                env.rank
            ))
        })
    } else {
        fetch(env, seq, deadline, timeout)
    }
}

/// The store key of rendezvous `seq` of this job and restart.
fn store_key(env: &DistEnv, seq: u64) -> String {
    format!("candle-distributed/{}/{}/{seq}", env.job_id, env.restart)
}

/// The job identity as it travels: a 64-bit FNV-1a of the identity, the world size and the
/// port, so that ranks of another job, or of the same job with another world size, differ.
fn identity(env: &DistEnv) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let text = format!("{}|{}|{}", env.job_id, env.world_size, env.master_port);
    for b in text.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// One attempt of a client rank at `addr`: the payload, or why the exchange cannot succeed
/// (rank 0's refusal, a length beyond [`MAX_PAYLOAD`]); an I/O error is worth a retry. The
/// attempt, connect and exchange together, takes at most [`CLIENT_DEADLINE`] (as rank 0
/// grants each client): an address that accepts and then says nothing costs one attempt, not
/// the whole timeout.
fn fetch_from(
    addr: SocketAddr,
    hello: &[u8],
    deadline: Instant,
) -> std::io::Result<std::result::Result<Vec<u8>, String>> {
    let deadline = deadline.min(Instant::now() + CLIENT_DEADLINE);
    let mut stream = TcpStream::connect_timeout(&addr, remaining(deadline))?;
    write_by(&mut stream, hello, deadline)?;
    let mut head = [0u8; 13];
    read_by(&mut stream, &mut head, deadline)?;
    if &head[..8] != MAGIC {
        return Err(std::io::Error::other(
            "the answer is not from a candle-distributed rank 0",
        ));
    }
    let len = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes")) as usize;
    if len > MAX_PAYLOAD {
        return Ok(Err(format!(
            "{addr} announces {len} bytes (at most {MAX_PAYLOAD} accepted): not a rank 0 of ours"
        )));
    }
    let mut body = vec![0u8; len];
    read_by(&mut stream, &mut body, deadline)?;
    match head[8] {
        OK => {
            write_by(&mut stream, &[1], deadline)?;
            Ok(Ok(body))
        }
        RETRY => Err(std::io::Error::other(
            String::from_utf8_lossy(&body).into_owned(),
        )),
        _ => Ok(Err(format!(
            "refused by rank 0: {}",
            String::from_utf8_lossy(&body)
        ))),
    }
}

fn fetch(env: &DistEnv, seq: u64, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&identity(env).to_le_bytes());
    hello.extend_from_slice(&seq.to_le_bytes());
    hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
    // Every address the name resolves to, in turn: one that refuses, answers garbage, stays
    // silent or is not rank 0 does not keep a rank from the others.
    let mut attempt = 0usize;
    loop {
        let last_err = match (env.master_addr.as_str(), env.master_port).to_socket_addrs() {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                if addrs.is_empty() {
                    "the address resolves to nothing".to_string()
                } else {
                    let a = addrs[attempt % addrs.len()];
                    match fetch_from(a, &hello, deadline) {
                        Ok(Ok(p)) => return Ok(p),
                        Ok(Err(why)) => bail!("bootstrap: rank {}: {why}", env.rank),
                        Err(e) => format!("{a}: {e}"),
                    }
                }
            }
            Err(e) => format!("resolving {}: {e}", env.master_addr),
        };
        attempt += 1;
        if Instant::now() >= deadline {
            bail!(
                "bootstrap: rank {} timed out after {timeout:?} reaching rank 0 at {}:{} (last error: {last_err})",
                env.rank,
                env.master_addr,
                env.master_port
            )
        }
        log::debug!(
            "bootstrap: rank {}: rank 0 not reached yet ({last_err}); retrying",
            env.rank
        );
        // Backing off, 50 ms doubling up to 1 s: a rank early by minutes (or many of them)
        // does not hammer rank 0.
        let pause = Duration::from_millis(50) * 2u32.saturating_pow(attempt.min(5) as u32);
        std::thread::sleep(pause.min(Duration::from_secs(1)).min(remaining(deadline)));
    }
}
