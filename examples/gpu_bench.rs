//! `SyncBatchNorm` on a GPU at the batch-norm sizes of ResNet-50 (per-GPU batch 32), NCHW and
//! channels-last, f32 and bf16: the layer's training forward and forward + backward (autograd),
//! its kernels alone, and a device-to-device copy of the same tensor measured in the same run.
//!
//! ```text
//! cargo run --release --features cuda,nccl --example gpu_bench            # markdown table
//! cargo run --release --features cuda,nccl --example gpu_bench -- --json  # one JSON line per case
//! ```
//!
//! `scripts/bench-gpu.sh` runs it with `--json` beside `scripts/torch_gpu_bench.py layer` (the
//! same cases through `torch.nn.functional.batch_norm`) and prints the ratios.
//!
//! - layer forward: `forward_t(x, true)` of a `SyncBatchNorm` on an NCCL communicator of one
//!   GPU (statistics, their all-reduce, the running statistics, the normalisation);
//! - layer forward + backward: the same, then `y.backward()` (candle seeds it with ones; the
//!   gradients of x, γ and β);
//! - kernels forward: `batch_norm_stats` + `batch_norm_gather_stats` + `batch_norm_elemt`
//!   (3 element accesses: x read twice, y written); kernels backward:
//!   `batch_norm_backward_reduce` + `batch_norm_backward_elemt` (5: dy and x read twice, dx
//!   written). GB/s counts those accesses; the copy counts 2.
//!
//! Each time is the median of `ROUNDS` rounds of `ITERS` calls, the device synchronised around
//! each round (so host-bound calls are timed as the host's time). `--quick` runs batch 2 and
//! fewer calls: the rehearsal on a simulated GPU (`GPU_SIM_SKIP_KERNELS=1`), where the figures
//! are host time only.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::{Collective, NcclGroup};
use candle_distributed::{ops, sync_batch_norm, ChannelLayout, SyncBatchNormConfig};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use clap::Parser;

/// `(C, H·W)` of ResNet-50's batch-norm layers: stem, then one per stage (H = W).
const SIZES: [(usize, usize); 5] = [
    (64, 112 * 112),
    (256, 56 * 56),
    (512, 28 * 28),
    (1024, 14 * 14),
    (2048, 7 * 7),
];

/// The layer and its kernels against a device copy, at ResNet-50's batch-norm sizes.
#[derive(Parser)]
struct Args {
    /// One JSON object per case on stdout (times in µs) instead of a markdown table.
    #[arg(long)]
    json: bool,
    /// Batch 2, 2 rounds of 3 calls: the rehearsal on a simulated GPU.
    #[arg(long)]
    quick: bool,
}

