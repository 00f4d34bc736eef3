//! The backend contract, written once over `&Arc<dyn Collective>`: what every `Collective`
//! must do, whatever carries the bytes. Each check runs on every rank of one communicator,
//! with tensors on the communicator's device (`Collective::device`); a check that fails returns
//! the rank's error.
//!
//! A backend gets the whole suite from its test file with one call of [`run_suite`], given a
//! function that runs one check on every rank of a communicator:
//! - thread ranks: `tests/conformance.rs` (4 `ThreadGroup` ranks, CPU tensors);
//! - MPI processes: `tests/mpi.rs` (4 processes under `mpirun`, `scripts/test-mpi.sh`);
//! - NCCL: `tests/nccl.rs::the_backend_contract_holds` (4 simulated GPUs in CI).
//!
//! The world size must be a power of two (the runners use 4): an average is then exact on
//! every backend, NCCL's included (it multiplies each value by `1/n` rounded to the type), so
//! every value below is compared exactly. Data are whole numbers wherever two backends may add
//! in different orders.
//!
//! What stays with a backend's own tests: argument and mismatch checks (their texts differ by
//! backend; NCCL checks arguments only under `Checked`), an all-reduce's parts read in place
//! (host memory), and faults.

use std::sync::Arc;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::{AllReduce, Collective, ReduceOp};

use super::randn;

/// One check of the suite, run on every rank of a communicator.
pub type Check = fn(&Arc<dyn Collective>) -> Result<()>;

/// Every check of the suite, with the sentence a report prints for it.
pub const CHECKS: &[(&str, Check)] = &[
    (
        "all_reduce: every op and floating dtype, an integer maximum, an f16 average whose sum overflows",
        all_reduce_every_op_and_dtype,
    ),
    (
        "results are bitwise identical on every rank",
        results_are_bitwise_identical_on_every_rank,
    ),
    (
        "reduce_scatter: rank r gets rows of the sum in rank order",
        reduce_scatter_gives_each_rank_its_rows,
    ),
    (
        "all_gather: unequal and empty row counts, concatenated in rank order",
        all_gather_concatenates_unequal_rows_in_rank_order,
    ),
    (
        "broadcast from the last rank, and barriers",
        broadcast_and_barrier,
    ),
    (
        "a wire dtype rounds like the casts it saves",
        a_wire_dtype_rounds_like_the_casts_it_saves,
    ),
    (
        "asynchronous collectives beside a synchronous one",
        asynchronous_collectives_beside_a_synchronous_one,
    ),
    ("split and new_group", split_and_new_group),
];

/// Runs every check of [`CHECKS`] in turn through `on_every_rank` (which runs one check on
/// every rank of a communicator of `backend` and returns a failing rank's error), printing `ok`
/// with each check's sentence when `print`; stops at the first check that fails.
///
/// # Errors
/// The first failing check's error, with its sentence and the backend.
pub fn run_suite(
    backend: &str,
    print: bool,
    on_every_rank: impl Fn(Check) -> Result<()>,
) -> Result<()> {
    for (name, check) in CHECKS {
        on_every_rank(*check).map_err(|e| anyhow::anyhow!("{backend}: {name}: {e:?}"))?;
        if print {
            println!("ok   {backend}: {name}");
        }
    }
    Ok(())
}

/// The world size, checked to be a power of two of at least 2.
fn world(comm: &Arc<dyn Collective>) -> Result<usize> {
    let n = comm.world_size();
    ensure!(
        n >= 2 && n.is_power_of_two(),
        "the suite needs a power-of-two world size of at least 2, not {n}"
    );
    Ok(n)
}

/// `values` as a tensor of `dtype` on the communicator's device (built on the CPU and moved:
/// candle's CUDA fills reject empty tensors).
fn tensor(
    comm: &Arc<dyn Collective>,
    values: &[f64],
    dims: &[usize],
    dtype: DType,
) -> Result<Tensor> {
    let t = Tensor::from_vec(values.to_vec(), dims, &Device::Cpu)?.to_dtype(dtype)?;
    Ok(t.to_device(&comm.device())?)
}

