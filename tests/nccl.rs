//! The NCCL backend on every visible GPU (world size = GPU count; NCCL allows one rank per GPU):
//! collective values, process groups, SyncBatchNorm across GPUs against single-process batch norm
//! on the CPU, the bootstrap over another communicator, and the fault paths: the watchdog's
//! timeout, a start-up whose peer never arrives, a started collective aborted before its
//! `wait`, a drop with a collective that cannot finish, and SyncBatchNorm's rollback after a
//! step whose all-reduce was aborted. (The ones that need a real peer skip on one GPU.)
//!
//! `cargo test --release --features nccl --test nccl` on a machine with NVIDIA GPUs and NCCL.
#![cfg(feature = "nccl")]

#[allow(dead_code)]
#[path = "../examples/resnet/check.rs"]
mod check;
#[allow(dead_code)]
#[path = "../examples/resnet/checkpoint.rs"]
mod checkpoint;
mod common;
#[allow(dead_code)]
#[path = "../examples/resnet/config.rs"]
mod config;

#[path = "../examples/resnet/data.rs"]
mod data;
#[allow(dead_code)]
#[path = "../examples/resnet/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../examples/resnet/report.rs"]
mod report;
#[allow(dead_code)]
#[path = "../examples/resnet/state.rs"]
mod state;

#[path = "../examples/resnet/train.rs"]
mod train;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use candle_core::cuda_backend::cudarc::driver::CudaContext;
use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::{
    AllReduce, Checked, Collective, CollectiveError, NcclCollective, NcclGroup, Pending, ReduceOp,
    ThreadGroup,
};
use candle_distributed::parallel::ParallelMode;
use candle_distributed::{sync_batch_norm, DataParallel, GradHooks, SyncBatchNormConfig};
use candle_nn::{Module, ModuleT, VarBuilder, VarMap};
use common::*;

/// Relative tolerance of an `Avg` all-reduce of small whole numbers against sum / n, for f32,
/// f64, f16 and bf16, when n is not a power of two: NCCL rounds 1/n and each product to the
/// type (a few units in the last place of each).
const AVG_TOL: [f32; 4] = [1e-6, 1e-6, 4e-3, 3e-2];

fn gpus() -> usize {
    let n = CudaContext::device_count().expect("the CUDA driver") as usize;
    assert!(n >= 1, "tests/nccl.rs needs at least one GPU");
    n
}

/// Runs `f` on one thread per communicator, results in rank order.
fn on_ranks<R: Send>(
    comms: Vec<Arc<NcclCollective>>,
    f: impl Fn(Arc<NcclCollective>) -> Result<R> + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    })
}

#[test]
fn collectives_on_every_gpu() {
    let n = gpus();
    let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
    let outs = on_ranks(comms, |c| {
        let dev = c.device();
        let r = c.rank() as f32;
        let t = Tensor::new(&[r + 1.0, -r], &dev)?;
        let mut got = Vec::new();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                let v = c.all_reduce(&t.to_dtype(dtype)?, op)?;
                assert_eq!(v.dtype(), dtype);
                got.push(v.to_dtype(DType::F32)?.to_vec1::<f32>()?);
            }
        }
        // Built on the CPU and moved: candle's CUDA fill rejects empty tensors (rank 0's).
        let rows = on(&dev, &Tensor::full(r, (c.rank() % 3, 2), &Device::Cpu)?);
        let gathered = c.all_gather(&rows)?.to_device(&Device::Cpu)?;
        let big = Tensor::arange(0f32, (2 * n) as f32, &dev)?.reshape((2 * n, 1))?;
        let scattered = c.reduce_scatter(&big, ReduceOp::Sum)?.to_vec2::<f32>()?;
        let b = c
            .broadcast(&Tensor::new(&[r * 3.0], &dev)?, n - 1)?
            .to_vec1::<f32>()?;
        c.barrier()?;
        // Asynchronous (side stream): the same sum, with a synchronous call in between.
        let pending = c.start_all_reduce(std::slice::from_ref(&t), ReduceOp::Sum.into())?;
        let _ = c.all_reduce(&t, ReduceOp::Max)?;
        got.push(pending.wait()?.to_vec1::<f32>()?);
        Ok((got, gathered, scattered, b))
    });
    let nf = n as f32;
    let sum = [nf * (nf + 1.0) / 2.0, -nf * (nf - 1.0) / 2.0];
    for (rank, (got, gathered, scattered, b)) in outs.into_iter().enumerate() {
        for (i, want) in [sum, [sum[0] / nf, sum[1] / nf], [nf, 0.0], [1.0, 1.0 - nf]]
            .iter()
            .enumerate()
        {
            for (v, tol) in got[4 * i..4 * i + 4].iter().zip(AVG_TOL) {
                if i == 1 && !n.is_power_of_two() {
                    // NCCL's average is a pre-multiplied sum (each value times 1/n rounded
                    // to the type): exact only where 1/n is (1, 2, 4, 8 GPUs, compared
                    // exactly below).
                    for (a, b) in v.iter().zip(want) {
                        assert!(
                            (a - b).abs() <= tol * b.abs().max(1.0),
                            "rank {rank} avg {v:?} {want:?}"
                        );
                    }
                } else {
                    assert_eq!(v, want, "rank {rank} op {i}");
                }
            }
        }
        assert_eq!(got[16], sum, "rank {rank} async all_reduce");
        let rows: usize = (0..n).map(|r| r % 3).sum();
        assert_eq!(gathered.dims(), [rows, 2]);
        let want_scatter = vec![
            vec![nf * (2 * rank) as f32],
            vec![nf * (2 * rank + 1) as f32],
        ];
        assert_eq!(scattered, want_scatter);
        assert_eq!(b, vec![(n - 1) as f32 * 3.0]);
    }
}

