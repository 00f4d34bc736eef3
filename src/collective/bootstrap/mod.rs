//! Start-up of multi-process groups from the environment that `torchrun` and similar launchers
//! set, and the exchange with which rank 0 hands a small secret (NCCL's 128-byte unique id) to
//! every other rank. Pure Rust, no GPU: the NCCL backend builds on it.
//!
//! Two ways, chosen by the environment:
//! - **Under torchrun** (`TORCHELASTIC_USE_AGENT_STORE=True`): torchrun's agent already serves a
//!   TCPStore at `MASTER_ADDR:MASTER_PORT`; rank 0 `set`s the payload there and the others `get`
//!   it, through [`store::TcpStoreClient`], under the key
//!   `candle-distributed/<TORCHELASTIC_RUN_ID>/<restart>/<n>`, where `n` counts this process's
//!   rendezvous (every rank creates its communicators in the same order).
//! - **Standalone** (any other launcher, or none): rank 0 listens on `MASTER_ADDR:MASTER_PORT`
//!   (every address the name resolves to, IPv4 and IPv6) and serves clients concurrently, each
//!   with a short deadline of its own. A client sends `MAGIC`, the run identity, the number of
//!   the rendezvous, its rank, the world size, whether it holds a shared secret, and a fresh
//!   nonce; rank 0 answers `MAGIC`, a status byte and a length-prefixed payload (or, for a
//!   client of another run or restart or an impossible rank, the reason it is refused; for a
//!   client already at the next rendezvous, "retry"), and the client acknowledges with one
//!   byte. Rank 0 returns once every rank has acknowledged; a rank that retries is answered
//!   again, an idle, garbled or foreign connection is dropped without failing the job, and
//!   every length read is bounded.
//!
//! **Run identity.** A run id (`TORCHELASTIC_RUN_ID`, else `CANDLE_DISTRIBUTED_RUN_ID`), the
//! restart count, the world size and the port. The standalone exchange refuses to start without
//! a run id: the launch gives every rank the same value, new for each launch, so that a client
//! left over from an earlier run is refused instead of being served the new run's payload.
//!
//! **Trust model.** Without a secret, as PyTorch's TCPStore: a trusted network, where whoever
//! reaches the port can read the payload or claim a rank. With a shared key (the same on every
//! rank: `CANDLE_DISTRIBUTED_SECRET`, or a file named by `CANDLE_DISTRIBUTED_SECRET_FILE`; a
//! generated key of at least 128 bits, `openssl rand -hex 32`, passphrases refused, see
//! [`secret`]), rank 0 first sends a challenge: its nonce and an HMAC-SHA256 proof over the
//! client's hello and that nonce; the client checks it and answers with its own proof, and
//! acknowledges the payload with a third. Only then is it counted, and the payload travels
//! sealed with XChaCha20-Poly1305, the exchange's hello and nonces as associated data. Under
//! torchrun, each rank `r > 0` sets a fresh random nonce under `<key>/nonce/<r>`, and rank 0,
//! once it has read every rank's nonce, sets one copy of the payload per rank under
//! `<key>/for/<r>`, sealed with that key and that rank's nonce as associated data: a value
//! recorded from an earlier launch does not open, whatever the run id (torchrun's default
//! `none` and `--rdzv-id=100` included), and rank 0 knows every rank is there. Rank 0 also
//! sets `<key>` itself to a marker, so that a rank without the key says so instead of waiting
//! for a value meant for it. A verdict without a proof (a refusal, an answer without the
//! challenge) is retried until the timeout, whose message quotes it. The key never crosses the
//! wire; a party without it can neither join, nor read or forge the payload. What the key does
//! not protect: NCCL's own connections, which the payload starts (NCCL has no authentication of
//! its own), a party that can read the key from a rank's environment or file, and traffic
//! recorded before a key leaks (no forward secrecy; the payloads are short-lived NCCL ids). A
//! client of another protocol version is refused with the reason in its own framing.
//!
//! **Limits.** Rank 0 listens on the addresses `MASTER_ADDR` resolves to (one that is not this
//! machine's, such as a NAT address, falls back to its family's wildcard; a port in use is an
//! error); set `MASTER_ADDR` to an address the other machines reach (Debian-style `/etc/hosts`
//! maps a machine's own name to 127.0.1.1). It serves each client for at most 5 s (per read, and
//! cut when the exchange is over), gives each client 500 ms for its hello, bounds every length
//! it reads (64 KiB), answers at most 4 × world size connections at once (16 to 256) and
//! releases each when done; when they are all taken, the oldest connection that has not yet
//! sent a hello of this job in time is closed to make room, else the oldest whose hello came
//! but whose proof of the secret has not (a real rank between the two goes after every silent
//! connection; a stranger who knows the run identity, which is no secret, can send a hello
//! too, and compete in that stage by age), and only when every one is proven is the newcomer
//! closed; a thread it cannot start closes that connection
//! instead of panicking. A stranger that keeps the table full and reconnects the moment a
//! connection closes does not keep the ranks out
//! (`bootstrap::tests::a_sustained_flood_does_not_keep_the_ranks_out`,
//! `a_connection_flood_under_a_low_descriptor_limit`); while descriptors are exhausted its
//! warning is logged once a second (`a_repeated_accept_failure_is_logged_once_a_second`).
//! Rank 0 counts a client's acknowledgement that arrives up to 2 s after that client's 5 s
//! (`a_late_acknowledgement_is_still_counted`). Clients try every
//! address in turn, each attempt bounded by 5 s, so a silent listener costs one attempt
//! (`bootstrap::tests::a_silent_listener_costs_one_attempt`), and back off from 50 ms to 1 s.
//! Name resolution (`getaddrinfo`, with timeouts of its own) is bounded by the caller's
//! deadline (`a_slow_resolver_costs_only_the_deadline`).
//! Under torchrun, [`store`] speaks to the TCPStore of PyTorch 2.5 and later (2.5.1, 2.9.1 and
//! 2.15.0 tested by `tests/torch_interop.rs`; an older server is refused with an error naming
//! that range, `tests/torch_interop.rs::an_unsupported_pytorch_is_named`, run against 2.4.1).
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use candle_core::{bail, Result};

