//! The CPU tests' computations on `Device::Cuda(0)`, compared with the CPU path on the same
//! inputs: every functional op, forward and backward, and the layer through candle's autograd
//! (one rank, and two thread ranks with an empty one sharing the GPU); f32, f64, f16, bf16;
//! NCHW and NHWC; C = 1, 3, 65, 2048; an empty batch; sizes that take the grid-split path.
//!
//! Needs an NVIDIA GPU: `cargo test --release --features cuda --test cuda` (see the README).
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::{Collective, ThreadGroup};
use candle_distributed::ops;
use candle_distributed::{sync_batch_norm, SyncBatchNorm, SyncBatchNormConfig};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use common::{assert_close_rel, layout_of, randn, split_batch, tol};

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Shapes `(N, C, *)` (read as `(N, *, C)` for channels-last): C = 1 with a large batch (grid
/// split), odd sizes, C = 65 (not a multiple of 32), C = 2048, an empty batch.
const SHAPES: [&[usize]; 6] = [
    &[64, 1, 96, 96],
    &[4, 3, 5, 7],
    &[2, 65, 9],
    &[3, 2048, 2, 2],
    &[0, 8, 4, 4],
    &[512, 16],
];

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda.rs needs CUDA device 0")
}

fn on(t: &Tensor, dev: &Device) -> Tensor {
    t.to_device(dev).unwrap()
}

/// Every functional op on the GPU against the CPU op, each fed the CPU's inputs.
#[test]
fn functional_ops_match_the_cpu() {
    let dev = gpu();
    for dtype in DTYPES {
        for (k, dims) in SHAPES.iter().enumerate() {
            for cl in [false, true] {
                ops_match_on(&dev, dtype, dims, cl, 100 * k as u64);
            }
        }
    }
}

/// `f` on the CPU and on `dev` (each moving the CPU's inputs to its device), compared with
/// tolerance `t`; returns the CPU's result, the input of the next op on both sides.
fn on_both(what: &str, dev: &Device, t: f64, f: impl Fn(&Device) -> Tensor) -> Tensor {
    let want = f(&Device::Cpu);
    assert_close_rel(what, &f(dev), &want, t);
    want
}

