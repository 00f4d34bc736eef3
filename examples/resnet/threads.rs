//! Candle's CPU threads for each rank: the machine's cores shared among the ranks on it, as
//! torchrun sets `OMP_NUM_THREADS=1` for PyTorch when it starts several processes per machine.
//! Otherwise every thread rank (or every process) would start a pool of one thread per core,
//! and with 4 ranks on 2 cores the pools' threads spin waiting for each other: the main job
//! trained at 561–563 images/s that way against 823–837 with one thread per rank
//! (docs/benchmarks.md).

use std::env;

/// The variables candle reads for its thread counts: its worker pool's, and its matrix
/// product's (and rayon's).
const VARS: [&str; 2] = ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"];

/// Sets [`VARS`] to `cores / ranks_here` (at least 1) when more than one rank runs on this
/// machine and the user set neither; returns the count set. Call it at the top of `main`,
/// before any thread starts (candle reads the variables when it first needs its threads, and
/// changing the environment while another thread reads it is a race).
pub fn share_cores(ranks_here: usize) -> Option<usize> {
    if ranks_here <= 1 || VARS.iter().any(|v| env::var_os(v).is_some()) {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let each = (cores / ranks_here).max(1);
    for v in VARS {
        env::set_var(v, each.to_string());
    }
    log::info!("{each} CPU thread(s) per rank: {cores} cores, {ranks_here} ranks on this machine ({} to choose)", VARS.join(" or "));
    Some(each)
}
