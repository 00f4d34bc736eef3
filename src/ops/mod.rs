//! The arithmetic of synchronized batch normalisation as functional ops.
//!
//! These are the building blocks of [`crate::SyncBatchNorm`], public for users who assemble
//! their own synchronized normalisation (the equivalent of PyTorch's `batch_norm_stats`,
//! `batch_norm_gather_stats`, `batch_norm_elemt`, `batch_norm_backward_reduce` and
//! `batch_norm_backward_elemt`). One training step of one rank:
//!
//! ```text
//! sums   = batch_norm_stats(x, shift)                 [3, C] f64, local
//! sums   = comm.all_reduce(sums, Sum)                  one collective, 3C values
//! stats  = batch_norm_gather_stats(sums, shift, eps)   mean, invstd, ... [C] f64
//! y      = batch_norm_elemt(x, mean, invstd, ElemtConfig { γ, β, z, relu, layout })
//! red    = batch_norm_backward_reduce(dy, x, mean, y?) [2, C] f64, local: dβ = red[0], dγ = red[1]·invstd
//! red    = comm.all_reduce(red, Sum)                   one collective, 2C values
//! dx, dz = batch_norm_backward_elemt(dy, x, mean, invstd, red, n, BackwardElemtConfig { γ, y?, dz? })
//! ```
//!
//! [`batch_norm_elemt_autograd`] is the last line of the forward with the three backward lines
//! as its gradient, for candle's autograd: what the layer runs after its statistics.
//!
//! The ops accept f32, f64, f16 and bf16 inputs (statistics in f64, element-wise arithmetic in
//! f32 or f64), contiguous or not (non-contiguous inputs are copied first), and run on the CPU
//! in parallel with results independent of the thread count.
//!
//! # Autograd
//!
//! `batch_norm_elemt_autograd(x, mean, invstd, count, config, StatsGrad::Global(reduce))`, with
//! `config` an [`ElemtConfig`] of `γ` and `β` (both, or neither), is `batch_norm_elemt` with the
//! last three lines as its gradient, for candle's autograd, `reduce` standing for the all-reduce: `loss.backward()` calls it on
//! every rank (`StatsGrad::Local` for one rank's own batch statistics, `StatsGrad::Constant`
//! for running statistics). These ops issue no collective themselves: the reduction is the
//! caller's, and `crate::batch_norm::synced(comm)` makes the all-reduce that `SyncBatchNorm`
//! passes after its statistics. `tests/functional_ops.rs::the_autograd_form_matches_the_whole_batch_reference` checks y, dx,
//! dz, dγ and dβ on 3 ranks, one of them empty, against the whole batch in f64.
//!
//! # On the CPU
//!
//! The CPU kernels run on candle's own CPU worker pool (`candle_core::utils::barrier_pool`, the
//! threads candle's CPU ops use; `CANDLE_NUM_THREADS` or `RAYON_NUM_THREADS` sets their number),
//! in fixed work items combined in a fixed order: results do not depend on the thread count
//! (`tests/thread_count.rs` runs the ops with 1 and 3 threads and compares the bits). A second
//! pool beside candle's would compete with candle's workers, which spin for a while after each
//! candle op before they sleep. Jobs under 2¹⁶ values run on the calling thread. The kernels
//! use f64 statistics and `x − mean` evaluated as `(x − hi) − lo` from an f64 mean, so that f32
//! arithmetic stays exact when |mean| ≫ std. Each inner loop is compiled twice, for the
//! baseline x86-64 target and for AVX2 + FMA, and the CPU picks at run time; set
//! `CANDLE_DISTRIBUTED_NO_SIMD=1` to force the baseline (the CI runs the tests both ways).
//!
//! # Max pooling
//!
//! `ops::max_pool2d(x, kernel, stride, padding)` is PyTorch's `max_pool2d` without dilation or ceil
//! mode, for `(N, C, H, W)` inputs of any float dtype on any candle device (candle tensor ops
//! where the crate has no kernels, `max_pool_composite.rs`; no f64 on Metal), with a backward for
//! overlapping windows: each window's gradient goes to its first maximum in row-major order (a NaN
//! wins its window), as in PyTorch. `tests/max_pool.rs` checks it against central finite
//! differences in f64, against a naive reference on inputs full of ties (exactly, in f64, f32, f16
//! and bf16), against candle's pooling where candle has one, and its errors; the CUDA kernels
//! match the CPU op bitwise under the emulator (`tests/kernels_emulated/max_pool.rs::max_pool_matches_the_cpu_op`).
//!
//! # Convolution
//!
//! `ops::conv2d(x, w, padding, stride)` is PyTorch's `conv2d` without bias, dilation or groups.
//! On the CPU in f32 and f64 it is the crate's own im2col + `gemm` forward and backward, faster
//! than candle's at the main job's shapes; elsewhere candle's forward with a faster input
//! gradient at stride 1 (`tests/conv.rs`; measured: docs/benchmarks.md, sections "The
//! convolution on the CPU: im2col + gemm, and the cores shared among the ranks" and "A first
//! step: the convolution's input gradient").

