//! The MPI backend under `mpirun -np 4` (`scripts/test-mpi.sh`): the contract every backend
//! passes (`tests/common/conformance.rs`), an all-reduce's parts read in place, argument and
//! mismatch errors, and SyncBatchNorm training steps on 4
//! processes against single-process batch norm on the concatenated batch, with unequal and
//! empty per-rank batches. Every process runs this binary; a failed check panics, the process
//! exits non-zero and mpirun reports the job as failed.

mod common;

use std::sync::Arc;

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::{Collective, Mpi, ReduceOp};
use candle_distributed::SyncBatchNormConfig;
use common::*;

const WORLD: usize = 4;

/// The fault runs (`mpirun -np 2`, a 2 s timeout): rank 1 never reaches the next call (it sleeps
/// for 60 s): with `CANDLE_DISTRIBUTED_MPI_HANG=dup` the duplicate of `MPI_COMM_WORLD` that
/// `world_with_timeout` makes, otherwise an all-reduce. Rank 0 times out, prints why and calls
/// `MPI_Abort`, which ends both processes. The script checks the message, a failed job, and that
/// the job ended well before rank 1's sleep.
fn a_rank_that_hangs_aborts_the_job(mpi: &Mpi) -> Result<()> {
    let timeout = std::time::Duration::from_secs(2);
    let hang = || -> Result<()> {
        std::thread::sleep(std::time::Duration::from_secs(60));
        anyhow::bail!("rank 1 slept 60 s: the abort never came")
    };
    let rank = mpi.world()?.rank();
    if std::env::var(HANG).is_ok_and(|v| v == "dup") {
        if rank == 1 {
            return hang();
        }
        mpi.world_with_timeout(timeout)?;
        anyhow::bail!("rank 0's dup returned without rank 1");
    }
    let comm = mpi.world_with_timeout(timeout)?;
    if rank == 1 {
        return hang();
    }
    let t = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
    comm.all_reduce(&t, ReduceOp::Sum)?;
    anyhow::bail!("rank 0's all-reduce returned without rank 1")
}

/// One check of the suite, run on every rank.
type Check = fn(&Arc<dyn Collective>) -> Result<()>;

/// Set by `scripts/test-mpi.sh` for its fault run: see [`a_rank_that_hangs_aborts_the_job`].
const HANG: &str = "CANDLE_DISTRIBUTED_MPI_HANG";

fn main() -> Result<()> {
    let mpi = Mpi::init()?;
    if std::env::var_os(HANG).is_some() {
        return a_rank_that_hangs_aborts_the_job(&mpi);
    }
    let comm = mpi.world()?;
    ensure!(
        comm.world_size() == WORLD,
        "run under mpirun -np {WORLD} (got {} processes)",
        comm.world_size()
    );
    let checks: [(&str, Check); 11] = [
        (
            "all_reduce_parts reads large parts in place, as the concatenation",
            parts_in_place,
        ),
        (
            "mismatched calls fail on every rank",
            mismatches_fail_everywhere,
        ),
        ("SyncBatchNorm NCHW, batches [3, 0, 5, 2]", |c| {
            sync_bn_matches_one_process(c, false)
        }),
        ("SyncBatchNorm NHWC, batches [3, 0, 5, 2]", |c| {
            sync_bn_matches_one_process(c, true)
        }),
        ("SyncBatchNorm within subgroups", sync_bn_in_subgroups),
        (
            "uneven inputs: ranks with 5, 3, 0 and 2 batches",
            uneven_inputs,
        ),
        (
            "gradient accumulation: one all-reduce per step",
            accumulation,
        ),
        (
            "the overlapped backward equals backward + sync_gradients, bit for bit",
            overlapped_backward,
        ),
        (
            "a layer used on some ranks beside SyncBatchNorm and a tensor-parallel layer",
            routed_layer,
        ),
        ("writes into an input and a result after wait", |c| {
            common::writes::EVERY
                .into_iter()
                .try_for_each(|w| common::writes::write_after_wait(c, w))
        }),
        ("writes into an input after a dropped handle", |c| {
            common::writes::EVERY.into_iter().try_for_each(|w| {
                let late = std::time::Duration::from_millis(100);
                common::writes::write_after_drop(c, w, late)
            })
        }),
    ];
    // The backend contract every backend passes (tests/common/conformance.rs).
    conformance::run_suite("MPI", comm.rank() == 0, |check| {
        check(&comm)?;
        comm.barrier()?;
        Ok(())
    })
    .map_err(|e| anyhow::anyhow!("rank {}: {e:?}", comm.rank()))?;
    for (name, check) in checks {
        check(&comm).map_err(|e| anyhow::anyhow!("rank {}: {name}: {e:?}", comm.rank()))?;
        comm.barrier()?;
        if comm.rank() == 0 {
            println!("ok   {name}");
        }
    }
    Ok(())
}

