//! `share_cores`: the cores shared among a machine's ranks, a user's own count respected and
//! warned about when it oversubscribes them. One test in a binary of its own: it changes the
//! process environment and candle's worker pool, which start once per process.

mod common;

use std::sync::Mutex;

use candle_collective::{share_cores, ThreadGroup, THREAD_VARS};
use common::Warnings;

static WARNINGS: Warnings = Warnings(Mutex::new(Vec::new()));

fn vars() -> Vec<Option<String>> {
    THREAD_VARS.iter().map(|v| std::env::var(v).ok()).collect()
}

#[test]
fn ranks_share_the_cores_unless_the_user_chose() {
    common::capture(&WARNINGS);
    // This process only: the test starts from an environment without a count.
    for v in THREAD_VARS {
        std::env::remove_var(v);
    }
    let cores = std::thread::available_parallelism().unwrap().get();
    let each = (cores / 2).max(1);

    // One rank: nothing to share.
    assert_eq!(share_cores(1), None);
    assert_eq!(vars(), [None, None]);

    // Two thread ranks: each gets half the cores, and candle's pool starts with that many.
    let comms = ThreadGroup::new(2).unwrap();
    let want = Some(each.to_string());
    assert_eq!(vars(), [want.clone(), want.clone()]);
    assert_eq!(candle_core::utils::barrier_pool().n_workers() + 1, each);
    drop(comms);
    // Set once per process: a later group keeps the count, and says nothing.
    assert_eq!(share_cores(4), None);
    assert_eq!(vars(), [want.clone(), want]);
    assert!(
        WARNINGS.0.lock().unwrap().is_empty(),
        "{:?}",
        WARNINGS.0.lock().unwrap()
    );

    // A count the user chose is kept; one that oversubscribes the cores is warned about, once.
    std::env::set_var("RAYON_NUM_THREADS", (2 * cores).to_string());
    assert_eq!(share_cores(2), None);
    assert_eq!(share_cores(3), None);
    assert_eq!(
        std::env::var("RAYON_NUM_THREADS").unwrap(),
        (2 * cores).to_string()
    );
    let warned = WARNINGS.0.lock().unwrap().clone();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].starts_with(&format!(
            "RAYON_NUM_THREADS={} with 2 ranks on this machine: {} CPU threads on {cores} cores",
            2 * cores,
            4 * cores
        )),
        "{warned:?}"
    );
}
