//! Data-parallel training: N thread ranks with gradient averaging (and SyncBatchNorm) take the
//! steps of one process on the concatenated batch, with SGD and AdamW; missing gradients count
//! as zero; bucketing does not change the result; unequal batches follow DDP's convention.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_distributed::collective::{Collective, Decorator, Op};
use candle_distributed::{sync_batch_norm, DataParallel, SyncBatchNormConfig};
use candle_nn::{
    conv2d, linear, AdamW, Conv2dConfig, ModuleT, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD,
};
use common::*;

const STEPS: u64 = 3;

/// conv → bn+ReLU → global mean → linear; `comm` None = plain candle-nn batch norm.
struct Net {
    conv: candle_nn::Conv2d,
    bn: Box<dyn ModuleT + Send + Sync>,
    fc: candle_nn::Linear,
}

fn net(vm: &VarMap, comm: Option<Arc<dyn Collective>>, dev: &Device) -> Net {
    let vb = VarBuilder::from_varmap(vm, DType::F64, dev);
    let conv = conv2d(3, 6, 3, Conv2dConfig::default(), vb.pp("conv")).unwrap();
    let bn: Box<dyn ModuleT + Send + Sync> = match comm {
        Some(c) => {
            let cfg = SyncBatchNormConfig::default().with_fuse_relu(true);
            Box::new(sync_batch_norm(6, cfg, vb.pp("bn"), c).unwrap())
        }
        None => Box::new(Relu(candle_nn::batch_norm(6, 1e-5, vb.pp("bn")).unwrap())),
    };
    let fc = linear(6, 4, vb.pp("fc")).unwrap();
    Net { conv, bn, fc }
}

struct Relu(candle_nn::BatchNorm);
impl ModuleT for Relu {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        self.0.forward_t(x, train)?.relu()
    }
}

impl Net {
    fn forward(&self, x: &Tensor) -> Tensor {
        let y = self
            .bn
            .forward_t(&self.conv.forward(x).unwrap(), true)
            .unwrap();
        self.fc
            .forward(&y.mean(D::Minus1).unwrap().mean(D::Minus1).unwrap())
            .unwrap()
    }
}

/// Overwrites every variable with seeded values (`salt` differs per rank to show that the
/// broadcast from rank 0 makes replicas identical).
fn seed_vars(vm: &VarMap, salt: u64) {
    let data = vm.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        if name.contains("running") || name.contains("num_batches") {
            continue;
        }
        // Seeded by name, so that models with other buffers get the same parameters.
        let by_name = name
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
        let v = &data[name];
        let t = randn(1000 * salt + by_name % 1000, v.dims(), 0.0, 0.3);
        v.set(&on(v.device(), &t)).unwrap();
    }
}

fn params(vm: &VarMap) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| !k.contains("running") && !k.contains("num_batches"))
        .map(|(k, v)| (k.clone(), cpu(&v.as_tensor().copy().unwrap())))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

enum Opt {
    Sgd,
    AdamW,
}

fn optimizer(
    kind: &Opt,
    vars: Vec<candle_core::Var>,
) -> Box<dyn FnMut(&candle_core::backprop::GradStore)> {
    match kind {
        Opt::Sgd => {
            let mut o = SGD::new(vars, 0.1).unwrap();
            Box::new(move |g| o.step(g).unwrap())
        }
        Opt::AdamW => {
            let p = ParamsAdamW {
                lr: 0.01,
                weight_decay: 0.01,
                ..Default::default()
            };
            let mut o = AdamW::new(vars, p).unwrap();
            Box::new(move |g| o.step(g).unwrap())
        }
    }
}

/// Global batch of step `s`: 12 images, labels 0..4.
fn global_batch(s: u64) -> (Tensor, Tensor) {
    let x = randn(50 + s, &[12, 3, 5, 5], 1.0, 1.0);
    let y: Vec<u32> = (0..12).map(|i| ((i as u64 * 7 + s) % 4) as u32).collect();
    (x, Tensor::new(y.as_slice(), &Device::Cpu).unwrap())
}