/// The contract every backend passes (`tests/common/conformance.rs`: values of every op and
/// dtype, bitwise identical results, reduce-scatter, unequal all-gathers, broadcast, wire
/// dtypes, asynchronous calls, split and new_group) on the first 4 GPUs (2 on a machine with 2
/// or 3; skipped on one), a fresh group of communicators for each check.
#[test]
fn the_backend_contract_holds() {
    let n = match gpus() {
        1 => return eprintln!("skipped: the contract needs at least 2 GPUs"),
        2 | 3 => 2,
        _ => 4,
    };
    conformance::run_suite("NCCL", true, |check| {
        let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>())?;
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let rank = c.rank();
                        let c: Arc<dyn Collective> = c;
                        check(&c).map_err(|e| anyhow::anyhow!("rank {rank}: {e:?}"))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Result<Vec<()>>>()
        })?;
        Ok(())
    })
    .unwrap();
}

/// SyncBatchNorm with one rank per GPU, unequal and empty per-rank batches, against the CPU
/// reference over the concatenated batch (f32 on the GPU: f32 rounding tolerance).
#[test]
fn sync_batch_norm_across_gpus_matches_one_process() {
    const TOL_F32: f64 = 1e-4;
    let n = gpus();
    // Rank 0 always has 3 rows, so the global batch can be normalised whatever n is.
    let batches: Vec<usize> = (0..n).map(|r| [3, 0, 5, 2][r % 4]).collect();
    let c = 6;
    let x = randn(3, &[batches.iter().sum(), c, 4, 5], 3.0, 2.0);
    let pieces = split_batch(&x, &batches);
    let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
    let outs = on_ranks(comms, |comm| {
        let dev = comm.device();
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let bn = sync_batch_norm(
            c,
            SyncBatchNormConfig::default(),
            vb,
            comm.clone() as Arc<dyn Collective>,
        )?;
        let xr = pieces[comm.rank()].to_dtype(DType::F32)?.to_device(&dev)?;
        let y = bn.forward_t(&xr, true)?;
        Ok((
            y.to_device(&Device::Cpu)?,
            bn.running_var().unwrap().to_device(&Device::Cpu)?,
        ))
    });
    let (want, _, var) = reference_bn(&x, None, None, None, false, 1e-5);
    let want = split_batch(&want, &batches);
    let m = x.elem_count() / c;
    let unbiased = (((var * (m as f64 / (m as f64 - 1.0))).unwrap() * 0.1).unwrap() + 0.9).unwrap();
    for (r, (y, rv)) in outs.iter().enumerate() {
        assert_close(&format!("rank {r} output"), y, &want[r], TOL_F32);
        assert_close(&format!("rank {r} running var"), rv, &unbiased, TOL_F32);
    }
}

