//! The layer's forward: validate the input, compute the batch statistics (one all-reduce,
//! the running statistics updated in the same finalize pass) or take the running ones, then
//! normalise through [`crate::ops::batch_norm_elemt_autograd`], whose backward calls the
//! layer's second all-reduce ([`super::synced`]); a failure past the finalize puts the running
//! statistics back. Both collectives of a step are issued here, over the collective-free ops.

use std::sync::Arc;

use candle_core::{bail, DType, Device, Result, Tensor};

use super::{Snapshot, SyncBatchNorm, OP};
use crate::layout::ChannelLayout;
use crate::ops::{
    batch_norm_elemt_autograd, batch_norm_gather_stats_update, batch_norm_stats, ElemtConfig,
    GatheredStats, RunningStats, StatsGrad,
};
use candle_collective::{AllReduce, Collective, ReduceOp};

/// The [`StatsGrad`] of statistics synchronized over `comm`: the backward all-reduces (sum)
/// its `[2, C]` gradient sums over the ranks, on every rank, whatever its batch. What
/// [`crate::SyncBatchNorm`] hands [`batch_norm_elemt_autograd`] in training; public for users
/// who assemble their own layer from [`crate::ops`].
pub fn synced(comm: Arc<dyn Collective>) -> StatsGrad {
    StatsGrad::Global(Arc::new(move |sums: &Tensor| {
        comm.all_reduce(sums, ReduceOp::Sum)
    }))
}

/// Statistics a forward normalises with (`[C]` f64 tensors on the input's device), and the
/// state from before the training step that produced them.
struct Plan {
    mean: Tensor,
    invstd: Tensor,
    /// Global values per channel (`[C]`).
    count: Tensor,
    before: Option<Snapshot>,
}

impl SyncBatchNorm {
    /// Checks the input (and residual) against the layer; returns the channel count.
    fn validate(&self, x: &Tensor, z: Option<&Tensor>) -> Result<usize> {
        let layout = self.config.layout;
        let Some(c) = layout.channels(x.dims()) else {
            bail!(
                "{OP}: expected an input of rank 2 to 5 {}, got shape {:?}",
                layout.describe(),
                x.dims()
            )
        };
        if c != self.num_features {
            bail!(
                "{OP}: expected {} channels, got {c} (input shape {:?}, {:?}){}",
                self.num_features,
                x.dims(),
                layout,
                other_layout_hint(layout, x.dims(), self.num_features)
            )
        }
        if !matches!(
            x.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        ) {
            bail!(
                "{OP}: unsupported input dtype {:?} (expected f32, f64, f16 or bf16)",
                x.dtype()
            )
        }
        let own = self.weight.as_ref().or(self.running_mean());
        if let Some(p) = own {
            if !x.device().same_device(p.device()) {
                bail!(
                    "{OP}: input on {:?} but the layer's parameters on {:?}",
                    x.device(),
                    p.device()
                )
            }
        }
        if let Some(z) = z {
            if z.dims() != x.dims() || z.dtype() != x.dtype() || !z.device().same_device(x.device())
            {
                bail!(
                    "{OP}: residual {:?} {:?} on {:?} does not match the input {:?} {:?} on {:?}",
                    z.dims(),
                    z.dtype(),
                    z.device(),
                    x.dims(),
                    x.dtype(),
                    x.device()
                )
            }
        }
        Ok(c)
    }

    /// Global (or local) batch statistics, on the input's device:
    /// exactly one all-reduce of `3·C` f64 when `train`, nothing read back to the host. In
    /// training with running statistics, the same finalize pass updates them and
    /// `num_batches_tracked` in place (one kernel on CUDA).
    ///
    /// The sums are shifted by the previous training step's global mean (0 on a layer's first
    /// step): every rank holds it bitwise identical because it comes from all-reduced values.
    /// Returns the state from before the step when it changed any (`train`).
    fn batch_stats(
        &self,
        x: &Tensor,
        c: usize,
        train: bool,
    ) -> Result<(GatheredStats, Option<Snapshot>)> {
        let (k, done) = self.step_shift(x.device(), c)?;
        let mut sums = batch_norm_stats(x, &k, self.config.layout)?;
        if train {
            // The sums are this call's own: NCCL reduces them in place.
            let given = [sums];
            sums = self
                .comm
                .all_reduce_with(&given, AllReduce::new(ReduceOp::Sum).in_place())?;
        }
        self.finalize(&sums, &k, train, done, x.device())
    }

