//! Writes into a started collective's input and output after `wait`, and after dropping the
//! handle without waiting, on thread ranks (on the CPU, and with the `cuda` feature on a GPU
//! the ranks share): each is ordered after the collective, so every rank receives the sum of
//! the inputs as they were at the call. The same bodies run over NCCL in `tests/nccl.rs` and
//! under MPI in `tests/mpi.rs`.

mod common;

use std::time::Duration;

use candle_core::Device;
use common::writes::{self, EVERY};

/// How much later than rank 0 the other ranks start, in the dropped-handle case: enough that a
/// backend reading rank 0's input only when the last rank arrives would read the overwrite.
const LATE: Duration = Duration::from_millis(100);

fn writes_after_wait_are_ordered(dev: &Device) -> anyhow::Result<()> {
    for which in EVERY {
        common::run_ranks_on(3, dev, |comm| writes::write_after_wait(&comm, which));
    }
    Ok(())
}

fn writes_after_a_dropped_handle_are_ordered(dev: &Device) -> anyhow::Result<()> {
    for which in EVERY {
        common::run_ranks_on(3, dev, |comm| writes::write_after_drop(&comm, which, LATE));
    }
    Ok(())
}

device_tests!(
    writes_after_wait_are_ordered,
    writes_after_a_dropped_handle_are_ordered,
);
