//! `ops::max_pool2d`: forward against candle's pooling and a naive reference, backward against
//! central finite differences in f64 and against a naive reference gradient on inputs full of
//! ties (routed to each window's first maximum, as PyTorch does), NaN windows, every dtype, and
//! errors. Every test runs on the CPU and, with the `cuda` feature, on GPU 0.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::ops::max_pool2d;
use common::*;
use rand::{Rng, SeedableRng};

/// Window configurations `(kernel, stride, padding)`: torchvision's stem pool first, then
/// overlapping, non-overlapping and gapped windows, with and without padding.
const CONFIGS: [(usize, usize, usize); 5] = [(3, 2, 1), (3, 1, 1), (2, 2, 0), (3, 2, 0), (2, 3, 1)];
/// Input shapes `(N, C, H, W)`: odd and even sides, a 1-pixel-wide input, an empty batch.
const SHAPES: [[usize; 4]; 4] = [[2, 3, 7, 8], [1, 2, 6, 5], [1, 1, 3, 1], [0, 2, 5, 5]];

/// The naive definition: window (i, j) of plane p covers rows i·s−p .. i·s−p+k (clamped); its
/// value is its first maximum in row-major order (a NaN wins), and its gradient goes there.
/// Returns `(y, dx)` as flat f64 vectors for `x` and `dy` given as flat f64 vectors.
fn reference(
    dims: [usize; 4],
    x: &[f64],
    dy: &[f64],
    (k, s, p): (usize, usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let [n, c, h, w] = dims;
    let (oh, ow) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
    let mut y = vec![0.0; n * c * oh * ow];
    let mut dx = vec![0.0; n * c * h * w];
    for plane in 0..n * c {
        for i in 0..oh {
            for j in 0..ow {
                let mut best: Option<(f64, usize)> = None;
                for a in 0..k {
                    for b in 0..k {
                        let (r, q) = (
                            (i * s + a) as isize - p as isize,
                            (j * s + b) as isize - p as isize,
                        );
                        if r < 0 || q < 0 || r as usize >= h || q as usize >= w {
                            continue;
                        }
                        let at = plane * h * w + r as usize * w + q as usize;
                        let v = x[at];
                        if best.is_none_or(|(m, _)| v > m || v.is_nan()) {
                            best = Some((v, at));
                        }
                    }
                }
                let (v, at) = best.expect("every window holds an input element");
                let o = plane * oh * ow + i * ow + j;
                y[o] = v;
                dx[at] += dy[o];
            }
        }
    }
    (y, dx)
}

/// Seeded values `round(u·levels)/levels·scale` for u uniform in [−1, 1]: with few levels,
/// windows are full of ties; all values are exact in bf16 for levels ≤ 8, scale a power of 2.
fn values(seed: u64, len: usize, levels: f64) -> Vec<f64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len)
        .map(|_| (rng.gen_range(-1.0..1.0f64) * levels).round() / levels * 2.0)
        .collect()
}

