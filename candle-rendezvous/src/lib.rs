//! # candle-rendezvous
//!
//! Start-up of multi-process groups from the environment that `torchrun` and similar launchers
//! set ([`DistEnv`]), and the exchange with which rank 0 hands a small payload (NCCL's 128-byte
//! unique id) to every other rank ([`share_bytes`]). Pure Rust, no GPU, no tensor:
//! `candle-distributed`'s NCCL backend builds on it, and re-exports it as
//! `candle_distributed::collective::rendezvous`. [`store`] holds [`Store`] and [`TcpStoreClient`],
//! a client of PyTorch's TCPStore; [`progress`] publishes each rank's newest collective for hang
//! reports; [`secret`] holds the optional shared key (feature `keys`, on by default).
//!
//! Two ways, chosen by the environment: under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`)
//! rank 0 sets the payload in the TCPStore that torchrun's agent serves and the others get it;
//! standalone (any other launcher, or none) rank 0 listens on `MASTER_ADDR:MASTER_PORT`, serves
//! the clients over TCP and returns once every rank has acknowledged. The standalone exchange
//! refuses to start without a run id (`TORCHELASTIC_RUN_ID`, else `CANDLE_DISTRIBUTED_RUN_ID`),
//! so that a client left over from an earlier run is refused instead of being served.
//!
//! Trust: without a shared key, as PyTorch's TCPStore, a trusted network, where whoever reaches
//! the port can read the payload or claim a rank. With one, the key never crosses the wire, a
//! party without it can neither join, nor read or forge the payload, and the payload travels
//! sealed; the key does not protect NCCL's own connections, a party that can read it from a
//! rank's environment or file, or traffic recorded before it leaks.
//!
//! Limits: rank 0 serves each client for at most 5 s, bounds every length it reads (64 KiB) and
//! answers at most 4 × world size connections at once (16 to 256); a stranger that keeps them
//! full does not keep the ranks out. The full text (the exchange, the run identity, the trust
//! model, every limit and the tests that show them): docs/startup.md in the repository.
//!
//! Under torchrun, [`store`] speaks to the TCPStore of PyTorch 2.5 and later (2.5.1, 2.9.1 and
//! 2.15.0 tested by `tests/torch_interop.rs`; an older server is refused with an error naming
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

/// Bytes that open every message of the standalone exchange (protocol name and version).
const MAGIC: &[u8; 8] = b"CDBOOT05";
/// Longest payload either side accepts: rendezvous payloads are tiny (NCCL's id is 128 bytes).
pub const MAX_PAYLOAD: usize = 1 << 16;
/// Time one client connection may take on rank 0 before it is dropped: an idle or slow
/// connection costs this much of one serving thread, never the job.
const CLIENT_DEADLINE: Duration = Duration::from_secs(5);
/// Answer status: the payload follows.
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
    JobStore::open(env, timeout)?.share(seq, payload, timeout)
}
