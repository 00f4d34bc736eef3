//! What one SyncBatchNorm training step asks of the GPU, counted by the simulated device
//! (`gpu-sim/`): kernel launches by name, copies, allocations and host synchronisations on the
//! rank's stream for a training forward and for its backward. A regression (an extra candle op,
//! a host read) fails here. On a real driver, which has no counters, the tests say so and pass
//! without checking.

mod common;

use candle_core::{DType, Tensor};
use candle_distributed::collective::{ReduceOp, ThreadGroup};
use candle_distributed::SyncBatchNormConfig;
use candle_nn::ModuleT;
use gpu_sim::{Counts, GpuSim as Sim};

/// The tests of this file one at a time: the launch log and the totals are the process's.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What `f` enqueued on the calling thread's stream, and the kernels it launched.
fn measure(sim: &Sim, f: impl FnOnce()) -> (Counts, Vec<String>) {
    let dev = common::cuda_device();
    dev.synchronize().unwrap();
    sim.reset();
    let before = sim.stream_counts();
    f();
    let counts = sim.stream_counts().minus(before);
    (counts, sim.launched())
}

/// For the NCCL tests: the simulated driver's counters, this file's lock, and a communicator of
/// world size 1 on GPU 0; None (after saying so) on a real driver.
#[cfg(feature = "nccl")]
fn on_simulated_nccl() -> Option<(
    Sim,
    std::sync::MutexGuard<'static, ()>,
    std::sync::Arc<candle_distributed::collective::NcclCollective>,
)> {
    let Some(sim) = Sim::loaded() else {
        eprintln!("not on the simulated driver: no counters to read");
        return None;
    };
    let alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let comm = candle_distributed::collective::NcclGroup::new(&[0])
        .unwrap()
        .remove(0);
    Some((sim, alone, comm))
}