/// SyncBatchNorm over NCCL in both layouts and in f32, f16 and bf16, forward and backward
/// through `loss.backward()`, with unequal and empty per-rank batches, against f64 autograd of
/// the reference batch norm over the concatenated batch (inputs rounded to the dtype first).
/// The f32 cases add the fused residual + ReLU (16-bit rounding would flip the ReLU's mask
/// near zero, where the gradient jumps).
#[test]
fn sync_batch_norm_over_nccl_in_every_layout_and_dtype() {
    let n = gpus();
    let batches: Vec<usize> = (0..n).map(|r| [3, 0, 5, 2][r % 4]).collect();
    let c = 5;
    let total: usize = batches.iter().sum();
    for channels_last in [false, true] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let fused = dtype == DType::F32;
            let what = format!("{} {dtype:?}", if channels_last { "NHWC" } else { "NCHW" });
            let round = |t: Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F64).unwrap();
            let x = round(randn(21, &[total, c, 3, 4], 3.0, 2.0));
            let z = round(randn(22, &[total, c, 3, 4], 0.0, 1.0));
            let w = round(randn(23, &[total, c, 3, 4], 0.0, 1.0));
            let (xs, zs, ws) = (
                split_batch(&x, &batches),
                split_batch(&z, &batches),
                split_batch(&w, &batches),
            );
            // The layer's layout: channels-last tensors are (N, H, W, C).
            let to_layer = |t: &Tensor| {
                let t = if channels_last {
                    to_channels_last(t)
                } else {
                    t.clone()
                };
                t.to_dtype(dtype).unwrap()
            };
            let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
            let outs = on_ranks(comms, |comm| {
                let dev = comm.device();
                let r = comm.rank();
                let vb = VarBuilder::from_varmap(&VarMap::new(), dtype, &dev);
                let cfg = SyncBatchNormConfig::default()
                    .with_layout(layout_of(channels_last))
                    .with_fuse_relu(fused);
                let bn = sync_batch_norm(c, cfg, vb, comm.clone() as Arc<dyn Collective>)?;
                let xv = candle_core::Var::from_tensor(&on(&dev, &to_layer(&xs[r])))?;
                let y = if fused {
                    bn.forward_residual(xv.as_tensor(), &on(&dev, &to_layer(&zs[r])), true)?
                } else {
                    bn.forward_t(xv.as_tensor(), true)?
                };
                let grads = weighted_sum(&y, &on(&dev, &to_layer(&ws[r])))?.backward()?;
                let dx = match grads.get(xv.as_tensor()) {
                    Some(g) => cpu(g),
                    None => xv.as_tensor().zeros_like()?.to_device(&Device::Cpu)?,
                };
                Ok((cpu(&y), dx))
            });
            // The reference: f64 autograd over the concatenated batch.
            let xv = candle_core::Var::from_tensor(&x).unwrap();
            let zr = fused.then_some(&z);
            let (want, _, _) = reference_bn(xv.as_tensor(), None, None, zr, fused, 1e-5);
            let dwant = weighted_sum(&want, &w).unwrap().backward().unwrap();
            let dwant = dwant.get(xv.as_tensor()).unwrap().clone();
            let (want, dwant) = (split_batch(&want, &batches), split_batch(&dwant, &batches));
            let tol = tol::gpu_vs_cpu(dtype);
            for (r, (y, dx)) in outs.iter().enumerate() {
                let back = |t: &Tensor| {
                    if channels_last {
                        to_channels_first(t)
                    } else {
                        t.clone()
                    }
                };
                assert_close_rel(&format!("{what} rank {r} output"), &back(y), &want[r], tol);
                assert_close_rel(&format!("{what} rank {r} dx"), &back(dx), &dwant[r], tol);
            }
        }
    }
}

/// The tensor-parallel layers over NCCL, one rank per GPU: the sharded MLP of
/// `tests/parallel.rs` (`common::mlp`, f64) in both modes, whose backward starts its
/// all-reduce or reduce-scatter asynchronously on NCCL's side stream; then the async
/// all-gather and reduce-scatter by value, each with a synchronous collective in between.
#[test]
fn parallel_layers_and_async_collectives_over_nccl() {
    let n = gpus();
    let p = common::mlp::problem(n);
    for mode in [ParallelMode::AllReduce, ParallelMode::ReduceScatter] {
        let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
        let outs = on_ranks(comms, |c| {
            let dev = c.device();
            common::mlp::rank(&p, mode, c as Arc<dyn Collective>, &dev)
        });
        common::mlp::check(&p, mode, &outs);
    }
    let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
    let outs = on_ranks(comms, |c| {
        let dev = c.device();
        let r = c.rank() as f32;
        let row = Tensor::new(&[[r, -r]], &dev)?;
        let gather = c.all_gather_async(&row)?;
        let _ = c.all_reduce(&row, ReduceOp::Sum)?;
        let big = Tensor::arange(0f32, (2 * n) as f32, &dev)?.reshape((2 * n, 1))?;
        let scatter = c.reduce_scatter_async(&(big * (r as f64 + 1.0))?, ReduceOp::Sum)?;
        let _ = c.all_reduce(&row, ReduceOp::Max)?;
        Ok((
            gather.wait()?.to_vec2::<f32>()?,
            scatter.wait()?.to_vec2::<f32>()?,
        ))
    });
    // Σ_r (r + 1) = n(n + 1)/2 times rows 2·rank and 2·rank + 1 of arange(2n).
    let weight = (n * (n + 1) / 2) as f32;
    for (rank, (gathered, scattered)) in outs.into_iter().enumerate() {
        let want: Vec<Vec<f32>> = (0..n).map(|q| vec![q as f32, -(q as f32)]).collect();
        assert_eq!(gathered, want, "rank {rank} all_gather_async");
        let want = vec![
            vec![weight * (2 * rank) as f32],
            vec![weight * (2 * rank + 1) as f32],
        ];
        assert_eq!(scattered, want, "rank {rank} reduce_scatter_async");
    }
}

/// Tensor and data parallelism side by side, one rank per GPU: replicas of 2 ranks each
/// (`gpus() / 2` of them), the sharded MLP on each replica's data with `DataParallel` over
/// the replicas (`common::mlp`, f64), against the unsharded MLPs. Each rank's layers and its
/// `DataParallel` use two communicators split from one, on the same GPU: under
/// `GPU_SIM_NCCL_PROGRESS=device` (one collective at a time per GPU, in issue order) this
/// completes only because every rank issues them in the same order.
#[test]
fn parallel_layers_beside_data_parallel_over_nccl() {
    let n = gpus();
    if n < 4 || !n.is_multiple_of(2) {
        eprintln!("parallel_layers_beside_data_parallel_over_nccl: skipped, needs an even GPU count of at least 4");
        return;
    }
    let ps: Vec<_> = (0..n / 2)
        .map(|d| common::mlp::replica(2, d as u64))
        .collect();
    for mode in [ParallelMode::AllReduce, ParallelMode::ReduceScatter] {
        let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
        let outs = on_ranks(comms, |c| {
            let dev = c.device();
            common::mlp::rank_2d(&ps, mode, c as Arc<dyn Collective>, &dev)
        });
        common::mlp::check_data_parallel(&ps, mode, &common::mlp::by_replica(outs, 2));
    }
}

