//! Half-precision inputs against the f32 computation, and data whose mean is much larger than
//! its spread against f64 references; plus the number of collectives per step.

mod common;

use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use candle_distributed::collective::Collective;
use candle_distributed::SyncBatchNormConfig;
use candle_nn::ModuleT;
use common::*;

/// Relative precision of the storage type (outputs are rounded to it), with slack for the
/// gradient, which goes through two rounded tensors.
const TOL_F16: f64 = 4.0 * 9.8e-4;
const TOL_BF16: f64 = 4.0 * 7.9e-3;
/// f32 output of well-conditioned data of magnitude ~3.
const TOL_F32_OUT: f64 = 1e-5;

/// Output and dx of a 2-rank training step in `dtype`, returned in f64.
fn step_in(dtype: DType, x: &Tensor, wl: &Tensor) -> Vec<(Tensor, Tensor)> {
    let params = Params::random(3, x.dim(1).unwrap());
    run_ranks(2, |comm| {
        let r = comm.rank();
        let cfg = SyncBatchNormConfig {
            fuse_relu: true,
            ..Default::default()
        };
        let (bn, _) = layer(x.dim(1)?, cfg, comm, Some(&params), DType::F32);
        let xs = split_batch(x, &[3, 2])[r].to_dtype(dtype)?;
        let xv = Var::from_tensor(&xs)?;
        let y = bn.forward_t(xv.as_tensor(), true)?;
        let w = split_batch(wl, &[3, 2])[r].to_dtype(dtype)?;
        let g = (y.to_dtype(DType::F32)? * w.to_dtype(DType::F32)?)?
            .sum_all()?
            .backward()?;
        let dx = g.get(xv.as_tensor()).unwrap().to_dtype(DType::F64)?;
        Ok((y.to_dtype(DType::F64)?, dx))
    })
}

#[test]
fn half_precision_inputs_match_the_f32_computation() {
    let x = randn(1, &[5, 4, 6, 6], 1.0, 2.0);
    let wl = randn(2, &[5, 4, 6, 6], 0.0, 1.0);
    let reference = step_in(DType::F32, &x, &wl);
    for (dtype, tol) in [(DType::F16, TOL_F16), (DType::BF16, TOL_BF16)] {
        let out = step_in(dtype, &x, &wl);
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
}

/// Mean 1e4, spread 1e-2: Σx² − (Σx)²/n would lose everything; shifted sums must not.
#[test]
fn large_mean_small_spread_matches_f64() -> anyhow::Result<()> {
    let c = 3;
    for dtype in [DType::F32, DType::F64] {
        let x = randn(5, &[6, c, 8, 8], 1e4, 1e-2)
            .to_dtype(dtype)?
            .to_dtype(DType::F64)?;
        let (y_ref, _, var_ref) = reference_bn(&x, None, None, None, false, 1e-5);
        let n = (x.elem_count() / c) as f64;
        let outs = run_ranks(3, |comm| {
            let r = comm.rank();
            let cfg = SyncBatchNormConfig {
                affine: false,
                momentum: Some(1.0),
                ..Default::default()
            };
            let (bn, _) = layer(c, cfg, comm, None, DType::F64);
            let y = bn.forward_t(&split_batch(&x, &[1, 3, 2])[r].to_dtype(dtype)?, true)?;
            Ok((y.to_dtype(DType::F64)?, bn.running_var().unwrap().clone()))
        });
        // running_var = M2/(n−1) with momentum 1.
        let var_unbiased = (var_ref * (n / (n - 1.0)))?;
        let (tol_y, tol_var) = match dtype {
            DType::F32 => (TOL_F32_OUT, 1e-6),
            _ => (1e-9, 1e-9),
        };
        for (r, (piece, out)) in split_batch(&y_ref, &[1, 3, 2])
            .iter()
            .zip(&outs)
            .enumerate()
        {
            assert_close(&format!("{dtype:?} output rank {r}"), &out.0, piece, tol_y);
            let rel = ((&out.1 - &var_unbiased)? / &var_unbiased)?;
            let worst = rel.abs()?.max(0)?.to_scalar::<f64>()?;
            assert!(
                worst <= tol_var,
                "{dtype:?} running_var relative error {worst:e} > {tol_var:e}"
            );
        }
    }
    Ok(())
}

/// One all-reduce in the training forward and one in the backward; a second forward
/// collective only on a first step whose shift (0) was far from the mean.
#[test]
fn one_collective_per_direction() {
    let counts = run_ranks(2, |comm| {
        let counting = Counting::new(comm);
        let comm: Arc<dyn Collective> = counting.clone();
        let (bn, _) = layer(
            3,
            SyncBatchNormConfig::default(),
            comm.clone(),
            Some(&Params::random(1, 3)),
            DType::F32,
        );
        let (bn_far, _) = layer(3, SyncBatchNormConfig::default(), comm, None, DType::F32);
        let mut seen = Vec::new();
        for step in 0..3u64 {
            let x = Var::from_tensor(&randn(step, &[2, 3, 4, 4], 0.5, 1.0).to_dtype(DType::F32)?)?;
            let before = counting.count();
            let y = bn.forward_t(x.as_tensor(), true)?;
            seen.push(counting.count() - before);
            let before = counting.count();
            y.sum_all()?.backward()?;
            seen.push(counting.count() - before);
        }
        for step in 0..2u64 {
            let x = randn(10 + step, &[2, 3, 4, 4], 1e3, 1e-1).to_dtype(DType::F32)?;
            let before = counting.count();
            bn_far.forward_t(&x, true)?;
            seen.push(counting.count() - before);
        }
        let before = counting.count();
        bn.forward_t(
            &randn(20, &[2, 3, 4, 4], 0.5, 1.0).to_dtype(DType::F32)?,
            false,
        )?;
        seen.push(counting.count() - before);
        Ok(seen)
    });
    for seen in counts {
        // 3 × (forward 1, backward 1), far data: first step 2 then 1, eval 0.
        assert_eq!(seen, vec![1, 1, 1, 1, 1, 1, 2, 1, 0]);
    }
}
