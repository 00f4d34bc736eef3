//! The training loop's machinery on thread ranks: loss scaling (`amp::GradScaler`), gradient
//! accumulation with one all-reduce per step, 16-bit gradients on the wire and uneven inputs
//! (`DataParallel::join_step`), each against one process on the same data.

mod common;

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_distributed::amp::{GradScaler, GradScalerConfig, GradScalerState};
use candle_distributed::collective::Collective;
use candle_distributed::{sync_batch_norm, DataParallel, SyncBatchNormConfig};
use candle_nn::{conv2d, linear, Conv2dConfig, ModuleT, Optimizer, VarBuilder, VarMap, SGD};
use common::*;

/// conv → batch norm + ReLU → conv → batch norm → spatial mean → linear, in `dtype`.
/// `comm` None: one process, SyncBatchNorm on a world of 1 (plain batch norm).
struct Net {
    conv1: candle_nn::Conv2d,
    bn1: candle_distributed::SyncBatchNorm,
    conv2: candle_nn::Conv2d,
    bn2: candle_distributed::SyncBatchNorm,
    fc: candle_nn::Linear,
}

fn net(vm: &VarMap, comm: Arc<dyn Collective>, dtype: DType) -> Net {
    let vb = VarBuilder::from_varmap(vm, dtype, &Device::Cpu);
    let relu = SyncBatchNormConfig {
        fuse_relu: true,
        ..Default::default()
    };
    let pad = Conv2dConfig {
        padding: 1,
        ..Default::default()
    };
    let net = Net {
        conv1: conv2d(3, 6, 3, pad, vb.pp("conv1")).unwrap(),
        bn1: sync_batch_norm(6, relu, vb.pp("bn1"), comm.clone()).unwrap(),
        conv2: conv2d(6, 5, 3, pad, vb.pp("conv2")).unwrap(),
        bn2: sync_batch_norm(5, Default::default(), vb.pp("bn2"), comm).unwrap(),
        fc: linear(5, 4, vb.pp("fc")).unwrap(),
    };
    seed(vm);
    net
}

/// Seeded parameters, by name (every rank and the reference alike).
fn seed(vm: &VarMap) {
    for (name, v) in vm.data().lock().unwrap().iter() {
        if name.contains("conv") || name.contains("fc") {
            let s = name
                .bytes()
                .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
            let t = randn(s, v.dims(), 0.0, 0.4).to_dtype(v.dtype()).unwrap();
            v.set(&t).unwrap();
        }
    }
}

impl Net {
    fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.bn1.forward_t(&self.conv1.forward(x)?, true)?;
        let h = self.bn2.forward_t(&self.conv2.forward(&h)?, true)?;
        self.fc.forward(&h.mean(D::Minus1)?.mean(D::Minus1)?)
    }

    /// The sum over the batch of the per-sample cross-entropy (0 for an empty batch, still
    /// through every layer, so that the batch norms take part in their collectives).
    fn loss_sum(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.logits(x)?;
        if x.dim(0)? == 0 {
            // candle's log-softmax refuses an empty tensor; a sum over dim 0 keeps the graph.
            // (candle drops an `affine` by 0 from the graph; a product with a zero tensor stays.)
            let s = logits.sum_keepdim(0)?.sum_all()?;
            return s.mul(&s.zeros_like()?);
        }
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
        logp.gather(&y.unsqueeze(1)?, 1)?.sum_all()?.neg()
    }
}