/// `DataParallel` over NCCL, one rank per GPU, with gradients missing on some ranks (the
/// presence flags ride along and are read back) and with the 16-bit wires: the 40 f32 variables
/// of `common::many_vars` in one bucket; each gradient must be the mean over all ranks (zero
/// where a rank has none), the variable no rank uses none; tolerance `tol::F32_OUT` in f32,
/// `tol::F16` / `tol::BF16` over the wires (relative).
#[test]
fn data_parallel_with_missing_gradients_and_16_bit_wires_over_nccl() {
    use common::many_vars;
    let n = gpus();
    for (wire, tol) in [
        (None, tol::F32_OUT),
        (Some(DType::F16), tol::F16),
        (Some(DType::BF16), tol::BF16),
    ] {
        let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
        let outs = on_ranks(comms, |c| {
            let (r, dev) = (c.rank(), c.device());
            let vars = many_vars::vars(DType::F32, &dev)?;
            let dp = DataParallel::from_vars(vars.clone(), vars.clone(), c as Arc<dyn Collective>)?
                .with_wire_dtype(wire)?;
            let grads = dp.sync_gradients(many_vars::loss(&vars, r)?.backward()?)?;
            Ok(vars
                .iter()
                .map(|(_, v)| {
                    (grads.get(v.as_tensor()))
                        .map(|g| g.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap())
                })
                .collect::<Vec<_>>())
        });
        many_vars::check(&format!("wire {wire:?}"), &outs, n, tol);
    }
}

/// `DataParallel`'s overlapped backward over NCCL (each bucket's all-reduce started on NCCL's
/// side stream from the gradient hooks, while the backward runs on the GPU's stream): the same
/// gradients, bit for bit, as `loss.backward()` + `sync_gradients` on a twin model, in f32 and
/// over the bf16 wire, one bucket per variable; from the second backward on, every bucket starts
/// inside the backward.
#[test]
fn overlapped_backward_over_nccl_equals_the_synced_one() {
    let n = gpus();
    for wire in [None, Some(DType::BF16)] {
        let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
        let outs = on_ranks(comms, |c| {
            let dev = c.device();
            let comm = c as Arc<dyn Collective>;
            let build = |vb: VarBuilder| -> Result<(candle_nn::Linear, candle_nn::Linear)> {
                Ok((
                    candle_nn::linear(6, 5, vb.pp("a"))?,
                    candle_nn::linear(5, 3, vb.pp("b"))?,
                ))
            };
            let (vm_o, vm_p) = (VarMap::new(), VarMap::new());
            let hooks = GradHooks::new();
            let (a_o, b_o) = build(hooks.var_builder(&vm_o, DType::F32, &dev))?;
            let (a_p, b_p) = build(VarBuilder::from_varmap(&vm_p, DType::F32, &dev))?;
            for vm in [&vm_o, &vm_p] {
                for v in vm.data().lock().unwrap().values() {
                    let seed = v.elem_count() as u64;
                    v.set(
                        &randn(seed, v.dims(), 0.0, 0.5)
                            .to_dtype(DType::F32)?
                            .to_device(&dev)?,
                    )?;
                }
            }
            let dp_o = DataParallel::new(&vm_o, comm.clone())?
                .with_bucket_bytes(1)
                .with_wire_dtype(wire)?
                .with_overlap(&hooks)?;
            let dp_p = DataParallel::new(&vm_p, comm.clone())?
                .with_bucket_bytes(1)
                .with_wire_dtype(wire)?;
            let x = randn(40 + comm.rank() as u64, &[4, 6], 0.0, 1.0)
                .to_dtype(DType::F32)?
                .to_device(&dev)?;
            let loss = |a: &candle_nn::Linear, b: &candle_nn::Linear| -> Result<Tensor> {
                Ok(b.forward(&a.forward(&x)?.tanh()?)?.sqr()?.mean_all()?)
            };
            // The first overlapped backward learns the order and places (it starts nothing
            // inside the backward); the second is compared.
            dp_o.backward(&loss(&a_o, &b_o)?)?;
            dp_p.sync_gradients(loss(&a_p, &b_p)?.backward()?)?;
            dp_o.refresh()?;
            let g_o = dp_o.backward(&loss(&a_o, &b_o)?)?;
            let g_p = dp_p.sync_gradients(loss(&a_p, &b_p)?.backward()?)?;
            let mut both = Vec::new();
            for (vm, g) in [(&vm_o, &g_o), (&vm_p, &g_p)] {
                let data = vm.data().lock().unwrap();
                let mut names: Vec<&String> = data.keys().collect();
                names.sort();
                let flat: Vec<Vec<f32>> = names
                    .iter()
                    .map(|k| {
                        g.get(data[*k].as_tensor())
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                    })
                    .collect();
                both.push(flat);
            }
            Ok((both, dp_o.overlap_stats()))
        });
        for (rank, (both, stats)) in outs.iter().enumerate() {
            assert_eq!(
                both[0], both[1],
                "wire {wire:?}, rank {rank}: overlapped vs synced"
            );
            assert_eq!(
                (stats.buckets, stats.started_during_backward),
                (4, 4),
                "wire {wire:?}, rank {rank}: {stats:?}"
            );
        }
    }
}