/// `all_reduce_with` of host f32 and f64 parts, read in place where they are large and
/// contiguous (at least 64 Ki elements) and copied in runs where not: the values of the
/// all-reduce of their concatenation, bit for bit, for a sum, an average and a maximum. The
/// parts hold whole numbers, so that every order of MPI's additions gives the same bits (a
/// 25-value run and a 65536-value part may take different algorithms). Parts that differ
/// between ranks are a mismatch on every rank; parts that differ only in layout reduce as the
/// same parts; parts refused on one rank are an error on every rank.
fn parts_in_place(comm: &Arc<dyn Collective>) -> Result<()> {
    let r = comm.rank() as u64;
    // Whole numbers in [-64, 64), seeded per rank and part; `+ 0` turns the rounding's negative
    // zeros positive (which of two zeros a maximum keeps depends on the order of the operands).
    let whole = |seed: u64, dims: &[usize]| -> Result<Tensor> {
        Ok(randn(seed * 10 + r, dims, 0.0, 20.0)
            .round()?
            .clamp(-64.0, 63.0)?
            .affine(1.0, 0.0)?)
    };
    // The parts laid end to end; a fresh subgroup of every rank (a mismatch breaks one); a
    // call's error text, empty when it succeeded.
    let concat = |parts: &[Tensor]| -> Result<Tensor> {
        let flat = parts
            .iter()
            .map(Tensor::flatten_all)
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&flat, 0)?)
    };
    let fresh = || -> Result<Arc<dyn Collective>> {
        Ok(comm
            .split(Some(0), comm.rank() as u32)?
            .expect("every rank joins"))
    };
    let error_of =
        |r: candle_core::Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    for dtype in [DType::F32, DType::F64] {
        let parts = vec![
            whole(1, &[70_000])?.to_dtype(dtype)?,        // in place
            whole(2, &[10])?.to_dtype(dtype)?,            // a run of three copied parts
            whole(3, &[300, 300])?.t()?.to_dtype(dtype)?, // strided
            whole(4, &[0])?.to_dtype(dtype)?,
            whole(5, &[1 << 16])?.to_dtype(dtype)?, // in place, at the threshold
            whole(6, &[3, 5])?.to_dtype(dtype)?,    // copied, last
        ];
        let flat = concat(&parts)?;
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let got = comm.all_reduce_with(&parts, op.into())?;
            let want = comm.all_reduce(&flat, op)?;
            ensure!(
                got.dims() == want.dims(),
                "{dtype:?} {op:?}: {:?}",
                got.dims()
            );
            let (a, b) = (
                got.to_dtype(DType::F64)?.to_vec1::<f64>()?,
                want.to_dtype(DType::F64)?.to_vec1::<f64>()?,
            );
            let bad = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            ensure!(bad.is_none(), "{dtype:?} {op:?}: element {bad:?} differs");
        }
    }
    // Rank 1 passes the same parts in another order: the same total, other MPI calls.
    let g = fresh()?;
    let (big, small) = (whole(7, &[1 << 16])?, whole(8, &[5])?);
    let parts = if comm.rank() == 1 {
        [small, big]
    } else {
        [big, small]
    };
    let err = error_of(g.all_reduce_with(&parts, ReduceOp::Sum.into()));
    ensure!(
        err.contains("every rank must call the same collective"),
        "parts that differ between ranks: {err:?}"
    );
    // Parts that differ only in layout (rank 1's large part a strided view of the same
    // values): the same MPI calls on every rank, and the concatenation's sum.
    let g = fresh()?;
    let big = whole(9, &[256, 256])?;
    let big = if comm.rank() == 1 {
        big.t()?.contiguous()?.t()?
    } else {
        big
    };
    ensure!(big.is_contiguous() == (comm.rank() != 1));
    let parts = [whole(10, &[7])?, big, whole(11, &[3])?];
    let flat = concat(&parts)?;
    let got = g.all_reduce_with(&parts, ReduceOp::Sum.into())?;
    let want = g.all_reduce(&flat, ReduceOp::Sum)?;
    ensure!(
        got.to_vec1::<f64>()? == want.to_vec1::<f64>()?,
        "parts in another layout on rank 1: another sum"
    );
    // Parts refused on one rank (none at all on rank 2): an error on every rank naming it,
    // no abort, and the group still usable.
    let parts: Vec<Tensor> = if comm.rank() == 2 {
        Vec::new()
    } else {
        vec![whole(12, &[5])?]
    };
    let err = error_of(g.all_reduce_with(&parts, ReduceOp::Sum.into()));
    ensure!(
        err.contains("invalid arguments on rank(s) [2]"),
        "bad parts on rank 2: {err:?}"
    );
    if comm.rank() == 2 {
        ensure!(err.contains("at least one part"), "{err}");
    }
    ensure!(
        g.all_reduce(&whole(13, &[2])?, ReduceOp::Max).is_ok(),
        "the group stays usable"
    );
    Ok(())
}

