//! ResNets with torchvision's layout and variable names (ResNet-18/34/50) and the CIFAR ResNets
//! of He et al. (ResNet-20/56), built from candle-nn convolutions and a norm factory, so that
//! `candle_nn::BatchNorm` and `SyncBatchNorm` swap with one argument.

use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Module, ModuleT, Tensor, D};
use candle_distributed::collective::Collective;
use candle_distributed::ops::max_pool2d;
use candle_distributed::{sync_batch_norm, SyncBatchNorm, SyncBatchNormConfig};
use candle_nn::{conv2d_no_bias, linear, BatchNorm, Conv2d, Conv2dConfig, Linear, VarBuilder};

/// Which batch norm the model uses.
#[derive(Debug, Clone)]
pub enum NormKind {
    /// `candle_nn::BatchNorm`: statistics of this rank's batch.
    Bn,
    /// `SyncBatchNorm` over `comm`: statistics of the global batch.
    SyncBn(Arc<dyn Collective>),
}

/// A batch norm followed by nothing, by a ReLU, or by a residual add and a ReLU; fused into
/// one op for `SyncBatchNorm`.
enum Norm {
    Bn(BatchNorm, bool),
    Sync(Box<SyncBatchNorm>),
}

impl Norm {
    fn new(kind: &NormKind, c: usize, relu: bool, vb: VarBuilder) -> Result<Self> {
        Ok(match kind {
            NormKind::Bn => Norm::Bn(candle_nn::batch_norm(c, 1e-5, vb)?, relu),
            NormKind::SyncBn(comm) => {
                let cfg = SyncBatchNormConfig::default().with_fuse_relu(relu);
                Norm::Sync(Box::new(sync_batch_norm(c, cfg, vb, comm.clone())?))
            }
        })
    }

    /// `act(bn(x))`.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        Ok(match self {
            Norm::Bn(bn, relu) => {
                let y = bn_in_own_dtype(bn, x, train)?;
                if *relu {
                    y.relu()?
                } else {
                    y
                }
            }
            Norm::Sync(bn) => bn.forward_t(x, train)?,
        })
    }

    /// `relu(bn(x) + z)`.
    fn forward_add_relu(&self, x: &Tensor, z: &Tensor, train: bool) -> Result<Tensor> {
        Ok(match self {
            Norm::Bn(bn, _) => (bn_in_own_dtype(bn, x, train)? + z)?.relu()?,
            Norm::Sync(bn) => bn.forward_residual(x, z, train)?,
        })
    }
}

/// `conv(x)` in `x`'s dtype: the weight is cast to it when they differ (mixed precision; the
/// cast is differentiable, so the gradient reaches the weight in its own dtype).
///
/// On the CPU, candle 0.11 has no bf16 matrix product (and a slow f16 one): there the operands,
/// rounded to the half dtype, are multiplied in f32 and the output is rounded back, which are
/// the numbers of a GPU's half-precision convolution with f32 accumulation.
///
/// The convolution is `candle_distributed::ops::conv2d` (candle's forward, a faster backward for
/// the input at stride 1) wherever it applies: no bias, dilation 1, one group.
fn run(c: &Conv2d, x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let cfg = c.config();
    let ours = c.bias().is_none() && cfg.dilation == 1 && cfg.groups == 1;
    let conv = |x: &Tensor, w: &Tensor| {
        if ours {
            candle_distributed::ops::conv2d(x, w, cfg.padding, cfg.stride)
        } else {
            x.conv2d(w, cfg.padding, cfg.stride, cfg.dilation, cfg.groups)
        }
    };
    // An empty share on a GPU: see `empty_via_cpu` (the weight's move keeps its edge too).
    if x.elem_count() == 0 && !x.device().is_cpu() {
        let w = c
            .weight()
            .to_device(&candle_core::Device::Cpu)?
            .to_dtype(dtype)?;
        return empty_via_cpu(x, |x| Ok(conv(x, &w)?));
    }
    if c.weight().dtype() == dtype {
        return Ok(if ours {
            conv(x, c.weight())?
        } else {
            c.forward(x)?
        });
    }
    let w = c.weight().to_dtype(dtype)?;
    if x.device().is_cpu() && matches!(dtype, DType::BF16 | DType::F16) {
        let y = conv(&x.to_dtype(DType::F32)?, &w.to_dtype(DType::F32)?)?;
        return Ok(y.to_dtype(dtype)?);
    }
    Ok(conv(x, &w)?)
}

fn conv(cin: usize, cout: usize, k: usize, stride: usize, vb: VarBuilder) -> Result<Conv2d> {
    let cfg = Conv2dConfig {
        padding: k / 2,
        stride,
        ..Default::default()
    };
    Ok(conv2d_no_bias(cin, cout, k, cfg, vb)?)
}