/// A layer used on some ranks only, moving from step to step, in a model whose backward also
/// all-reduces in SyncBatchNorm and a tensor-parallel layer (`common::overlap::routed_steps`),
/// one bucket per variable, over NCCL: the overlapped gradients equal `sync_gradients`' bit for
/// bit at every step. Run by `scripts/test-gpu-sim.sh` with NCCL's progress shared and one
/// collective at a time per GPU (`GPU_SIM_NCCL_PROGRESS=device`): the buckets on NCCL's side
/// stream and the layers' collectives on the GPU's stream meet in the same order on every rank,
/// so neither mode can deadlock.
#[test]
fn a_layer_used_on_some_ranks_keeps_the_collectives_in_step() {
    let n = gpus();
    let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
    let outs = on_ranks(comms, |c| {
        let dev = c.device();
        common::overlap::routed_steps(c as Arc<dyn Collective>, &dev)
    });
    common::overlap::assert_routed("NCCL", &outs);
}

/// A tensor on another GPU than the communicator's is refused by name, on every kind of call,
/// and the communicator stays usable (nothing was enqueued).
#[test]
fn a_tensor_on_another_gpu_is_refused_by_name() {
    let n = gpus();
    if n < 2 {
        eprintln!("a_tensor_on_another_gpu_is_refused_by_name: skipped, needs 2 GPUs");
        return;
    }
    let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
    let devs: Vec<Device> = comms.iter().map(|c| c.device()).collect();
    let outs = on_ranks(comms, |c| {
        let other = &devs[(c.rank() + 1) % n];
        let t = Tensor::new(&[1f32, 2.0], other)?;
        let errs = [
            c.all_reduce(&t, ReduceOp::Sum).unwrap_err().to_string(),
            c.all_gather(&t).unwrap_err().to_string(),
            c.broadcast(&t, 0).unwrap_err().to_string(),
            c.start_all_reduce(std::slice::from_ref(&t), ReduceOp::Sum.into())
                .err()
                .unwrap()
                .to_string(),
        ];
        let ok = c.all_reduce(&Tensor::new(&[1f32], &c.device())?, ReduceOp::Sum)?;
        Ok((errs, ok.to_vec1::<f32>()?))
    });
    for (rank, (errs, ok)) in outs.into_iter().enumerate() {
        for e in errs {
            assert!(
                e.contains("tensor on Cuda") && e.contains("the communicator on Cuda"),
                "rank {rank}: {e}"
            );
        }
        assert_eq!(
            ok,
            vec![n as f32],
            "rank {rank}: the communicator after the refusals"
        );
    }
}

/// The ResNet example's `--backend nccl --check` (one rank per GPU, a thread each): DataParallel
/// over NCCL (the model check and the broadcast on the GPU), SyncBatchNorm over NCCL and the
/// example's metrics all-reduce, against one rank of plain batch norm on GPU 0, in f64; then a
/// short training run whose loss falls. On one GPU the world size is 1.
#[test]
fn resnet_example_checks_and_trains_over_nccl() {
    let n = gpus();
    let cfg = train::Config {
        arch: model::Arch::ResNet20,
        backend: "nccl".into(),
        device: train::DeviceKind::Cuda,
        world_size: n,
        batch_size: 4 * n,
        image_size: 8,
        train_size: 16 * n,
        val_size: 8,
        ..Default::default()
    };
    let diff = check::check(&cfg, 3, true).unwrap().max_abs;
    assert!(diff <= 1e-6, "largest parameter difference {diff:e}");
    let run = train::Config {
        epochs: 3,
        write_outputs: false,
        ..cfg
    };
    let s = train::run(&run).unwrap();
    let losses: Vec<f64> = s.epochs.iter().map(|m| m.train_loss).collect();
    assert!(losses[2] < losses[0], "training losses {losses:?}");
}

/// NCCL started over a ThreadGroup (as under mpirun, where MPI broadcasts the id).
#[test]
fn bootstrap_over_another_communicator() {
    let n = gpus();
    let sums = ThreadGroup::run(n, |boot| {
        let c = NcclCollective::from_collective(&*boot, boot.rank())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let t = Tensor::new(&[2f32], &c.device())?;
        c.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()
    })
    .unwrap();
    for s in sums {
        assert_eq!(s, vec![2.0 * n as f32]);
    }
}

