//! Training-mode batch norm at world size 1: `SyncBatchNorm` against `candle_nn::BatchNorm`.
//!
//! Run with the allocator setting the README's table names (DESIGN.md §8: page faults of fresh
//! allocations otherwise dominate on small VMs):
//! `MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 cargo bench --bench batch_norm`
//!
//! Throughput is effective bandwidth against the minimum traffic: forward 3 passes over the
//! tensor (read for the statistics, read and write for the output), backward 5 (read dy and x
//! twice, write dx), forward + backward 8.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::{Collective, ReduceOp, ThreadGroup};
use candle_distributed::ops::{
    batch_norm_backward_elemt, batch_norm_backward_reduce, batch_norm_elemt,
    batch_norm_gather_stats, batch_norm_stats, BackwardElemtConfig, BatchStats, ElemtConfig,
};
use candle_distributed::{sync_batch_norm, ChannelLayout, SyncBatchNorm, SyncBatchNormConfig};
use candle_nn::{ModuleT, VarBuilder, VarMap};
use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};

const SHAPES: [[usize; 4]; 3] = [[32, 64, 32, 32], [64, 256, 14, 14], [8, 32, 112, 112]];

fn allocator_setting() -> String {
    let get = |k: &str| std::env::var(k).unwrap_or_else(|_| "unset".into());
    format!(
        "MALLOC_MMAP_THRESHOLD_={} MALLOC_TRIM_THRESHOLD_={}",
        get("MALLOC_MMAP_THRESHOLD_"),
        get("MALLOC_TRIM_THRESHOLD_")
    )
}

fn bench(c: &mut Criterion) {
    eprintln!(
        "allocator: {}; candle CPU threads: {}",
        allocator_setting(),
        candle_core::utils::get_num_threads()
    );
    let comm: Arc<dyn Collective> = ThreadGroup::new(1).unwrap().remove(0);
    for shape in SHAPES {
        for channels_last in [false, true] {
            bench_shape(c, &comm, shape, channels_last);
        }
    }
}

