//! The layer's forward: validate the input, compute the batch statistics (one all-reduce,
//! the running statistics updated in the same finalize pass) or take the running ones, then
//! normalise through [`crate::ops::batch_norm_elemt_autograd`], whose backward calls the
//! layer's second all-reduce ([`super::synced`]); a failure past the finalize puts the running
//! statistics back. Both collectives of a step are issued here, over the collective-free ops.

use std::sync::Arc;

use candle_core::{bail, DType, Result, Tensor};

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
        crate::device::check_supported(OP, x.device())?;
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
    /// The new shift is stored as soon as the reduced sums are known, before anything that can
    /// fail on one rank only, so the ranks' shifts never diverge. Returns the state from before
    /// the step when it changed any (`train`).
    fn batch_stats(
        &self,
        x: &Tensor,
        c: usize,
        train: bool,
    ) -> Result<(GatheredStats, Option<Snapshot>)> {
        let (k, done) = {
            let st = self.lock();
            (st.shift.clone(), st.num_batches_tracked + 1)
        };
        let k = match k {
            // On x's device (a no-op but for a shift restored by `set_shift` on a layer with
            // neither parameters nor running statistics to tell its device).
            Some(k) => k.to_device(x.device())?,
            None => Tensor::zeros(c, DType::F64, x.device())?,
        };
        let mut sums = batch_norm_stats(x, &k, self.config.layout)?;
        if train {
            // The sums are this call's own: NCCL reduces them in place.
            let given = [sums];
            sums = self
                .comm
                .all_reduce_with(&given, AllReduce::new(ReduceOp::Sum).in_place())?;
        }
        let running = self
            .running
            .as_ref()
            .filter(|_| train)
            .map(|r| RunningStats {
                mean: r.mean.as_tensor().clone(),
                var: r.var.as_tensor().clone(),
                num_batches_tracked: r.batches.as_tensor().clone(),
            });
        let momentum = match &running {
            Some(_) => self.config.momentum.unwrap_or(1.0 / done as f64),
            None => 0.0,
        };
        let committed = running.is_some();
        let stats =
            batch_norm_gather_stats_update(&sums, &k, self.config.eps, momentum, running.as_ref())?;
        if !train {
            return Ok((stats, None));
        }
        // The next shift is the mean, or K for a channel whose batch was not finite (or empty).
        let mut st = self.lock();
        let before = Snapshot {
            stats: stats.clone(),
            num_batches_tracked: st.num_batches_tracked,
            shift: st.shift.replace(stats.next_shift()?),
        };
        if committed {
            st.num_batches_tracked = done;
        }
        st.before_last_step = Some(before.clone());
        Ok((stats, Some(before)))
    }

    fn plan(&self, x: &Tensor, c: usize, train: bool) -> Result<Plan> {
        let (eps, dev) = (self.config.eps, x.device());
        let use_batch = train || self.running.is_none();
        if !use_batch {
            let r = self
                .running
                .as_ref()
                .expect("running statistics are tracked here");
            let var = r.var.as_tensor().to_dtype(DType::F64)?;
            return Ok(Plan {
                mean: r.mean.as_tensor().to_dtype(DType::F64)?,
                invstd: (var + eps)?.sqrt()?.recip()?,
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
        if let Some(n) = stats.host_count()? {
            if n <= 1.0 && (train || n == 1.0) {
                self.undo(&plan)?;
                bail!(
                    "{OP}: expected more than 1 value per channel when training, got {n} in the {} batch (input shape {:?})",
                    if train { "global" } else { "local" },
                    x.dims()
                )
            }
        }
        Ok(plan)
    }

    /// After a training step failed on this rank past its finalize: puts back the running
    /// statistics and `num_batches_tracked`, so that a failed call changes nothing the user
    /// sees. The shift stays: it came from the all-reduced sums, and every rank must keep the
    /// same.
    fn undo(&self, plan: &Plan) -> Result<()> {
        match &plan.before {
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
        let plan = self.plan(&x, c, train)?;
        match self.normalise(&x, z, &plan, train) {
            Ok(y) => Ok(y),
            // The failure that matters is the first; a failed undo is named in its context.
            Err(e) => match self.undo(&plan) {
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