/// candle-nn's batch norm on `x`, in the dtype of its parameters (it refuses another), back in
/// `x`'s dtype.
fn bn_in_own_dtype(bn: &BatchNorm, x: &Tensor, train: bool) -> Result<Tensor> {
    // An empty share (uneven data): candle-nn would average over nothing and make its running
    // statistics NaN for good; there is nothing to normalise.
    if x.dim(0)? == 0 {
        return Ok(x.clone());
    }
    let own = bn.running_mean().dtype();
    if own == x.dtype() {
        return Ok(bn.forward_t(x, train)?);
    }
    Ok(bn
        .forward_t(&x.to_dtype(own)?, train)?
        .to_dtype(x.dtype())?)
}

/// `f(x)`, computed on the CPU when `x` is an empty share on a GPU, where candle's CUDA kernels
/// refuse it (a cast or a convolution launches a grid of zero blocks, which the driver
/// refuses; a reduction divides by zero). The moves keep the autograd edges and copy nothing,
/// so the layers before still run their backward (and its collectives) on this rank.
pub fn empty_via_cpu(x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    if x.elem_count() == 0 && !x.device().is_cpu() {
        return Ok(f(&x.to_device(&candle_core::Device::Cpu)?)?.to_device(x.device())?);
    }
    f(x)
}

/// `x` in `dtype`, also for an empty share on a GPU.
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    empty_via_cpu(x, |x| Ok(x.to_dtype(dtype)?))
}

/// `downsample.0` (1×1 conv) and `downsample.1` (bn) when the shape changes.
struct Downsample {
    conv: Conv2d,
    bn: Norm,
}

impl Downsample {
    fn maybe(
        kind: &NormKind,
        cin: usize,
        cout: usize,
        stride: usize,
        vb: VarBuilder,
    ) -> Result<Option<Self>> {
        if stride == 1 && cin == cout {
            return Ok(None);
        }
        Ok(Some(Self {
            conv: conv(cin, cout, 1, stride, vb.pp("0"))?,
            bn: Norm::new(kind, cout, false, vb.pp("1"))?,
        }))
    }

    fn shortcut(ds: &Option<Self>, x: &Tensor, train: bool) -> Result<Tensor> {
        match ds {
            Some(d) => d.bn.forward(&run(&d.conv, x)?, train),
            None => Ok(x.clone()),
        }
    }
}

/// torchvision's `BasicBlock`: 3×3 conv, bn+ReLU, 3×3 conv, bn + shortcut + ReLU.
struct Basic {
    conv1: Conv2d,
    bn1: Norm,
    conv2: Conv2d,
    bn2: Norm,
    down: Option<Downsample>,
}

/// torchvision's `Bottleneck` (stride on the 3×3 conv): 1×1, 3×3, 1×1 (×4 channels).
struct Bottleneck {
    conv1: Conv2d,
    bn1: Norm,
    conv2: Conv2d,
    bn2: Norm,
    conv3: Conv2d,
    bn3: Norm,
    down: Option<Downsample>,
}

enum Block {
    Basic(Basic),
    Bottleneck(Bottleneck),
}

impl Block {
    /// Its batch norms, the shortcut's included.
    fn norms(&self) -> Vec<&Norm> {
        let (mut v, down) = match self {
            Block::Basic(b) => (vec![&b.bn1, &b.bn2], &b.down),
            Block::Bottleneck(b) => (vec![&b.bn1, &b.bn2, &b.bn3], &b.down),
        };
        v.extend(down.iter().map(|d| &d.bn));
        v
    }

    fn basic(kind: &NormKind, cin: usize, c: usize, stride: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Block::Basic(Basic {
            conv1: conv(cin, c, 3, stride, vb.pp("conv1"))?,
            bn1: Norm::new(kind, c, true, vb.pp("bn1"))?,
            conv2: conv(c, c, 3, 1, vb.pp("conv2"))?,
            bn2: Norm::new(kind, c, true, vb.pp("bn2"))?,
            down: Downsample::maybe(kind, cin, c, stride, vb.pp("downsample"))?,
        }))
    }

    fn bottleneck(
        kind: &NormKind,
        cin: usize,
        c: usize,
        stride: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Block::Bottleneck(Bottleneck {
            conv1: conv(cin, c, 1, 1, vb.pp("conv1"))?,
            bn1: Norm::new(kind, c, true, vb.pp("bn1"))?,
            conv2: conv(c, c, 3, stride, vb.pp("conv2"))?,
            bn2: Norm::new(kind, c, true, vb.pp("bn2"))?,
            conv3: conv(c, 4 * c, 1, 1, vb.pp("conv3"))?,
            bn3: Norm::new(kind, 4 * c, true, vb.pp("bn3"))?,
            down: Downsample::maybe(kind, cin, 4 * c, stride, vb.pp("downsample"))?,
        }))
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            Block::Basic(b) => {
                let y = b.bn1.forward(&run(&b.conv1, x)?, train)?;
                let short = Downsample::shortcut(&b.down, x, train)?;
                b.bn2.forward_add_relu(&run(&b.conv2, &y)?, &short, train)
            }
            Block::Bottleneck(b) => {
                let y = b.bn1.forward(&run(&b.conv1, x)?, train)?;
                let y = b.bn2.forward(&run(&b.conv2, &y)?, train)?;
                let short = Downsample::shortcut(&b.down, x, train)?;
                b.bn3.forward_add_relu(&run(&b.conv3, &y)?, &short, train)
            }
        }
    }
}

