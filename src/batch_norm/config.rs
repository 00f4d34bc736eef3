//! Configuration of [`super::SyncBatchNorm`].

use crate::layout::ChannelLayout;

/// Options of a synchronized batch-norm layer, with PyTorch's `nn.SyncBatchNorm` defaults.
///
/// Built from [`Default`] (or from a `candle_nn::BatchNormConfig`, or an `eps`) and the
/// `with_*` methods; fields can be read and set, and new ones may be added in a minor release:
///
/// ```
/// use candle_distributed::{ChannelLayout, SyncBatchNormConfig};
/// let cfg = SyncBatchNormConfig::default()
///     .with_layout(ChannelLayout::ChannelsLast)
///     .with_fuse_relu(true);
/// assert_eq!(cfg.momentum, Some(0.1));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct SyncBatchNormConfig {
    /// Added to the variance before the inverse square root. Default `1e-5`.
    pub eps: f64,
    /// Weight of the new batch statistics in the running statistics, in `[0, 1]`; `None` for a
    /// cumulative average (`1 / num_batches_tracked`). Default `Some(0.1)`.
    pub momentum: Option<f64>,
    /// Learnable per-channel `weight` (γ, init 1) and `bias` (β, init 0). Default `true`.
    pub affine: bool,
    /// Keep `running_mean` / `running_var` and use them in eval mode. Default `true`.
    pub track_running_stats: bool,
    /// Where the input's channel dimension sits. Default [`ChannelLayout::ChannelsFirst`].
    pub layout: ChannelLayout,
    /// Apply ReLU after the normalisation (and after the residual add). Default `false`.
    pub fuse_relu: bool,
}

impl Default for SyncBatchNormConfig {
    fn default() -> Self {
        Self {
            eps: 1e-5,
            momentum: Some(0.1),
            affine: true,
            track_running_stats: true,
            layout: ChannelLayout::ChannelsFirst,
            fuse_relu: false,
        }
    }
}

impl SyncBatchNormConfig {
    /// With [`Self::eps`] set.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// With [`Self::momentum`] set (`None`: cumulative average).
    pub fn with_momentum(mut self, momentum: Option<f64>) -> Self {
        self.momentum = momentum;
        self
    }

    /// With [`Self::affine`] set.
    pub fn with_affine(mut self, affine: bool) -> Self {
        self.affine = affine;
        self
    }

    /// With [`Self::track_running_stats`] set.
    pub fn with_track_running_stats(mut self, track: bool) -> Self {
        self.track_running_stats = track;
        self
    }

    /// With [`Self::layout`] set.
    pub fn with_layout(mut self, layout: ChannelLayout) -> Self {
        self.layout = layout;
        self
    }

    /// With [`Self::fuse_relu`] set.
    pub fn with_fuse_relu(mut self, fuse_relu: bool) -> Self {
        self.fuse_relu = fuse_relu;
        self
    }
}

impl From<f64> for SyncBatchNormConfig {
    /// The default configuration with the given `eps`.
    fn from(eps: f64) -> Self {
        Self::default().with_eps(eps)
    }
}

impl From<candle_nn::BatchNormConfig> for SyncBatchNormConfig {
    /// The options of a `candle_nn::BatchNorm`. candle's `remove_mean: false` variant (no mean
    /// subtraction) has no PyTorch equivalent and is not carried over: the mean is removed.
    fn from(c: candle_nn::BatchNormConfig) -> Self {
        Self::default()
            .with_eps(c.eps)
            .with_momentum(Some(c.momentum))
            .with_affine(c.affine)
    }
}
