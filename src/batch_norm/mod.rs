//! The [`SyncBatchNorm`] layer: batch normalisation whose training statistics cover the global
//! batch of every rank of a [`Collective`] group.
//!
//! # Semantics
//!
//! | | training | eval, `track_running_stats` | eval, no running stats |
//! |---|---|---|---|
//! | statistics | global batch, all ranks, count-weighted | running mean / var | local batch |
//! | communication | 1 all-reduce forward (3·C f64), 1 backward (2·C f64) | none | none |
//! | normalisation variance | biased `M2/n` | `running_var` | biased, local |
//! | running stats update | `(1−m)·r + m·batch`, `running_var` with unbiased `M2/(n−1)`, global `n`; `momentum: None` = cumulative average | — | — |
//! | backward | dx of `Σ_r L_r` (global objective), local dγ, dβ, dz | `dx = g·γ·invstd` | through local stats |
//!
//! - `y = act(γ·(x − mean)·invstd + β [+ z])`, `act` = ReLU with `fuse_relu`; `forward_residual(x,
//!   z, train)` adds `z` before the activation and gives `z` its gradient.
//! - An empty local batch (`N = 0`) takes part in both collectives and gets an empty output; fewer
//!   than 2 values per channel in the global training batch is an error, as in PyTorch (on a GPU,
//!   where checking would stall the stream, NaN outputs instead: see "On a GPU" below).
//! - A batch holding NaN or Inf never poisons later steps: per channel, when the
//!   global mean or variance is not finite, the next step's shift stays the previous one and the
//!   running mean and variance are left exactly as they were (PyTorch lets them become NaN for good;
//!   we skip, and `num_batches_tracked` still counts the step, as PyTorch's). Decided on the device
//!   by the finalize kernel (and its CPU twin), no host synchronisation. That step's own outputs
//!   show the bad data. Tested: `tests/non_finite.rs` (NaN and Inf on one rank; f32, f16, bf16; 1
//!   and 3 ranks: the clean steps after the bad one, and the running statistics, are bitwise those
//!   of clean steps alone; a NaN in one channel holds that channel only) and
//!   `tests/kernels_emulated/finalize.rs::finalize_holds_a_non_finite_channel` (the kernel, emulated).
//! - Subgroups: build the layer with a subgroup communicator (`comm.new_group(&[0, 1])?`, or
//!   `comm.split(Some(color), key)?`) to synchronise within it, as PyTorch's `process_group`.
//! - dγ, dβ are the local sums (the gradient of this rank's loss): sum or average them across ranks
//!   with your data-parallel gradient synchronisation.
//! - Statistics are exchanged in f64 whatever the input dtype; the sums are shifted by the previous
//!   training step's global mean (identical on every rank), so from the second step on they are as
//!   accurate as a two-pass f64 computation. A layer's first step has no such shift (0) and spends
//!   no extra collective on finding one: its variance carries a relative error of about
//!   `ε·mean²/var` (ε = 1.1e-16; 1e-4 for mean 1e4 and std 1e-2, nothing measurable for ordinary
//!   activations).
//!
//! # Failures
//!
//! Any failed call leaves running statistics, `num_batches_tracked` and parameters
//! untouched. A rank that times out (`ThreadGroup::with_timeout`, default 5 minutes), leaves the group
//! (drops its communicator or panics), or passes a mismatched tensor makes every rank's pending and
//! later collectives return an error naming the operation, the call and the ranks concerned. A rank
//! that fails local validation (e.g. wrong channel count) returns its error at once; the others then
//! wait for it until their timeout, unless it drops its communicator. Errors of the collectives are
//! a `collective::CollectiveError` inside candle's error (`Timeout`, `RankLeft`, `Mismatch`,
//! `Library`, `InvalidArgument`), recovered with `CollectiveError::find(&err)`, through
//! `ThreadGroup::run`'s rank context too (doc test on `CollectiveError`; `tests/async_failure.rs`,
//! `tests/checked.rs`).
//!
//! A step whose all-reduce fails *after* its call returned (NCCL: enqueued, then aborted by the
//! watchdog, its output never written) is rolled back: every training forward first asks
//! `Collective::deferred_error()`, and when the communicator reports such a loss the layer restores
//! the running statistics, `num_batches_tracked` and the shift of before the last training step and
//! returns the error (`SyncBatchNorm::check_collectives` does the same on demand). Exact when the
//! failure is noticed within one step, which a loop that reads its loss every step guarantees (the
//! read waits for the stream, and so for the abort); gradients of a failed backward are not the
//! layer's to undo. Cost: nothing per step: the finalize pass that updates the running statistics
//! in place writes their previous values into two rows of the statistics it returns, which the
//! layer keeps until the next step. Tested on the
//! CPU with a communicator that fails after returning (`tests/async_failure.rs`: the state after the
//! rollback is bitwise that of the clean steps, and a further step matches a layer that never saw
//! the failed one, so the shift was restored too); over NCCL in `tests/nccl.rs`
//! (`the_layer_rolls_back_a_step_whose_all_reduce_was_aborted`, needs 2 GPUs, **not run yet**).
//!
//! # Rules for callers
//!
//! As with any synchronized batch norm: every rank builds the same layers in the
//! same order and calls every training forward, and the backward of every output it used, the same
//! number of times (an empty batch still calls both; the layer makes sure its backward is reached
//! through `loss.backward()` even then).
//!
//! # On a GPU
//!
//! On a CUDA device the layer runs entirely on the GPU, on candle's stream, and never reads a
//! value back to the host in the forward or the backward: local sums, the all-reduced sums, the
//! shift, mean, invstd, count and the running-statistics update all stay device tensors (the
//! momentum for `momentum: None` is `1/num_batches_tracked`, counted on the host). The price: the
//! "more than 1 value per channel" check cannot run there without stalling the stream, so on a GPU a
//! global batch of one value per channel gives NaN outputs and leaves the running statistics
//! untouched (`num_batches_tracked` still counts the step), where the CPU path returns an error
//! (`tests/errors.rs::cuda::one_value_per_channel_in_the_global_batch_fails_on_every_rank` states both).
//!
//! # On a device without the crate's kernels
//!
//! On Metal, and on CUDA in a build without the `cuda` feature, the layer is built from candle's
//! tensor ops instead (`composite.rs`), with the semantics above: per channel, the local mean
//! `m̃`, `Σ(x − m̃)` and `Σ(x − m̃)²` on the device in f32 (f64 for f64 inputs), finished into
//! the shifted sums in f64 on the host (Metal has no f64), one all-reduce of them put into the
//! graph (its backward all-reduces their `2·C` gradient), the finalize and the running
//! statistics on the host, the normalisation on the device. candle's autograd differentiates
//! it; the sums carry a zero variable, so that the backward reaches their all-reduce on every
//! rank whenever the output is on the loss's path (also on a rank whose empty input candle left
//! out of the graph). Unlike the kernel path it reads back to the host twice per call, and the count is known
//! there: one value per channel is an error on every device. Set `CANDLE_DISTRIBUTED_COMPOSITE=1`
//! to take it on every device; CI runs the suites so on the CPU and on the simulated GPU.

