//! Training steps of one `SyncBatchNorm` layer on the CPU, forward and backward through candle's
//! autograd, as a whole process to time from outside: two builds of the crate compared with
//! `hyperfine` (one command per build). World size 1 (`ThreadGroup`), f32, seeded
//! input.
//!
//! `cargo run --release --example layer_steps -- --layout nhwc --shape 64 256 14 14 --steps 300`

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::ThreadGroup;
use candle_distributed::{sync_batch_norm, ChannelLayout, SyncBatchNormConfig};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use clap::{Parser, ValueEnum};
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Format {
    Nchw,
    Nhwc,
}

/// Forward + backward steps of one layer in training mode.
#[derive(Parser, Debug)]
struct Args {
    /// Memory layout of the input.
    #[arg(long, value_enum, default_value = "nchw")]
    layout: Format,
    /// N C H W.
    #[arg(long, num_args = 4, value_names = ["N", "C", "H", "W"], default_values_t = [64, 256, 14, 14])]
    shape: Vec<usize>,
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let [n, c, h, w] = args.shape[..] else {
        anyhow::bail!("--shape takes 4 values")
    };
    let channels_last = matches!(args.layout, Format::Nhwc);
    let dims = if channels_last {
        [n, h, w, c]
    } else {
        [n, c, h, w]
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let values: Vec<f32> = (0..n * c * h * w)
        .map(|_| 1.0 + 4.0 * rng.gen::<f32>())
        .collect();
    let x = Var::from_tensor(&Tensor::from_vec(values, &dims, &Device::Cpu)?)?;
    let vm = VarMap::new();
    let layout = if channels_last {
        ChannelLayout::ChannelsLast
    } else {
        ChannelLayout::ChannelsFirst
    };
    let cfg = SyncBatchNormConfig::default().with_layout(layout);
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let bn = sync_batch_norm(c, cfg, vb, ThreadGroup::new(1)?.remove(0))?;
    for _ in 0..args.steps {
        let grads = bn.forward_t(x.as_tensor(), true)?.backward()?;
        drop(grads);
    }
    Ok(())
}
