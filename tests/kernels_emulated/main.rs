//! The CUDA kernels of `kernels/*.cu`, compiled unchanged by g++ against the emulator in
//! `tests/emu/`, launched with the calls the CUDA path makes (entry point, launch configuration
//! and argument list from `candle_distributed::args`, buffer sizes checked there) and compared
//! with the CPU ops on the same inputs, under the three thread orders of the emulator
//! (forward, reverse, random). Needs g++ only; no CUDA.

//!
//! `harness.rs`: the emulator, device buffers, the test shapes and the launch loop; one file per
//! kernel family (statistics, finalize, apply, backward, max pooling, gradient packing); here, the check that
//! every entry point in `kernels/` is launched by one of them.

#[path = "../common/mod.rs"]
mod common;
mod harness;

mod apply;
mod backward;
mod finalize;
mod max_pool;
mod pack;
mod stats;

use std::collections::BTreeSet;
use std::path::PathBuf;

use candle_distributed::args::KernelGeometry;
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

/// An argument list that does not match the kernel's parameters (one argument short, or an
/// `int` where the kernel takes a `long long`) is refused before the kernel reads it.
#[test]
fn a_mismatched_argument_list_is_refused() {
    use candle_core::DType;
    use candle_distributed::args::{Arg, Scratch, Stats};
    use harness::{per_channel, run, Buf, Case};

    let case = Case {
        n: 2,
        c: 3,
        hw: 4,
        cl: false,
    };
    let r = case.extent().reduction().unwrap();
    let (mut xb, mut kb) = (
        Buf::of(&case.data(1, 0.0, DType::F32)),
        Buf::of(&per_channel(3, 2, -0.5, 0.5)),
    );
    let mut out = Buf::poisoned(DType::F64, &[3, 3]);
    let mut work = Buf::poisoned(DType::F64, &[r.work_len.max(1)]);
    let mut counters = Buf::zeros_u32(r.counters);
    let stats = Stats {
        x: xb.buffer(),
        shift: kb.buffer(),
        out: out.buffer(),
        scratch: Scratch {
            work: work.buffer(),
            counters: counters.buffer(),
        },
    };
    let call = stats
        .call("test", DType::F32, &case.extent())
        .unwrap()
        .unwrap();
    run(&call, "forward");
    let mut short = call.clone();
    short.args.pop();
    let mut narrow = call.clone();
    *narrow.args.last_mut().unwrap() = Arg::I32(4);
    for (what, bad) in [("one short", short), ("an int for a long long", narrow)] {
        let err = std::panic::catch_unwind(|| run(&bad, "forward")).unwrap_err();
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.contains("arguments 'pppppll")
                && msg.contains("do not match the kernel's parameters 'pppppll"),
            "{what}: {msg}"
        );
    }
}
