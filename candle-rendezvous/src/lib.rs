//! # candle-rendezvous
//!
//! Start-up of multi-process groups from the environment that `torchrun` and similar launchers
//! set ([`DistEnv`]), the key-value store every rank of a job reaches ([`JobStore`]), and the
//! exchange through it with which rank 0 hands a small payload (NCCL's 128-byte unique id) to
//! every other rank ([`share_bytes`]). Pure Rust, no GPU, no tensor: `candle-collective`'s NCCL
//! backend builds on it, and re-exports it as `candle_collective::rendezvous` (and so
//! `candle_distributed::collective::rendezvous`).
//! [`store`] holds [`Store`] and [`TcpStoreClient`], a client of PyTorch's TCPStore; [`progress`]
//! publishes each rank's newest collective in the job's store for hang reports; [`secret`] holds
//! the optional shared key (feature `keys`, on by default).
//!
//! One store per launch: under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) the TCPStore that
//! torchrun's agent serves; in any other launch (by hand, a script, `srun`, `mpirun`'s
//! environment) one that rank 0 hosts on `MASTER_ADDR:MASTER_PORT`, answering TCPStore's requests
//! behind an admission (the run identity, and with a shared key its proof), as PyTorch's `env://`
//! start-up hosts a TCPStore on rank 0. In both, rank 0 sets the payload, and the others get it
//! and acknowledge; when rank 0 hosts the store, it returns once every rank has acknowledged. A
//! launch without torchrun refuses to start without a run id (`TORCHELASTIC_RUN_ID`, else
//! `CANDLE_DISTRIBUTED_RUN_ID`), so that a client left over from an earlier run is refused at the
//! admission instead of joining the store.
//!
//! Trust: without a shared key, as PyTorch's TCPStore, a trusted network, where whoever reaches
//! the port can read the payload or claim a rank (the store rank 0 hosts refuses a client of
//! another run or restart). With one, the key never crosses the wire, a party without it is not
//! admitted to the store rank 0 hosts and can neither read nor forge the payload, and the payload
//! travels sealed, one copy per rank; the key does not protect NCCL's own connections, a party
//! that can read it from a rank's environment or file, or traffic recorded before it leaks.
//!
//! Limits: rank 0 gives each client 5 s for its admission, bounds every length it reads (64 KiB
//! for a payload) and what its store holds (keys of 4096 bytes, values of 64 KiB + 256, 1024 keys
//! per WAIT or CHECK, 64 MiB in all), and answers at most 4 × world size connections awaiting
//! admission at once (16 to 256), admitted sessions aside; a stranger that keeps them full does
//! not keep the ranks out. The full text (the
//! store, the admission, the run identity, the trust model, every limit and the tests that show
//! them): docs/startup.md in the repository.
//!
//! Under torchrun, [`store`] speaks to the TCPStore of PyTorch 2.5 and later (the oldest,
//! 2.5.1, and the newest, 2.15.0, tested by `tests/torch_interop.rs` in CI; an older server is refused with an error naming
//! that range, `tests/torch_interop.rs::an_unsupported_pytorch_is_named`, run against 2.4.1).
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![warn(clippy::missing_errors_doc)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

mod client;
mod env;
mod error;
mod host;
mod job;
mod launcher;
pub mod progress;
mod sealed;
#[cfg(feature = "keys")]
pub mod secret;
/// Without the `keys` feature: no shared key can be held, and one set in the environment is
/// refused by name.
#[cfg(not(feature = "keys"))]
#[path = "keyless.rs"]
pub mod secret;
mod server;
mod session;
pub mod store;
mod stored;
mod table;
#[cfg(all(test, feature = "keys"))]
mod tests;
mod wire;

pub use env::{local_world_size, local_world_size_from, DistEnv};
pub use error::{Error, Result};
pub use job::JobStore;
pub use secret::Secret;
pub use store::{Store, TcpStoreClient};

pub(crate) use error::bail;

pub(crate) use client::peer_text;
pub(crate) use job::SESSION;
use stored::store_key;

/// Bytes that open every message of the admission to the store rank 0 hosts (protocol name
/// and version).
const MAGIC: &[u8; 8] = b"CDBOOT05";
/// Longest payload either side accepts: rendezvous payloads are tiny (NCCL's id is 128 bytes).
pub const MAX_PAYLOAD: usize = 1 << 16;
/// Time a client connection has on rank 0 for its admission, and an admitted session for each
/// request from its first byte, before it is dropped: an idle or slow connection costs this much
/// of one serving thread, never the job.
const CLIENT_DEADLINE: Duration = Duration::from_secs(5);
/// Answer status: admitted (an empty body); the connection is a session of the store from here.
const OK: u8 = 0;
/// Answer status: refused, the reason follows.
const REFUSED: u8 = 1;
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

/// Rendezvous of this process so far: numbers the store keys (see the module documentation).
static RENDEZVOUS: AtomicU64 = AtomicU64::new(0);

/// The number of this process's next rendezvous, taken: what [`share_bytes`] uses, for a
/// caller that calls [`share_bytes_round`] itself and keys more by the same number (such as a
/// [`progress::ProgressBoard`]).
pub fn next_rendezvous() -> u64 {
    RENDEZVOUS.fetch_add(1, Ordering::SeqCst)
}

/// Hands rank 0's `payload` to every rank of `env`'s job and returns it on every rank, through
/// the job's store ([`JobStore`]): torchrun's agent store when `env.agent_store`, else one that
/// rank 0 hosts on `MASTER_ADDR:MASTER_PORT`, which stops when this returns unless another
/// [`JobStore`] of it is held.
///
/// Rank 0 passes `Some(payload)` (at most [`MAX_PAYLOAD`] bytes), the others `None` (what they
/// pass is ignored). Collective: every rank calls it the same number of times, in the same
/// order.
///
/// # Errors
/// On every rank that does not complete within `timeout`, naming what it waited for (rank 0,
/// when it hosts the store, waits until every rank has acknowledged its copy, and names the
/// ranks that have not), and on every rank of a launch without torchrun that has no run id. On
/// rank 0, also when it passes no payload or one of more than [`MAX_PAYLOAD`] bytes (the others
/// then time out), when it cannot listen on `master_port` (without torchrun), or when it cannot
/// reach torchrun's store or write the payload there. On the other ranks, also when rank 0
/// refuses them (another job or restart, a rank outside the world, a rendezvous behind rank
/// 0's), with its reason, when the address answering announces more than [`MAX_PAYLOAD`] bytes
/// (not a rank 0 of ours), and when the store cannot be reached or answers outside its
/// protocol.
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
    JobStore::open(env, timeout)?.share(seq, payload, timeout)
}