/// Every argument check runs after the ranks agree on the call: a bad argument on one rank is
/// an error on every rank (the group stays usable); ranks that disagree (dtype, shape, op) get
/// a mismatch on every rank, and the group is broken for every later call. Each case runs on a
/// fresh subgroup of all ranks, since a mismatch breaks it.
fn mismatches_fail_everywhere(comm: &Arc<dyn Collective>) -> Result<()> {
    let fresh = || -> Result<Arc<dyn Collective>> {
        Ok(comm
            .split(Some(0), comm.rank() as u32)?
            .expect("every rank joins"))
    };
    let one = |rank: usize| comm.rank() == rank;
    let t = Tensor::ones(3, DType::F32, &Device::Cpu)?;

    // Arguments invalid on one rank only (a split color beyond MPI's range on rank 1): an
    // error on every rank, the group still usable; invalid on every rank (root 9 of 4) alike.
    let g = fresh()?;
    let color = if one(1) { Some(u32::MAX) } else { Some(0) };
    let err = g
        .split(color, 0)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        err.contains("invalid arguments on rank(s) [1]"),
        "split: {err}"
    );
    if one(1) {
        ensure!(err.contains("exceeds i32"), "{err}");
    }
    let err = g.broadcast(&t, 9).unwrap_err().to_string();
    ensure!(
        err.contains("invalid arguments on rank(s) [0, 1, 2, 3]")
            && err.contains("root 9 out of range"),
        "{err}"
    );
    ensure!(
        g.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()? == [4.0; 3],
        "still usable"
    );

    // Different roots: the ranks disagree, a mismatch everywhere.
    let g = fresh()?;
    let root = if one(2) { 3 } else { 0 };
    let err = g.broadcast(&t, root).unwrap_err().to_string();
    ensure!(
        err.contains("ranks disagree") && err.contains("argument 3"),
        "{err}"
    );

    // Different shapes, each valid on its rank (reduce_scatter rows 8 on rank 0, 4 elsewhere):
    // a mismatch everywhere, then the group is broken. (A shape also invalid on its rank is an
    // invalid argument everywhere instead: no rank makes a data call, the group stays usable.)
    let g = fresh()?;
    let rows = if one(0) { 8 } else { 4 };
    let odd = Tensor::ones((rows, 2), DType::F32, &Device::Cpu)?;
    let err = g
        .reduce_scatter(&odd, ReduceOp::Sum)
        .unwrap_err()
        .to_string();
    ensure!(err.contains("same dtype and shape"), "{err}");
    let later = g.all_reduce(&t, ReduceOp::Sum).unwrap_err().to_string();
    ensure!(
        later.contains("the group is broken") && later.contains("reduce_scatter"),
        "{later}"
    );

    // Different dtypes, and rows that do not divide evenly on every rank.
    let g = fresh()?;
    let d = if one(3) { DType::F64 } else { DType::F32 };
    let err = g
        .all_reduce(&t.to_dtype(d)?, ReduceOp::Avg)
        .unwrap_err()
        .to_string();
    ensure!(err.contains("same dtype and shape"), "{err}");
    let g = fresh()?;
    let err = g
        .reduce_scatter(
            &Tensor::ones((3, 2), DType::F32, &Device::Cpu)?,
            ReduceOp::Sum,
        )
        .unwrap_err()
        .to_string();
    ensure!(err.contains("multiple of the world size"), "{err}");
    Ok(())
}