mod composite;
mod config;
mod convert;
mod forward;
mod norm;

pub use config::SyncBatchNormConfig;
pub use forward::synced;
pub use norm::{Norm, NormFactory};

use std::sync::{Arc, Mutex};

use candle_core::{bail, DType, Result, Tensor, Var};
use candle_nn::{Init, ModuleT, VarBuilder};

use crate::ops::GatheredStats;
use candle_collective::Collective;

/// The name errors of the layer and its ops begin with.
pub(crate) const OP: &str = "sync-batch-norm";

/// Running statistics, stored in `Var`s shared with the `VarBuilder`'s `VarMap` (when it has
/// one), so that saving the `VarMap` saves them under PyTorch's names.
#[derive(Debug, Clone)]
struct Running {
    mean: Var,
    var: Var,
    /// `num_batches_tracked`, a scalar i64 as in PyTorch checkpoints.
    batches: Var,
}

/// Mutable state updated by training steps.
#[derive(Debug, Default)]
struct State {
    num_batches_tracked: u64,
    /// Global batch mean of the previous training step (`[C]` f64 on the layer's device): the
    /// shift of the next one's sums (bitwise identical on every rank, as it comes from
    /// all-reduced values).
    shift: Option<Tensor>,
    /// The state before the last training step, kept until the next one: restored when the
    /// communicator reports (through [`Collective::deferred_error`]) that a collective failed
    /// after its call returned. Costs no copies: see [`Snapshot`].
    before_last_step: Option<Snapshot>,
}