mod apply;
mod arity;
pub(crate) mod attach;
mod backward_elemt;
mod backward_reduce;
mod conv;
mod conv_cpu;
mod gather;
mod max_pool;
mod max_pool_composite;
mod normalize;
mod options;
pub(crate) mod pack;
mod stats;

pub use crate::layout::ChannelLayout;

/// The former name of [`ChannelLayout`].
#[deprecated(since = "0.1.0", note = "renamed `ChannelLayout`")]
pub type Layout = ChannelLayout;

pub use apply::batch_norm_elemt;
pub use backward_elemt::batch_norm_backward_elemt;
pub use backward_reduce::batch_norm_backward_reduce;
pub use conv::conv2d;
pub use gather::{
    batch_norm_gather_stats, batch_norm_gather_stats_update, BatchStats, GatheredStats,
    RunningStats,
};
pub use max_pool::max_pool2d;
pub use normalize::{batch_norm_elemt_autograd, StatsGrad, SumsReduction};
pub use options::{BackwardElemtConfig, ElemtConfig};

/// The GPU architectures whose machine code the `cuda` build embeds (`sm_XX` as `XX`): 80 and
/// 90 always, and `CUDA_COMPUTE_CAP` at build time when it named another; the newest of them
/// also ships as PTX, which the driver compiles for newer GPUs at first use.
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub fn cuda_archs() -> &'static [u32] {
    crate::kernels::shipped_archs()
}
pub use stats::batch_norm_stats;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Result, Tensor};

use crate::device::cpu::{slice, Elem};

/// Name used in error messages.
pub(crate) const OP: &str = "sync-batch-norm";

/// A per-channel tensor of shape `dims` (`[C]`, or `[2, C]` for the backward sums) as a
/// contiguous f64 tensor on its own device (a no-op for one that already is). Another shape,
/// even with as many values (a transposed `[C, 2]`), or a non-float dtype is an error naming
/// `what`.
pub(crate) fn per_channel_f64(what: &str, t: &Tensor, dims: &[usize]) -> Result<Tensor> {
    check_per_channel(what, t, dims)?;
    t.to_dtype(DType::F64)?.contiguous()
}

/// Errors unless `t` has shape `dims` and a float dtype (see [`per_channel_f64`]).
pub(crate) fn check_per_channel(what: &str, t: &Tensor, dims: &[usize]) -> Result<()> {
    if t.dims() != dims || !t.dtype().is_float() {
        bail!(
            "{OP}: expected {what} of shape {dims:?} in a float dtype, got shape {:?} {:?}",
            t.dims(),
            t.dtype()
        )
    }
    Ok(())
}

/// Accumulation dtype of the element-wise kernels for an input dtype: f64 for f64, else f32.
/// Per-channel affine parameters are passed to the ops in this dtype.
pub(crate) fn acc_dtype(input: DType) -> DType {
    if input == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Errors unless `t` lives on `dev`.
pub(crate) fn check_device(what: &str, t: &Tensor, dev: &candle_core::Device) -> Result<()> {
    if !t.device().same_device(dev) {
        bail!(
            "{OP}: {what} is on {:?} but the input on {:?}",
            t.device(),
            dev
        )
    }
    Ok(())
}

/// The CPU inputs of a backward pass as contiguous slices of `T`: the output gradient `dy`, the
/// input `x` and, after a fused ReLU, its output `y`. A gradient or ReLU output whose dtype
/// differs from the input's is an error naming it.
#[allow(clippy::type_complexity)]
pub(crate) fn backward_slices<'a, T: Elem>(
    dy: (&'a CpuStorage, &candle_core::Layout),
    x: (&'a CpuStorage, &candle_core::Layout),
    y: Option<(&'a CpuStorage, &candle_core::Layout)>,
) -> Result<(&'a [T], &'a [T], Option<&'a [T]>)> {
    for (what, s) in [("gradient", Some(dy.0)), ("relu output", y.map(|y| y.0))] {
        if let Some(s) = s {
            if s.dtype() != x.0.dtype() {
                bail!(
                    "{OP} backward: {what} dtype {:?} differs from input dtype {:?}",
                    s.dtype(),
                    x.0.dtype()
                )
            }
        }
    }
    let y = y.map(|(s, l)| slice::<T>(OP, s, l)).transpose()?;
    Ok((slice::<T>(OP, dy.0, dy.1)?, slice::<T>(OP, x.0, x.1)?, y))
}

/// Errors unless `t` has shape `dims`.
pub(crate) fn check_same_shape(what: &str, dims: &[usize], t: &Tensor) -> Result<()> {
    if t.dims() != dims {
        bail!(
            "{OP}: {what} of shape {:?} does not match the input shape {dims:?}",
            t.dims()
        )
    }
    Ok(())
}