    /// The running mean and `1/sqrt(running_var + eps)` as `[C]` f64 constants on `dev` (cast
    /// there, after the move: on the host for the composite path, as Metal has no f64), for an
    /// evaluation with running statistics.
    pub(super) fn running_f64(&self, dev: &Device) -> Result<(Tensor, Tensor)> {
        let r = self
            .running
            .as_ref()
            .expect("running statistics are tracked here");
        let f64_on = |t: &Tensor| t.detach().to_device(dev)?.to_dtype(DType::F64);
        let invstd = (f64_on(r.var.as_tensor())? + self.config.eps)?
            .sqrt()?
            .recip()?;
        Ok((f64_on(r.mean.as_tensor())?, invstd))
    }

    /// This step's shift `K` (`[C]` f64 on `dev`) and `num_batches_tracked` after the step.
    pub(super) fn step_shift(&self, dev: &Device, c: usize) -> Result<(Tensor, u64)> {
        let (k, done) = {
            let st = self.lock();
            (st.shift.clone(), st.num_batches_tracked + 1)
        };
        let k = match k {
            // A no-op on the kernel path but for a shift restored by `set_shift` on a layer
            // with neither parameters nor running statistics to tell its device.
            Some(k) => k.to_device(dev)?,
            None => Tensor::zeros(c, DType::F64, dev)?,
        };
        Ok((k, done))
    }

    /// The statistics of `[3, C]` f64 sums shifted by `k` (both on one device), the running
    /// statistics updated with them when `train` (on the sums' device: in place when the
    /// variables live there, else through copies written back), and the next shift stored on
    /// `home`. The new shift is stored as soon as the reduced sums are known, before anything
    /// that can fail on one rank only, so the ranks' shifts never diverge.
    pub(super) fn finalize(
        &self,
        sums: &Tensor,
        k: &Tensor,
        train: bool,
        done: u64,
        home: &Device,
    ) -> Result<(GatheredStats, Option<Snapshot>)> {
        let at = sums.device();
        let running = self.running.as_ref().filter(|_| train);
        let stats_of = |r: &super::Running| -> Result<RunningStats> {
            let t = |v: &candle_core::Var| -> Result<Tensor> {
                let t = v.as_tensor();
                // `to_device` to another device is a fresh copy; on the same one, the
                // variable itself, updated in place.
                t.to_device(at)
            };
            Ok(RunningStats {
                mean: t(&r.mean)?,
                var: t(&r.var)?,
                num_batches_tracked: t(&r.batches)?,
            })
        };
        let running_stats = running.map(stats_of).transpose()?;
        let momentum = match &running_stats {
            Some(_) => self.config.momentum.unwrap_or(1.0 / done as f64),
            None => 0.0,
        };
        let stats = batch_norm_gather_stats_update(
            sums,
            k,
            self.config.eps,
            momentum,
            running_stats.as_ref(),
        )?;
        if !train {
            return Ok((stats, None));
        }
        // The next shift is the mean, or K for a channel whose batch was not finite (or empty).
        let before = {
            let mut st = self.lock();
            let before = Snapshot {
                stats: stats.clone(),
                num_batches_tracked: st.num_batches_tracked,
                shift: st.shift.replace(stats.next_shift()?.to_device(home)?),
            };
            if running_stats.is_some() {
                st.num_batches_tracked = done;
            }
            st.before_last_step = Some(before.clone());
            before
        };
        // Statistics updated in copies go back to the variables, after the shift is stored; a
        // failed write puts back the state of before the step.
        if let (Some(r), Some(copies)) = (running, &running_stats) {
            if !r.mean.device().same_device(at) {
                let written = (|| {
                    r.mean.set(&copies.mean.to_device(r.mean.device())?)?;
                    r.var.set(&copies.var.to_device(r.var.device())?)?;
                    r.batches
                        .set(&copies.num_batches_tracked.to_device(r.batches.device())?)
                })();
                self.undo_on_error(written, Some(&before))?;
            }
        }
        Ok((stats, Some(before)))
    }