/// A rank that skips a collective: the other's watchdog aborts the communicator after the
/// timeout and its next call fails with the reason, instead of hanging.
#[test]
fn a_missing_rank_aborts_after_the_timeout() {
    let n = gpus();
    if n < 2 {
        eprintln!("a_missing_rank_aborts_after_the_timeout: skipped, needs 2 GPUs (found {n})");
        return;
    }
    let comms = NcclGroup::with_timeout(&[0, 1], Duration::from_secs(2)).unwrap();
    let errs = on_ranks(comms, |c| {
        if c.rank() == 1 {
            return Ok(None);
        }
        let t = Tensor::new(&[1f32], &c.device())?;
        c.all_reduce(&t, ReduceOp::Sum)?;
        std::thread::sleep(Duration::from_secs(4));
        Ok(Some(
            c.all_reduce(&t, ReduceOp::Sum).unwrap_err().to_string(),
        ))
    });
    let e = errs[0].as_ref().unwrap();
    // Enqueued and never completed, or blocked inside NCCL on the host: either way aborted.
    assert!(e.contains("the communicator was aborted"), "{e}");
}

/// Rank 0 of a world of 2 whose rank 1 never exists: the broadcast of the NCCL id returns rank
/// 0's own (the bootstrap "works"), so NCCL's start-up itself waits for the missing peer.
#[derive(Debug)]
struct AloneOfTwo;

impl Collective for AloneOfTwo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        2
    }
    fn broadcast(&self, t: &Tensor, _root: usize) -> candle_core::Result<Tensor> {
        Ok(t.clone())
    }
    fn all_gather(&self, _: &Tensor) -> candle_core::Result<Tensor> {
        unreachable!("only the id broadcast is used")
    }
    fn barrier(&self) -> candle_core::Result<()> {
        unreachable!("only the id broadcast is used")
    }
    fn reduce_scatter(&self, _: &Tensor, _: ReduceOp) -> candle_core::Result<Tensor> {
        unreachable!("only the id broadcast is used")
    }
    fn start_all_reduce(&self, _: &[Tensor], _: AllReduce) -> candle_core::Result<Pending> {
        unreachable!("only the id broadcast is used")
    }
    fn all_gather_async(&self, _: &Tensor) -> candle_core::Result<Pending> {
        unreachable!("only the id broadcast is used")
    }
    fn reduce_scatter_async(&self, _: &Tensor, _: ReduceOp) -> candle_core::Result<Pending> {
        unreachable!("only the id broadcast is used")
    }
    fn split(&self, _: Option<u32>, _: u32) -> candle_core::Result<Option<Arc<dyn Collective>>> {
        unreachable!("only the id broadcast is used")
    }
}

/// `WORLD_SIZE=2` with one process: NCCL's start-up, polled under the timeout, fails with an
/// error naming it well before it could be mistaken for a hang (one GPU suffices).
#[test]
fn a_peer_missing_at_start_up_times_out() {
    gpus();
    let timeout = Duration::from_secs(3);
    let t0 = Instant::now();
    let err = NcclCollective::from_collective_with_timeout(&AloneOfTwo, 0, timeout).unwrap_err();
    let took = t0.elapsed();
    let msg = err.to_string();
    assert!(msg.contains("init") && msg.contains("within 3s"), "{msg}");
    assert!(
        took < timeout + Duration::from_secs(10),
        "the start-up took {took:?} with a {timeout:?} timeout"
    );
}

/// Rank 1 never joins: rank 0's started all-reduce is aborted by the watchdog, its `wait`
/// fails with the reason (it does not hand on a buffer NCCL never finished writing), `deferred_error`
/// reports it,
/// and the drop of the broken communicator returns at once.
#[test]
fn a_started_collective_aborted_by_the_watchdog_fails_its_wait() {
    let n = gpus();
    if n < 2 {
        eprintln!("a_started_collective_aborted_by_the_watchdog_fails_its_wait: skipped, needs 2 GPUs (found {n})");
        return;
    }
    let comms = NcclGroup::with_timeout(&[0, 1], Duration::from_secs(2)).unwrap();
    let out = on_ranks(comms, |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_secs(5));
            return Ok(None);
        }
        let t = Tensor::new(&[1f32, 2.0], &c.device())?;
        let pending = c.start_all_reduce(std::slice::from_ref(&t), ReduceOp::Sum.into())?;
        std::thread::sleep(Duration::from_secs(4));
        let err = pending
            .wait()
            .expect_err("the aborted collective's wait must fail");
        let matched = matches!(
            CollectiveError::find(&err),
            Some(CollectiveError::RankLeft { .. })
        );
        Ok(Some((
            matched,
            err.to_string(),
            c.deferred_error().is_err(),
        )))
    });
    let (matched, msg, unhealthy) = out[0].clone().unwrap();
    assert!(matched && msg.contains("aborted"), "{msg}");
    assert!(
        unhealthy,
        "deferred_error must report the abort of an enqueued collective"
    );
}

/// A communicator dropped with a collective its peer will never join returns within the
/// timeout (finalize polled, then abort), instead of hanging in ncclCommDestroy.
#[test]
fn a_drop_with_a_collective_that_cannot_finish_returns() {
    let n = gpus();
    if n < 2 {
        eprintln!("a_drop_with_a_collective_that_cannot_finish_returns: skipped, needs 2 GPUs (found {n})");
        return;
    }
    let timeout = Duration::from_secs(5);
    let comms = NcclGroup::with_timeout(&[0, 1], timeout).unwrap();
    let took = on_ranks(comms, |c| {
        if c.rank() == 1 {
            return Ok(Duration::ZERO);
        }
        let t = Tensor::new(&[1f32], &c.device())?;
        let _queued = c.all_reduce(&t, ReduceOp::Sum)?;
        let t0 = Instant::now();
        drop(c);
        Ok(t0.elapsed())
    });
    // The group closes its communicators together when the last is dropped: that drop waits
    // at most the timeout for the queued all-reduce, then aborts.
    assert!(
        took.iter().all(|t| *t < timeout + Duration::from_secs(20)),
        "{took:?}"
    );
}