/// Statistics, gather, apply and both backward passes of one shape on `dev` against the CPU.
fn ops_match_on(dev: &Device, dtype: DType, dims: &[usize], cl: bool, seed: u64) {
    let c = if cl { dims[dims.len() - 1] } else { dims[1] };
    let what = format!("{dtype:?} {dims:?} channels_last={cl}");
    let x = randn(seed, dims, 3.0, 2.0).to_dtype(dtype).unwrap();
    let z = randn(seed + 1, dims, 0.0, 1.0).to_dtype(dtype).unwrap();
    let dy = randn(seed + 2, dims, 0.0, 1.0).to_dtype(dtype).unwrap();
    let shift = randn(seed + 3, &[c], 3.0, 0.5);
    let w = randn(seed + 4, &[c], 1.0, 0.25);
    let b = randn(seed + 5, &[c], 0.0, 0.25);
    let t = tol::gpu_vs_cpu(dtype);
    let sums = on_both(&format!("stats {what}"), dev, t, |d| {
        ops::batch_norm_stats(&on(&x, d), &on(&shift, d), layout_of(cl)).unwrap()
    });
    let count = sums.get(0).unwrap().get(0).unwrap();
    if count.to_scalar::<f64>().unwrap() <= 1.0 {
        return;
    }
    let gather = |d: &Device| ops::batch_norm_gather_stats(&on(&sums, d), &on(&shift, d), 1e-5);
    let (st, st_gpu) = (gather(&Device::Cpu).unwrap(), gather(dev).unwrap());
    assert_close_rel(
        &format!("gather mean {what}"),
        &st_gpu.mean,
        &st.mean,
        1e-12,
    );
    assert_close_rel(
        &format!("gather invstd {what}"),
        &st_gpu.invstd,
        &st.invstd,
        1e-12,
    );
    let (mean, invstd) = (&st.mean, &st.invstd);
    let y = on_both(&format!("elemt {what}"), dev, t, |d| {
        let (w, b, z) = (on(&w, d), on(&b, d), on(&z, d));
        let (m, i) = (on(mean, d), on(invstd, d));
        ops::batch_norm_elemt(
            &on(&x, d),
            &m,
            &i,
            ops::ElemtConfig {
                weight: Some(&w),
                bias: Some(&b),
                residual: Some(&z),
                relu: true,
                layout: layout_of(cl),
            },
        )
        .unwrap()
    });
    let red = on_both(&format!("backward_reduce {what}"), dev, t, |d| {
        let (dy, x, m, y) = (on(&dy, d), on(&x, d), on(mean, d), on(&y, d));
        ops::batch_norm_backward_reduce(&dy, &x, &m, Some(&y), layout_of(cl)).unwrap()
    });
    let elemt = |d: &Device| {
        let (dy, x, y, w) = (on(&dy, d), on(&x, d), on(&y, d), on(&w, d));
        let (m, i, red, n) = (on(mean, d), on(invstd, d), on(&red, d), on(&st.count, d));
        let (dx, dz) = ops::batch_norm_backward_elemt(
            &dy,
            &x,
            &m,
            &i,
            &red,
            &n,
            ops::BackwardElemtConfig {
                weight: Some(&w),
                relu_output: Some(&y),
                want_dz: true,
                layout: layout_of(cl),
            },
        )
        .unwrap();
        (dx, dz.unwrap())
    };
    let ((dx, dz), (dx_gpu, dz_gpu)) = (elemt(&Device::Cpu), elemt(dev));
    assert_close_rel(&format!("backward_elemt dx {what}"), &dx_gpu, &dx, t);
    assert_close_rel(&format!("backward_elemt dz {what}"), &dz_gpu, &dz, t);
}

/// A layer on `dev` with parameters γ, β given by `seed`, over `comm`.
fn layer(
    c: usize,
    config: SyncBatchNormConfig,
    comm: Arc<dyn Collective>,
    dev: &Device,
    seed: u64,
) -> (SyncBatchNorm, VarMap) {
    let vm = VarMap::new();
    {
        let mut data = vm.data().lock().unwrap();
        for (i, name) in ["weight", "bias"].into_iter().enumerate() {
            let t = randn(seed + i as u64, &[c], 1.0 - i as f64, 0.25).to_dtype(DType::F32);
            let t = t.unwrap().to_device(dev).unwrap();
            data.insert(name.to_string(), Var::from_tensor(&t).unwrap());
        }
    }
    let vb = VarBuilder::from_varmap(&vm, DType::F32, dev);
    (sync_batch_norm(c, config, vb, comm).unwrap(), vm)
}

/// Outputs and gradients of `STEPS` training steps then one eval step of a layer on `dev` that
/// rank `rank` of `comm` feeds with its slice of the global batch.
fn train_steps(
    dev: &Device,
    comm: Arc<dyn Collective>,
    batches: &[usize],
    dims: &[usize],
    config: SyncBatchNormConfig,
    dtype: DType,
) -> Vec<Tensor> {
    const STEPS: u64 = 3;
    let rank = comm.rank();
    let cl = config.layout.is_channels_last();
    let c = if cl { dims[dims.len() - 1] } else { dims[1] };
    let (bn, vm) = layer(c, config, comm, dev, 7);
    let mut out = Vec::new();
    for step in 0..STEPS {
        let mut global = dims.to_vec();
        global[0] = batches.iter().sum();
        let mine = |seed: u64, mean: f64| {
            let t = randn(seed + 10 * step, &global, mean, 2.0)
                .to_dtype(dtype)
                .unwrap();
            on(&split_batch(&t, batches)[rank], dev)
        };
        let x = Var::from_tensor(&mine(1, 5.0)).unwrap();
        let z = Var::from_tensor(&mine(2, 0.0)).unwrap();
        let w = mine(3, 0.0);
        let y = bn
            .forward_residual(x.as_tensor(), z.as_tensor(), true)
            .unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * w.to_dtype(DType::F32).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        out.push(y);
        out.push(grads.get(x.as_tensor()).unwrap().clone());
        out.push(grads.get(z.as_tensor()).unwrap().clone());
        for name in ["weight", "bias"] {
            let v = common::var(&vm, name);
            out.push(grads.get(v.as_tensor()).unwrap().copy().unwrap());
        }
    }
    out.push(bn.running_mean().unwrap().copy().unwrap());
    out.push(bn.running_var().unwrap().copy().unwrap());
    let x = randn(99, dims, 5.0, 2.0).to_dtype(dtype).unwrap();
    out.push(bn.forward_t(&on(&x, dev), false).unwrap());
    out
}

