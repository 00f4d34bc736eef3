//! Half-precision inputs against the f32 computation, and data whose mean is much larger than
//! its spread against f64 references; plus the number of collectives per step.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::collective::Collective;
use candle_distributed::SyncBatchNormConfig;
use candle_nn::ModuleT;
use common::*;

/// Output and dx of a 2-rank training step in `dtype` on `dev`, returned in f64 on the CPU.
fn step_in(dtype: DType, x: &Tensor, wl: &Tensor, dev: &Device) -> Vec<(Tensor, Tensor)> {
    let params = Params::random(3, x.dim(1).unwrap());
    run_ranks_on(2, dev, |comm| {
        let r = comm.rank();
        let cfg = SyncBatchNormConfig::default().with_fuse_relu(true);
        let (bn, _) = layer(x.dim(1)?, cfg, comm, Some(&params), DType::F32, dev);
        let xs = on(dev, &split_batch(x, &[3, 2])[r].to_dtype(dtype)?);
        let xv = Var::from_tensor(&xs)?;
        let y = bn.forward_t(xv.as_tensor(), true)?;
        assert_eq!(y.dtype(), dtype, "the output keeps the input dtype");
        let w = on(dev, &split_batch(wl, &[3, 2])[r].to_dtype(dtype)?);
        let g = (y.to_dtype(DType::F32)? * w.to_dtype(DType::F32)?)?
            .sum_all()?
            .backward()?;
        let dx = cpu(g.get(xv.as_tensor()).unwrap()).to_dtype(DType::F64)?;
        Ok((cpu(&y).to_dtype(DType::F64)?, dx))
    })
}

fn half_precision_inputs_match_the_f32_computation(dev: &Device) -> anyhow::Result<()> {
    let x = randn(1, &[5, 4, 6, 6], 1.0, 2.0);
    let wl = randn(2, &[5, 4, 6, 6], 0.0, 1.0);
    let reference = step_in(DType::F32, &x, &wl, dev);
    for (dtype, tol) in [(DType::F16, tol::F16), (DType::BF16, tol::BF16)] {
        let out = step_in(dtype, &x, &wl, dev);
        for r in 0..2 {
            // Outputs are O(3), gradients O(1): scale the relative tolerance accordingly.
            assert_close(
                &format!("{dtype:?} output rank {r}"),
                &out[r].0,
                &reference[r].0,
                4.0 * tol,
            );
            assert_close(
                &format!("{dtype:?} dx rank {r}"),
                &out[r].1,
                &reference[r].1,
                tol,
            );
        }
    }
    Ok(())
}

/// Relative error of the variance on a layer's first training step, whose sums are shifted by 0
/// (no global mean is known yet and only one collective is allowed): cancellation in
/// `Σx² − (Σx)²/n` costs about `ε·mean²/var` with ε = 2⁻⁵³ (≈ 1.1e-4 at mean 1e4, std 1e-2);
/// ×4 covers the f64 accumulation over the few hundred values per lane.
fn first_step_var_tol(mean: f64, std: f64) -> f64 {
    4.0 * f64::EPSILON / 2.0 * mean * mean / (std * std)
}