/// One training forward and its backward of an affine layer with running statistics at world
/// size 1, after a first step (which also makes the shift), on one thread rank of a
/// `ThreadGroup`.
///
/// - The forward launches `bn_stats`, `bn_finalize` and `bn_apply` (`γ` and `β` go to it as
///   they are), and allocates its outputs and one scratch buffer: the finalized statistics and
///   `y`, and the local sums the all-reduce takes. The reduction's partial sums and arrival
///   counters are allocated once per device and stream, not per call.
/// - The backward of `Σ y·w` launches the loss's own kernels (`const_set` seeds the gradient,
///   `bmul`/`badd` are candle's backward of the product and its accumulation), then
///   `bn_backward_reduce`, `bn_backward_elemt` and the f64 ops that turn the reduced sums into
///   dγ and dβ (a product and two casts, no stack), and candle's accumulation of the gradients.
/// - Neither waits for the GPU or reads anything back, but for the all-reduce: `ThreadGroup`
///   stages it through the host (one copy down, one up, one wait), which is counted on its
///   own and taken off. The NCCL backend's all-reduce stays on the device.
#[test]
fn a_training_step_launches_what_the_readme_states() {
    let Some(sim) = Sim::loaded() else {
        eprintln!("not on the simulated driver: no counters to read");
        return;
    };
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    ThreadGroup::run(1, |comm| {
        let dev = common::cuda_device();
        let (bn, _vm) = common::layer(
            8,
            SyncBatchNormConfig::default(),
            comm.clone(),
            None,
            DType::F32,
            &dev,
        );
        let x = common::randn(1, &[4, 8, 3, 3], 1.0, 2.0)
            .to_dtype(DType::F32)?
            .to_device(&dev)?;
        let x = candle_core::Var::from_tensor(&x)?;
        let w = Tensor::ones(x.shape(), DType::F32, &dev)?;
        let loss = || -> candle_core::Result<Tensor> {
            bn.forward_t(x.as_tensor(), true)?.mul(&w)?.sum_all()
        };
        loss()?.backward()?;
        let sums = Tensor::ones((3, 8), DType::F64, &dev)?;
        let (staging, _) = measure(&sim, || {
            comm.all_reduce(&sums, ReduceOp::Sum).unwrap();
        });
        let mut y = None;
        let (fwd, fwd_kernels) = measure(&sim, || {
            y = Some(bn.forward_t(x.as_tensor(), true).unwrap());
        });
        let l = y.unwrap().mul(&w)?.sum_all()?;
        let (bwd, bwd_kernels) = measure(&sim, || {
            l.backward().unwrap();
        });
        eprintln!("all-reduce staging: {staging:?}");
        eprintln!("forward: {fwd:?}\n  {fwd_kernels:?}\nbackward: {bwd:?}\n  {bwd_kernels:?}");
        assert_eq!(
            (
                staging.copies_dtoh,
                staging.copies_htod,
                staging.host_syncs,
                staging.launches
            ),
            (1, 1, 1, 0),
            "ThreadGroup's all-reduce of a device tensor: down, combine on the host, up"
        );
        assert_eq!(
            fwd_kernels,
            ["bn_stats_nchw_f32", "bn_finalize_f32", "bn_apply_nchw_f32"],
            "the kernels of a training forward"
        );
        assert_eq!(
            fwd.minus(staging).allocs,
            3,
            "a training forward allocates the sums, the statistics and y: {fwd:?}"
        );
        for (what, c) in [
            ("forward", fwd.minus(staging)),
            ("backward", bwd.minus(staging)),
        ] {
            assert_eq!(
                c.host_syncs, 0,
                "the layer's {what} waits for nothing: {c:?}"
            );
            assert_eq!(
                c.copies_dtoh, 0,
                "the layer's {what} reads nothing back: {c:?}"
            );
        }
        assert_eq!(
            fwd.minus(staging).copies_htod,
            0,
            "the forward uploads nothing: {fwd:?}"
        );
        assert_eq!(
            bwd_kernels,
            [
                "const_set_f32",
                "badd_f32",
                "badd_f32",
                "bmul_f32",
                "badd_f32",
                "bmul_f32",
                "badd_f32",
                "bn_backward_reduce_nchw_f32",
                "cast_f32_f64",
                "cast_f64_f32",
                "bn_backward_elemt_nchw_f32",
                "bmul_f64",
                "cast_f64_f32",
                "cast_f64_f32",
                "badd_f32",
                "badd_f32",
                "badd_f32",
            ],
            "the kernels of the backward"
        );
        // Most of these are candle's autograd (the seed, the product's backward, gradient
        // accumulation); pinned so that a change of the layer's share shows.
        assert_eq!(
            bwd.minus(staging).allocs,
            25,
            "allocations of the backward: {bwd:?}"
        );
        Ok(())
    })
    .unwrap();
}