/// Trainable variables (not the batch-norm buffers), in name order.
fn trainable(vm: &VarMap) -> Vec<(String, Var)> {
    let mut v: Vec<(String, Var)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| !k.contains("running") && !k.contains("num_batches"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Every variable, buffers included, copied, in name order.
fn snapshot(vm: &VarMap) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// A batch of `n` images 3×4×4 and labels, seeded.
fn batch(seed: u64, n: usize) -> (Tensor, Tensor) {
    let x = randn(seed, &[n, 3, 4, 4], 0.5, 1.0);
    let y: Vec<u32> = (0..n).map(|i| ((i as u64 * 5 + seed) % 4) as u32).collect();
    (x, Tensor::new(y.as_slice(), &Device::Cpu).unwrap())
}

fn compare(what: &str, got: &[(String, Tensor)], want: &[(String, Tensor)], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: variable count");
    for ((name, g), (wname, w)) in got.iter().zip(want) {
        assert_eq!(name, wname);
        let w = w.to_dtype(g.dtype()).unwrap();
        assert_close(&format!("{what}: {name}"), g, &w, tol);
    }
}

/// One process, SyncBatchNorm on a world of 1: the reference.
fn solo() -> Arc<dyn Collective> {
    candle_distributed::collective::ThreadGroup::new(1)
        .unwrap()
        .remove(0)
}

// ---------------------------------------------------------------------------------------------
// GradScaler

/// The scale after each step of a sequence of found-inf flags, growth interval 3, computed by
/// hand from PyTorch's rule.
#[test]
fn the_scale_follows_pytorchs_rule() {
    let mut s = GradScaler::new(GradScalerConfig {
        init_scale: 8.0,
        growth_interval: 3,
        ..Default::default()
    })
    .unwrap();
    let flags = [
        false, false, false, true, false, true, false, false, false, false,
    ];
    let want = [8.0, 8.0, 16.0, 8.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0];
    for (i, (&inf, &w)) in flags.iter().zip(&want).enumerate() {
        s.update(inf);
        assert_eq!(s.scale_factor(), w, "after step {i}");
    }
    assert_eq!(s.state().growth_tracker, 1);
    // A scale whose growth would overflow f32 stays where it is.
    let mut big = GradScaler::new(GradScalerConfig {
        init_scale: 2f64.powi(127),
        growth_interval: 1,
        ..Default::default()
    })
    .unwrap();
    big.update(false);
    assert_eq!(big.scale_factor(), 2f64.powi(127));
    // The defaults are PyTorch's.
    let d = GradScalerConfig::default();
    assert_eq!(
        (
            d.init_scale,
            d.growth_factor,
            d.backoff_factor,
            d.growth_interval
        ),
        (65536.0, 2.0, 0.5, 2000)
    );
}

#[test]
fn bad_scaler_settings_are_refused() {
    for (cfg, what) in [
        (
            GradScalerConfig {
                init_scale: 0.0,
                ..Default::default()
            },
            "init_scale",
        ),
        (
            GradScalerConfig {
                growth_factor: 1.0,
                ..Default::default()
            },
            "growth_factor",
        ),
        (
            GradScalerConfig {
                backoff_factor: 1.5,
                ..Default::default()
            },
            "backoff_factor",
        ),
        (
            GradScalerConfig {
                growth_interval: 0,
                ..Default::default()
            },
            "growth_interval",
        ),
    ] {
        let err = GradScaler::new(cfg).unwrap_err().to_string();
        assert!(
            err.contains("grad_scaler") && err.contains(what),
            "{what}: {err}"
        );
    }
    let mut s = GradScaler::new(Default::default()).unwrap();
    let before = s.state();
    let bad = GradScalerState {
        scale: f64::NAN,
        growth_tracker: 3,
    };
    assert!(s.load_state(bad).unwrap_err().to_string().contains("NaN"));
    assert_eq!(s.state(), before, "a refused state changes nothing");
}

/// Three ranks; on step 1 rank 1's loss is Inf. Every rank skips that step (no weight moves
/// anywhere) and halves its scale; the other steps are those of one process without scaling,
/// bit for bit (the scale is a power of two: scaling and unscaling are exact).
#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    let sizes = [3, 2, 3];
    let steps = 3u64;
    let out = run_ranks(3, |comm| {
        let vm = VarMap::new();
        let model = net(&vm, comm.clone(), DType::F32);
        let dp = DataParallel::new(&vm, comm.clone())?;
        let vars = dp.trainable();
        let mut opt = SGD::new(vars.clone(), 0.05)?;
        let mut scaler = GradScaler::new(GradScalerConfig {
            init_scale: 1024.0,
            ..Default::default()
        })?;
        let mut log = Vec::new();
        for s in 0..steps {
            let (x, y) = batch(100 + s, 8);
            let r = comm.rank();
            let x = split_batch(&x.to_dtype(DType::F32)?, &sizes)[r].clone();
            let y = split_batch(&y, &sizes)[r].clone();
            let w = 3.0 / 8.0; // W / N
            let mut loss = (model.loss_sum(&x, &y)? * w)?;
            if s == 1 && r == 1 {
                loss = (loss * f64::INFINITY)?;
            }
            let before = snapshot(&vm);
            let grads = dp.sync_gradients(scaler.scale(&loss)?.backward()?)?;
            let stepped = scaler.step(&mut opt, grads, &vars)?;
            let moved = snapshot(&vm)
                .iter()
                .zip(&before)
                .filter(|((n, _), _)| !n.contains("running") && !n.contains("num_batches"))
                .any(|((_, a), (_, b))| max_abs_diff(a, b) > 0.0);
            log.push((stepped, moved, scaler.scale_factor()));
        }
        Ok((log, snapshot(&vm)))
    });
    for (r, (log, _)) in out.iter().enumerate() {
        assert_eq!(
            log,
            &vec![
                (true, true, 1024.0),
                (false, false, 512.0),
                (true, true, 512.0)
            ],
            "rank {r}: (stepped, weights moved, scale) per step"
        );
    }
    // One process, no scaler, skipping step 1.
    let vm = VarMap::new();
    let model = net(&vm, solo(), DType::F32);
    let mut opt = SGD::new(trainable(&vm).into_iter().map(|(_, v)| v).collect(), 0.05).unwrap();
    for s in [0, 2] {
        let (x, y) = batch(100 + s, 8);
        let loss = (model
            .loss_sum(&x.to_dtype(DType::F32).unwrap(), &y)
            .unwrap()
            / 8.0)
            .unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    let want = snapshot(&vm);
    for (r, (_, got)) in out.iter().enumerate() {
        // Not bitwise: the batch-norm sums and the gradient average are per rank, then summed.
        compare(
            &format!("rank {r}"),
            &got_trainable(got),
            &got_trainable(&want),
            1e-5,
        );
    }
}

fn got_trainable(v: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    v.iter()
        .filter(|(n, _)| !n.contains("running") && !n.contains("num_batches"))
        .cloned()
        .collect()
}

/// f16 compute with f32 master weights (the weights cast to f16 in the forward, the loss in
/// f32): a loss small enough that every f16 gradient underflows to zero without scaling; with
/// the default scale the weight gradient matches an f64 computation within f16's precision,
/// relative to its largest element.
#[test]
fn scaling_keeps_f16_gradients_from_underflowing() {
    let w64 = randn(11, &[4, 6], 0.0, 0.5);
    let x64 = randn(12, &[16, 6], 0.0, 1.0);
    // d loss / d y = 2·tiny·y / 64 ≈ 3·10⁻⁹·y: below half of f16's smallest subnormal (6·10⁻⁸)
    // for every |y| < 10 here.
    let tiny = 1e-7;
    let grad = |scaler: Option<&GradScaler>| -> Tensor {
        let w = Var::from_tensor(&w64.to_dtype(DType::F32).unwrap()).unwrap();
        let x = x64.to_dtype(DType::F16).unwrap();
        let wt = w.as_tensor().to_dtype(DType::F16).unwrap().t().unwrap();
        let y = x.matmul(&wt).unwrap().to_dtype(DType::F32).unwrap();
        let loss = (y.sqr().unwrap().mean_all().unwrap() * tiny).unwrap();
        let loss = match scaler {
            Some(s) => s.scale(&loss).unwrap(),
            None => loss,
        };
        let mut g = loss.backward().unwrap();
        if let Some(s) = scaler {
            assert!(
                !s.unscale(&mut g, std::slice::from_ref(&w)).unwrap(),
                "no overflow"
            );
        }
        g.get(w.as_tensor()).unwrap().clone()
    };
    // Reference in f64: d/dW tiny·mean((xWᵀ)²) = 2·tiny·(xWᵀ)ᵀx / 64.
    let y = x64.matmul(&w64.t().unwrap()).unwrap();
    assert!(
        y.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
            < 10.0
    );
    let want = (y.t().unwrap().matmul(&x64).unwrap() * (2.0 * tiny / 64.0)).unwrap();
    let unscaled = grad(None);
    assert_eq!(
        unscaled
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        0.0,
        "without scaling every f16 gradient underflows"
    );
    let scaled = grad(Some(&GradScaler::new(Default::default()).unwrap()));
    let largest = want
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let err = max_abs_diff(&scaled.to_dtype(DType::F64).unwrap(), &want) / largest;
    assert!(
        err <= tol::F16,
        "scaled f16 gradient: relative error {err:e} > {:e}",
        tol::F16
    );
}

// ---------------------------------------------------------------------------------------------
// Gradient accumulation and the wire dtype

/// `k` micro-batches per step on `world` ranks with one gradient all-reduce per step, SGD.
/// Returns every rank's variables and the number of collectives each issued.
fn accumulated_run(
    world: usize,
    k: usize,
    wire: Option<DType>,
    dtype: DType,
) -> Vec<(Vec<(String, Tensor)>, usize)> {
    let per_rank = 8 / world;
    run_ranks(world, |comm| {
        let probe = Probe::new(comm);
        let comm: Arc<dyn Collective> = probe.clone();
        let vm = VarMap::new();
        let model = net(&vm, comm.clone(), dtype);
        let dp = DataParallel::new(&vm, comm.clone())?.with_wire_dtype(wire)?;
        let mut opt = SGD::new(dp.trainable(), 0.05)?;
        let start = probe.count();
        for s in 0..2u64 {
            let mut acc: Option<GradStore> = None;
            for m in 0..k as u64 {
                let (x, y) = batch(200 + 10 * s + m, 8);
                let sizes = vec![per_rank; world];
                let x = split_batch(&x.to_dtype(dtype)?, &sizes)[comm.rank()].clone();
                let y = split_batch(&y, &sizes)[comm.rank()].clone();
                // Mean over the global micro-batch, and over the k micro-batches.
                let w = world as f64 / (8 * k) as f64;
                let loss = (model.loss_sum(&x, &y)? * w)?;
                acc = Some(dp.accumulate(acc, loss.backward()?)?);
            }
            opt.step(&dp.sync_gradients(acc.unwrap())?)?;
        }
        Ok((snapshot(&vm), probe.count() - start))
    })
}

/// One process, the same micro-batches, gradients summed over the k micro-batches.
fn accumulated_reference(k: usize, dtype: DType) -> Vec<(String, Tensor)> {
    let vm = VarMap::new();
    let model = net(&vm, solo(), dtype);
    let mut opt = SGD::new(trainable(&vm).into_iter().map(|(_, v)| v).collect(), 0.05).unwrap();
    for s in 0..2u64 {
        let mut total: Option<Tensor> = None;
        for m in 0..k as u64 {
            let (x, y) = batch(200 + 10 * s + m, 8);
            let l = (model.loss_sum(&x.to_dtype(dtype).unwrap(), &y).unwrap() / (8 * k) as f64)
                .unwrap();
            total = Some(match total {
                Some(t) => (t + l).unwrap(),
                None => l,
            });
        }
        opt.step(&total.unwrap().backward().unwrap()).unwrap();
    }
    snapshot(&vm)
}

/// 3 micro-batches per step on 2 ranks: 2 SyncBatchNorm all-reduces per micro-batch
/// (forward and backward) and one gradient all-reduce per step; the steps equal one process
/// summing the gradients of the same micro-batches (with batch norm, the statistics are per
/// micro-batch on both sides); running statistics included.
#[test]
fn accumulation_all_reduces_gradients_once_per_step() {
    let k = 3;
    let out = accumulated_run(2, k, None, DType::F64);
    let want = accumulated_reference(k, DType::F64);
    for (r, (got, calls)) in out.iter().enumerate() {
        // Per step: 2 batch norms × 2 directions × k micro-batches, plus 1 gradient bucket.
        assert_eq!(
            *calls,
            2 * (2 * 2 * k + 1),
            "rank {r}: collectives in 2 steps"
        );
        compare(&format!("rank {r}"), got, &want, tol::F64_STEPS);
    }
}

/// bf16 and f16 on the wire: the steps stay within the wire dtype's rounding of the f32 ones
/// (SGD moves each weight by lr·g; g is rounded to 8 or 11 significant bits once).
#[test]
fn sixteen_bit_gradients_on_the_wire_stay_close() {
    let exact = accumulated_run(2, 1, None, DType::F32);
    for (wire, tol) in [(DType::BF16, 0.05 * 4e-3), (DType::F16, 0.05 * 5e-4)] {
        let got = accumulated_run(2, 1, Some(wire), DType::F32);
        for (r, ((g, _), (e, _))) in got.iter().zip(&exact).enumerate() {
            // lr = 0.05; |g| < 1 here: the difference is at most lr · |g| · 2⁻⁸ (bf16).
            compare(&format!("{wire:?} wire, rank {r}"), g, e, tol);
        }
        let differs = got[0]
            .0
            .iter()
            .zip(&exact[0].0)
            .any(|((_, a), (_, b))| max_abs_diff(a, b) > 0.0);
        assert!(differs, "{wire:?}: the wire dtype must actually be used");
    }
    let comm = solo();
    let vm = VarMap::new();
    let _ = net(&vm, comm.clone(), DType::F32);
    let err = DataParallel::new(&vm, comm)
        .unwrap()
        .with_wire_dtype(Some(DType::F32))
        .unwrap_err()
        .to_string();
    assert!(err.contains("wire dtype") && err.contains("F32"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Uneven inputs

/// Ranks with 5, 3 and 0 batches (of 3, 2 and — sizes) in an epoch: every rank leaves the loop
/// after step 5, having served the SyncBatchNorm and gradient all-reduces of the others with
/// empty batches; the steps (weights and running statistics) equal one process on the
/// concatenation of each step's batches.
#[test]
fn uneven_inputs_finish_everywhere_and_match_one_process() {
    let batches = [5usize, 3, 0];
    let sizes = [3usize, 2, 4];
    let rank_batch = |r: usize, s: usize| batch(300 + 10 * s as u64 + r as u64, sizes[r]);
    let out = run_ranks(3, |comm| {
        let r = comm.rank();
        let vm = VarMap::new();
        let model = net(&vm, comm.clone(), DType::F64);
        let dp = DataParallel::new(&vm, comm.clone())?;
        let mut opt = SGD::new(dp.trainable(), 0.05)?;
        let mut steps = 0;
        for s in 0.. {
            let mine = (s < batches[r]).then(|| rank_batch(r, s));
            let n = mine.as_ref().map_or(0, |(x, _)| x.dim(0).unwrap());
            let step = dp.join_step(n)?;
            if step.done() {
                break;
            }
            let (x, y) = mine.unwrap_or_else(|| {
                (
                    Tensor::zeros((0, 3, 4, 4), DType::F64, &Device::Cpu).unwrap(),
                    Tensor::zeros(0, DType::U32, &Device::Cpu).unwrap(),
                )
            });
            let loss = (model.loss_sum(&x, &y)? * step.loss_weight())?;
            opt.step(&dp.sync_gradients(loss.backward()?)?)?;
            steps += 1;
        }
        Ok((steps, snapshot(&vm)))
    });
    let vm = VarMap::new();
    let model = net(&vm, solo(), DType::F64);
    let mut opt = SGD::new(trainable(&vm).into_iter().map(|(_, v)| v).collect(), 0.05).unwrap();
    for s in 0..5 {
        let parts: Vec<(Tensor, Tensor)> = (0..3)
            .filter(|&r| s < batches[r])
            .map(|r| rank_batch(r, s))
            .collect();
        let x = Tensor::cat(&parts.iter().map(|p| &p.0).collect::<Vec<_>>(), 0).unwrap();
        let y = Tensor::cat(&parts.iter().map(|p| &p.1).collect::<Vec<_>>(), 0).unwrap();
        let n = x.dim(0).unwrap() as f64;
        let loss = (model.loss_sum(&x, &y).unwrap() / n).unwrap();
        opt.step(&loss.backward().unwrap()).unwrap();
    }
    let want = snapshot(&vm);
    for (r, (steps, got)) in out.iter().enumerate() {
        assert_eq!(*steps, 5, "rank {r}: steps taken");
        compare(&format!("rank {r}"), got, &want, tol::F64_STEPS);
    }
}