/// What a training step changed, as it was before the step.
#[derive(Debug, Clone)]
struct Snapshot {
    /// The step's finalized statistics, which hold the running mean and variance from before
    /// the step (written by the finalize pass).
    stats: GatheredStats,
    num_batches_tracked: u64,
    shift: Option<Tensor>,
}

/// Synchronized batch normalisation (PyTorch's `nn.SyncBatchNorm`).
///
/// Input `(N, C, *)` (or `(N, *, C)` with [`crate::ChannelLayout::ChannelsLast`]), rank 2 to 5, f32/f64/f16/bf16;
/// output of the same shape and dtype. In training, the mean and variance of each channel are
/// those of the global batch (all ranks' inputs together, weighted by their counts, empty
/// local batches allowed); one all-reduce of `3·C` f64 values in the forward and one of `2·C`
/// in the backward, whatever the world size. In eval with running statistics, nothing is
/// communicated. Build it with [`sync_batch_norm`].
///
/// A clone is the same layer, as a clone of a candle-nn layer shares its tensors: it shares the
/// variables, the running statistics, `num_batches_tracked`, the shift and the communicator, so
/// that a model deriving `Clone` keeps one layer whichever copy trains. For a separate layer,
/// build another with [`sync_batch_norm`]; for candle's own layer (inference, export, folding
/// into a convolution), see [`SyncBatchNorm::to_batch_norm`].
///
/// ```
/// use std::sync::Arc;
/// use candle_core::{DType, Device, Module, Result, Tensor};
/// use candle_distributed::collective::{Collective, ThreadGroup};
/// use candle_distributed::{sync_batch_norm, SyncBatchNorm};
/// use candle_nn::{conv2d_no_bias, Conv2d, Conv2dConfig, ModuleT, VarBuilder, VarMap};
///
/// // A residual block as candle models write it; only the batch norm's constructor changes.
/// #[derive(Clone, Debug)]
/// struct Block {
///     conv: Conv2d,
///     bn: SyncBatchNorm,
/// }
///
/// impl Block {
///     fn new(c: usize, vb: VarBuilder, comm: Arc<dyn Collective>) -> Result<Self> {
///         let cfg = Conv2dConfig { padding: 1, ..Default::default() };
///         let conv = conv2d_no_bias(c, c, 3, cfg, vb.pp("conv"))?;
///         // was: let bn = candle_nn::batch_norm(c, 1e-5, vb.pp("bn"))?;
///         let bn = sync_batch_norm(c, 1e-5, vb.pp("bn"), comm)?;
///         Ok(Self { conv, bn })
///     }
///
///     fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
///         let y = self.bn.forward_t(&self.conv.forward(x)?, train)?;
///         (y + x)?.relu()
///     }
/// }
///
/// let outs = ThreadGroup::run(2, |comm| {
///     let vm = VarMap::new();
///     let block = Block::new(4, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), comm)?;
///     let copy = block.clone();
///     let x = Tensor::randn(0f32, 1., (2, 4, 5, 5), &Device::Cpu)?;
///     copy.forward_t(&x, true)?; // trains the one layer both share
///     Ok((block.bn.num_batches_tracked(), block.forward_t(&x, false)?.dims().to_vec()))
/// })?;
/// assert_eq!(outs[0], (1, vec![2, 4, 5, 5]));
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct SyncBatchNorm {
    /// The `VarBuilder` prefix the layer was built under (`layer1.0.bn1`).
    name: String,
    num_features: usize,
    config: SyncBatchNormConfig,
    comm: Arc<dyn Collective>,
    weight: Option<Tensor>,
    bias: Option<Tensor>,
    running: Option<Running>,
    state: Arc<Mutex<State>>,
}