use store::{remaining, resolve, TcpStoreClient};

mod launcher;
pub mod progress;
pub mod secret;
mod server;
pub mod store;
#[cfg(test)]
mod tests;
mod wire;

pub use secret::Secret;

use server::serve;
use wire::{read_by, write_by};

/// Bytes that open every message of the standalone exchange (protocol name and version).
const MAGIC: &[u8; 8] = b"CDBOOT04";
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
/// Answer status: prove that you hold the shared secret; rank 0's nonce and proof follow.
const CHALLENGE: u8 = 3;
/// Environment variable of the run id, where torchrun's `TORCHELASTIC_RUN_ID` is not set.
pub const RUN_ID_VAR: &str = "CANDLE_DISTRIBUTED_RUN_ID";
/// Environment variable of the optional shared key (a generated key in hexadecimal or base64:
/// see [`secret`]).
pub const SECRET_VAR: &str = "CANDLE_DISTRIBUTED_SECRET";
/// Environment variable naming a file that holds the shared key instead (which then stays out
/// of the environment that child processes inherit).
pub const SECRET_FILE_VAR: &str = "CANDLE_DISTRIBUTED_SECRET_FILE";

/// The shared key from [`SECRET_VAR`] or the file [`SECRET_FILE_VAR`] names, if either is set.
fn secret_from(get: &impl Fn(&str) -> Option<String>) -> Result<Option<Secret>> {
    match (get(SECRET_VAR), get(SECRET_FILE_VAR)) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => {
            bail!("bootstrap: both {SECRET_VAR} and {SECRET_FILE_VAR} are set: set one")
        }
        (Some(text), None) => {
            let text = zeroize::Zeroizing::new(text);
            Secret::from_text(&text, &format!("environment variable {SECRET_VAR}")).map(Some)
        }
        (None, Some(path)) => {
            let text =
                zeroize::Zeroizing::new(std::fs::read_to_string(path.trim()).map_err(|e| {
                    candle_core::Error::Msg(format!(
                        "bootstrap: the key file {path:?} ({SECRET_FILE_VAR}) cannot be read: {e}"
                    ))
                })?);
            Secret::from_key_file(&text, &format!("the key file {path:?} ({SECRET_FILE_VAR})"))
                .map(Some)
        }
    }
}