    /// Errors, after putting back what `before` holds, when the global (training) or local
    /// (evaluation) batch has at most one value per channel; only where the count is at hand
    /// without a wait (the CPU).
    pub(super) fn check_count(
        &self,
        stats: &GatheredStats,
        before: Option<&Snapshot>,
        dims: &[usize],
        train: bool,
    ) -> Result<()> {
        if let Some(n) = stats.host_count()? {
            if n <= 1.0 && (train || n == 1.0) {
                self.undo(before)?;
                bail!(
                    "{OP}: expected more than 1 value per channel when training, got {n} in the {} batch (input shape {dims:?})",
                    if train { "global" } else { "local" },
                )
            }
        }
        Ok(())
    }

    fn plan(&self, x: &Tensor, c: usize, train: bool) -> Result<Plan> {
        let dev = x.device();
        let use_batch = train || self.running.is_none();
        if !use_batch {
            let (mean, invstd) = self.running_f64(dev)?;
            return Ok(Plan {
                mean,
                invstd,
                count: Tensor::zeros(c, DType::F64, dev)?,
                before: None,
            });
        }
        let (stats, before) = self.batch_stats(x, c, train)?;
        let plan = Plan {
            mean: stats.mean()?,
            invstd: stats.invstd()?,
            count: stats.count()?,
            before,
        };
        // On the CPU the count is at hand; on a GPU reading it would stall the stream, and the
        // statistics kernel turns an unusable batch into NaN outputs and untouched running
        // statistics instead (see the README).
        self.check_count(&stats, plan.before.as_ref(), x.dims(), train)?;
        Ok(plan)
    }

    /// After a training step failed on this rank past its finalize: puts back the running
    /// statistics and `num_batches_tracked`, so that a failed call changes nothing the user
    /// sees. The shift stays: it came from the all-reduced sums, and every rank must keep the
    /// same.
    pub(super) fn undo(&self, before: Option<&Snapshot>) -> Result<()> {
        match before {
            Some(before) => self.restore(before, false),
            None => Ok(()),
        }
    }

    pub(super) fn forward_impl(
        &self,
        x: &Tensor,
        z: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        let c = self.validate(x, z)?;
        if train {
            self.check_collectives()?;
        }
        let x = x.contiguous()?;
        if crate::device::composite(x.device()) {
            return self.forward_composite(&x, z, c, train);
        }
        let plan = self.plan(&x, c, train)?;
        let y = self.normalise(&x, z, &plan, train);
        self.undo_on_error(y, plan.before.as_ref())
    }

    /// `y`, or its error after putting back the state of before the step (`before`).
    pub(super) fn undo_on_error<T>(&self, y: Result<T>, before: Option<&Snapshot>) -> Result<T> {
        match y {
            Ok(y) => Ok(y),
            // The failure that matters is the first; a failed undo is named in its context.
            Err(e) => match self.undo(before) {
                Ok(()) => Err(e),
                Err(u) => Err(e.context(format!(
                    "{OP}: and putting the running statistics back failed too: {u}"
                ))),
            },
        }
    }

    /// The differentiable normalisation of `x` (and `z`) with `plan`'s statistics.
    fn normalise(
        &self,
        x: &Tensor,
        z: Option<&Tensor>,
        plan: &Plan,
        train: bool,
    ) -> Result<Tensor> {
        let stats = match (train, &self.running) {
            (true, _) => synced(self.comm.clone()),
            (false, None) => StatsGrad::Local,
            (false, Some(_)) => StatsGrad::Constant,
        };
        let options = ElemtConfig {
            weight: self.weight.as_ref(),
            bias: self.bias.as_ref(),
            residual: z,
            relu: self.config.fuse_relu,
            layout: self.config.layout,
        };
        batch_norm_elemt_autograd(x, &plan.mean, &plan.invstd, &plan.count, options, stats)
    }
}

/// A hint for a channel count that is wrong in `layout` but right in the other one (an NHWC
/// input given to a channels-first layer, or the reverse): which setting to use. Empty
/// otherwise.
fn other_layout_hint(layout: ChannelLayout, dims: &[usize], channels: usize) -> String {
    let (other, words) = match layout {
        ChannelLayout::ChannelsFirst => (ChannelLayout::ChannelsLast, "channels-last"),
        ChannelLayout::ChannelsLast => (ChannelLayout::ChannelsFirst, "channels-first"),
    };
    if other.channels(dims) == Some(channels) {
        format!(
            "; a {words} input? make the layer with `SyncBatchNormConfig::default().with_layout(ChannelLayout::{other:?})`"
        )
    } else {
        String::new()
    }
}