/// On one shape: a copy of the tensor (the machine's limit), the layer's forward, its two passes
/// alone, the two backward ops, forward + backward through autograd, candle's share of that timed
/// alone, and the autograd step's replay split between the layer and candle; candle-nn's
/// BatchNorm beside them in NCHW (it has no channels-last form).
fn bench_shape(
    c: &mut Criterion,
    comm: &Arc<dyn Collective>,
    [n, ch, h, w]: [usize; 4],
    channels_last: bool,
) {
    let dev = Device::Cpu;
    let layout = if channels_last { "nhwc" } else { "nchw" };
    let mut group = c.benchmark_group(format!("{n}x{ch}x{h}x{w}/{layout}"));
    let dims: Vec<usize> = if channels_last {
        vec![n, h, w, ch]
    } else {
        vec![n, ch, h, w]
    };
    let bytes = (n * ch * h * w * 4) as u64;
    let x = Tensor::randn(1f32, 2f32, dims.as_slice(), &dev).unwrap();
    let dy = Tensor::randn(0f32, 1f32, dims.as_slice(), &dev).unwrap();
    let vm = VarMap::new();
    let layout = if channels_last {
        ChannelLayout::ChannelsLast
    } else {
        ChannelLayout::ChannelsFirst
    };
    let cfg = SyncBatchNormConfig::default().with_layout(layout);
    let bn = sync_batch_norm(
        ch,
        cfg,
        VarBuilder::from_varmap(&vm, DType::F32, &dev),
        comm.clone(),
    )
    .unwrap();

    // The machine's limit for a pass that reads the tensor and writes another: a copy of its
    // values into a buffer written before, on candle's worker pool (the threads our kernels
    // run on), in work items of the kernels' size.
    group.throughput(Throughput::Bytes(2 * bytes));
    let src = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut dst = vec![1f32; src.len()];
    group.bench_function("copy_baseline", |b| b.iter(|| pool_copy(&src, &mut dst)));

    group.throughput(Throughput::Bytes(3 * bytes));
    group.bench_function("syncbn_forward", |b| {
        b.iter(|| bn.forward_t(&x, true).unwrap())
    });

    let shift = Tensor::zeros(ch, DType::F64, &dev).unwrap();
    // The forward's first pass alone: the per-channel shifted sums.
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("syncbn_stats", |b| {
        b.iter(|| batch_norm_stats(&x, &shift, layout).unwrap())
    });
    let sums = batch_norm_stats(&x, &shift, layout).unwrap();
    let st = batch_norm_gather_stats(&sums, &shift, 1e-5).unwrap();
    let weight = Tensor::ones(ch, DType::F32, &dev).unwrap();
    let bias = Tensor::zeros(ch, DType::F32, &dev).unwrap();
    // The forward's second pass alone: the normalisation, reading the tensor and writing another.
    group.throughput(Throughput::Bytes(2 * bytes));
    group.bench_function("syncbn_apply", |b| {
        b.iter(|| {
            let (w, bi) = (Some(&weight), Some(&bias));
            batch_norm_elemt(
                &x,
                &st.mean,
                &st.invstd,
                ElemtConfig {
                    weight: w,
                    bias: bi,
                    layout,
                    ..Default::default()
                },
            )
            .unwrap()
        })
    });
    group.throughput(Throughput::Bytes(5 * bytes));
    group.bench_function("syncbn_backward_ops", |b| {
        b.iter(|| {
            let red = batch_norm_backward_reduce(&dy, &x, &st.mean, None, layout).unwrap();
            batch_norm_backward_elemt(
                &dy,
                &x,
                &st.mean,
                &st.invstd,
                &red,
                &st.count,
                BackwardElemtConfig {
                    weight: Some(&weight),
                    layout,
                    ..Default::default()
                },
            )
            .unwrap()
        })
    });

    let xv = Var::from_tensor(&x).unwrap();
    group.throughput(Throughput::Bytes(8 * bytes));
    group.bench_function("syncbn_forward_backward_autograd", |b| {
        b.iter(|| {
            bn.forward_t(xv.as_tensor(), true)
                .unwrap()
                .backward()
                .unwrap()
        })
    });

    // What candle's autograd adds around the layer's backward for `x` (candle-core's
    // `Tensor::backward`): a dense seed of ones for `y`, and a zero-filled gradient that the
    // op's `dx` is then added into. Timed alone, so that the table can say how much of the
    // autograd step is candle's.
    group.throughput(Throughput::Bytes(5 * bytes));
    group.bench_function("candle_autograd_share", |b| {
        b.iter(|| {
            let seed = x.ones_like().unwrap().contiguous().unwrap();
            let dx = x.zeros_like().unwrap().add(&dy).unwrap();
            (seed, dx)
        })
    });

    // The same step replayed by hand, the way candle-core's `Tensor::backward` runs it for
    // this graph, with a clock around each part: inside the step, where the tensors no longer
    // stay in the cache, how much of its time is the layer's and how much candle's. The table
    // puts the two parts' sum beside the step's time as a check of the replay.
    let replay = Replay {
        bn: &bn,
        comm,
        xv: &xv,
        stats: &st,
        weight: &weight,
        layout,
    };
    // Each of the two runs whole steps and reports one part of them, so criterion, which sizes
    // its runs by what is reported, takes about twice the measurement time over each.
    group.throughput(Throughput::Bytes(8 * bytes));
    group.bench_function("autograd_replay_layer", |b| {
        b.iter_custom(|iters| replay.run(iters).layer)
    });
    group.throughput(Throughput::Bytes(5 * bytes));
    group.bench_function("autograd_replay_candle", |b| {
        b.iter_custom(|iters| replay.run(iters).candle)
    });

    if !channels_last {
        bench_candle_nn(&mut group, ch, &x, &xv, bytes);
    }
    group.finish();
}

/// The autograd step `bn.forward_t(x, true)?.backward()?` done by hand in the order candle-core
/// 0.11's `Tensor::backward` does it for this graph: the layer's forward, a dense seed of ones
/// for `y`, the layer's backward (`batch_norm_backward_reduce`, the all-reduce of its sums,
/// `batch_norm_backward_elemt`, the parameters' gradients), then each input's gradient added
/// into a zero-filled one. Candle's walk of the graph and the tensors' drops are on neither
/// clock.
struct Replay<'a> {
    bn: &'a SyncBatchNorm,
    /// The layer's group (world size 1 here): its backward all-reduces the sums of its
    /// reduction, as the layer does in training.
    comm: &'a Arc<dyn Collective>,
    xv: &'a Var,
    /// The batch's statistics (the forward computes the same ones inside the layer).
    stats: &'a BatchStats,
    weight: &'a Tensor,
    layout: ChannelLayout,
}