/// One `DataParallel::sync_gradients` of three variables in one bucket on NCCL (world size 1,
/// the simulated NCCL): what it launches, allocates (the bucket, averaged in place) and copies
/// on the rank's stream, and that
/// it neither waits for the GPU nor reads anything back while every variable has a gradient.
/// A variable without a gradient on this rank makes it read the bucket's flags back (one copy
/// down, one wait): that case is counted too.
#[cfg(feature = "nccl")]
#[test]
fn a_gradient_sync_launches_what_the_docs_state() {
    use candle_distributed::DataParallel;

    let Some((sim, _alone, comm)) = on_simulated_nccl() else {
        return;
    };
    let dev = comm.device();
    let var = |seed: u64, dims: &[usize]| {
        let t = common::randn(seed, dims, 0.0, 1.0)
            .to_dtype(DType::F32)
            .unwrap()
            .to_device(&dev)
            .unwrap();
        candle_core::Var::from_tensor(&t).unwrap()
    };
    let (w1, b1, w2) = (var(1, &[16, 3, 3, 3]), var(2, &[16]), var(3, &[10, 16]));
    let vars: Vec<(String, candle_core::Var)> = [("w1", &w1), ("b1", &b1), ("w2", &w2)]
        .into_iter()
        .map(|(n, v)| (n.to_string(), v.clone()))
        .collect();
    let dp = DataParallel::from_vars(vars.clone(), vars, comm.clone()).unwrap();
    let grads_of = |all: bool| {
        let mut loss = (w1.as_tensor().sqr().unwrap().sum_all().unwrap()
            + w2.as_tensor().sum_all().unwrap())
        .unwrap();
        if all {
            loss = (loss + b1.as_tensor().sum_all().unwrap()).unwrap();
        }
        loss.backward().unwrap()
    };
    // Once before counting: the first collective of a communicator sets it up.
    dp.sync_gradients(grads_of(true)).unwrap();
    let measure_sync = |all: bool| {
        let grads = grads_of(all);
        dev.synchronize().unwrap();
        sim.reset();
        let synced = dp.sync_gradients(grads).unwrap();
        (sim.total_counts(), sim.launched(), synced)
    };
    let (all, all_kernels, synced) = measure_sync(true);
    let (some, some_kernels, _) = measure_sync(false);
    eprintln!(
        "every gradient: {all:?}\n  {all_kernels:?}\none missing: {some:?}\n  {some_kernels:?}"
    );
    assert!(synced.get(b1.as_tensor()).is_some());
    for (what, kernels) in [
        ("every gradient", &all_kernels),
        ("one missing", &some_kernels),
    ] {
        assert_eq!(
            kernels,
            &["pack_f32", "ncclAllReduce"],
            "{what}: one launch packs the three gradients (zeros for a missing one) and their \
             flags, then one all-reduce"
        );
    }
    assert_eq!(
        (all.host_syncs, all.copies_dtoh, all.copies_htod),
        (0, 0, 0),
        "a sync where every variable has a gradient copies nothing to or from the host and \
         waits for nothing: {all:?}"
    );
    assert_eq!(
        all.allocs, 1,
        "the bucket, which the all-reduce averages in place: {all:?}"
    );
    // Event records and stream waits: the all-reduce runs on the device's stream (a blocking
    // call); one record after it is the watchdog's, and the rest is cudarc's tracking of each
    // buffer's reads and writes, which cudarc turns on once a context has a second stream (the
    // communicator's own, for its asynchronous calls). Pinned, so that a change shows.
    assert_eq!(
        (all.event_records, all.stream_waits),
        (6, 9),
        "events of a sync: {all:?}"
    );
    assert_eq!(
        (some.host_syncs, some.copies_dtoh, some.memsets, some.allocs),
        (0, 1, 0, 1),
        "a missing gradient: its zeros come from the pack kernel (no allocation, no memset); \
         the flags are read back (a copy into pageable memory, which returns once done): \
         {some:?}"
    );
}

/// One training forward of an affine layer with running statistics on NCCL (world size 1, the
/// simulated NCCL), after a first step: `bn_stats`, the all-reduce, `bn_finalize`, `bn_apply`,
/// and three allocations, the layer's two outputs (`y` and the finalized statistics) and the
/// local sums, which the all-reduce sums in place (NCCL's in-place form); nothing read back,
/// no host wait.
#[cfg(feature = "nccl")]
#[test]
fn a_forward_over_nccl_allocates_its_outputs_and_one_scratch() {
    use candle_distributed::collective::Collective;

    let Some((sim, _alone, comm)) = on_simulated_nccl() else {
        return;
    };
    let dev = comm.device();
    let (bn, _vm) = common::layer(
        8,
        SyncBatchNormConfig::default(),
        comm.clone() as std::sync::Arc<dyn Collective>,
        None,
        DType::F32,
        &dev,
    );
    let x = common::randn(2, &[4, 8, 3, 3], 1.0, 2.0)
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&dev)
        .unwrap();
    bn.forward_t(&x, true).unwrap();
    dev.synchronize().unwrap();
    sim.reset();
    let y = bn.forward_t(&x, true).unwrap();
    let (fwd, kernels) = (sim.total_counts(), sim.launched());
    eprintln!("forward over NCCL: {fwd:?}\n  {kernels:?}");
    assert_eq!(
        kernels,
        [
            "bn_stats_nchw_f32",
            "ncclAllReduce",
            "bn_finalize_f32",
            "bn_apply_nchw_f32"
        ],
        "the launches of a training forward over NCCL"
    );
    assert_eq!(fwd.allocs, 3, "y, the statistics and the sums: {fwd:?}");
    assert_eq!(
        (fwd.host_syncs, fwd.copies_dtoh, fwd.copies_htod),
        (0, 0, 0),
        "a forward over NCCL waits for nothing and copies nothing: {fwd:?}"
    );
    drop(y);
}

