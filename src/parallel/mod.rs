//! Differentiable collectives and tensor-parallel linear layers, on any [`Collective`] backend.
//!
//! Every op's documentation states the objective its gradient is exact for. Two conventions:
//! - **sum of per-rank losses** (`Σ_r L_r`): each rank may compute a different loss `L_r`, and the
//!   gradient a rank receives is that of the sum. [`all_gather`], [`reduce_scatter`],
//!   [`all_reduce`] follow it.
//! - **replicated loss**: every rank computes the same loss `L` (from replicated or gathered
//!   tensors), and the gradient is that of `L` once. The tensor-parallel ops
//!   [`copy_to_parallel`], [`reduce_from_parallel`], [`scatter_to_parallel`] and
//!   [`gather_from_parallel`] follow it.
//!
//! With data-parallel gradient averaging ([`crate::DataParallel`], the mean over ranks), the
//! first convention gives exactly the single-process gradient for a loss computed, identically on
//! every rank, from gathered features: `all_gather` hands each rank `Σ_r ∂L/∂x_mine = W·∂L/∂x_mine`
//! and the average over ranks divides the `W` back out. For example, a contrastive loss over
//! the global batch:
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use candle_distributed::collective::ThreadGroup;
//! use candle_distributed::parallel::all_gather;
//!
//! let grads = ThreadGroup::run(2, |comm| {
//!     let local = Var::from_tensor(&Tensor::full(comm.rank() as f32 + 1.0, (2, 3), &Device::Cpu)?)?;
//!     let global = all_gather(local.as_tensor(), &comm, 0)?; // (4, 3), rank order
//!     let loss = global.sqr()?.sum_all()?;                   // the same L on every rank
//!     let g = loss.backward()?;
//!     // Σ_r ∂L/∂local = 2·(2·local): DataParallel's average over the 2 ranks gives ∂L/∂local.
//!     g.get(local.as_tensor()).unwrap().to_vec2::<f32>()
//! })?;
//! assert_eq!(grads[1][0], vec![8.0; 3]);
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! # The ops
//!
//! | op | forward | backward | exact for |
//! |---|---|---|---|
//! | `all_gather(x, comm, dim)` | concatenation of every rank's `x` (unequal sizes allowed) | reduce-scatter (sum) of the gradient | `Σ_r L_r` |
//! | `reduce_scatter(x, comm, dim)` | sum over ranks, rank r keeps part r | all-gather | `Σ_r L_r` |
//! | `all_reduce(x, comm)` | sum over ranks | all-reduce (sum) | `Σ_r L_r` |
//! | `copy_to_parallel(x, comm)` | identity | all-reduce | replicated `L` |
//! | `reduce_from_parallel(x, comm)` | all-reduce | identity | replicated `L` |
//! | `scatter_to_parallel(x, comm, dim)` | this rank's part | all-gather | replicated `L` |
//! | `gather_from_parallel(x, comm, dim)` | all-gather | this rank's part | replicated `L` |
//!
//! Tested: `tests/contrastive.rs::contrastive_loss_over_gathered_features_matches_one_process` (InfoNCE
//! on 4 ranks against one process).
//!
//! # The layers
//!
//! `ColumnParallelLinear` (weight split by output features) and `RowParallelLinear` (by input
//! features) take the full layer's shape and the communicator, `ParallelMode::AllReduce` (replicated
//! activations) or `ParallelMode::ReduceScatter` (sequence parallel: activations split along
//! dimension 0; the column layer all-gathers its input, optionally again in the backward with
//! `regather_input(true)` instead of keeping it). In the column layer's backward the input-gradient
//! collective is started first, asynchronously (`Collective::*_async` → `Pending::wait`: a
//! communication thread on ThreadGroup and MPI — MPI on a duplicate communicator —, a side stream
//! with events on NCCL), and overlaps the weight-gradient matmul. Tested by central finite
//! differences for every op and both layers in both modes, and a column → row MLP on 4 ranks against
//! the unsharded MLP (outputs, dx, gathered weight gradients).
//! What the overlap buys, with an injected latency, is in the crate's `docs/benchmarks.md`
//! (`cargo bench --bench overlap`).

mod linear;

pub use linear::{gather_features, ColumnParallelLinear, ParallelMode, RowParallelLinear};

use std::sync::Arc;

use candle_core::{bail, Result, Tensor};

pub(crate) use crate::ops::attach::attach2;
use crate::ops::attach::{self, attach};
use candle_collective::{Collective, ReduceOp};

