//! # candle-rendezvous
//!
//! Start-up of multi-process groups from the environment that `torchrun` and similar launchers
//! set ([`DistEnv`]), and the exchange with which rank 0 hands a small payload (NCCL's 128-byte
//! unique id) to every other rank ([`share_bytes`]). Pure Rust, no GPU, no tensor:
//! `candle-distributed`'s NCCL backend builds on it, and re-exports it as
//! `candle_distributed::collective::rendezvous`.
//!
//! - [`store`]: [`Store`], what the exchange needs of a key-value store (set, get, add, check,
//!   wait, each with a deadline), and [`TcpStoreClient`], a client of PyTorch's TCPStore.
//! - [`progress`]: each rank's newest collective published in the store, for hang reports.
//! - [`secret`]: the optional shared key (feature `keys`, on by default; without it the crate
//!   depends on `log` and `getrandom` only, and a key set in the environment is refused).
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
//! (`candle_rendezvous::tests::a_sustained_flood_does_not_keep_the_ranks_out`,
//! `a_connection_flood_under_a_low_descriptor_limit`); while descriptors are exhausted its
//! warning is logged once a second (`a_repeated_accept_failure_is_logged_once_a_second`).
//! Rank 0 counts a client's acknowledgement that arrives up to 2 s after that client's 5 s
//! (`a_late_acknowledgement_is_still_counted`). Clients try every
//! address in turn, each attempt bounded by 5 s, so a silent listener costs one attempt
//! (`candle_rendezvous::tests::a_silent_listener_costs_one_attempt`), and back off from 50 ms to 1 s.
//! Name resolution (`getaddrinfo`, with timeouts of its own) is bounded by the caller's
//! deadline (`a_slow_resolver_costs_only_the_deadline`).
//! Under torchrun, [`store`] speaks to the TCPStore of PyTorch 2.5 and later (2.5.1, 2.9.1 and
//! 2.15.0 tested by `tests/torch_interop.rs`; an older server is refused with an error naming
//! that range, `tests/torch_interop.rs::an_unsupported_pytorch_is_named`, run against 2.4.1).#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]
#![warn(clippy::missing_errors_doc)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod client;
mod env;
mod error;
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
pub mod store;
mod stored;
#[cfg(all(test, feature = "keys"))]
mod tests;
mod wire;

pub use env::{local_world_size, local_world_size_from, DistEnv};
pub use error::{Error, Result};
pub use secret::Secret;
pub use store::{Store, TcpStoreClient};

pub(crate) use error::bail;

pub(crate) use client::peer_text;
use client::{fetch, identity};
use server::serve;
use stored::store_key;

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
            stored::set_payload(env, &mut store, seq, payload, deadline)?;
        } else {
            serve(env, seq, payload, deadline, timeout)?;
        }
        Ok(payload.to_vec())
    } else if env.agent_store {
        let mut store = TcpStoreClient::connect(&env.master_addr, env.master_port, deadline)
            .map_err(|e| {
                Error::Msg(format!(
                    "bootstrap: rank {} cannot reach torchrun's store: {e}",
                    env.rank
                ))
            })?;
        stored::get_payload(env, &mut store, seq, deadline, timeout)
    } else {
        fetch(env, seq, deadline, timeout)
    }
}