/// Where a process sits in a multi-process job, as launchers describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// `RANK`: this process's rank in `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's index on its machine (its GPU), 0 when unset.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: the processes on this machine, when the launcher says
    /// (for node-local groups: [`crate::collective::groups_of`]).
    pub local_world_size: Option<usize>,
    /// `MASTER_ADDR`: host name or address of rank 0 (or of torchrun's agent store).
    pub master_addr: String,
    /// `MASTER_PORT`: port rank 0 listens on (or torchrun's agent store).
    pub master_port: u16,
    /// The run id: `TORCHELASTIC_RUN_ID`, else `CANDLE_DISTRIBUTED_RUN_ID`; the standalone
    /// exchange needs one (the same on every rank, new for each launch). Rank 0 refuses a rank
    /// of another run or restart (a leftover of an earlier run that reaches the port).
    pub run_id: String,
    /// `TORCHELASTIC_RESTART_COUNT` (0 when unset): torchrun's restart of the job.
    pub restart: u64,
    /// `TORCHELASTIC_USE_AGENT_STORE=True`: torchrun's agent serves a TCPStore at
    /// `MASTER_ADDR:MASTER_PORT`, and rank 0 must not listen there itself.
    pub agent_store: bool,
    /// `CANDLE_DISTRIBUTED_SECRET` or the file `CANDLE_DISTRIBUTED_SECRET_FILE` names: the
    /// shared key that ranks prove they hold (see the module documentation's trust model);
    /// `None` on a trusted network.
    pub secret: Option<Secret>,
}

/// The processes a launcher placed on this machine, when one is there and says (torchrun's
/// `LOCAL_WORLD_SIZE`, `srun`'s tasks on this node, Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`:
/// the table of [`DistEnv::from_env`]); needs none of the rendezvous variables. For sharing a
/// machine's cores among its ranks before any work starts.
pub fn local_world_size() -> Option<usize> {
    local_world_size_from(|k| std::env::var(k).ok())
}

/// [`local_world_size`] with the variables looked up by `get`.
pub fn local_world_size_from(get: impl Fn(&str) -> Option<String>) -> Option<usize> {
    launcher::placement(&get)
        .ok()
        .and_then(|p| p.local_world_size)
}

impl DistEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (optional), `LOCAL_WORLD_SIZE` (optional),
    /// `MASTER_ADDR`, `MASTER_PORT`, torchrun's `TORCHELASTIC_*` variables,
    /// `CANDLE_DISTRIBUTED_RUN_ID` and `CANDLE_DISTRIBUTED_SECRET` (or `…_SECRET_FILE`) from the
    /// process environment.
    /// Without `RANK`, the rank, world size, local rank and local world size come from Slurm's
    /// `srun` or Open MPI's `mpirun`, which also name the launch (the run id, unless one is set);
    /// `MASTER_ADDR` and `MASTER_PORT` are the user's to export:
    ///
    /// | | torchrun / by hand | `srun` | Open MPI's `mpirun` |
    /// |---|---|---|---|
    /// | rank | `RANK` | `SLURM_PROCID` | `OMPI_COMM_WORLD_RANK` |
    /// | world size | `WORLD_SIZE` | `SLURM_STEP_NUM_TASKS` | `OMPI_COMM_WORLD_SIZE` |
    /// | local rank | `LOCAL_RANK` (0 when unset) | `SLURM_LOCALID` | `OMPI_COMM_WORLD_LOCAL_RANK` |
    /// | local world size | `LOCAL_WORLD_SIZE` | `SLURM_STEP_TASKS_PER_NODE` at `SLURM_NODEID` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
    /// | run id, when none is set | — | `slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>` | `ompi-<PMIX_NAMESPACE>` |
    ///
    /// `RANK` wins when it is set. Slurm's step variables, not the allocation's
    /// (`SLURM_NTASKS`), give the world size, so that a batch script's own process is not
    /// taken for a rank of a larger job.
    ///
    /// # Errors
    /// When a required variable is missing or not a number, `RANK ≥ WORLD_SIZE`, the shared
    /// key is not a generated key (see [`secret`]), both of its variables are set or its file
    /// cannot be read, a standalone launch (no torchrun agent store) has no run id, or a key
    /// under torchrun comes with its default run id `none`.
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
        let placement = launcher::placement(&get)?;
        let (rank, world_size, local_rank) =
            (placement.rank, placement.world_size, placement.local_rank);
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
        let run_id = get("TORCHELASTIC_RUN_ID")
            .or_else(|| get(RUN_ID_VAR))
            .or(placement.run_id)
            .unwrap_or_default()
            .trim()
            .to_string();
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "1");
        let secret = secret_from(&get)?;
        let env = Self {
            rank,
            world_size,
            local_rank,
            local_world_size: placement.local_world_size,
            master_addr,
            master_port,
            run_id,
            restart,
            agent_store,
            secret,
        };
        env.check_run_id()?;
        Ok(env)
    }

    /// A standalone exchange needs a run id.
    fn check_run_id(&self) -> Result<()> {
        // One rank alone meets nobody: no identity is needed.
        if !self.agent_store && self.world_size > 1 && self.run_id.is_empty() {
            bail!(
                "bootstrap: rank {}: a launch without torchrun needs a run id, so that a process left over from an earlier run cannot join this one: set {RUN_ID_VAR} on every rank to the same value, new for each launch (for example the output of `uuidgen` or `date +%s%N`, generated once by the launch script)",
                self.rank
            )
        }
        Ok(())
    }
}