/// A tensor's values as f64 on the host.
fn host(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Rank `r` of `n` contributes `[r + 1, 10 - r, -r]`: every op of every floating dtype gives
/// the exact reduction, in the input's dtype; an i64 maximum; and an f16 average of 30000 on
/// every rank, whose sum (n · 30000 > 65504) overflows f16, is still 30000.
fn all_reduce_every_op_and_dtype(comm: &Arc<dyn Collective>) -> Result<()> {
    let n = world(comm)? as f64;
    let r = comm.rank() as f64;
    let sum = [
        n * (n + 1.0) / 2.0,
        10.0 * n - n * (n - 1.0) / 2.0,
        -n * (n - 1.0) / 2.0,
    ];
    let expect = [
        (ReduceOp::Sum, sum),
        (ReduceOp::Avg, sum.map(|s| s / n)),
        (ReduceOp::Max, [n, 10.0, 0.0]),
        (ReduceOp::Min, [1.0, 11.0 - n, 1.0 - n]),
    ];
    for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
        let t = tensor(comm, &[r + 1.0, 10.0 - r, -r], &[3], dtype)?;
        for (op, want) in expect {
            let got = comm.all_reduce(&t, op)?;
            ensure!(
                got.dtype() == dtype,
                "{dtype:?} {op:?} returned {:?}",
                got.dtype()
            );
            let got = host(&got)?;
            ensure!(got == want, "{dtype:?} {op:?}: {got:?}, expected {want:?}");
        }
    }
    let big = tensor(comm, &[30000.0], &[1], DType::F16)?;
    let avg = host(&comm.all_reduce(&big, ReduceOp::Avg)?)?;
    ensure!(avg == [30000.0], "f16 average of 30000 everywhere: {avg:?}");
    let ints = Tensor::new(&[comm.rank() as i64 * 5], &Device::Cpu)?.to_device(&comm.device())?;
    let max = comm
        .all_reduce(&ints, ReduceOp::Max)?
        .to_device(&Device::Cpu)?
        .to_vec1::<i64>()?;
    ensure!(max == [5 * (n as i64 - 1)], "i64 maximum {max:?}");
    Ok(())
}

/// Every rank receives the same bits of a sum of 1000 values of mixed magnitudes (seeded per
/// rank, not whole numbers: the order of the additions shows), compared through an all-gather
/// of the results.
fn results_are_bitwise_identical_on_every_rank(comm: &Arc<dyn Collective>) -> Result<()> {
    let n = world(comm)?;
    let t = randn(comm.rank() as u64, &[1000], 0.0, 1e8)
        .to_dtype(DType::F32)?
        .to_device(&comm.device())?;
    let sum = comm.all_reduce(&t, ReduceOp::Sum)?;
    let every = comm.all_gather(&sum.reshape((1, 1000))?)?;
    let rows = every.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
    ensure!(rows.len() == n, "{} rows gathered", rows.len());
    for (q, row) in rows.iter().enumerate() {
        let bad = row
            .iter()
            .zip(&rows[0])
            .position(|(a, b)| a.to_bits() != b.to_bits());
        ensure!(
            bad.is_none(),
            "rank {q}'s sum differs from rank 0's at element {bad:?}"
        );
    }
    Ok(())
}

/// A `(2n, 3)` input of whole numbers seeded per rank: rank `r`'s share of the reduce-scatter is
/// rows `2r` and `2r + 1` of the all-reduce, for a sum and a maximum, in f32 and f64.
fn reduce_scatter_gives_each_rank_its_rows(comm: &Arc<dyn Collective>) -> Result<()> {
    let n = world(comm)?;
    let r = comm.rank();
    for dtype in [DType::F32, DType::F64] {
        let t = randn(100 + r as u64, &[2 * n, 3], 0.0, 50.0)
            .round()?
            .to_dtype(dtype)?
            .to_device(&comm.device())?;
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let part = comm.reduce_scatter(&t, op)?;
            ensure!(
                part.dims() == [2, 3],
                "{dtype:?} {op:?}: dims {:?}",
                part.dims()
            );
            let mine = comm.all_reduce(&t, op)?.narrow(0, 2 * r, 2)?;
            ensure!(
                host(&part)? == host(&mine)?,
                "{dtype:?} {op:?}: rows {} and {} differ from the all-reduce's",
                2 * r,
                2 * r + 1
            );
        }
    }
    Ok(())
}

/// Rank `r` contributes `r % 3` rows (rank 0 none) of `(r, r + 0.5)`: every rank receives all
/// rows, concatenated in rank order.
fn all_gather_concatenates_unequal_rows_in_rank_order(comm: &Arc<dyn Collective>) -> Result<()> {
    let n = world(comm)?;
    let rows_of = |q: usize| q % 3;
    let r = comm.rank();
    let mine: Vec<f64> = (0..rows_of(r))
        .flat_map(|_| [r as f64, r as f64 + 0.5])
        .collect();
    let t = tensor(comm, &mine, &[rows_of(r), 2], DType::F32)?;
    let got = comm.all_gather(&t)?;
    let want: Vec<f64> = (0..n)
        .flat_map(|q| (0..rows_of(q)).flat_map(move |_| [q as f64, q as f64 + 0.5]))
        .collect();
    ensure!(
        got.dims() == [want.len() / 2, 2],
        "all_gather dims {:?}, expected [{}, 2]",
        got.dims(),
        want.len() / 2
    );
    ensure!(host(&got)? == want, "all_gather order: {:?}", host(&got)?);
    Ok(())
}

