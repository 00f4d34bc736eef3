//! A ResNet-20 trained the way a candle user would write it, for comparing its speed with the
//! main job's (`examples/resnet`): candle-nn's layers with this crate's `conv2d_no_bias` in
//! place of candle-nn's and `sync_batch_norm` in place of `batch_norm`, candle-nn's `AdamW`,
//! `DataParallel` with the all-reduce overlapped with the backward, the `DistributedSampler`,
//! 4 thread ranks, nothing set in the environment. The same work as the main job at its
//! defaults: 3 epochs of 8000 synthetic 16×16 images in 10 classes, a global batch of 128, an
//! evaluation of 2000 images after each epoch.
//!
//! With `--fused` the ReLUs move into the batch norms, as the main job has them: the layers
//! made with `SyncBatchNormConfig::with_fuse_relu(true)`, and a block's last norm, residual add
//! and ReLU in one call of `SyncBatchNorm::forward_residual`, in place of candle's `relu()`
//! and `+` (whose backward is four passes over the values: a comparison, a conversion, a
//! product and a sum).
//!
//! ```sh
//! cargo run --release --example user_resnet        # prints one JSON line, as the main job
//! cargo run --release --example user_resnet -- --fused
//! scripts/bench-user.sh                            # both against the main job, alternating
//! ```

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Module, ModuleT, Tensor, D};
use candle_distributed::collective::{Collective, ReduceOp, ThreadGroup};
use candle_distributed::sampler::{index_tensor, DistributedSampler};
use candle_distributed::{conv2d_no_bias, sync_batch_norm, Conv2d, DataParallel, GradHooks};
use candle_distributed::{SyncBatchNorm, SyncBatchNormConfig};
use candle_nn::{linear, AdamW, Conv2dConfig, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use rand::{rngs::StdRng, Rng, SeedableRng};

const RANKS: usize = 4;
const EPOCHS: u64 = 3;
const PER_RANK: usize = 32;
const SIDE: usize = 16;
const CLASSES: usize = 10;
const TRAIN: usize = 8000;
const VAL: usize = 2000;

/// How the model is built: the ReLUs candle's (`Plain`) or inside the batch norms (`Fused`).
#[derive(Clone, Copy, PartialEq)]
enum Style {
    Plain,
    Fused,
}

/// A convolution and its batch norm, with a ReLU after it when `relu`.
struct ConvBn {
    conv: Conv2d,
    bn: SyncBatchNorm,
    relu: bool,
    style: Style,
}

/// Where a [`ConvBn`] sits: its shapes, its ReLU, the model's style.
struct Spec {
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    relu: bool,
    style: Style,
}

impl ConvBn {
    fn new(s: Spec, vb: VarBuilder, comm: &Arc<dyn Collective>) -> Result<Self> {
        let cfg = Conv2dConfig {
            padding: s.k / 2,
            stride: s.stride,
            ..Default::default()
        };
        let norm = SyncBatchNormConfig::default().with_fuse_relu(s.relu && s.style == Style::Fused);
        Ok(Self {
            conv: conv2d_no_bias(s.cin, s.cout, s.k, cfg, vb.pp("conv"))?,
            bn: sync_batch_norm(s.cout, norm, vb.pp("bn"), comm.clone())?,
            relu: s.relu,
            style: s.style,
        })
    }

    /// `relu(bn(conv(x)))`, or without the ReLU.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let y = self.bn.forward_t(&self.conv.forward(x)?, train)?;
        match self.relu && self.style == Style::Plain {
            true => Ok(y.relu()?),
            false => Ok(y),
        }
    }

    /// `relu(bn(conv(x)) + z)` (a layer made with `relu`).
    fn forward_add_relu(&self, x: &Tensor, z: &Tensor, train: bool) -> Result<Tensor> {
        let y = self.conv.forward(x)?;
        match self.style {
            Style::Plain => Ok((self.bn.forward_t(&y, train)? + z)?.relu()?),
            Style::Fused => Ok(self.bn.forward_residual(&y, z, train)?),
        }
    }
}

/// A basic block: two 3×3 convolutions, with a 1×1 projection when the shape changes.
struct Block {
    a: ConvBn,
    b: ConvBn,
    down: Option<ConvBn>,
}

impl Block {
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let y = self.a.forward(x, train)?;
        let short = match &self.down {
            Some(d) => d.forward(x, train)?,
            None => x.clone(),
        };
        self.b.forward_add_relu(&y, &short, train)
    }
}

struct ResNet20 {
    stem: ConvBn,
    blocks: Vec<Block>,
    fc: Linear,
}

