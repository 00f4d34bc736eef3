//! `ops::conv2d`: candle's forward, a faster backward for the input at stride 1. Its output is
//! candle's bit for bit; its gradients equal candle's backward within f32 rounding, and central
//! finite differences in f64; bad shapes are refused naming them.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::ops::conv2d;
use common::{on, randn};

/// (batch, C_in, C_out, side, kernel, padding, stride): stride 1 (the new backward) with
/// "same" and "valid" padding and a 5×5 kernel, and stride 2 with 3×3 and 1×1 kernels (candle's).
const CASES: [(usize, usize, usize, usize, usize, usize, usize); 6] = [
    (3, 4, 5, 7, 3, 1, 1),
    (2, 3, 6, 8, 3, 0, 1),
    (2, 2, 3, 9, 5, 2, 1),
    (3, 4, 5, 8, 3, 1, 2),
    (3, 4, 5, 7, 3, 1, 2),
    (2, 4, 6, 8, 1, 0, 2),
];

fn max_rel(a: &Tensor, b: &Tensor) -> anyhow::Result<f64> {
    let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let scale = b.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-30);
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f64>()? / scale)
}

/// Output bit for bit, gradients within 1e-5 of the largest (f32 sums in another order) of
/// candle's own `conv2d` and backward, for every case; a loss weighted by a random tensor, so
/// that no gradient is uniform.
fn gradients_match_candles(dev: &Device) -> anyhow::Result<()> {
    for (i, (n, cin, cout, side, k, p, s)) in CASES.into_iter().enumerate() {
        let seed = 10 * i as u64;
        let x = Var::from_tensor(&on(
            dev,
            &randn(seed, &[n, cin, side, side], 0.0, 1.0).to_dtype(DType::F32)?,
        ))?;
        let w = Var::from_tensor(&on(
            dev,
            &randn(seed + 1, &[cout, cin, k, k], 0.0, 0.5).to_dtype(DType::F32)?,
        ))?;
        let ours = conv2d(x.as_tensor(), w.as_tensor(), p, s)?;
        let theirs = x.as_tensor().conv2d(w.as_tensor(), p, s, 1, 1)?;
        assert_eq!(ours.dims(), theirs.dims(), "case {i}");
        let diff = (&ours - &theirs)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "case {i}: the forward is candle's");
        let r = on(
            dev,
            &randn(seed + 2, ours.dims(), 0.0, 1.0).to_dtype(DType::F32)?,
        );
        let g_ours = (&ours * &r)?.sum_all()?.backward()?;
        let g_theirs = (&theirs * &r)?.sum_all()?.backward()?;
        for (what, v) in [("dx", &x), ("dw", &w)] {
            let (a, b) = (g_ours.get(v).unwrap(), g_theirs.get(v).unwrap());
            let rel = max_rel(a, b)?;
            assert!(
                rel < 1e-5,
                "case {i} {:?}: {what} off by {rel:e} (relative)",
                CASES[i]
            );
        }
    }
    Ok(())
}

/// f64 gradients against central differences (step 1e-6) of `sum(conv2d(x, w) · r)`, every
/// element of x and w, for a stride-1 and a stride-2 case: within 1e-7 relative.
fn gradients_match_finite_differences(dev: &Device) -> anyhow::Result<()> {
    for (n, cin, cout, side, k, p, s) in [(2, 2, 3, 5, 3, 1, 1), (2, 2, 3, 6, 3, 1, 2)] {
        let x = Var::from_tensor(&on(dev, &randn(1, &[n, cin, side, side], 0.0, 1.0)))?;
        let w = Var::from_tensor(&on(dev, &randn(2, &[cout, cin, k, k], 0.0, 0.5)))?;
        let out = conv2d(x.as_tensor(), w.as_tensor(), p, s)?;
        let r = on(dev, &randn(3, out.dims(), 0.0, 1.0));
        let loss = |x: &Tensor, w: &Tensor| -> anyhow::Result<f64> {
            Ok((conv2d(x, w, p, s)? * &r)?.sum_all()?.to_scalar::<f64>()?)
        };
        let grads = (out * &r)?.sum_all()?.backward()?;
        for (what, v, other) in [("dx", &x, &w), ("dw", &w, &x)] {
            let base: Vec<f64> = v.as_tensor().flatten_all()?.to_vec1()?;
            let got: Vec<f64> = grads.get(v).unwrap().flatten_all()?.to_vec1()?;
            let h = 1e-6;
            let mut worst: f64 = 0.0;
            for j in 0..base.len() {
                let at = |d: f64| -> anyhow::Result<f64> {
                    let mut b = base.clone();
                    b[j] += d;
                    let t = on(dev, &Tensor::from_vec(b, v.dims(), &Device::Cpu)?);
                    if what == "dx" {
                        loss(&t, other.as_tensor())
                    } else {
                        loss(other.as_tensor(), &t)
                    }
                };
                let fd = (at(h)? - at(-h)?) / (2.0 * h);
                worst = worst.max((fd - got[j]).abs() / got[j].abs().max(1.0));
            }
            assert!(worst < 1e-7, "stride {s}: {what} off by {worst:e}");
        }
    }
    Ok(())
}

/// Shapes the op does not take are refused, naming them.
fn bad_shapes_are_refused(dev: &Device) -> anyhow::Result<()> {
    let x = on(
        dev,
        &randn(1, &[1, 2, 5, 5], 0.0, 1.0).to_dtype(DType::F32)?,
    );
    let w = |d: &[usize]| on(dev, &randn(2, d, 0.0, 1.0).to_dtype(DType::F32).unwrap());
    for (what, w, p, s) in [
        ("non-square kernel", w(&[3, 2, 3, 1]), 0, 1),
        ("channels", w(&[3, 4, 3, 3]), 1, 1),
        ("padding", w(&[3, 2, 3, 3]), 3, 1),
        ("stride", w(&[3, 2, 3, 3]), 1, 0),
        ("rank", w(&[3, 2, 3]), 1, 1),
    ] {
        let e = conv2d(&x, &w, p, s).unwrap_err().to_string();
        assert!(
            e.contains("conv2d") && e.contains("[1, 2, 5, 5]"),
            "{what}: {e}"
        );
    }
    Ok(())
}

device_tests!(
    gradients_match_candles,
    gradients_match_finite_differences,
    bad_shapes_are_refused,
);