/// Builds a [`SyncBatchNorm`] over `num_features` channels, with variables under PyTorch's
/// names in `vb`: `weight`, `bias` (when `affine`), `running_mean`, `running_var` and
/// `num_batches_tracked` (when `track_running_stats`; the latter is optional in a checkpoint).
///
/// The drop-in for `candle_nn::batch_norm(num_features, config, vb)`: `config` is an `f64`
/// eps, a `candle_nn::BatchNormConfig` or a [`SyncBatchNormConfig`]; `comm` is this rank's
/// communicator (every rank of the group must build the same layers in the same order).
///
/// # Errors
///
/// When `num_features` is 0, `eps` is negative or NaN, or `momentum` is outside `[0, 1]`; when `vb`
/// cannot provide a variable (for instance a stored tensor of another shape); or when a stored
/// `num_batches_tracked` is not a scalar convertible to i64.
pub fn sync_batch_norm(
    num_features: usize,
    config: impl Into<SyncBatchNormConfig>,
    vb: VarBuilder,
    comm: Arc<dyn Collective>,
) -> Result<SyncBatchNorm> {
    let config = config.into();
    if num_features == 0 {
        bail!("{OP}: num_features must be at least 1")
    }
    if config.eps.is_nan() || config.eps < 0.0 {
        bail!("{OP}: eps must be non-negative, got {}", config.eps)
    }
    if let Some(m) = config.momentum {
        if !(0.0..=1.0).contains(&m) {
            bail!("{OP}: momentum must be in [0, 1], got {m}")
        }
    }
    let (weight, bias) = if config.affine {
        (
            Some(vb.get_with_hints(num_features, "weight", Init::Const(1.0))?),
            Some(vb.get_with_hints(num_features, "bias", Init::Const(0.0))?),
        )
    } else {
        (None, None)
    };
    let mut state = State::default();
    let running = if config.track_running_stats {
        let mean = vb.get_with_hints(num_features, "running_mean", Init::Const(0.0))?;
        let var = vb.get_with_hints(num_features, "running_var", Init::Const(1.0))?;
        let batches = match vb.get_with_hints_dtype(
            (),
            "num_batches_tracked",
            Init::Const(0.0),
            DType::I64,
        ) {
            Ok(t) => t,
            Err(_) if !vb.contains_tensor("num_batches_tracked") => {
                Tensor::zeros((), DType::I64, vb.device())?
            }
            Err(e) => return Err(e),
        };
        state.num_batches_tracked = batches.to_dtype(DType::I64)?.to_scalar::<i64>()?.max(0) as u64;
        Some(Running {
            mean: Var::from_tensor(&mean)?,
            var: Var::from_tensor(&var)?,
            batches: Var::from_tensor(&batches)?,
        })
    } else {
        None
    };
    Ok(SyncBatchNorm {
        name: vb.prefix(),
        num_features,
        config,
        comm,
        weight,
        bias,
        running,
        state: Arc::new(Mutex::new(state)),
    })
}

