//! The backend contract (`tests/common/conformance.rs`) on 4 `ThreadGroup` ranks with CPU
//! tensors. MPI runs the same suite in `tests/mpi.rs`, NCCL in `tests/nccl.rs`.

mod common;

use candle_distributed::collective::ThreadGroup;
use common::conformance::run_suite;

#[test]
fn the_backend_contract_holds_on_thread_ranks() {
    run_suite("ThreadGroup", true, |check| {
        ThreadGroup::run(4, |comm| {
            check(&comm)
                .map_err(|e| candle_core::Error::Msg(format!("rank {}: {e:?}", comm.rank())))
        })
        .map(drop)
        .map_err(anyhow::Error::from)
    })
    .unwrap();
}