impl ResNet20 {
    fn new(vb: VarBuilder, comm: &Arc<dyn Collective>, style: Style) -> Result<Self> {
        let spec = |cin, cout, k, stride, relu| Spec {
            cin,
            cout,
            k,
            stride,
            relu,
            style,
        };
        let stem = ConvBn::new(spec(3, 16, 3, 1, true), vb.pp("stem"), comm)?;
        let mut blocks = Vec::new();
        let mut cin = 16;
        for (s, cout) in [16, 32, 64].into_iter().enumerate() {
            for i in 0..3 {
                let stride = if s > 0 && i == 0 { 2 } else { 1 };
                let vb = vb.pp(format!("layer{}.{i}", s + 1));
                let down = (stride != 1 || cin != cout)
                    .then(|| ConvBn::new(spec(cin, cout, 1, stride, false), vb.pp("down"), comm))
                    .transpose()?;
                blocks.push(Block {
                    a: ConvBn::new(spec(cin, cout, 3, stride, true), vb.pp("a"), comm)?,
                    b: ConvBn::new(spec(cout, cout, 3, 1, true), vb.pp("b"), comm)?,
                    down,
                });
                cin = cout;
            }
        }
        Ok(Self {
            stem,
            blocks,
            fc: linear(64, CLASSES, vb.pp("fc"))?,
        })
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut y = self.stem.forward(x, train)?;
        for b in &self.blocks {
            y = b.forward(&y, train)?;
        }
        Ok(self.fc.forward(&y.mean((2, 3))?)?)
    }
}

/// `n` images of 3×SIDE×SIDE and their labels: each class a fixed pattern plus noise (seeded).
fn images(n: usize, seed: u64) -> Result<(Tensor, Tensor)> {
    let mut rng = StdRng::seed_from_u64(7);
    let len = 3 * SIDE * SIDE;
    let patterns: Vec<Vec<f32>> = (0..CLASSES)
        .map(|_| (0..len).map(|_| rng.gen_range(-1f32..1.)).collect())
        .collect();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut xs = Vec::with_capacity(n * len);
    let mut ys = Vec::with_capacity(n);
    for _ in 0..n {
        let c = rng.gen_range(0..CLASSES);
        xs.extend(patterns[c].iter().map(|p| p + rng.gen_range(-4f32..4.)));
        ys.push(c as u32);
    }
    Ok((
        Tensor::from_vec(xs, (n, 3, SIDE, SIDE), &Device::Cpu)?,
        Tensor::from_vec(ys, n, &Device::Cpu)?,
    ))
}

/// One rank's training; rank 0's images seen and seconds.
fn train(
    comm: Arc<dyn Collective>,
    train: &(Tensor, Tensor),
    val: &(Tensor, Tensor),
    style: Style,
) -> Result<(f64, f64, f32)> {
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let hooks = GradHooks::new();
    let model = ResNet20::new(hooks.var_builder(&vm, DType::F32, &dev), &comm, style)?;
    let dp = DataParallel::new(&vm, comm.clone())?.with_overlap(&hooks)?;
    let params = ParamsAdamW {
        lr: 4e-3,
        weight_decay: 5e-4,
        ..Default::default()
    };
    let mut opt = AdamW::new(dp.trainable(), params)?;
    let sampler = DistributedSampler::for_comm(TRAIN, &*comm)?;
    let (start, mut seen, mut acc) = (Instant::now(), 0usize, 0f32);
    for epoch in 0..EPOCHS {
        for batch in sampler.batches(epoch, PER_RANK, 0)? {
            let idx = index_tensor(&batch, &dev)?;
            let (x, y) = (
                train.0.index_select(&idx, 0)?,
                train.1.index_select(&idx, 0)?,
            );
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x, true)?, &y)?;
            dp.step(&mut opt, &loss)?;
            seen += batch.len() * comm.world_size();
        }
        // This rank's share of the validation set, the correct answers summed over the ranks.
        let share =
            DistributedSampler::new(VAL, comm.rank(), comm.world_size())?.with_shuffle(false);
        let idx = index_tensor(&share.indices(0), &dev)?;
        let logits = model.forward(&val.0.index_select(&idx, 0)?, false)?;
        let right = logits
            .argmax(D::Minus1)?
            .eq(&val.1.index_select(&idx, 0)?)?;
        let right = right.to_dtype(DType::F32)?.sum_all()?.reshape(1)?;
        let total = comm.all_reduce(&right, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
        acc = total / (share.num_samples() * comm.world_size()) as f32;
    }
    Ok((seen as f64, start.elapsed().as_secs_f64(), acc))
}

fn main() -> Result<()> {
    let style = match std::env::args().nth(1).as_deref() {
        None => Style::Plain,
        Some("--fused") => Style::Fused,
        Some(other) => anyhow::bail!("user_resnet: unknown argument {other:?} (only --fused)"),
    };
    let (tr, val) = (images(TRAIN, 1)?, images(VAL, 2)?);
    let out = ThreadGroup::run(RANKS, |comm| {
        train(comm, &tr, &val, style).map_err(|e| candle_core::Error::Msg(format!("{e:?}")))
    })?;
    let (seen, seconds, acc) = out[0];
    println!(
        "{{\"epochs\":{EPOCHS},\"world_size\":{RANKS},\"val_acc\":{acc:.4},\"images_per_sec\":{:.1},\"seconds\":{seconds:.1}}}",
        seen / seconds
    );
    Ok(())
}