/// Rendezvous of this process so far: numbers the store keys (see the module documentation).
static RENDEZVOUS: AtomicU64 = AtomicU64::new(0);

/// The number of this process's next rendezvous, taken: what [`share_bytes`] uses, for a
/// caller that calls [`share_bytes_round`] itself and keys more by the same number (such as a
/// [`progress::ProgressBoard`]).
pub fn next_rendezvous() -> u64 {
    RENDEZVOUS.fetch_add(1, Ordering::SeqCst)
}

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
    share_bytes_round(env, next_rendezvous(), payload, timeout)
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
    env.check_run_id()?;
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
            let key = store_key(env, seq);
            match &env.secret {
                Some(k) => seal_per_rank(env, k, &mut store, &key, payload, deadline)?,
                None => store.set(&key, payload, deadline)?,
            }
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
        let key = store_key(env, seq);
        let waited = |e: candle_core::Error| {
            candle_core::Error::Msg(format!(
                "bootstrap: rank {} waited {timeout:?} for rank 0's payload: {e}",
                env.rank
            ))
        };
        let value = store.get(&key, deadline).map_err(waited)?;
        let (Some(_), true) = (&env.secret, value == secret::per_rank_marker()) else {
            return unseal_stored(env, &key, value);
        };
        // Rank 0 seals a copy for this rank's fresh nonce.
        let nonce = secret::nonce()?;
        store.set(&nonce_key(&key, env.rank), &nonce, deadline)?;
        let mine = per_rank_key(&key, env.rank);
        let value = store.get(&mine, deadline).map_err(waited)?;
        open_per_rank(env, &mine, &nonce, &value)
    } else {
        fetch(env, seq, deadline, timeout)
    }
}

/// Where rank `r` leaves its nonce for rendezvous `key`.
fn nonce_key(key: &str, r: usize) -> String {
    format!("{key}/nonce/{r}")
}

/// Where rank 0 leaves rank `r`'s sealed copy of rendezvous `key`'s payload.
fn per_rank_key(key: &str, r: usize) -> String {
    format!("{key}/for/{r}")
}

/// What rank `r`'s copy is sealed with, besides the key: its store key and its nonce.
fn per_rank_context(key: &str, nonce: &[u8]) -> Vec<u8> {
    let mut ctx = key.as_bytes().to_vec();
    ctx.push(b'\n');
    ctx.extend_from_slice(nonce);
    ctx
}

