//! From a [`SyncBatchNorm`] to candle's own `candle_nn::BatchNorm`: for inference, export, or
//! folding the normalisation into the preceding convolution.

use candle_core::{bail, Result};

use super::{SyncBatchNorm, OP};
use crate::layout::ChannelLayout;
use candle_collective::device::fresh_copy;

impl SyncBatchNorm {
    /// A `candle_nn::BatchNorm` with a copy of this layer's running statistics, affine
    /// parameters and eps, whose eval output (`forward_t(x, false)`) equals this layer's eval
    /// output (within rounding: the two compute in another order), for inputs `(N, C, *)`.
    ///
    /// What candle's layer lacks: the fused ReLU (with [`SyncBatchNormConfig::fuse_relu`],
    /// apply `.relu()` to its output), the residual input of
    /// [`SyncBatchNorm::forward_residual`] (add it before that ReLU), and the cumulative
    /// average of `momentum: None` (candle's layer gets candle's default momentum, 0.1, which
    /// matters only if it is trained further). Checked in
    /// `tests/drop_in.rs::the_candle_batch_norm_gives_the_same_eval_output`.
    ///
    /// [`SyncBatchNormConfig::fuse_relu`]: super::SyncBatchNormConfig::fuse_relu
    ///
    /// # Errors
    ///
    /// When the layer keeps no running statistics (`track_running_stats: false`: in eval it
    /// normalises with the batch's own statistics, which candle's layer cannot do), or its
    /// layout is channels-last (candle's layer takes channels at dimension 1: permute the input,
    /// or read [`SyncBatchNorm::running_mean`], [`SyncBatchNorm::running_var`],
    /// [`SyncBatchNorm::weight`] and [`SyncBatchNorm::bias`] to fold them yourself); when a copy
    /// fails.
    pub fn to_batch_norm(&self) -> Result<candle_nn::BatchNorm> {
        let Some(running) = &self.running else {
            bail!(
                "{OP}: to_batch_norm: the layer keeps no running statistics \
                 (track_running_stats: false), and candle's BatchNorm always normalises with \
                 running statistics in eval"
            )
        };
        if self.config.layout == ChannelLayout::ChannelsLast {
            bail!(
                "{OP}: to_batch_norm: the layer is channels-last, candle's BatchNorm takes the \
                 channels at dimension 1: permute the input to (N, C, *) first, or fold the \
                 layer's running_mean, running_var, weight and bias yourself"
            )
        }
        let (mean, var) = (
            fresh_copy(running.mean.as_tensor())?,
            fresh_copy(running.var.as_tensor())?,
        );
        let (c, eps) = (self.num_features, self.config.eps);
        let momentum = self.config.momentum.unwrap_or(0.1);
        match (&self.weight, &self.bias) {
            (Some(w), Some(b)) => candle_nn::BatchNorm::new_with_momentum(
                c,
                mean,
                var,
                fresh_copy(w)?,
                fresh_copy(b)?,
                eps,
                momentum,
            ),
            _ => candle_nn::BatchNorm::new_no_bias_with_momentum(c, mean, var, eps, momentum),
        }
    }
}

impl TryFrom<&SyncBatchNorm> for candle_nn::BatchNorm {
    type Error = candle_core::Error;

    /// [`SyncBatchNorm::to_batch_norm`].
    fn try_from(bn: &SyncBatchNorm) -> Result<Self> {
        bn.to_batch_norm()
    }
}