/// SyncBatchNorm over NCCL: rank 1 skips a training step, so rank 0's all-reduce (enqueued
/// without error) is aborted by the watchdog; rank 0's next training forward fails and its
/// running statistics are those from before the failed step.
#[test]
fn the_layer_rolls_back_a_step_whose_all_reduce_was_aborted() {
    let n = gpus();
    if n < 2 {
        eprintln!("the_layer_rolls_back_a_step_whose_all_reduce_was_aborted: skipped, needs 2 GPUs (found {n})");
        return;
    }
    let comms = NcclGroup::with_timeout(&[0, 1], Duration::from_secs(2)).unwrap();
    let out = on_ranks(comms, |comm| {
        let dev = comm.device();
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
        let bn = sync_batch_norm(
            3,
            SyncBatchNormConfig::default(),
            vb,
            comm.clone() as Arc<dyn Collective>,
        )?;
        let x = |seed| {
            randn(seed, &[4, 3, 2, 2], 1.0, 2.0)
                .to_dtype(DType::F32)?
                .to_device(&dev)
        };
        bn.forward_t(&x(1)?, true)?;
        let before = bn.running_mean().unwrap().to_vec1::<f32>()?;
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(6));
            return Ok(None);
        }
        // Enqueued; reading the output waits for the stream, which the watchdog's abort frees.
        let y = bn.forward_t(&x(2)?, true)?;
        let _ = y.to_device(&Device::Cpu);
        let err = bn
            .forward_t(&x(3)?, true)
            .expect_err("the step after the abort must fail");
        let after = bn.running_mean().unwrap().to_vec1::<f32>()?;
        Ok(Some((
            before,
            after,
            bn.num_batches_tracked(),
            err.to_string(),
        )))
    });
    let (before, after, batches, msg) = out[0].clone().unwrap();
    assert_eq!(before, after, "running mean not rolled back: {msg}");
    assert_eq!(batches, 1);
    assert!(msg.contains("before the last training step"), "{msg}");
}

/// An in-place all-reduce (`AllReduce::in_place`) on NCCL: bitwise `all_reduce`'s result,
/// every dtype and op, written into the given tensor's own storage when it is contiguous (a
/// clone kept by the test sees the result: the storage is shared), a contiguous view at an
/// offset included; a transposed tensor takes the allocating path and is left as it was.
/// Checked (`Checked`) forwards it.
/// Needs 2 GPUs or more: on one, every reduction is its input, in place or not.
#[test]
fn an_owned_all_reduce_reduces_in_place() {
    let n = gpus();
    if n < 2 {
        eprintln!("one GPU: a reduction equals its input, so in place cannot be told apart");
        return;
    }
    let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
    on_ranks(comms, |c| {
        let dev = c.device();
        let host = randn(40 + c.rank() as u64, &[6, 5], 0.5, 2.0);
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let t = host.to_dtype(dtype)?.to_device(&dev)?;
                let want = c.all_reduce(&t, op)?.to_device(&Device::Cpu)?;
                // Widened to f64 exactly, compared as bit patterns.
                let bits = |t: &Tensor| -> Result<Vec<u64>> {
                    let v = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                    Ok(v.into_iter().map(f64::to_bits).collect())
                };
                let kept = t.clone();
                let got = c.all_reduce_with(&[t], AllReduce::new(op).in_place())?;
                assert_eq!(bits(&got)?, bits(&want)?, "{dtype:?} {op:?}");
                assert_eq!(bits(&kept)?, bits(&want)?, "{dtype:?} {op:?}: not in place");
            }
        }
        // Rows 2..5 of a contiguous tensor: a view at an offset, reduced where it lies.
        let whole = host.to_device(&dev)?.to_dtype(DType::F32)?;
        let want = c.all_reduce(&whole.narrow(0, 2, 3)?, ReduceOp::Sum)?;
        let got = c.all_reduce_with(
            &[whole.narrow(0, 2, 3)?],
            AllReduce::new(ReduceOp::Sum).in_place(),
        )?;
        assert_eq!(got.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
        assert_eq!(
            whole.narrow(0, 2, 3)?.to_vec2::<f32>()?,
            want.to_vec2::<f32>()?
        );
        assert_eq!(
            whole.narrow(0, 0, 2)?.to_vec2::<f32>()?,
            host.narrow(0, 0, 2)?
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?,
            "rows outside the view were written"
        );
        // Transposed: not contiguous, so reduced into a new tensor; the input keeps its values.
        let t = host.to_device(&dev)?.to_dtype(DType::F32)?.t()?;
        let kept = t.clone();
        let got = c.all_reduce_with(&[t], AllReduce::new(ReduceOp::Sum).in_place())?;
        assert_eq!(
            got.to_vec2::<f32>()?,
            c.all_reduce(&kept, ReduceOp::Sum)?.to_vec2::<f32>()?
        );
        assert_eq!(
            kept.to_vec2::<f32>()?,
            host.t()?.to_dtype(DType::F32)?.to_vec2::<f32>()?
        );
        // Through `Checked`: still in place.
        let checked = Checked::new(c.clone() as Arc<dyn Collective>, &dev);
        let t = host.to_device(&dev)?.to_dtype(DType::F32)?;
        let kept = t.clone();
        let got = checked.all_reduce_with(&[t], AllReduce::new(ReduceOp::Sum).in_place())?;
        assert_eq!(kept.to_vec2::<f32>()?, got.to_vec2::<f32>()?);
        Ok(())
    });
}