/// Three training steps of one layer (momentum 0.1, fused residual + ReLU) on this rank's slice
/// of seeded global batches, against the single-process reference on the whole batch, which
/// every rank computes itself.
/// Ranks with 5, 3, 0 and 2 batches (of 3, 2, 4 and 1 samples) all leave the `join_step`
/// loop after 5 steps; the steps equal one process on each step's concatenated batches.
fn uneven_inputs(comm: &Arc<dyn Collective>) -> Result<()> {
    let (batches, sizes) = ([5usize, 3, 0, 2], [3usize, 2, 4, 1]);
    let (steps, got) = training::uneven_rank(comm.clone(), &batches, &sizes)?;
    ensure!(steps == 5, "{steps} steps taken, 5 expected");
    let want = training::uneven_reference(&batches, &sizes);
    training::compare("uneven inputs", &got, &want, tol::F64_STEPS);
    Ok(())
}

/// 3 micro-batches per step, 2 steps: 2 batch norms × 2 directions × 3 micro-batches + 1
/// gradient all-reduce per step; equal to one process accumulating the same micro-batches.
fn accumulation(comm: &Arc<dyn Collective>) -> Result<()> {
    let k = 3;
    let (got, calls) = training::accumulated_rank(comm.clone(), k, None, DType::F64)?;
    ensure!(
        calls == 2 * (2 * 2 * k + 1),
        "{calls} collectives in 2 steps"
    );
    let want = training::accumulated_reference(k, DType::F64);
    training::compare("accumulation", &got, &want, tol::F64_STEPS);
    Ok(())
}

/// `DataParallel::backward` with the overlap (buckets started from the gradient hooks on the
/// communication thread) against `loss.backward()` + `sync_gradients` on a twin replica
/// (`common::overlap`): 3 SGD steps, gradients and variables bit for bit, in f32 and over the
/// bf16 and f16 wires, one bucket per variable and the default buckets.
fn overlapped_backward(comm: &Arc<dyn Collective>) -> Result<()> {
    for wire in [None, Some(DType::BF16), Some(DType::F16)] {
        for bucket_bytes in [1, candle_distributed::data_parallel::DEFAULT_BUCKET_BYTES] {
            let twins =
                common::overlap::twin_steps(comm.clone(), &Device::Cpu, wire, bucket_bytes, false)?;
            let stats = twins.2;
            ensure!(
                bucket_bytes != 1 || stats.started_during_backward == stats.buckets,
                "wire {wire:?}: not every bucket started inside the backward: {stats:?}"
            );
            common::overlap::assert_twins_equal(&format!("MPI, wire {wire:?}"), vec![twins]);
        }
    }
    Ok(())
}

/// A layer used on some ranks only, moving from step to step, in a model whose backward also
/// all-reduces in SyncBatchNorm and a tensor-parallel layer (`common::overlap::routed_steps`),
/// one bucket per variable: the overlapped gradients equal `sync_gradients`' bit for bit at
/// every step (the buckets, on the communication thread's duplicate communicator, and the
/// tensor-parallel layer's asynchronous all-reduce share that duplicate).
fn routed_layer(comm: &Arc<dyn Collective>) -> Result<()> {
    let got = common::overlap::routed_steps(comm.clone(), &Device::Cpu)?;
    common::overlap::assert_routed("MPI", &[got]);
    Ok(())
}

