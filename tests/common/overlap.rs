//! A replica twice, for the overlapped backward's suites (`tests/overlap.rs` on thread ranks,
//! `tests/mpi.rs` on MPI processes): one built through `GradHooks` and stepped with
//! `DataParallel::backward` (overlapped), one built from its `VarMap` and stepped with
//! `loss.backward()` + `sync_gradients`; their gradients and variables compared bit for bit.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_distributed::collective::Collective;
use candle_distributed::{sync_batch_norm, DataParallel, GradHooks, SyncBatchNormConfig};
use candle_nn::{conv2d, linear, Conv2dConfig, ModuleT, Optimizer, VarBuilder, VarMap, SGD};

use super::{on, randn};

/// conv → SyncBatchNorm+ReLU → global mean → linear → linear (the last sharing nothing), in
/// f32; `unused` adds a linear layer the forward never calls.
pub struct Net {
    conv: candle_nn::Conv2d,
    bn: candle_distributed::SyncBatchNorm,
    fc: candle_nn::Linear,
    head: candle_nn::Linear,
}

pub fn net(vb: VarBuilder, comm: Arc<dyn Collective>, unused: bool) -> anyhow::Result<Net> {
    let conv = conv2d(3, 6, 3, Conv2dConfig::default(), vb.pp("conv"))?;
    let cfg = SyncBatchNormConfig::default().with_fuse_relu(true);
    let bn = sync_batch_norm(6, cfg, vb.pp("bn"), comm)?;
    let fc = linear(6, 5, vb.pp("fc"))?;
    if unused {
        linear(5, 5, vb.pp("spare"))?;
    }
    let head = linear(5, 4, vb.pp("head"))?;
    Ok(Net { conv, bn, fc, head })
}

impl Net {
    pub fn loss(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.bn.forward_t(&self.conv.forward(x)?, true)?;
        let y = self.fc.forward(&y.mean(D::Minus1)?.mean(D::Minus1)?)?;
        self.head.forward(&y)?.sqr()?.mean_all()
    }
}

/// Seeded values for every trainable variable (the same on every rank and in both models).
pub fn seed(vm: &VarMap) {
    let data = vm.data().lock().unwrap();
    for (name, v) in data.iter() {
        if name.contains("running") || name.contains("num_batches") {
            continue;
        }
        let by_name = name
            .bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31) ^ b as u64);
        v.set(&on(
            v.device(),
            &randn(by_name % 997, v.dims(), 0.0, 0.3)
                .to_dtype(DType::F32)
                .unwrap(),
        ))
        .unwrap();
    }
}

/// Rank `r`'s batch of step `s`: 4 images.
pub fn batch(r: usize, s: u64, dev: &Device) -> Tensor {
    on(
        dev,
        &randn(100 * s + r as u64, &[4, 3, 5, 5], 0.5, 1.0)
            .to_dtype(DType::F32)
            .unwrap(),
    )
}