/// Rank 0's side under torchrun with a key: the marker under `key`, then for each rank its
/// nonce read (waiting for it) and its copy set.
fn seal_per_rank(
    env: &DistEnv,
    k: &Secret,
    store: &mut TcpStoreClient,
    key: &str,
    payload: &[u8],
    deadline: Instant,
) -> Result<()> {
    store.set(key, &secret::per_rank_marker(), deadline)?;
    for r in 1..env.world_size {
        let nonce = store.get(&nonce_key(key, r), deadline).map_err(|e| {
            candle_core::Error::Msg(format!(
                "bootstrap: rank 0 waited for rank {r}'s nonce in torchrun's store: {e} (does rank {r} run, with {SECRET_VAR} set?)"
            ))
        })?;
        if nonce.len() != secret::NONCE {
            bail!(
                "bootstrap: rank {r}'s nonce in torchrun's store has {} bytes, {} expected",
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
fn open_per_rank(env: &DistEnv, key: &str, nonce: &[u8], value: &[u8]) -> Result<Vec<u8>> {
    let k = env.secret.as_ref().expect("called with a secret");
    k.open(&per_rank_context(key, nonce), value).map_err(|e| {
        candle_core::Error::Msg(format!(
            "bootstrap: rank {}: the value of {key} in torchrun's store: {e} (is {SECRET_VAR} the same on every rank?)",
            env.rank
        ))
    })
}

/// The payload of a store value without per-rank copies: as it is without a key; with one,
/// refused (rank 0 has no key, or the value is not ours).
fn unseal_stored(env: &DistEnv, key: &str, value: Vec<u8>) -> Result<Vec<u8>> {
    match &env.secret {
        Some(_) if secret::is_sealed(&value) => bail!(
            "bootstrap: rank {}: the value of {key} in torchrun's store is sealed but not for this rank (another protocol version, or not from this job's rank 0)",
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
fn store_key(env: &DistEnv, seq: u64) -> String {
    format!("candle-distributed/{}/{}/{seq}", env.run_id, env.restart)
}

/// The run identity as it travels: a 64-bit FNV-1a of the run id, the restart count, the world
/// size and the port, so that ranks of another run or restart, or with another world size,
/// differ. Not a secret: the shared secret, when set, authenticates.
fn identity(env: &DistEnv) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let text = format!(
        "{}:{}|{}|{}|{}",
        env.run_id.len(),
        env.run_id,
        env.restart,
        env.world_size,
        env.master_port
    );
    for b in text.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The hello of one attempt (with a fresh nonce): see the module documentation.
fn hello(env: &DistEnv, seq: u64) -> Result<Vec<u8>> {
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&identity(env).to_le_bytes());
    hello.extend_from_slice(&seq.to_le_bytes());
    hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
    hello.push(u8::from(env.secret.is_some()));
    hello.extend_from_slice(&secret::nonce()?);
    debug_assert_eq!(hello.len(), wire::HELLO);
    Ok(hello)
}

/// One answer frame from `addr`: its status and body, or why the exchange cannot succeed (a
/// length beyond what rank 0 sends); an I/O error or a stranger's bytes are worth a retry.
fn read_answer(
    stream: &mut TcpStream,
    addr: SocketAddr,
    deadline: Instant,
) -> std::io::Result<std::result::Result<(u8, Vec<u8>), String>> {
    let mut head = [0u8; 13];
    read_by(stream, &mut head, deadline)?;
    if &head[..8] != MAGIC {
        return Err(std::io::Error::other(
            "the answer is not from a candle-distributed rank 0",
        ));
    }
    let len = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes")) as usize;
    let most = MAX_PAYLOAD + secret::SEAL_OVERHEAD;
    if len > most {
        return Ok(Err(format!(
            "{addr} announces {len} bytes (at most {most} accepted): not a rank 0 of ours"
        )));
    }
    let mut body = vec![0u8; len];
    read_by(stream, &mut body, deadline)?;
    Ok(Ok((head[8], body)))
}

/// One attempt of a client rank at `addr`: the payload, or why the exchange cannot succeed
/// (rank 0's refusal, a length beyond [`MAX_PAYLOAD`], a disagreement on the shared secret's
/// use); an I/O error, or an answer that does not prove the secret, is worth a retry. The
/// attempt, connect and exchange together, takes at most [`CLIENT_DEADLINE`] (as rank 0
/// grants each client): an address that accepts and then says nothing costs one attempt, not
/// the whole timeout.
fn fetch_from(
    addr: SocketAddr,
    env: &DistEnv,
    seq: u64,
    deadline: Instant,
) -> std::io::Result<std::result::Result<Vec<u8>, String>> {
    let hello = hello(env, seq).map_err(std::io::Error::other)?;
    let deadline = deadline.min(Instant::now() + CLIENT_DEADLINE);
    let mut stream = TcpStream::connect_timeout(&addr, remaining(deadline))?;
    write_by(&mut stream, &hello, deadline)?;
    // With a secret, nothing unproven ends the attempt for good: an oversized frame is retried.
    let unproven = |why: String| match env.secret {
        Some(_) => Err(std::io::Error::other(why)),
        None => Ok(Err(why)),
    };
    let (mut status, mut body) = match read_answer(&mut stream, addr, deadline)? {
        Ok(answer) => answer,
        Err(why) => return unproven(why),
    };
    let mut context = hello.clone();
    match (&env.secret, status) {
        (None, CHALLENGE) => {
            return Ok(Err(format!(
                "rank 0 at {addr} requires the job's shared secret and this rank has none: set {SECRET_VAR} on every rank"
            )))
        }
        (Some(k), CHALLENGE) => {
            if body.len() != secret::NONCE + secret::TAG {
                return Err(std::io::Error::other("a malformed challenge"));
            }
            let (ns, proof) = body.split_at(secret::NONCE);
            if !k.check(&[b"rank 0", &hello, ns], proof) {
                return Err(std::io::Error::other(format!(
                    "{addr} does not prove the job's shared secret (not our rank 0, or its {SECRET_VAR} differs)"
                )));
            }
            write_by(&mut stream, &k.prove(&[b"rank", &hello, ns]), deadline)?;
            context.extend_from_slice(ns);
            (status, body) = match read_answer(&mut stream, addr, deadline)? {
                Ok(answer) => answer,
                Err(why) => return unproven(why),
            };
        }
        (Some(_), OK) => {
            return Err(std::io::Error::other(format!(
                "rank 0 at {addr} answered without the shared secret's challenge: set {SECRET_VAR} on every rank, or on none"
            )))
        }
        _ => {}
    }
    match status {
        OK => {
            let payload = match &env.secret {
                Some(k) => k.open(&context, &body).map_err(std::io::Error::other)?,
                None => body,
            };
            if payload.len() > MAX_PAYLOAD {
                return Ok(Err(format!(
                    "{addr} sent {} bytes (at most {MAX_PAYLOAD} accepted): not a rank 0 of ours",
                    payload.len()
                )));
            }
            // The acknowledgement: with a secret, a proof over this exchange (a relay that read
            // the sealed payload cannot acknowledge in this rank's place).
            let ack = match &env.secret {
                Some(k) => k.prove(&[b"ack", &context]).to_vec(),
                None => vec![1],
            };
            write_by(&mut stream, &ack, deadline)?;
            Ok(Ok(payload))
        }
        RETRY => Err(std::io::Error::other(format!(
            "asked to retry: {}",
            peer_text(&body)
        ))),
        // With a secret, a refusal carries no proof (anyone on the way could send it): retried
        // until the timeout, whose message quotes it. Without one, it ends this rank at once.
        _ if env.secret.is_some() => Err(std::io::Error::other(format!(
            "an unproven refusal (anyone on the way could have sent it): {}",
            peer_text(&body)
        ))),
        _ => Ok(Err(format!("refused by rank 0: {}", peer_text(&body)))),
    }
}

/// Text a peer sent, as an error may quote it: its first 200 bytes in quotes, control
/// characters and quotes escaped (no terminal escape sequence or line break reaches the
/// user's log), and the full length when longer.
fn peer_text(body: &[u8]) -> String {
    const MOST: usize = 200;
    let shown = String::from_utf8_lossy(&body[..body.len().min(MOST)]);
    let more = match body.len() > MOST {
        true => format!(" … ({} bytes in all)", body.len()),
        false => String::new(),
    };
    let escaped: String = shown
        .chars()
        .map(|c| match c.is_control() || c == '"' || c == '\\' {
            true => c.escape_default().collect(),
            false => c.to_string(),
        })
        .collect();
    format!("\"{escaped}\"{more}")
}

fn fetch(env: &DistEnv, seq: u64, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    // Every address the name resolves to, in turn: one that refuses, answers garbage, stays
    // silent or is not rank 0 does not keep a rank from the others.
    let mut attempt = 0usize;
    // The last attempt's error, unless the deadline cut that attempt short: then the one
    // before, which says more (a refused connection, an answer that does not prove the secret).
    let mut last_err = String::new();
    loop {
        let this_err = match resolve(&env.master_addr, env.master_port, deadline) {
            Ok(addrs) => {
                if addrs.is_empty() {
                    "the address resolves to nothing".to_string()
                } else {
                    let a = addrs[attempt % addrs.len()];
                    match fetch_from(a, env, seq, deadline) {
                        Ok(Ok(p)) => return Ok(p),
                        Ok(Err(why)) => bail!("bootstrap: rank {}: {why}", env.rank),
                        Err(e) => format!("{a}: {e}"),
                    }
                }
            }
            Err(e) => format!("resolving {}: {e}", env.master_addr),
        };
        attempt += 1;
        let cut_short = Instant::now() >= deadline;
        if !cut_short || last_err.is_empty() {
            last_err = this_err;
        }
        if cut_short {
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
