//! The CUDA kernels of `kernels/*.cu`, compiled unchanged by g++ against the emulator in
//! `tests/emu/`, launched with the calls the CUDA path makes (entry point, launch configuration
//! and argument list from `candle_distributed::args`, buffer sizes checked there) and compared
//! with the CPU ops on the same inputs, under the three thread orders of the emulator
//! (forward, reverse, random). Needs g++ only; no CUDA.

//!
//! `harness.rs`: the emulator, device buffers, the test shapes and the launch loop; one file per
//! kernel family (statistics, finalize, apply, backward, max pooling); here, the check that
//! every entry point in `kernels/` is launched by one of them.

#[path = "../common/mod.rs"]
mod common;
mod harness;

mod apply;
mod backward;
mod finalize;
mod max_pool;
mod stats;

use std::collections::BTreeSet;
use std::path::PathBuf;

use harness::{registered, DTYPES, ROOTS, SINGLE};

#[test]
fn every_entry_point_is_launched_by_a_test() {
    let tested: BTreeSet<String> = ROOTS
        .iter()
        .flat_map(|r| DTYPES.iter().map(move |(_, s)| format!("{r}_{s}")))
        .chain(SINGLE.iter().map(|s| s.to_string()))
        .collect();
    let kernels: BTreeSet<String> = registered()
        .into_iter()
        .filter(|n| !n.starts_with("emu_selftest_"))
        .collect();
    assert_eq!(
        kernels, tested,
        "entry points in kernels/ vs those the tests launch"
    );
    // Every `extern "C"` stamp macro in the sources is one of the roots above.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kernels");
    for entry in std::fs::read_dir(root).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text.lines().filter(|l| l.contains("__global__ void")) {
            let name = line
                .split("void")
                .nth(1)
                .unwrap()
                .trim()
                .split(['#', '('])
                .next()
                .unwrap();
            let root = name.trim_end_matches('_');
            assert!(
                ROOTS.contains(&root) || SINGLE.contains(&name),
                "kernel {name} is not tested"
            );
        }
    }
}
