//! Configuration of [`super::SyncBatchNorm`].

/// Options of a synchronized batch-norm layer, with PyTorch's `nn.SyncBatchNorm` defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// Inputs are `(N, *, C)` instead of `(N, C, *)`. Default `false`.
    pub channels_last: bool,
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
            channels_last: false,
            fuse_relu: false,
        }
    }
}

impl From<f64> for SyncBatchNormConfig {
    /// The default configuration with the given `eps`.
    fn from(eps: f64) -> Self {
        Self {
            eps,
            ..Default::default()
        }
    }
}

impl From<candle_nn::BatchNormConfig> for SyncBatchNormConfig {
    /// The options of a `candle_nn::BatchNorm`. candle's `remove_mean: false` variant (no mean
    /// subtraction) has no PyTorch equivalent and is not carried over: the mean is removed.
    fn from(c: candle_nn::BatchNormConfig) -> Self {
        Self {
            eps: c.eps,
            momentum: Some(c.momentum),
            affine: c.affine,
            ..Default::default()
        }
    }
}