impl SyncBatchNorm {
    /// `act(bn(x) + z)`: batch norm, residual add, then ReLU when `fuse_relu`.
    ///
    /// `x` and `z`: same shape `(N, C, *)` (or `(N, *, C)`), same dtype and device. The backward
    /// gives `z` the gradient of the sum (masked by the ReLU).
    ///
    /// # Errors
    ///
    /// When `x` is not of rank 2 to 5, its channel dimension is not the layer's `num_features`, its
    /// dtype is not f32, f64, f16 or bf16, or it is not on the device of the layer's variables;
    /// when `z` differs from `x` in shape, dtype or device.
    ///
    /// In training, also: when the communicator reports that an earlier collective failed (the
    /// state is rolled back first, see [`Self::check_collectives`]); when the all-reduce of the
    /// statistics fails (a rank that left, a timeout, ranks with different channel counts); and, on
    /// the CPU, when the global batch has at most 1 value per channel (on a GPU the output is NaN
    /// instead). Without running statistics, in eval, on the CPU: when the local batch has exactly
    /// 1 value per channel.
    ///
    /// The all-reduce of the backward fails in `backward()`, not here.
    pub fn forward_residual(&self, x: &Tensor, z: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_impl(x, Some(z), train)
    }

    /// Running mean `[C]`, `None` without `track_running_stats`.
    pub fn running_mean(&self) -> Option<&Tensor> {
        self.running.as_ref().map(|r| r.mean.as_tensor())
    }

    /// Running (unbiased) variance `[C]`, `None` without `track_running_stats`.
    pub fn running_var(&self) -> Option<&Tensor> {
        self.running.as_ref().map(|r| r.var.as_tensor())
    }

    /// Number of training forwards that updated the running statistics.
    pub fn num_batches_tracked(&self) -> u64 {
        self.lock().num_batches_tracked
    }

    /// `weight` (γ) `[C]`, `None` without `affine`.
    pub fn weight(&self) -> Option<&Tensor> {
        self.weight.as_ref()
    }

    /// `bias` (β) `[C]`, `None` without `affine`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The shift the next training step subtracts before summing (`[C]` f64: the previous
    /// training step's global batch mean; `None` before the first step, meaning 0). It changes
    /// the rounding of the statistics, not their value: save it with the running statistics to
    /// resume a run bit for bit ([`Self::set_shift`]).
    pub fn shift(&self) -> Option<Tensor> {
        self.lock().shift.clone()
    }

    /// Restores a [`Self::shift`] (between training steps, on every rank alike; `None`: 0).
    /// Any float dtype; stored as f64 on the layer's device (moved to the input's device at the
    /// next step when the layer has no variables to tell it). The state kept to roll back the
    /// last step (see [`Self::check_collectives`]) is dropped.
    ///
    /// # Errors
    /// A shape other than `[C]` or a non-finite value; the layer is then unchanged.
    pub fn set_shift(&self, shift: Option<&Tensor>) -> Result<()> {
        let shift = self.checked_shift(shift)?;
        self.put_shift(shift);
        Ok(())
    }

    /// The variable prefix the layer was built under (`vb.prefix()` at
    /// [`sync_batch_norm`]: `layer1.0.bn1`), which names its shift in a checkpoint.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A shift for [`Self::set_shift`], checked and on the layer's device; nothing changes.
    pub(crate) fn checked_shift(&self, shift: Option<&Tensor>) -> Result<Option<Tensor>> {
        Ok(match shift {
            None => None,
            Some(t) => {
                if t.dims() != [self.num_features] {
                    bail!(
                        "{OP}: set_shift: expected shape [{}], got {:?}",
                        self.num_features,
                        t.dims()
                    )
                }
                let device = self
                    .weight
                    .as_ref()
                    .map(|w| w.device().clone())
                    .or_else(|| self.running.as_ref().map(|r| r.mean.device().clone()))
                    .unwrap_or_else(|| t.device().clone());
                // Checked and cast on the host (a Metal device has no f64 arithmetic).
                let host = t
                    .to_device(&candle_core::Device::Cpu)?
                    .to_dtype(DType::F64)?;
                if let Some(bad) = host.to_vec1::<f64>()?.iter().find(|v| !v.is_finite()) {
                    bail!("{OP}: set_shift: the shift must be finite, got {bad}")
                }
                Some(host.to_device(&device)?)
            }
        })
    }