/// Time spent over the steps of one [`Replay::run`], split between the layer and candle.
struct ReplayTimes {
    /// The forward and the layer's backward ops.
    layer: Duration,
    /// The seed and the gradients' zero fills and additions.
    candle: Duration,
}

impl Replay<'_> {
    fn run(&self, iters: u64) -> ReplayTimes {
        let (x, st, layout) = (self.xv.as_tensor(), self.stats, self.layout);
        let mut t = ReplayTimes {
            layer: Duration::ZERO,
            candle: Duration::ZERO,
        };
        for _ in 0..iters {
            let t0 = Instant::now();
            let y = self.bn.forward_t(x, true).unwrap();
            let t1 = Instant::now();
            let seed = y.ones_like().unwrap().contiguous().unwrap();
            let t2 = Instant::now();
            let red = batch_norm_backward_reduce(&seed, x, &st.mean, None, layout).unwrap();
            let sums = self.comm.all_reduce(&red, ReduceOp::Sum).unwrap();
            let (dx, _) = batch_norm_backward_elemt(
                &seed,
                x,
                &st.mean,
                &st.invstd,
                &sums,
                &st.count,
                BackwardElemtConfig {
                    weight: Some(self.weight),
                    layout,
                    ..Default::default()
                },
            )
            .unwrap();
            let dgamma = (red.get(1).unwrap() * &st.invstd).unwrap();
            let dgamma = dgamma.to_dtype(DType::F32).unwrap();
            let dbeta = red.get(0).unwrap().to_dtype(DType::F32).unwrap();
            let t3 = Instant::now();
            let accumulate = |g: &Tensor, of: &Tensor| of.zeros_like().unwrap().add(g).unwrap();
            let grads = [
                accumulate(&dx, x),
                accumulate(&dgamma, self.weight),
                accumulate(&dbeta, self.weight),
            ];
            let t4 = Instant::now();
            t.layer += (t1 - t0) + (t3 - t2);
            t.candle += (t2 - t1) + (t4 - t3);
            drop((y, seed, red, sums, dx, dgamma, dbeta, grads));
        }
        t
    }
}

/// Copies `src` into `dst` (of one length) on candle's worker pool, 32768 values per item.
fn pool_copy(src: &[f32], dst: &mut [f32]) {
    const ITEM: usize = 1 << 15;
    assert_eq!(src.len(), dst.len(), "copy of one length");
    let (len, out) = (src.len(), dst.as_mut_ptr() as usize);
    candle_core::utils::barrier_pool().execute_chunked(len.div_ceil(ITEM), |items| {
        for i in items {
            let (lo, hi) = (i * ITEM, len.min((i + 1) * ITEM));
            // SAFETY: `out` is `dst`'s data, borrowed exclusively for this call; every item
            // index is handed to one closure call only, so the ranges `lo..hi` never overlap,
            // and they lie within its length.
            let d = unsafe { std::slice::from_raw_parts_mut((out as *mut f32).add(lo), hi - lo) };
            d.copy_from_slice(&src[lo..hi]);
        }
    });
}

/// candle-nn's BatchNorm (training mode): forward, and forward + backward through autograd.
fn bench_candle_nn(
    group: &mut BenchmarkGroup<'_, WallTime>,
    ch: usize,
    x: &Tensor,
    xv: &Var,
    bytes: u64,
) {
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let reference =
        candle_nn::batch_norm(ch, 1e-5, VarBuilder::from_varmap(&vm, DType::F32, &dev)).unwrap();
    group.throughput(Throughput::Bytes(3 * bytes));
    group.bench_function("candle_nn_forward", |b| {
        b.iter(|| reference.forward_t(x, true).unwrap())
    });
    group.throughput(Throughput::Bytes(8 * bytes));
    group.bench_function("candle_nn_forward_backward_autograd", |b| {
        b.iter(|| {
            reference
                .forward_t(xv.as_tensor(), true)
                .unwrap()
                .backward()
                .unwrap()
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(15)
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