/// A gradient function that communicates, announced first to an overlapped data-parallel
/// backward on this thread ([`crate::collective::in_backward`]), which places its buckets
/// around such collectives.
fn communicating(
    f: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> attach::Backward {
    Box::new(move |g| candle_collective::in_backward::collective(|| f(g)))
}

/// `f` applied with `dim` moved to the front (collectives work along dimension 0).
fn along(t: &Tensor, dim: usize, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    if dim >= t.rank() {
        bail!(
            "parallel: dimension {dim} out of range for shape {:?}",
            t.dims()
        )
    }
    if dim == 0 {
        return f(&t.contiguous()?);
    }
    f(&t.transpose(0, dim)?.contiguous()?)?
        .transpose(0, dim)?
        .contiguous()
}

/// Every rank's size along `dim` (one small all-gather, on `t`'s device: the communicator's).
fn sizes_along(t: &Tensor, comm: &Arc<dyn Collective>, dim: usize) -> Result<Vec<usize>> {
    let mine = Tensor::new(&[t.dims()[dim] as i64], t.device())?;
    Ok(comm
        .all_gather(&mine)?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|v| v as usize)
        .collect())
}

/// This rank's rows of a tensor reduced over ranks along `dim`: a reduce-scatter when the
/// sizes are equal, else an all-reduce and a slice.
fn sum_and_take(
    g: &Tensor,
    comm: &Arc<dyn Collective>,
    dim: usize,
    sizes: &[usize],
) -> Result<Tensor> {
    let r = comm.rank();
    if sizes.iter().all(|&s| s == sizes[0]) {
        return along(g, dim, |t| comm.reduce_scatter(t, ReduceOp::Sum));
    }
    let start: usize = sizes[..r].iter().sum();
    comm.all_reduce(&g.contiguous()?, ReduceOp::Sum)?
        .narrow(dim, start, sizes[r])
}

/// Concatenation of every rank's `x` along `dim`, in rank order.
///
/// `x`: any shape; every rank's must agree except along `dim` (unequal sizes allowed).
/// Returns the concatenation, identical on every rank.
///
/// Gradient, exact for the **sum of per-rank losses** `Σ_r L_r`: the incoming gradients are
/// summed over ranks and each rank receives the part for its own `x` (a reduce-scatter).
/// Cost: one small all-gather of the sizes, then the gather; the backward one reduce-scatter
/// (an all-reduce when the sizes differ).
///
/// # Errors
///
/// When `dim` is not below the rank of `x`, or when the exchange of the sizes or the all-gather
/// fails (ranks whose shapes differ other than along `dim` or whose dtypes differ, a rank that
/// left, a timeout). The reduce-scatter (or all-reduce) of the backward fails in `backward()`, not
/// here.
pub fn all_gather(x: &Tensor, comm: &Arc<dyn Collective>, dim: usize) -> Result<Tensor> {
    if dim >= x.rank() {
        bail!(
            "parallel all_gather: dimension {dim} out of range for shape {:?}",
            x.dims()
        )
    }
    let sizes = sizes_along(x, comm, dim)?;
    let y = along(&x.detach(), dim, |t| comm.all_gather(t))?;
    let comm = comm.clone();
    attach(
        x,
        y,
        "all-gather",
        communicating(move |g| sum_and_take(g, &comm, dim, &sizes)),
    )
}

/// Sum over ranks of `x`, scattered along `dim`: rank `r` receives the `r`-th of `W` equal parts.
///
/// `x`: identical shape on every rank, size along `dim` a multiple of the world size `W`.
/// Gradient, exact for `Σ_r L_r`: the all-gather of every rank's incoming gradient.
///
/// # Errors
///
/// When `dim` is not below the rank of `x`, when the size along `dim` is not a multiple of the
/// world size, or when the reduce-scatter fails (ranks with different shapes or dtypes, a rank that
/// left, a timeout). The all-gather of the backward fails in `backward()`, not here.
pub fn reduce_scatter(x: &Tensor, comm: &Arc<dyn Collective>, dim: usize) -> Result<Tensor> {
    let y = along(&x.detach(), dim, |t| comm.reduce_scatter(t, ReduceOp::Sum))?;
    let comm = comm.clone();
    attach(
        x,
        y,
        "reduce-scatter",
        communicating(move |g| along(g, dim, |t| comm.all_gather(t))),
    )
}