/// Mean 1e4, spread 1e-2: Σx² − (Σx)²/n in f32 would lose everything. The first step (shift 0)
/// is within [`first_step_var_tol`]; from the second step on, the sums are shifted by the
/// previous global mean and the statistics are as accurate as an f64 two-pass computation.
fn large_mean_small_spread_matches_f64(dev: &Device) -> anyhow::Result<()> {
    let (c, mean, std) = (3, 1e4, 1e-2);
    for dtype in [DType::F32, DType::F64] {
        let cfg = SyncBatchNormConfig::default()
            .with_affine(false)
            .with_momentum(Some(1.0));
        let steps: Vec<Tensor> = (0..3)
            .map(|s| {
                randn(5 + s, &[6, c, 8, 8], mean, std)
                    .to_dtype(dtype)
                    .and_then(|x| x.to_dtype(DType::F64))
            })
            .collect::<candle_core::Result<_>>()?;
        let outs = run_ranks_on(3, dev, |comm| {
            let r = comm.rank();
            let (bn, _) = layer(c, cfg, comm, None, DType::F64, dev);
            let mut per_step = Vec::new();
            for x in &steps {
                let xr = on(dev, &split_batch(x, &[1, 3, 2])[r].to_dtype(dtype)?);
                let y = bn.forward_t(&xr, true)?;
                // A copy on the CPU: the running statistics are updated in place by later steps.
                let running_var = cpu(&bn.running_var().unwrap().copy()?);
                per_step.push((cpu(&y).to_dtype(DType::F64)?, running_var));
            }
            Ok(per_step)
        });
        for (step, x) in steps.iter().enumerate() {
            let (y_ref, _, var_ref) = reference_bn(x, None, None, None, false, 1e-5);
            let n = (x.elem_count() / c) as f64;
            // running_var = M2/(n−1) with momentum 1.
            let var_unbiased = (var_ref * (n / (n - 1.0)))?;
            let tol_var = match (step, dtype) {
                (0, _) => first_step_var_tol(mean, std),
                (_, DType::F32) => tol::F32_VAR,
                _ => tol::F64_STEPS,
            };
            // y = (x − mean)·invstd with |y| ≲ 2: invstd's relative error is half the
            // variance's; f32 outputs are also rounded to f32.
            let tol_y = 2.0 * tol_var / 2.0
                + match dtype {
                    DType::F32 => tol::F32_OUT,
                    _ => tol::F64_STEPS,
                };
            for (r, piece) in split_batch(&y_ref, &[1, 3, 2]).iter().enumerate() {
                let (y, running_var) = &outs[r][step];
                let what = format!("{dtype:?} step {step} rank {r}");
                assert_close(&format!("{what} output"), y, piece, tol_y);
                let rel = ((running_var - &var_unbiased)? / &var_unbiased)?;
                let worst = rel.abs()?.max(0)?.to_scalar::<f64>()?;
                assert!(
                    worst <= tol_var,
                    "{what}: running_var relative error {worst:e} > {tol_var:e}"
                );
            }
        }
    }
    Ok(())
}

/// Exactly one all-reduce in the training forward and one in the backward, also for data far
/// from the first step's shift; none in eval. Their payloads are `3·C` and `2·C` values on 2
/// ranks and on 4: they do not grow with the number of ranks.
fn one_collective_per_direction(dev: &Device) -> anyhow::Result<()> {
    for world in [2, 4] {
        one_collective_per_direction_on(world, dev)?;
    }
    Ok(())
}

fn one_collective_per_direction_on(world: usize, dev: &Device) -> anyhow::Result<()> {
    let counts = run_ranks_on(world, dev, |comm| {
        let counting = Counting::new(comm);
        let comm: Arc<dyn Collective> = counting.clone();
        let (bn, _) = layer(
            3,
            SyncBatchNormConfig::default(),
            comm.clone(),
            Some(&Params::random(1, 3)),
            DType::F32,
            dev,
        );
        let (bn_far, _) = layer(
            3,
            SyncBatchNormConfig::default(),
            comm,
            None,
            DType::F32,
            dev,
        );
        let mut seen = Vec::new();
        for step in 0..3u64 {
            let x = randn(step, &[2, 3, 4, 4], 0.5, 1.0).to_dtype(DType::F32)?;
            let x = Var::from_tensor(&on(dev, &x))?;
            let before = counting.count();
            let y = bn.forward_t(x.as_tensor(), true)?;
            seen.push(counting.count() - before);
            let before = counting.count();
            y.sum_all()?.backward()?;
            seen.push(counting.count() - before);
        }
        for step in 0..2u64 {
            let x = on(
                dev,
                &randn(10 + step, &[2, 3, 4, 4], 1e3, 1e-1).to_dtype(DType::F32)?,
            );
            let before = counting.count();
            bn_far.forward_t(&x, true)?;
            seen.push(counting.count() - before);
        }
        let before = counting.count();
        let x = on(
            dev,
            &randn(20, &[2, 3, 4, 4], 0.5, 1.0).to_dtype(DType::F32)?,
        );
        bn.forward_t(&x, false)?;
        seen.push(counting.count() - before);
        Ok((seen, counting.elements()))
    });
    for (seen, elements) in counts {
        // 3 × (forward 1, backward 1), far data 1 and 1, eval 0.
        assert_eq!(seen, vec![1, 1, 1, 1, 1, 1, 1, 1, 0]);
        // C = 3: [3, C] sums forward, [2, C] backward, whatever `world`.
        assert_eq!(elements, vec![9, 6, 9, 6, 9, 6, 9, 9], "world size {world}");
    }
    Ok(())
}

device_tests!(
    half_precision_inputs_match_the_f32_computation,
    large_mean_small_spread_matches_f64,
    one_collective_per_direction,
);