/// Every trainable gradient of `grads`, by name, flattened to f32 values.
pub fn flat(vm: &VarMap, grads: &GradStore) -> Vec<(String, Option<Vec<f32>>)> {
    let data = vm.data().lock().unwrap();
    let mut out: Vec<_> = data
        .iter()
        .filter(|(k, _)| !k.contains("running") && !k.contains("num_batches"))
        .map(|(k, v)| {
            let g = grads.get(v.as_tensor()).map(|g| {
                g.flatten_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            });
            (k.clone(), g)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The same replica twice, seeded alike: `model_o` built through `hooks` over `vm_o` (for the
/// overlapped path), `model_p` from its own `vm_p` (for the plain one).
pub struct Twin<M = Net> {
    pub vm_o: VarMap,
    pub model_o: M,
    pub vm_p: VarMap,
    pub model_p: M,
    pub hooks: GradHooks,
}

/// [`Twin`] of the model `build` makes from a builder.
pub fn twin_of<M>(
    dev: &Device,
    build: impl Fn(VarBuilder<'static>) -> anyhow::Result<M>,
) -> anyhow::Result<Twin<M>> {
    let (vm_o, vm_p, hooks) = (VarMap::new(), VarMap::new(), GradHooks::new());
    let model_o = build(hooks.var_builder(&vm_o, DType::F32, dev))?;
    let model_p = build(VarBuilder::from_varmap(&vm_p, DType::F32, dev))?;
    seed(&vm_o);
    seed(&vm_p);
    Ok(Twin {
        vm_o,
        model_o,
        vm_p,
        model_p,
        hooks,
    })
}

/// The twin's two `DataParallel`s, one bucket per variable: the hooked one overlapped.
pub fn one_bucket_each<M>(
    t: &Twin<M>,
    comm: &Arc<dyn Collective>,
) -> anyhow::Result<(DataParallel, DataParallel)> {
    let dp_o = DataParallel::new(&t.vm_o, comm.clone())?
        .with_bucket_bytes(1)
        .with_overlap(&t.hooks)?;
    let dp_p = DataParallel::new(&t.vm_p, comm.clone())?.with_bucket_bytes(1);
    Ok((dp_o, dp_p))
}

/// [`Twin`] of [`net`].
pub fn twin(comm: Arc<dyn Collective>, dev: &Device, unused: bool) -> anyhow::Result<Twin> {
    twin_of(dev, |vb| net(vb, comm.clone(), unused))
}

/// One rank: the same replica twice, one built through `GradHooks` and stepped with
/// `DataParallel::step` (overlapped), one built from its `VarMap` and stepped with
/// `loss.backward()` + `sync_gradients` + the optimizer; 3 SGD steps. Returns, per step, both
/// gradient lists, then both final parameter lists, and the overlap statistics of the last step.
pub fn twin_steps(
    comm: Arc<dyn Collective>,
    dev: &Device,
    wire: Option<DType>,
    bucket_bytes: usize,
    unused: bool,
) -> anyhow::Result<Twins> {
    let Twin {
        vm_o,
        model_o,
        vm_p,
        model_p,
        hooks,
    } = twin(comm.clone(), dev, unused)?;
    let dp_o = DataParallel::new(&vm_o, comm.clone())?
        .with_bucket_bytes(bucket_bytes)
        .with_wire_dtype(wire)?
        .with_overlap(&hooks)?;
    let dp_p = DataParallel::new(&vm_p, comm.clone())?
        .with_bucket_bytes(bucket_bytes)
        .with_wire_dtype(wire)?;
    let mut opt_o = SGD::new(dp_o.trainable(), 0.1)?;
    let mut opt_p = SGD::new(dp_p.trainable(), 0.1)?;
    let mut steps = Vec::new();
    for s in 0..3 {
        let x = batch(comm.rank(), s, dev);
        let g_o = dp_o.backward(&model_o.loss(&x)?)?;
        let g_p = dp_p.sync_gradients(model_p.loss(&x)?.backward()?)?;
        steps.push([flat(&vm_o, &g_o), flat(&vm_p, &g_p)]);
        opt_o.step(&g_o)?;
        dp_o.refresh()?;
        opt_p.step(&g_p)?;
    }
    let end = |vm: &VarMap| {
        let data = vm.data().lock().unwrap();
        let mut v: Vec<_> = data
            .iter()
            .map(|(k, v)| {
                let t = v
                    .as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                (k.clone(), Some(t.to_vec1::<f32>().unwrap()))
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    Ok((steps, [end(&vm_o), end(&vm_p)], dp_o.overlap_stats()))
}

/// Both models' gradients by name at each step (overlapped, synced).
pub type StepGrads = [Vec<(String, Option<Vec<f32>>)>; 2];
/// [`twin_steps`]' result: per-step gradients, both final variable lists, the last step's stats.
pub type Twins = (Vec<StepGrads>, StepGrads, candle_distributed::OverlapStats);

pub fn assert_twins_equal(what: &str, outs: Vec<Twins>) {
    for (rank, (steps, end, _)) in outs.iter().enumerate() {
        for (s, [o, p]) in steps.iter().enumerate() {
            assert_eq!(
                o, p,
                "{what}: rank {rank}, step {s}: overlapped vs synced gradients"
            );
        }
        assert_eq!(
            end[0], end[1],
            "{what}: rank {rank}: variables after 3 steps"
        );
    }
}

/// Where a step routes the `extra` layer of [`Routed`]: not at all, before the tensor-parallel
/// layer, or after it (the backward reaches it before the tensor-parallel layer's collective).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Skip,
    BeforeTp,
    AfterTp,
}

/// conv → SyncBatchNorm+ReLU → global mean → fc → column-parallel linear (its backward
/// all-reduces) → gathered features → head, with a linear layer `extra` used where the step
/// routes it, per rank: stochastic depth, expert routing or a data-dependent branch as the
/// backward sees them. The tensor-parallel layer runs over the data-parallel ranks themselves
/// (its shard replicated by the broadcast, its gradient averaged): not a model anyone would
/// train, but a backward with two kinds of collective inside it.
pub struct Routed {
    conv: candle_nn::Conv2d,
    bn: candle_distributed::SyncBatchNorm,
    fc: candle_nn::Linear,
    extra: candle_nn::Linear,
    tp: candle_distributed::parallel::ColumnParallelLinear,
    head: candle_nn::Linear,
    comm: Arc<dyn Collective>,
}

pub fn routed(vb: VarBuilder, comm: Arc<dyn Collective>) -> anyhow::Result<Routed> {
    use candle_distributed::parallel::{ColumnParallelLinear, ParallelMode};
    let conv = conv2d(3, 6, 3, Conv2dConfig::default(), vb.pp("conv"))?;
    let cfg = SyncBatchNormConfig::default().with_fuse_relu(true);
    let bn = sync_batch_norm(6, cfg, vb.pp("bn"), comm.clone())?;
    let fc = linear(6, 8, vb.pp("fc"))?;
    let extra = linear(8, 8, vb.pp("extra"))?;
    let width = 8 * comm.world_size();
    let tp = ColumnParallelLinear::new(
        8,
        width,
        true,
        ParallelMode::AllReduce,
        vb.pp("tp"),
        comm.clone(),
    )?;
    let head = linear(width, 3, vb.pp("head"))?;
    Ok(Routed {
        conv,
        bn,
        fc,
        extra,
        tp,
        head,
        comm,
    })
}

impl Routed {
    pub fn loss(&self, x: &Tensor, route: Route) -> candle_core::Result<Tensor> {
        let y = self.bn.forward_t(&self.conv.forward(x)?, true)?;
        let mut y = self.fc.forward(&y.mean(D::Minus1)?.mean(D::Minus1)?)?;
        if route == Route::BeforeTp {
            y = self.extra.forward(&y)?.tanh()?;
        }
        let y = candle_distributed::parallel::gather_features(&self.tp.forward(&y)?, &self.comm)?;
        let y = if route == Route::AfterTp {
            // The same layer on the gathered features' first 8 values, added back.
            let head = y.narrow(1, 0, 8)?.contiguous()?;
            let rest = y.narrow(1, 8, y.dim(1)? - 8)?;
            Tensor::cat(&[self.extra.forward(&head)?.tanh()?, rest], 1)?
        } else {
            y
        };
        self.head.forward(&y)?.sqr()?.mean_all()
    }
}

/// The route of rank `rank` at step `step`: `extra` after the tensor-parallel layer on rank 0
/// alone (steps 0, 1: the order and places are learned from it), then before it on rank 1
/// alone (later than its learned place: its bucket starts without it on every rank and is sent
/// again), then before it on every rank, then after it on rank 0 alone (earlier than its
/// place: its bucket waits for it).
pub fn route(step: usize, rank: usize) -> Route {
    match (step, rank) {
        (0 | 1, 0) | (4, 0) => Route::AfterTp,
        (2, 1) | (3, _) => Route::BeforeTp,
        _ => Route::Skip,
    }
}

/// Steps of [`routed_steps`].
pub const ROUTED_STEPS: usize = 5;

/// One rank: [`Routed`] twice, one built through `GradHooks` and stepped with the overlapped
/// `DataParallel::backward`, one built from its `VarMap` and stepped with `loss.backward()` +
/// `sync_gradients`, one bucket per variable, [`ROUTED_STEPS`] SGD steps routed by [`route`].
/// Returns, per step, both gradient lists and the overlap statistics.
pub fn routed_steps(
    comm: Arc<dyn Collective>,
    dev: &Device,
) -> anyhow::Result<(Vec<StepGrads>, Vec<candle_distributed::OverlapStats>)> {
    let t = twin_of(dev, |vb| routed(vb, comm.clone()))?;
    let (dp_o, dp_p) = one_bucket_each(&t, &comm)?;
    let Twin {
        vm_o,
        model_o,
        vm_p,
        model_p,
        ..
    } = t;
    let mut opt_o = SGD::new(dp_o.trainable(), 0.1)?;
    let mut opt_p = SGD::new(dp_p.trainable(), 0.1)?;
    let (mut steps, mut stats) = (Vec::new(), Vec::new());
    for s in 0..ROUTED_STEPS {
        let x = batch(comm.rank(), 60 + s as u64, dev);
        let r = route(s, comm.rank());
        let g_o = dp_o.backward(&model_o.loss(&x, r)?)?;
        let g_p = dp_p.sync_gradients(model_p.loss(&x, r)?.backward()?)?;
        steps.push([flat(&vm_o, &g_o), flat(&vm_p, &g_p)]);
        stats.push(dp_o.overlap_stats());
        opt_o.step(&g_o)?;
        dp_o.refresh()?;
        opt_p.step(&g_p)?;
    }
    Ok((steps, stats))
}

/// What every suite checks of [`routed_steps`]: at every step the overlapped gradients equal
/// the synced ones bit for bit; nothing starts inside the first backward; from the second on,
/// the tensor-parallel layer's and the batch norm's collectives are announced and buckets start
/// inside the backward; the step that routes `extra` later than its learned place sends a
/// bucket again.
pub fn assert_routed(what: &str, outs: &[(Vec<StepGrads>, Vec<candle_distributed::OverlapStats>)]) {
    for (rank, (steps, stats)) in outs.iter().enumerate() {
        for (s, [o, p]) in steps.iter().enumerate() {
            assert_eq!(
                o, p,
                "{what}: rank {rank}, step {s}: overlapped vs synced gradients"
            );
        }
        assert_eq!(
            stats[0].started_during_backward, 0,
            "{what}: rank {rank}: {stats:?}"
        );
        for st in &stats[1..] {
            assert_eq!(st.announced, 2, "{what}: rank {rank}: {stats:?}");
            assert!(
                st.started_during_backward > 0,
                "{what}: rank {rank}: {stats:?}"
            );
        }
        assert!(stats[2].sent_again >= 1, "{what}: rank {rank}: {stats:?}");
        assert_eq!(stats[3].sent_again, 0, "{what}: rank {rank}: {stats:?}");
    }
}
