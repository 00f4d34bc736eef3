//! Candle's CPU threads shared among the ranks on one machine.
//!
//! Candle sizes its CPU worker pool and its matrix products' threads from `CANDLE_NUM_THREADS`
//! and `RAYON_NUM_THREADS`, else from the machine's cores. Each rank doing so on its own, the
//! ranks of one machine would start a thread per core each, and their threads would spin
//! waiting for each other (measured on the ResNet example, 4 thread ranks on 2 cores: 561–563
//! images/s against 823–837 with one thread per rank; candle-distributed's
//! docs/benchmarks.md). PyTorch's launcher does the same for OpenMP (`OMP_NUM_THREADS=1` when
//! it starts several processes per machine).

use std::sync::OnceLock;

/// The variables candle reads for its thread counts: its worker pool's, and its matrix
/// products' (rayon's).
pub const THREAD_VARS: [&str; 2] = ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"];

/// What [`share_cores`] set, once per process.
static SET: OnceLock<usize> = OnceLock::new();

/// Gives each of the `ranks_here` ranks on this machine its share of the cores,
/// `max(1, cores / ranks_here)` candle threads, by setting [`THREAD_VARS`], unless the user set
/// either of them; returns the count set, or `None` when nothing was set (one rank, a count the
/// user chose, or a count set before).
///
/// The communicators call it as they are made, before any rank starts: `ThreadGroup::new` and
/// `ThreadGroup::run` (all ranks in this process), `NcclGroup::new` (a thread per GPU), and with
/// the launcher's count of processes on this machine (torchrun's `LOCAL_WORLD_SIZE`, `srun`'s,
/// Open MPI's) `Mpi::init` and `NcclCollective::from_env`. A program that runs candle CPU ops
/// before it makes its communicator calls it itself at the start of `main`: candle's worker
/// pool keeps the size it started with.
///
/// Logs a warning (once) when the user's count oversubscribes the cores (`count · ranks_here`
/// above them), and when candle's worker pool had started with another count before the cores
/// were shared. To choose another count, set either variable before the program starts.
///
/// It changes the process environment: call it before threads that read the environment
/// through C (`getenv`) run, as the constructors above do first thing.
pub fn share_cores(ranks_here: usize) -> Option<usize> {
    if ranks_here <= 1 {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let user: Vec<(&str, usize)> = THREAD_VARS
        .iter()
        .filter_map(|&v| Some((v, std::env::var(v).ok()?.trim().parse::<usize>().ok()?)))
        .collect();
    if let Some(&ours) = SET.get() {
        // Set here before: the user cannot have chosen these (unless set to the same count).
        if user.iter().all(|&(_, n)| n == ours) {
            return None;
        }
    }
    // A count the user set (parseable or not) is theirs.
    if THREAD_VARS.iter().any(|v| std::env::var_os(v).is_some()) {
        if let Some(&(var, n)) = user
            .iter()
            .find(|&&(_, n)| n.saturating_mul(ranks_here) > cores)
        {
            warn_once(format!(
                "{var}={n} with {ranks_here} ranks on this machine: {} CPU threads on {cores} cores, which spin waiting for each other (unset it to share the cores, {} each)",
                n * ranks_here,
                (cores / ranks_here).max(1)
            ));
        }
        return None;
    }
    let each = (cores / ranks_here).max(1);
    if SET.set(each).is_err() {
        return None;
    }
    for v in THREAD_VARS {
        // The constructors call this before their ranks start; see the function's docs.
        std::env::set_var(v, each.to_string());
    }
    log::info!(
        "{each} CPU thread(s) per rank: {cores} cores, {ranks_here} ranks on this machine (set {} to choose)",
        THREAD_VARS.join(" or ")
    );
    let pool = candle_core::utils::barrier_pool().n_workers() + 1;
    if pool != each {
        warn_once(format!(
            "candle's CPU worker pool started with {pool} threads before the cores were shared among {ranks_here} ranks ({each} each): call candle_collective::share_cores({ranks_here}) at the start of main, before any candle CPU op"
        ));
    }
    Some(each)
}

/// Logs `msg` as a warning, the first time only.
fn warn_once(msg: String) {
    static WARNED: OnceLock<()> = OnceLock::new();
    if WARNED.set(()).is_ok() {
        log::warn!("{msg}");
    }
}