/// `world` ranks on `dev`, equal batches, SyncBatchNorm + DataParallel, against one process
/// with plain batch norm on the whole batch on the CPU.
fn equivalence(opt: Opt, world: usize, bucket_bytes: usize, dev: &Device) -> anyhow::Result<()> {
    let sizes = vec![12 / world; world];
    let dist = run_ranks_on(world, dev, |comm| {
        let vm = VarMap::new();
        let model = net(&vm, Some(comm.clone()), dev);
        seed_vars(&vm, comm.rank() as u64 + 1);
        let dp = DataParallel::new(&vm, comm.clone())?.with_bucket_bytes(bucket_bytes);
        let mut step = optimizer(&opt, dp.trainable());
        for s in 0..STEPS {
            let (x, y) = global_batch(s);
            let (x, y) = (
                &on(dev, &split_batch(&x, &sizes)[comm.rank()]),
                &on(dev, &split_batch(&y, &sizes)[comm.rank()]),
            );
            let loss = candle_nn::loss::cross_entropy(&model.forward(x), y)?;
            step(&dp.sync_gradients(loss.backward()?)?);
        }
        Ok(params(&vm))
    });
    let vm = VarMap::new();
    let model = net(&vm, None, &Device::Cpu);
    seed_vars(&vm, 1);
    let mut step = optimizer(
        &opt,
        vm.all_vars()
            .into_iter()
            .filter(|v| v.dtype() == DType::F64)
            .collect(),
    );
    for s in 0..STEPS {
        let (x, y) = global_batch(s);
        let loss = candle_nn::loss::cross_entropy(&model.forward(&x), &y).unwrap();
        step(&loss.backward().unwrap());
    }
    let want = params(&vm);
    for (rank, got) in dist.iter().enumerate() {
        assert_eq!(got.len(), want.len());
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            assert_close(&format!("rank {rank} {name}"), g, w, tol::F64_STEPS);
        }
    }
    Ok(())
}

fn sgd_steps_match_one_process(dev: &Device) -> anyhow::Result<()> {
    equivalence(Opt::Sgd, 4, usize::MAX, dev)
}

fn adamw_steps_match_one_process(dev: &Device) -> anyhow::Result<()> {
    equivalence(Opt::AdamW, 3, usize::MAX, dev)
}

fn small_buckets_give_the_same_steps(dev: &Device) -> anyhow::Result<()> {
    equivalence(Opt::AdamW, 2, 64, dev)
}

/// A model without batch norm, unequal batches [5, 3, 4]: each rank's loss is the mean over its
/// batch, and the averaged gradient is `(1/W) Σ_r ∇L_r` (DDP's convention), i.e. the gradient of
/// `Σ_r mean_r / W` on one process.
#[test]
fn unequal_batches_average_per_rank_means() {
    let sizes = [5usize, 3, 4];
    let x = randn(7, &[12, 6], 0.0, 1.0);
    let t = randn(8, &[12, 2], 0.0, 1.0);
    let dist = run_ranks(3, |comm| {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu);
        let model = linear(6, 2, vb.pp("fc"))?;
        seed_vars(&vm, 1);
        let dp = DataParallel::new(&vm, comm.clone())?;
        let mut opt = SGD::new(dp.trainable(), 0.5)?;
        let (xr, tr) = (
            &split_batch(&x, &sizes)[comm.rank()],
            &split_batch(&t, &sizes)[comm.rank()],
        );
        let loss = (model.forward(xr)? - tr)?.sqr()?.mean_all()?;
        opt.step(&dp.sync_gradients(loss.backward()?)?)?;
        Ok(params(&vm))
    });
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu);
    let model = linear(6, 2, vb.pp("fc")).unwrap();
    seed_vars(&vm, 1);
    let mut opt = SGD::new(vm.all_vars(), 0.5).unwrap();
    let mut loss = Tensor::new(0f64, &Device::Cpu).unwrap();
    for (xr, tr) in split_batch(&x, &sizes).iter().zip(split_batch(&t, &sizes)) {
        let l = (model.forward(xr).unwrap() - tr)
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        loss = (loss + (l / 3.0).unwrap()).unwrap();
    }
    opt.step(&loss.backward().unwrap()).unwrap();
    let want = params(&vm);
    for got in &dist {
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            assert_close(name, g, w, tol::F64_STEPS);
        }
    }
}

/// A variable used only on rank 0 gets `g0 / W` on every rank (zero elsewhere), and every rank
/// issued the same collectives.
fn a_missing_gradient_counts_as_zero(dev: &Device) -> anyhow::Result<()> {
    let outs = run_ranks_on(4, dev, |comm| {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F64, dev);
        let a = linear(3, 1, vb.pp("a"))?;
        let b = linear(3, 1, vb.pp("b"))?;
        seed_vars(&vm, 2);
        let dp = DataParallel::new(&vm, comm.clone())?;
        let x = Tensor::ones((2, 3), DType::F64, dev)?;
        let mut loss = a.forward(&x)?.sum_all()?;
        if comm.rank() == 0 {
            loss = (loss + b.forward(&x)?.sum_all()?)?;
        }
        let grads = dp.sync_gradients(loss.backward()?)?;
        let wb = vm.data().lock().unwrap()["b.weight"].clone();
        Ok(grads
            .get(wb.as_tensor())
            .map(|g| g.to_vec2::<f64>().unwrap()))
    });
    for g in outs {
        // d(sum of 2 rows of x·wᵀ)/dw = [2, 2, 2] on rank 0, averaged over 4 ranks.
        assert_eq!(g, Some(vec![vec![0.5, 0.5, 0.5]]));
    }
    Ok(())
}

