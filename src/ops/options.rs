//! The options of the element-wise batch-norm ops, as candle passes a `Conv2dConfig`: what the
//! normalisation adds (affine parameters, a residual, ReLU) and where the channel dimension
//! sits. `Default` is none of them, channels first.

use candle_core::Tensor;

use crate::layout::ChannelLayout;

/// What [`super::batch_norm_elemt`] and [`super::batch_norm_elemt_autograd`] add to
/// `(x − mean)·invstd`: `y = relu?((x − mean)·invstd·γ + β + z)`.
///
/// ```
/// # use candle_distributed::ops::ElemtConfig;
/// # use candle_distributed::ChannelLayout;
/// let plain = ElemtConfig::default();
/// let fused = ElemtConfig { relu: true, layout: ChannelLayout::ChannelsLast, ..plain };
/// # assert!(fused.weight.is_none());
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct ElemtConfig<'a> {
    /// `γ`, `[C]` on `x`'s device, or `None` for 1.
    pub weight: Option<&'a Tensor>,
    /// `β`, `[C]` on `x`'s device, or `None` for 0.
    pub bias: Option<&'a Tensor>,
    /// `z`, of `x`'s shape, dtype and device, added before the activation, or `None`.
    pub residual: Option<&'a Tensor>,
    /// ReLU after the sum (in the backward, its mask applied to the incoming gradient).
    pub relu: bool,
    /// Where `x`'s channel dimension sits.
    pub layout: ChannelLayout,
}

/// What [`super::batch_norm_backward_elemt`] needs besides the statistics: the forward's `γ`,
/// its output when ReLU was fused, whether the residual's gradient is wanted, and the layout.
#[derive(Clone, Copy, Debug, Default)]
pub struct BackwardElemtConfig<'a> {
    /// `γ`, `[C]` on `x`'s device, or `None` for 1.
    pub weight: Option<&'a Tensor>,
    /// The forward's output when ReLU was fused (its mask gates the gradient), else `None`.
    pub relu_output: Option<&'a Tensor>,
    /// Also return `dz = g`, the residual's gradient.
    pub want_dz: bool,
    /// Where `x`'s channel dimension sits.
    pub layout: ChannelLayout,
}
