//! Host time of a `SyncBatchNorm` training step on a GPU against candle-nn's `BatchNorm`, in
//! the same run: the time to issue one forward (and one forward + backward through autograd)
//! without waiting for the device, at the ResNet-20 sizes, f32, NCHW, NCCL world size 1.
//!
//! Meant for the simulated GPU with its kernels skipped, where the device costs nothing and
//! what is left is the host's work (candle's ops, our launches, the driver calls as the
//! simulator implements them):
//!
//! ```text
//! . scripts/gpu-sim-env.sh
//! cargo build --release --features cuda,nccl --example host_cost
//! GPU_SIM_SKIP_KERNELS=1 target/cuda/release/examples/host_cost
//! ```
//!
//! On a real GPU the same binary measures the same thing, as long as the launch queue does not
//! fill (it is drained after every batch of calls, outside the timing).

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::NcclGroup;
use candle_distributed::{sync_batch_norm, SyncBatchNormConfig};
use candle_nn::{ModuleT, VarBuilder, VarMap};

/// The batch-norm inputs of ResNet-20 at batch 128: one per stage.
const SHAPES: [[usize; 4]; 3] = [[128, 16, 32, 32], [128, 32, 16, 16], [128, 64, 8, 8]];
/// Calls per timed batch, and timed batches (interleaved between the two layers).
const CALLS: usize = 20;
const BATCHES: usize = 15;

/// The median over the batches of the time per call of `f`, issued `CALLS` times in a row; the
/// device is drained after each batch, outside the timing.
fn per_call(dev: &Device, f: &mut dyn FnMut() -> Result<()>, times: &mut Vec<f64>) -> Result<()> {
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..CALLS {
        f()?;
    }
    times.push(t.elapsed().as_secs_f64() / CALLS as f64);
    dev.synchronize()?;
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let skip = std::env::var("GPU_SIM_SKIP_KERNELS").is_ok_and(|v| v == "1");
    let comm = NcclGroup::new(&[0])?.remove(0);
    let dev = comm.device();
    println!(
        "host time per call, µs (median of {BATCHES} batches of {CALLS} calls){}",
        if skip {
            ", simulated GPU, kernels skipped"
        } else {
            ""
        }
    );
    println!("| shape | what | SyncBatchNorm | candle-nn BatchNorm | ratio |");
    println!("|---|---|---|---|---|");
    for [n, c, h, w] in SHAPES {
        // A variable, as an activation inside a network is: the backward computes its gradient.
        let x = Var::from_tensor(&Tensor::randn(0f32, 1f32, (n, c, h, w), &dev)?)?;
        let ours_vm = VarMap::new();
        let ours = sync_batch_norm(
            c,
            SyncBatchNormConfig::default(),
            VarBuilder::from_varmap(&ours_vm, DType::F32, &dev),
            comm.clone(),
        )?;
        let nn_vm = VarMap::new();
        let theirs = candle_nn::batch_norm(
            c,
            candle_nn::BatchNormConfig::default(),
            VarBuilder::from_varmap(&nn_vm, DType::F32, &dev),
        )?;
        let layers: [&dyn ModuleT; 2] = [&ours, &theirs];
        for what in ["forward", "forward + backward"] {
            let mut times = [Vec::new(), Vec::new()];
            for batch in 0..BATCHES + 2 {
                for (layer, t) in layers.iter().zip(times.iter_mut()) {
                    let mut f = || -> Result<()> {
                        let y = layer.forward_t(x.as_tensor(), true)?;
                        if what != "forward" {
                            y.backward()?;
                        }
                        Ok(())
                    };
                    per_call(&dev, &mut f, t)?;
                    // The first two batches warm up (allocator pools, module loads).
                    if batch < 2 {
                        t.clear();
                    }
                }
            }
            let [a, b] = times.map(median);
            println!(
                "| {n}×{c}×{h}×{w} | {what} | {:.1} | {:.1} | {:.2}× |",
                a * 1e6,
                b * 1e6,
                a / b
            );
        }
    }
    Ok(())
}