/// A bucket of more variables than one packing launch takes (40, f32 and f64,
/// `common::many_vars`): each variable's gradient is the mean over ranks of the ranks'
/// gradients, zero where a rank has none; the variable no rank uses gets none.
fn a_bucket_of_many_variables_averages_each(dev: &Device) -> anyhow::Result<()> {
    use common::many_vars;
    let world = 3;
    for dtype in [DType::F32, DType::F64] {
        let outs = run_ranks_on(world, dev, |comm| {
            let vars = many_vars::vars(dtype, dev)?;
            let dp = DataParallel::from_vars(vars.clone(), vars.clone(), comm.clone())?;
            let grads = dp.sync_gradients(many_vars::loss(&vars, comm.rank())?.backward()?)?;
            Ok(vars
                .iter()
                .map(|(_, v)| {
                    (grads.get(v.as_tensor()))
                        .map(|g| g.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap())
                })
                .collect::<Vec<_>>())
        });
        many_vars::check(&format!("{dtype:?}"), &outs, world, tol::F32_OUT);
    }
    Ok(())
}

/// A variable no rank uses gets no gradient (an optimizer then leaves it alone, as in one
/// process), while the others are averaged.
#[test]
fn a_variable_unused_everywhere_gets_no_gradient() {
    let outs = run_ranks(3, |comm| {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F64, &Device::Cpu);
        let a = linear(3, 1, vb.pp("a"))?;
        let _unused = linear(3, 1, vb.pp("b"))?;
        seed_vars(&vm, 3);
        let dp = DataParallel::new(&vm, comm.clone())?;
        let x = Tensor::ones((2, 3), DType::F64, &Device::Cpu)?;
        let grads = dp.sync_gradients(a.forward(&x)?.sum_all()?.backward()?)?;
        let data = vm.data().lock().unwrap();
        Ok((
            grads.get(data["b.weight"].as_tensor()).is_none(),
            grads
                .get(data["a.weight"].as_tensor())
                .map(|g| g.to_vec2::<f64>().unwrap()),
        ))
    });
    for (none, a) in outs {
        assert!(none, "an unused variable got a gradient");
        assert_eq!(a, Some(vec![vec![2.0, 2.0, 2.0]]));
    }
}

/// A gradient whose element count differs from its variable's (a hand-made `GradStore`) is an
/// error naming the variable and both shapes, not a bucket with shifted ranges.
fn a_gradient_of_the_wrong_shape_is_refused(dev: &Device) -> anyhow::Result<()> {
    let errs = run_ranks_on(1, dev, |comm| {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, dev);
        linear(3, 2, vb.pp("fc"))?;
        let dp = DataParallel::new(&vm, comm.clone())?;
        let w = vm.data().lock().unwrap()["fc.weight"].clone();
        let mut grads = (w.as_tensor().sum_all()? * 2.0)?.backward()?;
        grads.insert(w.as_tensor(), Tensor::ones(7, DType::F32, dev)?);
        Ok(dp.sync_gradients(grads).unwrap_err().to_string())
    });
    for e in errs {
        assert!(
            e.contains("the gradient of `fc.weight` has shape [7], the variable [2, 3]"),
            "{e}"
        );
    }
    Ok(())
}

fn different_models_fail_on_every_rank(dev: &Device) -> anyhow::Result<()> {
    let errs = run_ranks_on(2, dev, |comm| {
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, dev);
        linear(3, 1 + comm.rank(), vb.pp("fc"))?;
        Ok(DataParallel::new(&vm, comm.clone())
            .unwrap_err()
            .to_string())
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(
            e.contains("models differ")
                && e.contains(
                    "`fc.weight` is [2, 3] F32 trainable on rank 1, [1, 3] F32 trainable on rank 0"
                ),
            "rank {rank}: {e}"
        );
    }
    // A variable one rank lacks, one only it has, a dtype: each named with what differs.
    let errs = run_ranks_on(3, dev, |comm| {
        let vm = VarMap::new();
        let dtype = if comm.rank() == 2 {
            DType::F64
        } else {
            DType::F32
        };
        let vb = VarBuilder::from_varmap(&vm, dtype, dev);
        linear(3, 2, vb.pp(if comm.rank() == 1 { "other" } else { "fc" }))?;
        Ok(DataParallel::new(&vm, comm.clone())
            .unwrap_err()
            .to_string())
    });
    assert!(
        errs[1].contains("rank 1 has no `fc.bias`") && errs[1].contains("rank 1 has `other.bias`"),
        "{}",
        errs[1]
    );
    assert!(errs[2].contains("`fc.weight` is [2, 3] F64"), "{}", errs[2]);
    assert!(
        errs[0].contains("rank 1"),
        "rank 0 names the first rank that differs: {}",
        errs[0]
    );
    Ok(())
}

