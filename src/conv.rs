//! [`Conv2d`]: candle-nn's `Conv2d` layer, with the same constructors, variable names and
//! initialisation, whose forward and backward run [`crate::ops::conv2d`]'s faster paths
//! wherever they apply. Swapping candle-nn's layer for it is one line:
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{Conv2dConfig, VarBuilder, VarMap};
//! // use candle_nn::conv2d;                  // before
//! use candle_distributed::conv2d;            // after: same arguments, same variables
//!
//! let vm = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
//! let cfg = Conv2dConfig { padding: 1, ..Default::default() };
//! let conv = conv2d(3, 16, 3, cfg, vb.pp("conv1"))?;
//! let y = conv.forward(&Tensor::randn(0f32, 1., (2, 3, 8, 8), &Device::Cpu)?)?;
//! assert_eq!(y.dims(), [2, 16, 8, 8]);
//! assert!(vm.data().lock().unwrap().contains_key("conv1.weight"));
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{Module, Result, Tensor};
use candle_nn::{Conv2dConfig, VarBuilder};

use crate::ops::conv2d as conv2d_op;

/// A 2-D convolution layer: input `(N, C_in, H, W)`, weight `(C_out, C_in / groups, k, k)`,
/// optional bias `(C_out)`, output `(N, C_out, H_out, W_out)`, the values candle-nn's `Conv2d`
/// computes (within f32 rounding: the sums run in another order).
///
/// With dilation 1, one group and a square kernel larger than the padding (every convolution
/// of a ResNet) the convolution is [`crate::ops::conv2d`]: on the CPU in f32 and f64 the
/// crate's own im2col + `gemm` forward and backward, elsewhere candle's forward with a faster
/// input gradient. Otherwise, and for the configuration's `cudnn_fwd_algo`, it is candle's
/// `conv2d_with_algo`, as in candle-nn. The bias is added as candle-nn adds it. An empty batch
/// gives an empty output and zero gradients (candle-nn's layer fails on one).
#[derive(Clone, Debug)]
pub struct Conv2d {
    inner: candle_nn::Conv2d,
}

impl Conv2d {
    /// A layer of `weight` `(C_out, C_in / groups, k, k)` and an optional `bias` `(C_out)`.
    pub fn new(weight: Tensor, bias: Option<Tensor>, config: Conv2dConfig) -> Self {
        Self {
            inner: candle_nn::Conv2d::new(weight, bias, config),
        }
    }

    /// The weight, `(C_out, C_in / groups, k, k)`.
    pub fn weight(&self) -> &Tensor {
        self.inner.weight()
    }

    /// The bias, `(C_out)`, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.inner.bias()
    }

    /// Padding, stride, dilation and groups.
    pub fn config(&self) -> &Conv2dConfig {
        self.inner.config()
    }

    /// Whether [`crate::ops::conv2d`] computes this layer's convolution (see [`Conv2d`]).
    fn ours(&self) -> bool {
        let (cfg, w) = (self.config(), self.weight().dims());
        cfg.dilation == 1
            && cfg.groups == 1
            && cfg.cudnn_fwd_algo.is_none()
            && w.len() == 4
            && w[2] == w[3]
            && cfg.padding < w[2]
    }
}

impl Module for Conv2d {
    /// `(N, C_in, H, W)` → `(N, C_out, H_out, W_out)`, `H_out = (H + 2·padding −
    /// dilation·(k − 1) − 1) / stride + 1` (and `W_out` alike).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let [0, c, h, w] = *x.dims() {
            // An empty batch (a rank without samples at the end of an uneven epoch): candle's
            // own convolutions fail on one (its CPU kernel panics), so one zero sample is
            // convolved with it and dropped: the output is empty, the gradients of the weight
            // and bias are zeros.
            let one = Tensor::zeros((1, c, h, w), x.dtype(), x.device())?;
            return self.forward(&Tensor::cat(&[x, &one], 0)?)?.narrow(0, 0, 0);
        }
        if !self.ours() {
            return self.inner.forward(x);
        }
        let cfg = self.config();
        let y = conv2d_op(x, self.weight(), cfg.padding, cfg.stride)?;
        match self.bias() {
            None => Ok(y),
            Some(b) => y.broadcast_add(&b.reshape((1, b.dims1()?, 1, 1))?),
        }
    }
}

impl From<candle_nn::Conv2d> for Conv2d {
    /// The same weights and configuration, with this crate's forward.
    fn from(inner: candle_nn::Conv2d) -> Self {
        Self { inner }
    }
}

impl From<Conv2d> for candle_nn::Conv2d {
    /// The same weights and configuration, with candle-nn's forward.
    fn from(c: Conv2d) -> Self {
        c.inner
    }
}

/// candle-nn's `conv2d`: a layer of `in_channels → out_channels` with a square `kernel_size`
/// kernel and a bias, its variables `weight` and `bias` under `vb`'s prefix, initialised as
/// candle-nn initialises them (Kaiming normal; the bias uniform in `±1/√in_channels`).
///
/// # Errors
///
/// When `vb` holds a variable of that name with another shape, or cannot make one.
pub fn conv2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv2dConfig,
    vb: VarBuilder,
) -> Result<Conv2d> {
    candle_nn::conv2d(in_channels, out_channels, kernel_size, cfg, vb).map(Conv2d::from)
}

/// candle-nn's `conv2d_no_bias`: [`conv2d`] without the bias.
///
/// # Errors
///
/// As [`conv2d`].
pub fn conv2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv2dConfig,
    vb: VarBuilder,
) -> Result<Conv2d> {
    candle_nn::conv2d_no_bias(in_channels, out_channels, kernel_size, cfg, vb).map(Conv2d::from)
}
