//! Where one training step of the main job's model goes on the CPU: ResNet-20 (SyncBatchNorm at
//! world size 1, f32, 16×16 inputs, AdamW), one process, candle's default thread count. The
//! whole step (forward, backward, optimizer) is timed, then each op family alone at the exact
//! shapes and counts of the model, so that the families add up to a share of the step and the
//! rest (autograd bookkeeping, element-wise ops, the loss, pooling, the linear layer,
//! allocation) is what is left:
//!
//! - convolution forward: the model's `ops::conv2d` (on the CPU its own im2col + `gemm`) for
//!   each of the 21 convolutions' shapes, and candle's `x.conv2d(w)` in the second-last column;
//! - convolution backward: `loss.backward()` through that convolution alone, minus its forward:
//!   the model's op, and candle's own backward (`conv_transpose2d` and a dilated `conv2d`) in
//!   the last column;
//! - batch norm: `SyncBatchNorm`'s forward with the fused residual add and ReLU and its backward,
//!   for each of the 21 layers' shapes;
//! - optimizer: `optim::AdamW::step` over the model's variables.
//!
//! Medians of `REPS` runs. Run at the main job's per-rank batch (32) and at its global batch
//! (128, what one PyTorch process trains on in the comparison of `scripts/torch_step.py`):
//!
//! ```text
//! cargo bench --bench step_breakdown
//! ```

#[allow(dead_code)]
#[path = "../examples/resnet/model.rs"]
mod model;

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::ThreadGroup;
use candle_distributed::ops::conv2d;
use candle_distributed::optim::AdamW;
use candle_distributed::{sync_batch_norm, SyncBatchNormConfig};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
use model::{Arch, NormKind, ResNet};

const SIDE: usize = 16;
const REPS: usize = 7;

/// One convolution of ResNet-20: input channels, output channels, kernel, stride, input side,
/// how many the model has.
const CONVS: [(usize, usize, usize, usize, usize, usize); 8] = [
    (3, 16, 3, 1, 16, 1),  // stem
    (16, 16, 3, 1, 16, 6), // stage 1
    (16, 32, 3, 2, 16, 1), // stage 2, first
    (16, 32, 1, 2, 16, 1), // stage 2, shortcut
    (32, 32, 3, 1, 8, 5),  // stage 2
    (32, 64, 3, 2, 8, 1),  // stage 3, first
    (32, 64, 1, 2, 8, 1),  // stage 3, shortcut
    (64, 64, 3, 1, 4, 5),  // stage 3
];
/// One batch norm: channels, side, how many (every convolution has one).
const NORMS: [(usize, usize, usize); 3] = [(16, 16, 7), (32, 8, 7), (64, 4, 7)];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median milliseconds of `f`, after one warm-up run.
fn time(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut ms = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let t = Instant::now();
        f()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(ms))
}

fn randn(dims: &[usize]) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1f32, dims, &Device::Cpu)?)
}

/// The model's convolutions at batch `n`, in milliseconds: forward and backward of the model's
/// op (`ops::conv2d`), then of candle's own `conv2d` for comparison.
struct Convs {
    fwd: f64,
    bwd: f64,
    fwd_candle: f64,
    bwd_candle: f64,
}

fn convolutions(n: usize) -> Result<Convs> {
    let mut c = Convs {
        fwd: 0.0,
        bwd: 0.0,
        fwd_candle: 0.0,
        bwd_candle: 0.0,
    };
    for (cin, cout, k, stride, side, count) in CONVS {
        let x = Var::from_tensor(&randn(&[n, cin, side, side])?)?;
        let w = Var::from_tensor(&(randn(&[cout, cin, k, k])? * 0.1)?)?;
        let pad = k / 2;
        let (ours, candle) = (
            |x: &Tensor, w: &Tensor| conv2d(x, w, pad, stride),
            |x: &Tensor, w: &Tensor| x.conv2d(w, pad, stride, 1, 1),
        );
        let mut f = [0.0; 2];
        let mut fb = [0.0; 2];
        for (i, op) in [
            &ours as &dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
            &candle,
        ]
        .into_iter()
        .enumerate()
        {
            f[i] = time(|| {
                op(&x.as_tensor().detach(), &w.as_tensor().detach())?;
                Ok(())
            })?;
            fb[i] = time(|| {
                op(x.as_tensor(), w.as_tensor())?.sum_all()?.backward()?;
                Ok(())
            })?;
        }
        let count = count as f64;
        c.fwd += f[0] * count;
        c.bwd += (fb[0] - f[0]).max(0.0) * count;
        c.fwd_candle += f[1] * count;
        c.bwd_candle += (fb[1] - f[1]).max(0.0) * count;
    }
    Ok(c)
}