/// `max_pool2d` forward and its gradient for a loss `Σ y·dy`, as flat f64 vectors.
fn pooled(
    dev: &Device,
    dims: [usize; 4],
    x: &[f64],
    dy: &[f64],
    cfg: (usize, usize, usize),
    dtype: DType,
) -> Result<(Vec<f64>, Vec<f64>)> {
    // Cast on the CPU, then moved: candle's CUDA casts launch an empty grid for an empty
    // tensor, which the driver refuses.
    let on_dev = |v: &[f64], dims: &[usize]| -> Result<Tensor> {
        Ok(Tensor::from_vec(v.to_vec(), dims, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?)
    };
    let xv = Var::from_tensor(&on_dev(x, &dims)?)?;
    let y = max_pool2d(xv.as_tensor(), cfg.0, cfg.1, cfg.2)?;
    let dyt = on_dev(dy, y.dims())?;
    let grads = (&y * &dyt)?.sum_all()?.backward()?;
    let dx = grads.get(xv.as_tensor()).expect("gradient of x");
    let flat = |t: &Tensor| -> Result<Vec<f64>> {
        Ok(common::cpu(t)
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1()?)
    };
    Ok((flat(&y)?, flat(dx)?))
}

fn out_len(dims: [usize; 4], (k, s, p): (usize, usize, usize)) -> usize {
    dims[0] * dims[1] * ((dims[2] + 2 * p - k) / s + 1) * ((dims[3] + 2 * p - k) / s + 1)
}

/// Ties everywhere (5 levels): the output and the gradient equal the naive reference exactly,
/// in every dtype (the values and every sum of at most 4 gradients are exact in bf16).
fn ties_route_to_the_first_maximum(dev: &Device) -> Result<()> {
    for (ci, &cfg) in CONFIGS.iter().enumerate() {
        for (si, &dims) in SHAPES.iter().enumerate() {
            if dims[2] + 2 * cfg.2 < cfg.0 || dims[3] + 2 * cfg.2 < cfg.0 {
                continue;
            }
            let seed = (10 * ci + si) as u64;
            let x = values(seed, dims.iter().product(), 2.0);
            let dy = values(seed + 100, out_len(dims, cfg), 4.0);
            let (y_ref, dx_ref) = reference(dims, &x, &dy, cfg);
            for dtype in [DType::F64, DType::F32, DType::F16, DType::BF16] {
                let (y, dx) = pooled(dev, dims, &x, &dy, cfg, dtype)?;
                assert_eq!(y, y_ref, "output, {dims:?} {cfg:?} {dtype:?}");
                assert_eq!(dx, dx_ref, "gradient, {dims:?} {cfg:?} {dtype:?}");
            }
        }
    }
    Ok(())
}

/// Central differences in f64 on inputs without ties: every element of dx.
fn gradient_matches_finite_differences(dev: &Device) -> Result<()> {
    let dims = [2, 2, 7, 6];
    for &cfg in &CONFIGS {
        let x = randn(1, &dims, 0.0, 1.0).flatten_all()?.to_vec1::<f64>()?;
        let dy = randn(2, &[out_len(dims, cfg)], 0.0, 1.0).to_vec1::<f64>()?;
        let loss = |x: &[f64]| -> Result<f64> {
            let y = max_pool2d(
                &Tensor::from_vec(x.to_vec(), &dims, dev)?,
                cfg.0,
                cfg.1,
                cfg.2,
            )?;
            Ok((y.flatten_all()? * Tensor::new(dy.as_slice(), dev)?)?
                .sum_all()?
                .to_scalar::<f64>()?)
        };
        let (_, dx) = pooled(dev, dims, &x, &dy, cfg, DType::F64)?;
        for i in 0..x.len() {
            let numeric = central_difference(|h| {
                let mut xp = x.clone();
                xp[i] += h;
                loss(&xp).unwrap()
            });
            assert_fd(&format!("dx[{i}] with (k, s, p) = {cfg:?}"), dx[i], numeric);
        }
    }
    Ok(())
}

/// Without padding, a 2×2 stride-2 pool equals candle's own (non-overlapping) max pooling, and
/// a 3×3 stride-2 pool of non-negative values with padding 1 equals candle's pooling of the
/// zero-padded input (which is how the ResNet example pooled before).
fn forward_matches_candle(dev: &Device) -> Result<()> {
    let x = randn(3, &[2, 3, 9, 8], 0.0, 1.0).to_device(dev)?;
    assert_close("2×2 / 2", &max_pool2d(&x, 2, 2, 0)?, &x.max_pool2d(2)?, 0.0);
    let r = x.relu()?;
    let padded = r.pad_with_zeros(2, 1, 1)?.pad_with_zeros(3, 1, 1)?;
    assert_close(
        "3×3 / 2, pad 1",
        &max_pool2d(&r, 3, 2, 1)?,
        &padded.max_pool2d_with_stride(3, 2)?,
        0.0,
    );
    Ok(())
}

/// A window holding a NaN outputs NaN and routes its gradient to the (last) NaN; other windows
/// are unaffected.
fn nan_wins_its_window(dev: &Device) -> Result<()> {
    let dims = [1, 1, 4, 4];
    let mut x: Vec<f64> = (0..16).map(|v| v as f64).collect();
    x[5] = f64::NAN;
    x[6] = f64::NAN;
    let dy: Vec<f64> = (1..=4).map(|v| v as f64).collect();
    let (y_ref, dx_ref) = reference(dims, &x, &dy, (2, 2, 0));
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let (y, dx) = pooled(dev, dims, &x, &dy, (2, 2, 0), dtype)?;
        let same = |a: &[f64], b: &[f64]| {
            a.iter()
                .zip(b)
                .all(|(p, q)| p == q || (p.is_nan() && q.is_nan()))
        };
        assert!(
            y[0].is_nan() && y[1].is_nan() && same(&y, &y_ref),
            "{dtype:?}: {y:?}"
        );
        assert_eq!(dx, dx_ref, "{dtype:?}");
        assert_eq!(dx[6], 2.0, "{dtype:?}: window 1's gradient goes to its NaN");
    }
    Ok(())
}

/// Non-contiguous inputs are pooled as their contiguous copy.
fn strided_input(dev: &Device) -> Result<()> {
    let x = randn(4, &[2, 5, 6, 3], 0.0, 1.0).to_device(dev)?;
    let t = x.transpose(2, 3)?; // (2, 5, 3, 6), not contiguous
    assert_close(
        "strided",
        &max_pool2d(&t, 3, 2, 1)?,
        &max_pool2d(&t.contiguous()?, 3, 2, 1)?,
        0.0,
    );
    Ok(())
}

/// Bad arguments are errors that name the op and the values.
fn bad_arguments_are_errors(dev: &Device) -> Result<()> {
    let x = randn(5, &[1, 2, 4, 4], 0.0, 1.0).to_device(dev)?;
    let err = |r: candle_core::Result<Tensor>| r.expect_err("must fail").to_string();
    assert!(err(max_pool2d(&x, 3, 2, 2))
        .contains("padding (2) must be at most half the kernel size (3)"));
    assert!(err(max_pool2d(&x, 0, 2, 0)).contains("kernel size (0)"));
    assert!(err(max_pool2d(&x, 2, 0, 0)).contains("stride (0)"));
    assert!(err(max_pool2d(&x, 7, 1, 1)).contains("smaller than the 7×7 window"));
    assert!(err(max_pool2d(&x.flatten_from(2)?, 3, 2, 1))
        .contains("expected an input of shape (N, C, H, W)"));
    assert!(err(max_pool2d(&x.to_dtype(DType::U32)?, 3, 2, 1)).contains("unsupported dtype"));
    let flat = on(dev, &Tensor::zeros((1, 2, 0, 4), DType::F32, &Device::Cpu)?);
    assert!(err(max_pool2d(&flat, 2, 2, 1)).contains("height and width must be at least 1"));
    assert!(err(max_pool2d(&x, 1 << 33, 1, 1 << 32)).contains("fit in 32 bits"));
    Ok(())
}

device_tests!(
    ties_route_to_the_first_maximum,
    gradient_matches_finite_differences,
    forward_matches_candle,
    nan_wins_its_window,
    strided_input,
    bad_arguments_are_errors,
);