/// Median seconds per call of `f` over `rounds` rounds of `iters` calls, after 3 warm-up calls.
fn time(
    dev: &Device,
    rounds: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut t = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        dev.synchronize()?;
        let start = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        dev.synchronize()?;
        t.push(start.elapsed().as_secs_f64() / iters as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// One case's times in seconds.
struct Case {
    copy: f64,
    layer_fwd: f64,
    layer_fwd_bwd: f64,
    kernels_fwd: f64,
    kernels_bwd: f64,
}

fn measure(
    comm: &std::sync::Arc<dyn Collective>,
    dev: &Device,
    dims: &[usize],
    dtype: DType,
    layout: ChannelLayout,
    (rounds, iters): (usize, usize),
) -> Result<Case> {
    let c = if layout.is_channels_last() {
        dims[3]
    } else {
        dims[1]
    };
    let x = Var::from_tensor(&Tensor::randn(3f32, 2f32, dims, dev)?.to_dtype(dtype)?)?;
    let xt = x.as_tensor();
    let dy = Tensor::randn(0f32, 1f32, dims, dev)?.to_dtype(dtype)?;
    let copy = time(dev, rounds, iters, || {
        xt.copy()?;
        Ok(())
    })?;

    let vm = VarMap::new();
    let bn = sync_batch_norm(
        c,
        SyncBatchNormConfig::default().with_layout(layout),
        VarBuilder::from_varmap(&vm, DType::F32, dev),
        comm.clone(),
    )?;
    let layer_fwd = time(dev, rounds, iters, || {
        bn.forward_t(xt, true)?;
        Ok(())
    })?;
    let layer_fwd_bwd = time(dev, rounds, iters, || {
        bn.forward_t(xt, true)?.backward()?;
        Ok(())
    })?;

    let shift = Tensor::zeros(c, DType::F64, dev)?;
    let weight = Tensor::ones(c, DType::F32, dev)?;
    let bias = Tensor::zeros(c, DType::F32, dev)?;
    let elemt = || ops::ElemtConfig {
        weight: Some(&weight),
        bias: Some(&bias),
        layout,
        ..Default::default()
    };
    let kernels_fwd = time(dev, rounds, iters, || {
        let sums = ops::batch_norm_stats(xt, &shift, layout)?;
        let st = ops::batch_norm_gather_stats(&sums, &shift, 1e-5)?;
        ops::batch_norm_elemt(xt, &st.mean, &st.invstd, elemt())?;
        Ok(())
    })?;
    let sums = ops::batch_norm_stats(xt, &shift, layout)?;
    let st = ops::batch_norm_gather_stats(&sums, &shift, 1e-5)?;
    let kernels_bwd = time(dev, rounds, iters, || {
        let red = ops::batch_norm_backward_reduce(&dy, xt, &st.mean, None, layout)?;
        let cfg = ops::BackwardElemtConfig {
            weight: Some(&weight),
            layout,
            ..Default::default()
        };
        ops::batch_norm_backward_elemt(&dy, xt, &st.mean, &st.invstd, &red, &st.count, cfg)?;
        Ok(())
    })?;
    Ok(Case {
        copy,
        layer_fwd,
        layer_fwd_bwd,
        kernels_fwd,
        kernels_bwd,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let nccl = NcclGroup::new(&[0])?.remove(0);
    let dev = nccl.device();
    let comm: std::sync::Arc<dyn Collective> = nccl;
    let (batch, timing) = if args.quick {
        (2, (2, 3))
    } else {
        (32, (7, 50))
    };
    if !args.json {
        println!(
            "batch {batch}, µs per call (median of {} rounds of {} calls)",
            timing.0, timing.1
        );
        println!(
            "| layout | dtype | C × H·W | copy | layer fwd | layer fwd+bwd | kernels fwd (GB/s, of copy) | kernels bwd (GB/s, of copy) |"
        );
        println!("|---|---|---|---|---|---|---|---|");
    }
    for layout in [ChannelLayout::ChannelsFirst, ChannelLayout::ChannelsLast] {
        let cl = layout.is_channels_last();
        for dtype in [DType::F32, DType::BF16] {
            for (c, hw) in SIZES {
                let side = (hw as f64).sqrt() as usize;
                let dims = if cl {
                    [batch, side, side, c]
                } else {
                    [batch, c, side, side]
                };
                let t = measure(&comm, &dev, &dims, dtype, layout, timing)?;
                let name = if cl { "NHWC" } else { "NCHW" };
                let dt = if dtype == DType::F32 { "f32" } else { "bf16" };
                let us = |s: f64| (s * 1e7).round() / 10.0;
                if args.json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "bench": "layer", "layout": name, "dtype": dt, "batch": batch,
                            "c": c, "hw": hw, "copy_us": us(t.copy),
                            "fwd_us": us(t.layer_fwd), "fwd_bwd_us": us(t.layer_fwd_bwd),
                            "kernels_fwd_us": us(t.kernels_fwd),
                            "kernels_bwd_us": us(t.kernels_bwd),
                        })
                    );
                    continue;
                }
                let bytes = (batch * c * hw * dtype.size_in_bytes()) as f64;
                let gbs = |accesses: f64, s: f64| accesses * bytes / s / 1e9;
                let copy_gbs = gbs(2.0, t.copy);
                let (f, b) = (gbs(3.0, t.kernels_fwd), gbs(5.0, t.kernels_bwd));
                println!(
                    "| {name} | {dt} | {c} × {hw} | {:.1} | {:.1} | {:.1} | {f:.0} ({:.0} %) | {b:.0} ({:.0} %) |",
                    us(t.copy),
                    us(t.layer_fwd),
                    us(t.layer_fwd_bwd),
                    100.0 * f / copy_gbs,
                    100.0 * b / copy_gbs
                );
            }
        }
    }
    Ok(())
}