/// The layer trained on the GPU takes the same steps as on the CPU: outputs, dx, dz, dγ, dβ,
/// running statistics, then eval outputs; both layouts, all dtypes.
#[test]
fn layer_training_matches_the_cpu() {
    let dev = gpu();
    for dtype in DTYPES {
        for (dims, cl) in [(&[6usize, 5, 4, 3][..], false), (&[6, 4, 3, 65][..], true)] {
            let config = SyncBatchNormConfig::default()
                .with_layout(layout_of(cl))
                .with_fuse_relu(true);
            let run = |d: &Device| {
                ThreadGroup::run(1, |comm| {
                    Ok(train_steps(d, comm, &[dims[0]], dims, config, dtype))
                })
                .unwrap()
                .remove(0)
            };
            let (g, c) = (run(&dev), run(&Device::Cpu));
            for (i, (g, c)) in g.iter().zip(&c).enumerate() {
                // Parameter gradients are sums over the batch: f32 accumulation both sides.
                assert_close_rel(
                    &format!("{dtype:?} {dims:?} output {i}"),
                    g,
                    c,
                    tol::gpu_vs_cpu(dtype).max(1e-4),
                );
            }
        }
    }
}

/// Two thread ranks sharing the GPU, one of them with an empty batch, against the same on the
/// CPU: the collectives and the empty-rank path on device tensors.
#[test]
fn two_ranks_with_an_empty_one_match_the_cpu() {
    let dev = gpu();
    let dims = [5usize, 3, 4, 4];
    let config = SyncBatchNormConfig::default();
    let batches = [5usize, 0];
    let run = |d: &Device| {
        ThreadGroup::run(2, |comm| {
            Ok(train_steps(d, comm, &batches, &dims, config, DType::F32))
        })
        .unwrap()
    };
    let (g, c) = (run(&dev), run(&Device::Cpu));
    for (rank, (g, c)) in g.iter().zip(&c).enumerate() {
        for (i, (g, c)) in g.iter().zip(c).enumerate() {
            assert_close_rel(&format!("rank {rank} output {i}"), g, c, 1e-4);
        }
    }
}

/// A global batch of one value per channel cannot be normalised. On the GPU, where checking
/// would wait for the device, the output is NaN and the running statistics stay untouched.
#[test]
fn one_value_per_channel_gives_nan_and_keeps_running_stats() {
    let dev = gpu();
    ThreadGroup::run(1, |comm| {
        let (bn, _vm) = layer(3, SyncBatchNormConfig::default(), comm, &dev, 1);
        let before = bn.running_var().unwrap().to_vec1::<f32>()?;
        let x = on(&randn(5, &[1, 3], 1.0, 1.0).to_dtype(DType::F32)?, &dev);
        let y = bn.forward_t(&x, true)?.to_vec2::<f32>()?;
        assert!(y[0].iter().all(|v| v.is_nan()), "got {y:?}");
        assert_eq!(bn.running_var().unwrap().to_vec1::<f32>()?, before);
        Ok(())
    })
    .unwrap();
}
