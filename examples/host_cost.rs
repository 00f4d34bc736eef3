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
//!
//! Then the same for `DataParallel::sync_gradients` of ResNet-20's parameters (one bucket),
//! against one bare all-reduce of as many values.
//!
//! `--json` prints one JSON object per row instead of the tables (times in µs; what
//! `scripts/bench-gpu.sh` reads beside `scripts/torch_gpu_bench.py host`).

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::{Collective, NcclGroup, ReduceOp};
use candle_distributed::{sync_batch_norm, DataParallel, SyncBatchNormConfig};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use gpu_sim::{Counts, GpuSim};

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

/// The driver calls of one call of `f`, by kind, from the simulated driver's process-wide
/// counters (`None` on a real driver, which has none).
fn driver_calls(dev: &Device, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<Counts>> {
    let Some(sim) = GpuSim::loaded() else {
        return Ok(None);
    };
    dev.synchronize()?;
    sim.reset();
    f()?;
    dev.synchronize()?;
    Ok(Some(sim.total_counts()))
}

/// `launches / allocations / memsets and device copies / event records and waits` of a call.
fn describe(c: Option<Counts>) -> String {
    c.map_or("–".into(), |c| {
        format!(
            "{} / {} / {} / {}",
            c.launches,
            c.allocs,
            c.memsets + c.copies_dtod,
            c.event_records + c.stream_waits
        )
    })
}

/// The parameter shapes of ResNet-20 for 32×32 images (He et al., option B shortcuts): 19
/// convolutions with their batch norms' γ and β, two 1×1 projections, the classifier.
fn resnet20_shapes() -> Vec<Vec<usize>> {
    let mut shapes = vec![vec![16, 3, 3, 3]];
    let mut bn = vec![16];
    let mut c_in = 16;
    for c in [16, 32, 64] {
        for block in 0..3 {
            shapes.push(vec![c, c_in, 3, 3]);
            shapes.push(vec![c, c, 3, 3]);
            bn.extend([c, c]);
            if block == 0 && c != c_in {
                shapes.push(vec![c, c_in, 1, 1]);
                bn.push(c);
            }
            c_in = c;
        }
    }
    shapes.extend([vec![10, 64], vec![10]]);
    for c in bn {
        shapes.extend([vec![c], vec![c]]);
    }
    shapes
}

/// Host time of `DataParallel::sync_gradients` of ResNet-20's parameters against one bare
/// all-reduce of as many values, each call timed alone (its gradients made before, the device
/// drained after), median of `BATCHES × CALLS` calls; and their driver calls.
fn sync_row(comm: &std::sync::Arc<dyn Collective>, dev: &Device, json: bool) -> Result<()> {
    let vars: Vec<(String, Var)> = resnet20_shapes()
        .into_iter()
        .enumerate()
        .map(|(i, s)| Ok((format!("p{i}"), Var::randn(0f32, 1f32, s, dev)?)))
        .collect::<Result<_>>()?;
    let total: usize = vars.iter().map(|(_, v)| v.elem_count()).sum();
    let dp = DataParallel::from_vars(vars.clone(), vars.clone(), comm.clone())?;
    let grads = || -> Result<candle_core::backprop::GradStore> {
        let mut loss = vars[0].1.as_tensor().sum_all()?;
        for (_, v) in &vars[1..] {
            loss = (loss + v.as_tensor().sum_all()?)?;
        }
        Ok(loss.backward()?)
    };
    let flat = Tensor::randn(0f32, 1f32, total, dev)?;
    let (mut sync_t, mut bare_t) = (Vec::new(), Vec::new());
    for i in 0..BATCHES * CALLS + 5 {
        let g = grads()?;
        dev.synchronize()?;
        let t = Instant::now();
        dp.sync_gradients(g)?;
        let sync = t.elapsed().as_secs_f64();
        dev.synchronize()?;
        let t = Instant::now();
        comm.all_reduce(&flat, ReduceOp::Avg)?;
        let bare = t.elapsed().as_secs_f64();
        dev.synchronize()?;
        if i >= 5 {
            sync_t.push(sync);
            bare_t.push(bare);
        }
    }
    let g = grads()?;
    let mut g = Some(g);
    let sync_calls = driver_calls(dev, &mut || {
        dp.sync_gradients(g.take().expect("one call"))?;
        Ok(())
    })?;
    let bare_calls = driver_calls(dev, &mut || {
        comm.all_reduce(&flat, ReduceOp::Avg)?;
        Ok(())
    })?;
    let (a, b) = (median(sync_t), median(bare_t));
    if json {
        println!(
            "{}",
            serde_json::json!({
                "bench": "host_sync", "variables": vars.len(), "values": total,
                "sync_gradients_us": us(a), "all_reduce_us": us(b),
            })
        );
        return Ok(());
    }
    println!(
        "\n| parameters | sync_gradients µs | one all_reduce µs | ratio | driver calls: sync_gradients | all_reduce |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| ResNet-20: {} variables, {total} values | {:.1} | {:.1} | {:.2}× | {} | {} |",
        vars.len(),
        a * 1e6,
        b * 1e6,
        a / b,
        describe(sync_calls),
        describe(bare_calls)
    );
    Ok(())
}

/// Seconds as µs to one decimal.
fn us(s: f64) -> f64 {
    (s * 1e7).round() / 10.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let skip = std::env::var("GPU_SIM_SKIP_KERNELS").is_ok_and(|v| v == "1");
    let json = std::env::args().skip(1).any(|a| a == "--json");
    let nccl = NcclGroup::new(&[0])?.remove(0);
    let dev = nccl.device();
    let comm: std::sync::Arc<dyn Collective> = nccl;
    if !json {
        println!(
            "host time per call (median of {BATCHES} batches of {CALLS} calls){}",
            if skip {
                ", simulated GPU, kernels skipped"
            } else {
                ""
            }
        );
        println!(
        "| shape | what | SyncBatchNorm µs | candle-nn BatchNorm µs | ratio | driver calls (launches / allocations / memsets and device copies / events): SyncBatchNorm | candle-nn |"
    );
        println!("|---|---|---|---|---|---|---|");
    }
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
            let mut calls = [None, None];
            for batch in 0..BATCHES + 2 {
                for ((layer, t), count) in layers.iter().zip(times.iter_mut()).zip(&mut calls) {
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
                    } else if batch == 2 {
                        *count = driver_calls(&dev, &mut f)?;
                    }
                }
            }
            let [a, b] = times.map(median);
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "bench": "host_layer", "shape": [n, c, h, w], "what": what,
                        "sync_batch_norm_us": us(a), "candle_nn_us": us(b),
                    })
                );
                continue;
            }
            println!(
                "| {n}×{c}×{h}×{w} | {what} | {:.1} | {:.1} | {:.2}× | {} | {} |",
                a * 1e6,
                b * 1e6,
                a / b,
                describe(calls[0]),
                describe(calls[1])
            );
        }
    }
    sync_row(&comm, &dev, json)
}
