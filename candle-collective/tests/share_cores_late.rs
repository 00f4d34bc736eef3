//! `share_cores` after candle's worker pool has started with a count of its own: the pool keeps
//! it, and a warning says so and what to do. A binary of its own: the pool starts once per
//! process.

mod common;

use std::sync::Mutex;

use candle_collective::{share_cores, THREAD_VARS};
use common::Warnings;

static WARNINGS: Warnings = Warnings(Mutex::new(Vec::new()));

#[test]
fn a_pool_started_before_the_cores_were_shared_is_named() {
    common::capture(&WARNINGS);
    for v in THREAD_VARS {
        std::env::remove_var(v);
    }
    // A candle CPU op before the communicator: the pool starts with candle's own count.
    let pool = candle_core::utils::barrier_pool().n_workers() + 1;
    if pool == 1 {
        // One core: every share is one thread, the pool's own count; nothing can differ.
        eprintln!("skipped: candle's pool has one thread on this machine");
        return;
    }
    let ranks = pool + 1; // more ranks than the pool has threads: the share differs from it
    let each = (std::thread::available_parallelism().unwrap().get() / ranks).max(1);
    assert_ne!(each, pool);
    assert_eq!(share_cores(ranks), Some(each));
    let warned = WARNINGS.0.lock().unwrap().clone();
    assert_eq!(
        warned,
        [format!(
            "candle's CPU worker pool started with {pool} threads before the cores were shared among {ranks} ranks ({each} each): call candle_collective::share_cores({ranks}) at the start of main, before any candle CPU op"
        )]
    );
}