/// The architectures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// CIFAR ResNet-20: 3 stages × 3 basic blocks, 16/32/64 channels, 3×3 stem.
    ResNet20,
    /// CIFAR ResNet-56: 3 stages × 9 basic blocks.
    ResNet56,
    /// torchvision ResNet-18.
    ResNet18,
    /// torchvision ResNet-34.
    ResNet34,
    /// torchvision ResNet-50.
    ResNet50,
}

impl Arch {
    /// As `--model` spells it (`resnet20`, ...).
    pub fn name(self) -> String {
        format!("{self:?}").to_lowercase()
    }
}

/// A ResNet classifier: `(N, 3, H, W)` images → `(N, classes)` logits.
pub struct ResNet {
    conv1: Conv2d,
    bn1: Norm,
    /// torchvision's stem max-pool (ImageNet models only).
    maxpool: bool,
    layers: Vec<Vec<Block>>,
    fc: Linear,
}

impl ResNet {
    /// Builds `arch` for `classes` classes with the given norm, variables in `vb` under
    /// torchvision's names (`conv1`, `bn1`, `layer1.0.conv1`, …, `fc`).
    pub fn new(arch: Arch, classes: usize, norm: &NormKind, vb: VarBuilder) -> Result<Self> {
        let (stem, maxpool, widths, depths, bottleneck): (
            usize,
            bool,
            Vec<usize>,
            Vec<usize>,
            bool,
        ) = match arch {
            Arch::ResNet20 => (16, false, vec![16, 32, 64], vec![3, 3, 3], false),
            Arch::ResNet56 => (16, false, vec![16, 32, 64], vec![9, 9, 9], false),
            Arch::ResNet18 => (64, true, vec![64, 128, 256, 512], vec![2, 2, 2, 2], false),
            Arch::ResNet34 => (64, true, vec![64, 128, 256, 512], vec![3, 4, 6, 3], false),
            Arch::ResNet50 => (64, true, vec![64, 128, 256, 512], vec![3, 4, 6, 3], true),
        };
        let conv1 = if maxpool {
            let cfg = Conv2dConfig {
                padding: 3,
                stride: 2,
                ..Default::default()
            };
            conv2d_no_bias(3, stem, 7, cfg, vb.pp("conv1"))?
        } else {
            conv(3, stem, 3, 1, vb.pp("conv1"))?
        };
        let bn1 = Norm::new(norm, stem, true, vb.pp("bn1"))?;
        let mut cin = stem;
        let mut layers = Vec::new();
        for (i, (&w, &d)) in widths.iter().zip(&depths).enumerate() {
            let vbl = vb.pp(format!("layer{}", i + 1));
            let mut blocks = Vec::new();
            for j in 0..d {
                let stride = if j == 0 && i > 0 { 2 } else { 1 };
                let block = if bottleneck {
                    Block::bottleneck(norm, cin, w, stride, vbl.pp(j.to_string()))?
                } else {
                    Block::basic(norm, cin, w, stride, vbl.pp(j.to_string()))?
                };
                cin = if bottleneck { 4 * w } else { w };
                blocks.push(block);
            }
            layers.push(blocks);
        }
        let fc = linear(cin, classes, vb.pp("fc"))?;
        Ok(Self {
            conv1,
            bn1,
            maxpool,
            layers,
            fc,
        })
    }

    /// Every `SyncBatchNorm` layer (clones: they share the layers' state; none with plain batch
    /// norm). A checkpoint keys each one's shift by its `SyncBatchNorm::name()`.
    pub fn sync_norms(&self) -> Vec<SyncBatchNorm> {
        let blocks = self.layers.iter().flatten().flat_map(Block::norms);
        std::iter::once(&self.bn1)
            .chain(blocks)
            .filter_map(|n| match n {
                Norm::Sync(bn) => Some((**bn).clone()),
                Norm::Bn(..) => None,
            })
            .collect()
    }

    /// Logits `(N, classes)` in the weights' dtype; `train` selects batch statistics (and their
    /// synchronisation). The convolutions and batch norms compute in `x`'s dtype (mixed
    /// precision: f32 weights are cast to a bf16/f16 `x`'s dtype in the forward, so that
    /// their gradients arrive in f32); batch-norm statistics are f64 and their parameters
    /// stay f32; the classifier computes in the weights' dtype.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut y = self.bn1.forward(&run(&self.conv1, x)?, train)?;
        if self.maxpool {
            // torchvision's 3×3, stride-2, padding-1 stem pool; candle 0.11 has no backward for
            // overlapping windows, the crate's op does.
            y = max_pool2d(&y, 3, 2, 1)?;
        }
        for blocks in &self.layers {
            for b in blocks {
                y = b.forward(&y, train)?;
            }
        }
        let pooled = empty_via_cpu(&y, |y| Ok(y.mean(D::Minus1)?.mean(D::Minus1)?))?;
        Ok(self.fc.forward(&cast(&pooled, self.fc.weight().dtype())?)?)
    }
}