/// A broadcast from the last rank gives every rank its value; barriers before and after.
fn broadcast_and_barrier(comm: &Arc<dyn Collective>) -> Result<()> {
    let n = world(comm)?;
    comm.barrier()?;
    let r = comm.rank() as f64;
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let t = tensor(comm, &[r * 7.0 + 0.5, -r], &[2], dtype)?;
        let got = host(&comm.broadcast(&t, n - 1)?)?;
        let last = (n - 1) as f64;
        ensure!(
            got == [last * 7.0 + 0.5, -last],
            "{dtype:?} broadcast: {got:?}"
        );
    }
    comm.barrier()?;
    Ok(())
}

/// An all-reduce of f32 values on an f16 or bf16 wire (`AllReduce::wire`): bitwise the result
/// of casting to the wire dtype, reducing, and casting back, for a sum and an average.
fn a_wire_dtype_rounds_like_the_casts_it_saves(comm: &Arc<dyn Collective>) -> Result<()> {
    world(comm)?;
    // Seeded per rank, uniform in about ±17 around 0.5: most values change when rounded.
    let t = randn(40 + comm.rank() as u64, &[3001], 0.5, 10.0)
        .to_dtype(DType::F32)?
        .to_device(&comm.device())?;
    for wire in [DType::BF16, DType::F16] {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let fused =
                comm.all_reduce_with(std::slice::from_ref(&t), AllReduce::new(op).wire(wire))?;
            ensure!(
                fused.dtype() == DType::F32,
                "{wire:?} {op:?}: dtype {:?}",
                fused.dtype()
            );
            let cast = comm
                .all_reduce(&t.to_dtype(wire)?, op)?
                .to_dtype(DType::F32)?;
            let (a, b) = (
                fused.to_device(&Device::Cpu)?.to_vec1::<f32>()?,
                cast.to_device(&Device::Cpu)?.to_vec1::<f32>()?,
            );
            let bad = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            ensure!(
                bad.is_none(),
                "{wire:?} {op:?}: element {bad:?} differs from the casts'"
            );
        }
    }
    Ok(())
}

/// An asynchronous all-reduce, all-gather and reduce-scatter in flight around a synchronous
/// all-reduce: each returns its own result.
fn asynchronous_collectives_beside_a_synchronous_one(comm: &Arc<dyn Collective>) -> Result<()> {
    let n = world(comm)?;
    let r = comm.rank() as f64;
    let t = tensor(comm, &[r + 1.0], &[1], DType::F64)?;
    let sum = comm.start_all_reduce(std::slice::from_ref(&t), ReduceOp::Sum.into())?;
    let gathered = comm.all_gather_async(&t.reshape((1, 1))?)?;
    let max = host(&comm.all_reduce(&t, ReduceOp::Max)?)?;
    let rows = tensor(comm, &vec![1.0; 2 * n], &[n, 2], DType::F64)?;
    let scattered = comm.reduce_scatter_async(&rows, ReduceOp::Sum)?;
    let nf = n as f64;
    ensure!(max == [nf], "the synchronous maximum: {max:?}");
    let sum = host(&sum.wait()?)?;
    ensure!(
        sum == [nf * (nf + 1.0) / 2.0],
        "the asynchronous sum: {sum:?}"
    );
    let g = host(&gathered.wait()?)?;
    ensure!(
        g == (1..=n).map(|q| q as f64).collect::<Vec<_>>(),
        "gathered {g:?}"
    );
    let s = scattered.wait()?;
    ensure!(
        s.dims() == [1, 2] && host(&s)? == [nf, nf],
        "scattered {:?}",
        host(&s)?
    );
    Ok(())
}

/// `split` by parity with keys that reverse the order, the last rank joining nothing: each
/// group holds its ranks in key order; `new_group(&[n - 1, 0])` makes rank n-1 its rank 0 and
/// rank 0 its rank 1, and no group for the others.
fn split_and_new_group(comm: &Arc<dyn Collective>) -> Result<()> {
    let n = world(comm)?;
    let r = comm.rank();
    let color = (r != n - 1).then_some((r % 2) as u32);
    match comm.split(color, (100 - r) as u32)? {
        None => ensure!(r == n - 1, "rank {r} got no group"),
        Some(sub) => {
            let t = tensor(comm, &[r as f64], &[1], DType::F32)?;
            let order = host(&sub.all_gather(&t)?)?;
            let want: Vec<f64> = (0..n - 1)
                .rev()
                .filter(|q| q % 2 == r % 2)
                .map(|q| q as f64)
                .collect();
            ensure!(
                order == want,
                "rank {r}: group order {order:?}, expected {want:?}"
            );
            ensure!(
                sub.world_size() == want.len(),
                "rank {r}: group size {}",
                sub.world_size()
            );
        }
    }
    let g = comm.new_group(&[n - 1, 0])?;
    let want = match r {
        _ if r == n - 1 => Some(0),
        0 => Some(1),
        _ => None,
    };
    ensure!(
        g.as_ref().map(|g| g.rank()) == want,
        "rank {r}: new_group rank {:?}",
        g.map(|g| g.rank())
    );
    Ok(())
}