/// NCCL averages integers as a sum then an integer division; ThreadGroup
/// and MPI refuse `Avg` on integer dtypes, and so does this backend, without aborting the
/// communicator.
#[test]
fn an_integer_average_is_refused() {
    gpus();
    let c = NcclGroup::new(&[0]).unwrap().remove(0);
    for dtype in [DType::U32, DType::I64, DType::U8] {
        let t = Tensor::new(&[3f32, 4.0], &c.device())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        for err in [
            c.all_reduce(&t, ReduceOp::Avg).unwrap_err(),
            c.reduce_scatter(&t, ReduceOp::Avg).unwrap_err(),
        ] {
            assert!(
                matches!(
                    CollectiveError::find(&err),
                    Some(CollectiveError::InvalidArgument { .. })
                ),
                "{dtype:?}: {err}"
            );
        }
    }
    let t = Tensor::new(&[3u32], &c.device()).unwrap();
    let sum = c.all_reduce(&t, ReduceOp::Sum).unwrap().to_vec1::<u32>();
    assert_eq!(sum.unwrap(), vec![3]);
}

/// A `Pending` that outlives its communicator: dropping the communicators
/// finalizes them, which flushes the collective, so its wait returns the sum.
#[test]
fn a_pending_that_outlives_its_communicator_completes() {
    let n = gpus();
    const LEN: usize = 1 << 20;
    let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
    let sums = on_ranks(comms, |c| {
        let t = Tensor::ones(LEN, DType::F32, &c.device())?;
        let p = c.start_all_reduce(std::slice::from_ref(&t), ReduceOp::Sum.into())?;
        drop(c);
        let v = p.wait()?;
        Ok(v.sum_all()?.to_scalar::<f32>()?)
    });
    for (r, s) in sums.into_iter().enumerate() {
        assert_eq!(s, (n * LEN) as f32, "rank {r}");
    }
}

/// Writes into a started collective's input and output right after `wait`, before anything
/// synchronises the host (`common::writes`): the device's stream waits for the side stream
/// first, so the simulated GPU's race checker sees no unordered use and the results hold the
/// sums of the inputs as they were at the call. Every collective with a side-stream form.
#[test]
fn writes_after_wait_are_ordered_after_the_collective() {
    let n = gpus();
    for which in common::writes::EVERY {
        let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
        on_ranks(comms, |c| {
            let c: Arc<dyn Collective> = c;
            common::writes::write_after_wait(&c, which)
        });
    }
}

/// Rank 0 drops its handle at once and overwrites its input while the others start 100 ms
/// later: the drop makes the device's stream wait for the collective, so the write cannot
/// reach what NCCL sends (`common::writes`). Skips on one GPU (no peer to start late).
#[test]
fn writes_after_a_dropped_handle_are_ordered_after_the_collective() {
    let n = gpus();
    if n < 2 {
        return;
    }
    for which in common::writes::EVERY {
        let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
        on_ranks(comms, |c| {
            let c: Arc<dyn Collective> = c;
            common::writes::write_after_drop(&c, which, Duration::from_millis(100))
        });
    }
}

/// A split where rank 0 passes no color (`NCCL_SPLIT_NOCOLOR`) and the keys reverse the
/// others' order: rank 0 gets no communicator, the others one of `n - 1` ranks ordered by key.
#[test]
fn split_without_a_color_and_with_reversed_keys() {
    let n = gpus();
    if n < 2 {
        eprintln!(
            "split_without_a_color_and_with_reversed_keys: skipped, needs 2 GPUs (found {n})"
        );
        return;
    }
    let comms = NcclGroup::new(&(0..n).collect::<Vec<_>>()).unwrap();
    let outs = on_ranks(comms, |c| {
        let color = (c.rank() != 0).then_some(7);
        let Some(sub) = c.split(color, (n - c.rank()) as u32)? else {
            return Ok(None);
        };
        let t = Tensor::new(&[c.rank() as f32], &c.device())?;
        let sum = sub.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()?[0];
        Ok(Some((sub.rank(), sub.world_size(), sum)))
    });
    assert!(outs[0].is_none(), "rank 0 passed no color");
    let want_sum = (1..n).sum::<usize>() as f32;
    for (r, out) in outs.into_iter().enumerate().skip(1) {
        assert_eq!(out, Some((n - 1 - r, n - 1, want_sum)), "rank {r}");
    }
}
