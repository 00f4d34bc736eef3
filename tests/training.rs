//! The training loop's machinery on thread ranks: loss scaling (`amp::GradScaler`), gradient
//! accumulation with one all-reduce per step, 16-bit gradients on the wire and uneven inputs
//! (`DataParallel::join_step`), each against one process on the same data.

mod common;

use candle_core::{DType, Tensor, Var};
use candle_distributed::amp::{GradScaler, GradScalerConfig, GradScalerState};
use candle_distributed::DataParallel;
use candle_nn::{Optimizer, VarMap, SGD};
use common::training::*;
use common::*;

// ---------------------------------------------------------------------------------------------
// GradScaler

/// The scale after each step of a sequence of found-inf flags, growth interval 3, computed by
/// hand from PyTorch's rule.
#[test]
fn the_scale_follows_pytorchs_rule() {
    let mut s = GradScaler::new(
        GradScalerConfig::default()
            .with_init_scale(8.0)
            .with_growth_interval(3),
    )
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
    let mut big = GradScaler::new(
        GradScalerConfig::default()
            .with_init_scale(2f64.powi(127))
            .with_growth_interval(1),
    )
    .unwrap();
    big.update(false);
    assert_eq!(big.scale_factor(), 2f64.powi(127));
    // An f16 loss is scaled in f32: 2.25 · 2¹⁶ overflows f16 (and 2¹⁶ itself does).
    let d = GradScaler::new(GradScalerConfig::default()).unwrap();
    let loss = Tensor::new(2.25f32, &candle_core::Device::Cpu)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let scaled = d.scale(&loss).unwrap();
    assert_eq!(scaled.dtype(), DType::F32);
    assert_eq!(scaled.to_scalar::<f32>().unwrap(), 2.25 * 65536.0);
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
            GradScalerConfig::default().with_init_scale(0.0),
            "init_scale",
        ),
        (
            GradScalerConfig::default().with_init_scale(1e39), // beyond f32
            "init_scale",
        ),
        (
            GradScalerConfig::default().with_growth_factor(1.0),
            "growth_factor",
        ),
        (
            GradScalerConfig::default().with_backoff_factor(1.5),
            "backoff_factor",
        ),
        (
            GradScalerConfig::default().with_growth_interval(0),
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
        let mut scaler = GradScaler::new(GradScalerConfig::default().with_init_scale(1024.0))?;
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
                .filter(|((n, _), _)| !is_buffer(n))
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
    v.iter().filter(|(n, _)| !is_buffer(n)).cloned().collect()
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

/// 3 micro-batches per step on 2 ranks: 2 SyncBatchNorm all-reduces per micro-batch
/// (forward and backward) and one gradient all-reduce per step; the steps equal one process
/// summing the gradients of the same micro-batches (with batch norm, the statistics are per
/// micro-batch on both sides); running statistics included.
/// [`accumulated_rank`] on `world` thread ranks.
fn accumulated_run(
    world: usize,
    k: usize,
    wire: Option<DType>,
    dtype: DType,
) -> Vec<(Vec<(String, Tensor)>, usize)> {
    run_ranks(world, |comm| accumulated_rank(comm, k, wire, dtype))
}

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

/// Ranks with 5, 3 and 0 batches (of 3, 2 and 4 samples) in an epoch: every rank leaves the
/// loop after step 5, having served the SyncBatchNorm and gradient all-reduces of the others
/// with empty batches; the steps (weights and running statistics) equal one process on the
/// concatenation of each step's batches.
#[test]
fn uneven_inputs_finish_everywhere_and_match_one_process() {
    let (batches, sizes) = ([5usize, 3, 0], [3usize, 2, 4]);
    let out = run_ranks(3, |comm| uneven_rank(comm, &batches, &sizes));
    let want = uneven_reference(&batches, &sizes);
    for (r, (steps, got)) in out.iter().enumerate() {
        assert_eq!(*steps, 5, "rank {r}: steps taken");
        compare(&format!("rank {r}"), got, &want, tol::F64_STEPS);
    }
}

/// `SyncBatchNorm::shift` after a training step is that step's global mean; `set_shift`
/// restores it (a layer given another's shift computes the same next step, bit for bit) and
/// refuses a wrong shape or a non-finite value, leaving the layer unchanged.
#[test]
fn the_shift_round_trips() {
    let comm = solo();
    let build = || {
        let vm = VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &candle_core::Device::Cpu);
        let bn = candle_distributed::sync_batch_norm(
            3,
            candle_distributed::SyncBatchNormConfig::default(),
            vb,
            comm.clone(),
        );
        (bn.unwrap(), vm)
    };
    let x1 = randn(1, &[4, 3, 2, 2], 50.0, 2.0)
        .to_dtype(DType::F32)
        .unwrap();
    let x2 = randn(2, &[4, 3, 2, 2], 50.0, 2.0)
        .to_dtype(DType::F32)
        .unwrap();
    let (a, va) = build();
    assert!(a.shift().is_none(), "no shift before the first step");
    candle_nn::ModuleT::forward_t(&a, &x1, true).unwrap();
    let shift = a.shift().expect("a shift after a step");
    let mean = x1
        .to_dtype(DType::F64)
        .unwrap()
        .transpose(0, 1)
        .unwrap()
        .flatten_from(1)
        .unwrap()
        .mean(1)
        .unwrap();
    assert_close("shift = the step's mean", &shift, &mean, 1e-12);
    // A fresh layer with the running statistics and the shift of `a` takes the same step.
    let (b, vb) = build();
    for name in ["running_mean", "running_var"] {
        var(&vb, name).set(var(&va, name).as_tensor()).unwrap();
    }
    b.set_shift(Some(&shift)).unwrap();
    let ya = candle_nn::ModuleT::forward_t(&a, &x2, true).unwrap();
    let yb = candle_nn::ModuleT::forward_t(&b, &x2, true).unwrap();
    assert_close("output", &ya, &yb, 0.0);
    let before = b.shift().unwrap();
    let err = b
        .set_shift(Some(
            &Tensor::zeros(4, DType::F64, &candle_core::Device::Cpu).unwrap(),
        ))
        .unwrap_err()
        .to_string();
    assert!(err.contains("set_shift") && err.contains("[3]"), "{err}");
    let nan = Tensor::new(&[0.0, f64::NAN, 1.0], &candle_core::Device::Cpu).unwrap();
    let err = b.set_shift(Some(&nan)).unwrap_err().to_string();
    assert!(err.contains("finite"), "{err}");
    assert_close("unchanged", &b.shift().unwrap(), &before, 0.0);
}