/// Forward + backward milliseconds of the model's batch norms (fused residual add and ReLU) at
/// batch `n`, world size 1.
fn batch_norms(n: usize) -> Result<f64> {
    let comm = ThreadGroup::new(1)?.remove(0);
    let mut total = 0.0;
    for (c, side, count) in NORMS {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
        let cfg = SyncBatchNormConfig::default().with_fuse_relu(true);
        let bn = sync_batch_norm(c, cfg, vb, comm.clone())?;
        let x = Var::from_tensor(&randn(&[n, c, side, side])?)?;
        let z = Var::from_tensor(&randn(&[n, c, side, side])?)?;
        let t = time(|| {
            let y = bn.forward_residual(x.as_tensor(), z.as_tensor(), true)?;
            y.sum_all()?.backward()?;
            Ok(())
        })?;
        total += t * count as f64;
    }
    Ok(total)
}

/// The whole step, the forward alone and the optimizer alone, in milliseconds, at batch `n`.
fn step(n: usize) -> Result<(f64, f64, f64)> {
    let comm = ThreadGroup::new(1)?.remove(0);
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let model = ResNet::new(Arch::ResNet20, 10, &NormKind::SyncBn(comm), vb)?;
    let vars: Vec<(String, Var)> = {
        let data = vm.data().lock().unwrap();
        let mut v: Vec<_> = (data.iter())
            .filter(|(k, v)| v.dtype().is_float() && !k.contains("running"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let mut opt = AdamW::new_named(&vars, ParamsAdamW::default())?;
    let x = randn(&[n, 3, SIDE, SIDE])?;
    let y = Tensor::new(
        (0..n as u32).map(|i| i % 10).collect::<Vec<_>>(),
        &Device::Cpu,
    )?;
    let loss = |model: &ResNet| -> Result<Tensor> {
        Ok(candle_nn::loss::cross_entropy(
            &model.forward(&x, true)?,
            &y,
        )?)
    };
    let forward = time(|| {
        loss(&model)?;
        Ok(())
    })?;
    let grads = loss(&model)?.backward()?;
    let optimizer = time(|| {
        opt.step(&grads)?;
        Ok(())
    })?;
    let whole = time(|| {
        let g = loss(&model)?.backward()?;
        opt.step(&g)?;
        Ok(())
    })?;
    Ok((whole, forward, optimizer))
}

fn main() -> Result<()> {
    println!(
        "ResNet-20, f32, {SIDE}×{SIDE}, SyncBatchNorm at world size 1, AdamW; one process, {} candle threads; medians of {REPS}",
        candle_core::utils::get_num_threads()
    );
    println!();
    println!("| batch | step ms | images/s | forward (whole model) ms | conv forward | conv backward | batch norm fwd+bwd | optimizer | the rest | conv forward, candle's | conv backward, candle's |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for n in [32, 128] {
        let (whole, forward, optimizer) = step(n)?;
        let c = convolutions(n)?;
        let bn = batch_norms(n)?;
        let rest = whole - c.fwd - c.bwd - bn - optimizer;
        let pct = |v: f64| format!("{v:.0} ms ({:.0} %)", 100.0 * v / whole);
        println!(
            "| {n} | {whole:.0} | {:.0} | {forward:.0} | {} | {} | {} | {} | {} | {:.0} ms | {:.0} ms |",
            n as f64 / (whole / 1e3),
            pct(c.fwd),
            pct(c.bwd),
            pct(bn),
            pct(optimizer),
            pct(rest),
            c.fwd_candle,
            c.bwd_candle
        );
    }
    Ok(())
}