/// A trainable variable that is not one of `all` (here on rank 1 only: a variable outside the
/// model) would never be broadcast: an error on every rank, naming it where it is.
fn a_stray_trainable_variable_fails_on_every_rank(dev: &Device) -> anyhow::Result<()> {
    let errs = run_ranks_on(2, dev, |comm| {
        let all = vec![("w".to_string(), Var::ones(3, DType::F32, dev)?)];
        let mut trainable = all.clone();
        if comm.rank() == 1 {
            trainable.push(("w".to_string(), Var::ones(3, DType::F32, dev)?));
        }
        Ok(DataParallel::from_vars(all, trainable, comm.clone())
            .unwrap_err()
            .to_string())
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(
            e.contains("every trainable variable must be one of `all`")
                && e.contains("on rank(s) [1]"),
            "{e}"
        );
        assert_eq!(e.contains(r#"here: ["w"]"#), rank == 1, "{e}");
    }
    Ok(())
}

/// Replicas start from rank 0's weights on every device: the broadcast and the model check
/// travel on the variables' device (NCCL takes nothing else).
fn replicas_start_from_rank_0(dev: &Device) -> anyhow::Result<()> {
    let weights = run_ranks_on(3, dev, |comm| {
        let vm = VarMap::new();
        let _model = net(&vm, Some(comm.clone()), dev);
        seed_vars(&vm, comm.rank() as u64 + 1);
        DataParallel::new(&vm, comm.clone())?;
        Ok(params(&vm))
    });
    for (r, w) in weights.iter().enumerate() {
        for ((name, a), (_, b)) in w.iter().zip(&weights[0]) {
            assert_close(&format!("rank {r} {name}"), a, b, 0.0);
        }
    }
    Ok(())
}

/// `inner`, except that its broadcasts fail from the `fail_at`-th on (every rank alike, so no
/// rank waits for another).
#[derive(Debug)]
struct BroadcastFails {
    inner: Arc<dyn Collective>,
    seen: std::sync::atomic::AtomicUsize,
    fail_at: usize,
}

impl Decorator for BroadcastFails {
    fn inner(&self) -> &Arc<dyn Collective> {
        &self.inner
    }
    fn before(&self, op: Op, _: Option<&Tensor>) -> candle_core::Result<()> {
        if let Op::Broadcast(_) = op {
            let n = self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            if n >= self.fail_at {
                candle_core::bail!("broadcast #{n} fails on purpose")
            }
        }
        Ok(())
    }
}

/// A broadcast that fails after the first few (of one per variable): `DataParallel::new`
/// fails and leaves every rank's variables all its own, not partly rank 0's.
fn a_failed_start_changes_no_variable(dev: &Device) -> anyhow::Result<()> {
    let out = run_ranks_on(3, dev, |comm| {
        let vm = VarMap::new();
        let _model = net(&vm, Some(comm.clone()), dev);
        seed_vars(&vm, comm.rank() as u64 + 1);
        let before = params(&vm);
        let failing = Arc::new(BroadcastFails {
            inner: comm.clone(),
            seen: Default::default(),
            fail_at: 3,
        });
        let err = DataParallel::new(&vm, failing).err().map(|e| e.to_string());
        let vars = vm.data().lock().unwrap().len();
        Ok((before, params(&vm), err, vars))
    });
    for (r, (before, after, err, vars)) in out.into_iter().enumerate() {
        assert!(
            vars > 3,
            "rank {r}: the model must have more variables than the broadcasts that succeed"
        );
        let err = err.expect("the start must fail");
        assert!(err.contains("fails on purpose"), "rank {r}: {err}");
        for ((name, a), (_, b)) in after.iter().zip(&before) {
            assert_close(&format!("rank {r} {name}"), a, b, 0.0);
        }
    }
    Ok(())
}

device_tests!(
    a_failed_start_changes_no_variable,
    sgd_steps_match_one_process,
    adamw_steps_match_one_process,
    small_buckets_give_the_same_steps,
    a_missing_gradient_counts_as_zero,
    a_bucket_of_many_variables_averages_each,
    different_models_fail_on_every_rank,
    a_gradient_of_the_wrong_shape_is_refused,
    a_stray_trainable_variable_fails_on_every_rank,
    replicas_start_from_rank_0,
);