    /// Reads `num_batches_tracked` again from its variable, after something outside the layer
    /// set it (a checkpoint restored into the `VarMap`): the host counter the next step uses
    /// (the cumulative average's momentum) follows it.
    ///
    /// # Errors
    /// When the variable cannot be read to the host as an i64 scalar.
    pub(crate) fn reread_num_batches_tracked(&self) -> Result<()> {
        if let Some(r) = &self.running {
            let n = r
                .batches
                .as_tensor()
                .to_dtype(DType::I64)?
                .to_scalar::<i64>()?;
            self.lock().num_batches_tracked = n.max(0) as u64;
        }
        Ok(())
    }

    /// Sets a shift [`Self::checked_shift`] returned.
    pub(crate) fn put_shift(&self, shift: Option<Tensor>) {
        let mut st = self.lock();
        st.shift = shift;
        // A rollback of the last step must not undo the restored shift.
        st.before_last_step = None;
    }

    /// The layer's configuration.
    pub fn config(&self) -> &SyncBatchNormConfig {
        &self.config
    }

    /// The communicator the layer synchronises over.
    pub fn comm(&self) -> &Arc<dyn Collective> {
        &self.comm
    }

    /// Asks the communicator whether every collective the layer relied on completed; when it
    /// reports a failure, restores the running statistics, `num_batches_tracked` and the shift
    /// to what they were before the last training step, and returns the failure.
    ///
    /// Every training forward calls this first. Why it exists: on NCCL a collective's call
    /// returns when it is enqueued, so a step whose all-reduce is later aborted by the watchdog
    /// has committed statistics computed from a buffer NCCL never finished writing (it may hold
    /// the old sums, a partial result or garbage: NCCL promises nothing). Exact when the failure
    /// is noticed within one step (a training loop that reads its loss every step waits for
    /// the stream, and so for the abort); a loop that enqueues several steps without reading
    /// anything back can outrun the watchdog, and the rollback then covers only the last step.
    /// Gradients are not the layer's: an optimizer step taken from a failed backward is not
    /// undone here.
    ///
    /// # Errors
    /// The communicator's failure (e.g. a [`crate::collective::CollectiveError::RankLeft`]),
    /// with a note that the layer rolled back.
    pub fn check_collectives(&self) -> Result<()> {
        let Err(e) = self.comm.deferred_error() else {
            return Ok(());
        };
        let snap = self.lock().before_last_step.take();
        let restored = snap.is_some();
        if let Some(snap) = snap {
            self.restore(&snap, true)?;
        }
        Err(e.context(if restored {
            format!("{OP}: the communicator failed; the running statistics and shift are those before the last training step")
        } else {
            format!("{OP}: the communicator failed (the state was already rolled back)")
        }))
    }

    /// Puts back the running statistics and `num_batches_tracked` of `snap` (and the shift
    /// when `shift`): a rare path, through ordinary candle ops.
    fn restore(&self, snap: &Snapshot, shift: bool) -> Result<()> {
        if let Some(r) = &self.running {
            let (mean, var) = snap.stats.previous_running()?;
            // On the variables' device: the statistics of the composite path are on the host.
            r.mean
                .set(&mean.to_dtype(r.mean.dtype())?.to_device(r.mean.device())?)?;
            r.var
                .set(&var.to_dtype(r.var.dtype())?.to_device(r.var.device())?)?;
            r.batches.set(&Tensor::new(
                snap.num_batches_tracked as i64,
                r.batches.device(),
            )?)?;
        }
        let mut st = self.lock();
        st.num_batches_tracked = snap.num_batches_tracked;
        if shift {
            st.shift.clone_from(&snap.shift);
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ModuleT for SyncBatchNorm {
    /// `act(bn(x))`; `train` selects batch statistics (synchronized) or running statistics.
    ///
    /// # Errors
    ///
    /// As [`SyncBatchNorm::forward_residual`], less the conditions on `z`.
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_impl(x, None, train)
    }
}
