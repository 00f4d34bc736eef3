//! Blocking mode, asked of NCCL itself. NCCL applies `NCCL_COMM_BLOCKING` over a
//! communicator's config, from wherever NCCL finds it: the environment, its configuration files
//! (with NCCL's own precedence and line syntax), or, in newer versions, an environment plugin.
//! Blocking mode voids every timeout and abort of this backend (a call then waits inside NCCL,
//! holding the communicator, out of the watchdog's reach; a missing rank hangs the job), so it
//! is refused before any peer is contacted.
//!
//! The probe: a one-rank communicator with a fresh unique id, created with the non-blocking
//! config inside a group. `ncclGroupEnd` returns "in progress" for a non-blocking group and
//! success when NCCL has made the communicator blocking; it needs no peer, so it cannot hang on
//! one. The verdict is taken once per process (NCCL reads the setting once per process too).

use std::sync::OnceLock;
use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver::CudaContext;

use super::raw::{unique_id, NcclFail, Progress, RawComm};
use super::watchdog::{wait_ready, CallError};

const VAR: &str = "NCCL_COMM_BLOCKING";

/// The probe's verdict: `Some(source)` when NCCL makes communicators blocking.
static VERDICT: OnceLock<Option<String>> = OnceLock::new();

/// Refuses blocking mode, on NCCL's word (see the module docs): probes once per process on the
/// GPU of `ctx`, within `timeout`; the same error on every rank where NCCL is set up alike.
///
/// # Errors
/// `blocking` when NCCL makes communicators blocking; NCCL's or CUDA's error when the probe
/// itself fails, or `probe` when it does not complete within `timeout`.
pub(super) fn refuse_blocking_mode(ctx: &CudaContext, timeout: Duration) -> Result<(), NcclFail> {
    let verdict = match VERDICT.get() {
        Some(v) => v,
        None => {
            let v = probe(ctx, timeout)?;
            VERDICT.get_or_init(|| v)
        }
    };
    refuse_comm_id()?;
    match verdict {
        None => Ok(()),
        Some(source) => Err(NcclFail::new(
            "blocking",
            format!("NCCL puts its communicators in blocking mode ({source}), under which a call waits inside NCCL where no timeout or abort can reach it (a missing rank would hang the job forever); this backend refuses it: unset {VAR} or set it to 0 where NCCL reads it (the environment, NCCL_CONF_FILE or ~/.nccl.conf, /etc/nccl.conf)"),
        )),
    }
}

/// One probe: `Some(where the setting was seen)` when NCCL made the one-rank communicator
/// blocking, `None` when it honoured the non-blocking config.
fn probe(ctx: &CudaContext, timeout: Duration) -> Result<Option<String>, NcclFail> {
    // NCCL has read its configuration files (into the environment) once it made an id.
    let id = unique_id()?;
    refuse_comm_id()?;
    let (comms, end) = RawComm::start_group(&[ctx], 1, &id, &[0])?;
    if end == Progress::Done {
        drop(comms); // aborted
        return Ok(Some(source()));
    }
    // Polled as every start-up is (dropped, so aborted, on failure).
    wait_ready(&comms, &[0], "the blocking-mode probe", timeout).map_err(|(_, e)| match e {
        CallError::Nccl(f) => f,
        CallError::Broken(why) => NcclFail::new("probe", why),
    })?;
    drop(comms); // a one-rank communicator: aborted without waiting on anyone
    Ok(None)
}

/// `NCCL_COMM_ID` fixes the address of every communicator's bootstrap root, which NCCL then
/// creates on whichever process is rank 0 of a communicator: the probe's one-rank communicator
/// on every process, and the communicators this backend makes, whose id it hands over itself
/// (through the job's store or MPI). Refused, on every process where it is set, before
/// NCCL is asked to start anything.
fn refuse_comm_id() -> Result<(), NcclFail> {
    match std::env::var("NCCL_COMM_ID") {
        Err(_) => Ok(()),
        Ok(v) => Err(NcclFail::new(
            "comm_id",
            format!("NCCL_COMM_ID={v:?} is set (in the environment or an NCCL configuration file): it would make NCCL create every communicator's bootstrap root at that address on whichever process is a communicator's rank 0, and this backend hands NCCL's id to every rank itself; unset it"),
        )),
    }
}

/// Where the setting came from, as far as this process can tell: NCCL copies the lines of its
/// configuration files into the environment when it starts, so a value seen now came from the
/// environment or one of those files; none seen means another source (an environment plugin).
fn source() -> String {
    match std::env::var(VAR) {
        Ok(v) => format!("{VAR}={v}, from the environment or an NCCL configuration file"),
        Err(_) => format!(
            "{VAR} from a source this process cannot see, such as an NCCL environment plugin"
        ),
    }
}