/// Sum over ranks of `x` (identical shape on every rank).
///
/// Gradient, exact for `Σ_r L_r`: the sum over ranks of the incoming gradients (an all-reduce).
///
/// # Errors
///
/// When the all-reduce fails (ranks with different shapes or dtypes, a rank that left, a timeout).
/// The all-reduce of the backward fails in `backward()`, not here.
pub fn all_reduce(x: &Tensor, comm: &Arc<dyn Collective>) -> Result<Tensor> {
    let y = comm.all_reduce(&x.detach().contiguous()?, ReduceOp::Sum)?;
    let comm = comm.clone();
    attach(
        x,
        y,
        "all-reduce",
        communicating(move |g| comm.all_reduce(&g.contiguous()?, ReduceOp::Sum)),
    )
}

/// Identity forward; the backward sums the gradient over ranks. Put it before a
/// column-parallel computation on a replicated `x`: each rank's shard contributes part of
/// `∂L/∂x`. Exact for a **replicated loss** `L`.
///
/// # Errors
///
/// Only when copying `x` fails: the forward does not communicate. The all-reduce of the backward
/// fails in `backward()`.
pub fn copy_to_parallel(x: &Tensor, comm: &Arc<dyn Collective>) -> Result<Tensor> {
    let comm = comm.clone();
    attach(
        x,
        x.detach(),
        "copy-to-parallel",
        communicating(move |g| comm.all_reduce(&g.contiguous()?, ReduceOp::Sum)),
    )
}

/// Sum over ranks forward (partial results of a row-parallel computation); identity backward.
/// Exact for a **replicated loss** `L` computed from the (replicated) sum.
///
/// # Errors
///
/// When the all-reduce fails (ranks with different shapes or dtypes, a rank that left, a timeout).
pub fn reduce_from_parallel(x: &Tensor, comm: &Arc<dyn Collective>) -> Result<Tensor> {
    let y = comm.all_reduce(&x.detach().contiguous()?, ReduceOp::Sum)?;
    attach(x, y, "reduce-from-parallel", Box::new(|g| Ok(g.clone())))
}

/// This rank's part (the `r`-th of `W` equal parts along `dim`) of a replicated `x`; the
/// backward all-gathers the parts' gradients. Exact for a **replicated loss** (sequence
/// parallelism's split).
///
/// # Errors
///
/// When `dim` is not below the rank of `x` or the size along it is not a multiple of the world
/// size. The forward does not communicate; the all-gather of the backward fails in `backward()`.
pub fn scatter_to_parallel(x: &Tensor, comm: &Arc<dyn Collective>, dim: usize) -> Result<Tensor> {
    let (w, r) = (comm.world_size(), comm.rank());
    if dim >= x.rank() {
        bail!(
            "parallel scatter_to_parallel: dimension {dim} is out of range for {:?}",
            x.dims()
        );
    }
    let n = x.dim(dim)?;
    if n % w != 0 {
        bail!("parallel scatter_to_parallel: size {n} along dimension {dim} of {:?} is not a multiple of the world size {w}", x.dims())
    }
    let y = x.detach().narrow(dim, r * (n / w), n / w)?.contiguous()?;
    let comm = comm.clone();
    attach(
        x,
        y,
        "scatter-to-parallel",
        communicating(move |g| along(g, dim, |t| comm.all_gather(t))),
    )
}

/// Every rank's part concatenated along `dim` (sequence parallelism's gather); the backward
/// keeps this rank's part of the gradient. Exact for a **replicated loss** `L` computed from the
/// gathered tensor (every rank holds the same `∂L/∂y`, so no sum is needed — compare
/// [`all_gather`], whose gradient sums over ranks for `Σ_r L_r`).
///
/// # Errors
///
/// When `dim` is not below the rank of `x`, or when the exchange of the sizes or the all-gather
/// fails (ranks whose shapes differ other than along `dim` or whose dtypes differ, a rank that
/// left, a timeout).
pub fn gather_from_parallel(x: &Tensor, comm: &Arc<dyn Collective>, dim: usize) -> Result<Tensor> {
    if dim >= x.rank() {
        bail!(
            "parallel gather_from_parallel: dimension {dim} out of range for shape {:?}",
            x.dims()
        )
    }
    let sizes = sizes_along(x, comm, dim)?;
    let y = along(&x.detach(), dim, |t| comm.all_gather(t))?;
    let r = comm.rank();
    let start: usize = sizes[..r].iter().sum();
    let mine = sizes[r];
    attach(
        x,
        y,
        "gather-from-parallel",
        Box::new(move |g| g.narrow(dim, start, mine)?.contiguous()),
    )
}