/// The overlapped backward of `DataParallel` on NCCL (world size 1, the simulated NCCL): a
/// 2-layer MLP, one bucket per variable. The launch log shows the first bucket's pack and
/// all-reduce enqueued before the backward's last kernel (the hooks start buckets while the
/// backward is still enqueuing the first layer's gradients), one `pack_f32` and one
/// `ncclAllReduce` per bucket, then the exchange (one more `ncclAllReduce` and its one copy to
/// the host); and one allocation, memset and launch fewer per variable than `loss.backward()` +
/// `sync_gradients` (the gradient is handed over, not added into a zeroed slot of the
/// variable); each path ends with one small all-reduce and its copy to the host (the exchange;
/// `sync_gradients`' agreement on the hooked copies, the hooks being a `DataParallel`'s).
#[cfg(feature = "nccl")]
#[test]
fn an_overlapped_backward_starts_buckets_before_its_last_kernel() {
    use candle_core::Module;
    use candle_distributed::{DataParallel, GradHooks};
    use candle_nn::{linear, VarMap};

    let Some((sim, _alone, comm)) = on_simulated_nccl() else {
        return;
    };
    let dev = comm.device();
    let vm = VarMap::new();
    let hooks = GradHooks::new();
    let vb = hooks.var_builder(&vm, DType::F32, &dev);
    let (a, b) = (
        linear(6, 5, vb.pp("a")).unwrap(),
        linear(5, 3, vb.pp("b")).unwrap(),
    );
    let dp = DataParallel::new(&vm, comm.clone())
        .unwrap()
        .with_bucket_bytes(1)
        .with_overlap(&hooks)
        .unwrap();
    let x = common::randn(7, &[4, 6], 0.0, 1.0)
        .to_dtype(DType::F32)
        .unwrap()
        .to_device(&dev)
        .unwrap();
    let loss = || {
        b.forward(&a.forward(&x).unwrap().tanh().unwrap())
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap()
    };
    // Once before counting: the first collective of a communicator sets it up, and the first
    // overlapped backward learns the buckets' order and places. Each measured step follows a
    // refresh, as in `DataParallel::step` (no check of the hooked copies is due then).
    dp.backward(&loss()).unwrap();
    dp.refresh().unwrap();
    let l = loss();
    dev.synchronize().unwrap();
    sim.reset();
    dp.backward(&l).unwrap();
    let (counts, log) = (sim.total_counts(), sim.launched());
    eprintln!("{counts:?}\n{log:?}");
    // The same step the plain way (the hooks pass the gradients on): `loss.backward()`, then
    // `sync_gradients`.
    dp.refresh().unwrap();
    let l = loss();
    dev.synchronize().unwrap();
    sim.reset();
    dp.sync_gradients(l.backward().unwrap()).unwrap();
    let (plain, plain_log) = (sim.total_counts(), sim.launched());
    eprintln!("plain: {plain:?}\n{plain_log:?}");
    // Per variable, candle's zeros (a memset into a fresh buffer) and the add into them.
    let vars = 4u64;
    assert_eq!(
        (
            plain.allocs - counts.allocs,
            plain.memsets - counts.memsets,
            (plain_log.len() - log.len()) as u64
        ),
        (vars, vars, vars),
        "the overlapped backward hands each gradient over without candle's zeros + add into the \
         variable's slot: one allocation, memset and launch fewer per variable than the plain \
         step ({counts:?} against {plain:?})"
    );
    let first_all_reduce = log.iter().position(|k| k == "ncclAllReduce").unwrap();
    let last_backward = log
        .iter()
        .rposition(|k| k != "ncclAllReduce" && k != "pack_f32")
        .unwrap();
    assert!(
        first_all_reduce < last_backward,
        "the first bucket starts before the backward's last kernel: {log:?}"
    );
    let count = |name: &str| log.iter().filter(|k| *k == name).count();
    assert_eq!(
        (
            count("pack_f32"),
            count("ncclAllReduce"),
            dp.overlap_stats().buckets
        ),
        (4, 5, 4),
        "one pack and one all-reduce per bucket, and the exchange after the backward: {log:?}"
    );
    assert_eq!(
        (counts.host_syncs, counts.copies_dtoh),
        (0, 1),
        "no host wait but the one copy to the host, the exchange after the backward: {counts:?}"
    );
}
