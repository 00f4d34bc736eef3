//! Bandwidth of the CUDA kernels against a device-to-device copy measured in the same run, at
//! the batch-norm sizes of ResNet-50 (per-GPU batch 32), NCHW and NHWC, f32 and bf16.
//!
//! ```text
//! CUDA_COMPUTE_CAP=90 cargo run --release --features cuda --example gpu_bench
//! ```
//!
//! Forward = local statistics + finalize + normalisation (3 element accesses: x read twice, y
//! written); backward = backward reduce + backward element-wise (5: dy and x read twice, dx
//! written). The collectives are left out (one rank): they move `3·C` and `2·C` f64 values,
//! not activations. GB/s counts those accesses; "of copy" divides by the copy's GB/s (2 accesses
//! per element) measured on the same tensor.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_distributed::{ops, ChannelLayout};

/// `(C, H·W)` of ResNet-50's batch-norm layers: stem, then one per stage.
const SIZES: [(usize, usize); 5] = [
    (64, 112 * 112),
    (256, 56 * 56),
    (512, 28 * 28),
    (1024, 14 * 14),
    (2048, 7 * 7),
];
const BATCH: usize = 32;
const WARMUP: usize = 5;
const ITERS: usize = 50;

/// Seconds per call of `f`, after warm-up, with the device synchronised around the timing.
fn time(dev: &Device, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..ITERS {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / ITERS as f64)
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    println!(
        "| layout | dtype | C × H·W | copy GB/s | fwd GB/s | fwd / copy | bwd GB/s | bwd / copy |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for layout in [ChannelLayout::ChannelsFirst, ChannelLayout::ChannelsLast] {
        let cl = layout.is_channels_last();
        for dtype in [DType::F32, DType::BF16] {
            for (c, hw) in SIZES {
                let dims: Vec<usize> = if cl {
                    vec![BATCH, hw, c]
                } else {
                    vec![BATCH, c, hw]
                };
                let x = Tensor::randn(3f32, 2f32, dims.as_slice(), &dev)?.to_dtype(dtype)?;
                let dy = Tensor::randn(0f32, 1f32, dims.as_slice(), &dev)?.to_dtype(dtype)?;
                let shift = Tensor::zeros(c, DType::F64, &dev)?;
                let weight = Tensor::ones(c, DType::F32, &dev)?;
                let bias = Tensor::zeros(c, DType::F32, &dev)?;
                let bytes = (x.elem_count() * dtype.size_in_bytes()) as f64;

                let copy = time(&dev, || {
                    x.copy()?;
                    Ok(())
                })?;
                let sums = ops::batch_norm_stats(&x, &shift, layout)?;
                let st = ops::batch_norm_gather_stats(&sums, &shift, 1e-5)?;
                let fwd = time(&dev, || {
                    let sums = ops::batch_norm_stats(&x, &shift, layout)?;
                    let st = ops::batch_norm_gather_stats(&sums, &shift, 1e-5)?;
                    let y = ops::batch_norm_elemt(
                        &x,
                        &st.mean,
                        &st.invstd,
                        ops::ElemtConfig {
                            weight: Some(&weight),
                            bias: Some(&bias),
                            layout,
                            ..Default::default()
                        },
                    )?;
                    drop(y);
                    Ok(())
                })?;
                let bwd = time(&dev, || {
                    let red = ops::batch_norm_backward_reduce(&dy, &x, &st.mean, None, layout)?;
                    let (dx, _) = ops::batch_norm_backward_elemt(
                        &dy,
                        &x,
                        &st.mean,
                        &st.invstd,
                        &red,
                        &st.count,
                        ops::BackwardElemtConfig {
                            weight: Some(&weight),
                            layout,
                            ..Default::default()
                        },
                    )?;
                    drop(dx);
                    Ok(())
                })?;
                let gbs = |accesses: f64, t: f64| accesses * bytes / t / 1e9;
                let (copy_gbs, fwd_gbs, bwd_gbs) = (gbs(2.0, copy), gbs(3.0, fwd), gbs(5.0, bwd));
                println!(
                    "| {} | {dtype:?} | {c} × {hw} | {copy_gbs:.0} | {fwd_gbs:.0} | {:.0} % | {bwd_gbs:.0} | {:.0} % |",
                    if cl { "NHWC" } else { "NCHW" },
                    100.0 * fwd_gbs / copy_gbs,
                    100.0 * bwd_gbs / copy_gbs,
                );
            }
        }
    }
    Ok(())
}