fn sync_bn_matches_one_process(comm: &Arc<dyn Collective>, channels_last: bool) -> Result<()> {
    let batches = [3usize, 0, 5, 2];
    let (c, h, w) = (5, 3, 4);
    let r = comm.rank();
    let config = SyncBatchNormConfig::default().with_layout(layout_of(channels_last));
    let params = Params::random(17, c);
    let (bn, vm) = layer(
        c,
        config,
        comm.clone(),
        Some(&params),
        DType::F64,
        &Device::Cpu,
    );
    let wt = Tensor::new(params.weight.as_slice(), &Device::Cpu)?;
    let bt = Tensor::new(params.bias.as_slice(), &Device::Cpu)?;
    let mut running = Tensor::zeros(c, DType::F64, &Device::Cpu)?;
    for step in 0..3u64 {
        let x = randn(100 + step, &[10, c, h, w], 4.0, 2.0);
        let dy = randn(200 + step, &[10, c, h, w], 0.0, 1.0);
        // Reference: plain f64 tensor ops on the whole batch, gradients by candle autograd.
        let xv = Var::from_tensor(&x)?;
        let (yref, mean, _) = reference_bn(xv.as_tensor(), Some(&wt), Some(&bt), None, false, 1e-5);
        let gref = (&yref * &dy)?.sum_all()?.backward()?;
        let dxref = gref.get(xv.as_tensor()).expect("dx").clone();
        running = ((running * 0.9)? + (mean * 0.1)?)?;

        let lay = |t: &Tensor| -> Result<Tensor> {
            let t = split_batch(t, &batches)[r].clone();
            Ok(if channels_last {
                to_channels_last(&t)
            } else {
                t
            })
        };
        let xr = Var::from_tensor(&lay(&x)?)?;
        let y = candle_nn::ModuleT::forward_t(&bn, xr.as_tensor(), true)?;
        let grads = (&y * &lay(&dy)?)?.sum_all()?.backward()?;
        let dx = grads.get(xr.as_tensor()).expect("dx").clone();
        let unlay = |t: &Tensor| {
            if channels_last {
                to_channels_first(t)
            } else {
                t.clone()
            }
        };
        let want_y = &split_batch(&yref, &batches)[r];
        let want_dx = &split_batch(&dxref, &batches)[r];
        ensure!(
            max_abs_diff(&unlay(&y), want_y) <= tol::F64,
            "step {step}: output"
        );
        ensure!(
            max_abs_diff(&unlay(&dx), want_dx) <= tol::F64,
            "step {step}: dx"
        );
        let dgamma = grads
            .get(var(&vm, "weight").as_tensor())
            .expect("dγ")
            .clone();
        let dgamma = comm.all_reduce(&dgamma, ReduceOp::Sum)?;
        let want_dgamma = (&yref - bt.reshape((1, c, 1, 1))?.broadcast_as(yref.shape())?)?;
        let want_dgamma = ((want_dgamma * &dy)?.sum((0, 2, 3))? / &wt)?;
        ensure!(
            max_abs_diff(&dgamma, &want_dgamma) <= 1e-8,
            "step {step}: Σ dγ"
        );
    }
    let got = bn.running_mean().expect("running stats");
    ensure!(max_abs_diff(got, &running) <= tol::F64, "running mean");
    Ok(())
}

/// Ranks {0, 1} and {2, 3} normalise over their own subgroup's batch.
fn sync_bn_in_subgroups(comm: &Arc<dyn Collective>) -> Result<()> {
    let batches = [3usize, 0, 2, 5];
    let c = 4;
    let r = comm.rank();
    let global = randn(11, &[10, c, 3, 2], 2.0, 1.5);
    let pieces = split_batch(&global, &batches);
    let low = comm.new_group(&[0, 1])?;
    let high = comm.new_group(&[2, 3])?;
    let sub = low.or(high).expect("every rank is in a subgroup");
    let (bn, _vm) = layer(
        c,
        SyncBatchNormConfig::default(),
        sub,
        None,
        DType::F64,
        &Device::Cpu,
    );
    let y = candle_nn::ModuleT::forward_t(&bn, &pieces[r], true)?;
    let group = if r < 2 { [0, 1] } else { [2, 3] };
    let x = Tensor::cat(&[&pieces[group[0]], &pieces[group[1]]], 0)?;
    let (want, _, _) = reference_bn(&x, None, None, None, false, 1e-5);
    let want = &split_batch(&want, &[batches[group[0]], batches[group[1]]])[r % 2];
    ensure!(max_abs_diff(&y, want) <= tol::F64, "subgroup output");
    Ok(())
}
