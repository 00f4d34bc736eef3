//! `ops::conv2d` (on the CPU its own im2col + `gemm`, on a GPU candle's forward with a faster
//! input gradient): output and gradients equal candle's within f32 rounding (1e-12 in f64 on
//! the CPU path, at the shapes its code distinguishes), and central finite differences in f64;
//! only tracked inputs get gradients; bad shapes are refused naming them.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_distributed::ops::conv2d;
use common::{on, randn};

/// (batch, C_in, C_out, side, kernel, padding, stride): stride 1 with "same" and "valid"
/// padding and a 5×5 kernel, and stride 2 with 3×3 and 1×1 kernels.
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

/// Output within 1e-6 and gradients within 1e-5 of the largest value (f32 sums in another
/// order) of candle's own `conv2d` and backward, for every case; a loss weighted by a random
/// tensor, so that no gradient is uniform. (On the CPU the op is its own im2col + `gemm`; on a
/// GPU candle's forward.)
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
        let rel = max_rel(&ours, &theirs)?;
        assert!(
            rel < 1e-6,
            "case {i}: the forward off by {rel:e} (relative)"
        );
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
/// element of x and w, for a stride-1 and two stride-2 cases, one of them rectangular with an
/// odd height and an even width after padding (candle's own backward fails there): within 1e-7
/// relative.
fn gradients_match_finite_differences(dev: &Device) -> anyhow::Result<()> {
    let cases = [
        (2, 2, 3, 5, 5, 3, 1, 1),
        (2, 2, 3, 6, 6, 3, 1, 2),
        (2, 2, 3, 6, 5, 3, 1, 2),
    ];
    for (n, cin, cout, h, wd, k, p, s) in cases {
        let x = Var::from_tensor(&on(dev, &randn(1, &[n, cin, h, wd], 0.0, 1.0)))?;
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
        (
            "kernel larger than the padded input",
            w(&[3, 2, 9, 9]),
            1,
            1,
        ),
    ] {
        let e = conv2d(&x, &w, p, s).unwrap_err().to_string();
        assert!(
            e.contains("conv2d") && e.contains("[1, 2, 5, 5]"),
            "{what}: {e}"
        );
    }
    Ok(())
}

/// The CPU path at the shapes its code distinguishes, in f64 against candle's convolution and
/// backward in f64 (within 1e-12 relative): rectangular planes, odd strides and paddings, a
/// batch that does not split evenly into the pool's groups, a batch of one large enough for
/// the matrix products' own threads, one large enough for the pool, and an empty batch (an
/// empty output, a zero weight gradient).
#[test]
fn the_cpu_path_matches_candle_in_f64() -> anyhow::Result<()> {
    // (batch, C_in, C_out, H, W, kernel, padding, stride)
    let cases = [
        (5, 3, 4, 7, 10, 3, 1, 1),
        (3, 2, 5, 11, 7, 5, 2, 2),
        (2, 3, 2, 9, 9, 3, 0, 3),
        (3, 4, 3, 6, 5, 3, 2, 1),
        (1, 16, 32, 32, 24, 3, 1, 1),
        (8, 16, 16, 16, 16, 3, 1, 1),
        (7, 8, 8, 12, 12, 3, 1, 2),
    ];
    for (i, (n, cin, cout, h, wd, k, p, s)) in cases.into_iter().enumerate() {
        let seed = 100 + 10 * i as u64;
        let x = Var::from_tensor(&randn(seed, &[n, cin, h, wd], 0.5, 1.0))?;
        let w = Var::from_tensor(&randn(seed + 1, &[cout, cin, k, k], 0.0, 0.5))?;
        let ours = conv2d(x.as_tensor(), w.as_tensor(), p, s)?;
        let theirs = x.as_tensor().conv2d(w.as_tensor(), p, s, 1, 1)?;
        assert_eq!(ours.dims(), theirs.dims(), "case {i}");
        let r = randn(seed + 2, ours.dims(), 0.0, 1.0);
        let g_ours = (&ours * &r)?.sum_all()?.backward()?;
        let g_theirs = (&theirs * &r)?.sum_all()?.backward()?;
        let checks = [
            ("y", &ours, &theirs),
            ("dx", g_ours.get(&x).unwrap(), g_theirs.get(&x).unwrap()),
            ("dw", g_ours.get(&w).unwrap(), g_theirs.get(&w).unwrap()),
        ];
        for (what, a, b) in checks {
            let rel = max_rel(a, b)?;
            assert!(
                rel < 1e-12,
                "case {i} {:?}: {what} off by {rel:e}",
                cases[i]
            );
        }
    }
    let x = Var::from_tensor(&randn(1, &[0, 3, 6, 6], 0.0, 1.0))?;
    let w = Var::from_tensor(&randn(2, &[4, 3, 3, 3], 0.0, 1.0))?;
    let y = conv2d(x.as_tensor(), w.as_tensor(), 1, 1)?;
    assert_eq!(y.dims(), &[0, 4, 6, 6]);
    let grads = y.sum_all()?.backward()?;
    let dw = grads.get(&w).unwrap();
    assert_eq!(dw.dims(), &[4, 3, 3, 3]);
    assert_eq!(
        dw.abs()?.sum_all()?.to_scalar::<f64>()?,
        0.0,
        "an empty batch adds nothing"
    );
    Ok(())
}

/// Only the input that needs a gradient gets one: a constant input (the images) costs no
/// input gradient, a frozen weight none for the weight.
#[test]
fn only_tracked_inputs_get_gradients() -> anyhow::Result<()> {
    let x = randn(3, &[2, 3, 6, 6], 0.0, 1.0);
    let w = Var::from_tensor(&randn(4, &[4, 3, 3, 3], 0.0, 1.0))?;
    let grads = conv2d(&x, w.as_tensor(), 1, 1)?.sum_all()?.backward()?;
    assert!(grads.get(&x).is_none() && grads.get(&w).is_some());
    let x = Var::from_tensor(&x)?;
    let w = randn(4, &[4, 3, 3, 3], 0.0, 1.0);
    let grads = conv2d(x.as_tensor(), &w, 1, 1)?.sum_all()?.backward()?;
    assert!(grads.get(&x).is_some() && grads.get(&w).is_none());
    Ok(())
}

/// The layer (`candle_distributed::conv2d`) against candle-nn's `conv2d` built on the same
/// variables (same names, so the second constructor takes the first one's, reset to seeded
/// values): the same variable names and shapes, the output within 1e-6 and the gradients of the
/// input, weight and bias within 1e-5 of the largest value (f32 sums in another order), with
/// and without a bias, at stride 1 and 2, and with dilation 2 and 2 groups (candle's own
/// convolution there); an empty batch gives an empty output and nothing to the gradients.
fn the_layer_matches_candle_nns(dev: &Device) -> anyhow::Result<()> {
    use candle_core::Module;
    use candle_nn::{Conv2dConfig, VarBuilder, VarMap};
    // (C_in, C_out, k, padding, stride, dilation, groups, bias)
    let cases = [
        (4, 6, 3, 1, 1, 1, 1, true),
        (4, 6, 3, 1, 2, 1, 1, false),
        (3, 5, 1, 0, 1, 1, 1, true),
        (4, 6, 3, 2, 1, 2, 1, true),
        (4, 6, 3, 1, 1, 1, 2, true),
    ];
    for (i, (cin, cout, k, padding, stride, dilation, groups, bias)) in
        cases.into_iter().enumerate()
    {
        let seed = 100 + 10 * i as u64;
        // Rectangular at stride 1; square at stride 2, where candle's own backward fails on a
        // rectangle whose padded sides differ in parity (`gradients_match_finite_differences`).
        let width = if stride == 1 { 8 } else { 9 };
        let cfg = Conv2dConfig {
            padding,
            stride,
            dilation,
            groups,
            ..Default::default()
        };
        let mut vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, DType::F32, dev);
        let ours = match bias {
            true => candle_distributed::conv2d(cin, cout, k, cfg, vb.pp("c"))?,
            false => candle_distributed::conv2d_no_bias(cin, cout, k, cfg, vb.pp("c"))?,
        };
        let mut names: Vec<String> = vm.data().lock().unwrap().keys().cloned().collect();
        names.sort();
        let want: &[&str] = if bias {
            &["c.bias", "c.weight"]
        } else {
            &["c.weight"]
        };
        assert_eq!(names, want, "case {i}");
        vm.set_one(
            "c.weight",
            on(
                dev,
                &randn(seed, &[cout, cin / groups, k, k], 0.0, 0.5).to_dtype(DType::F32)?,
            ),
        )?;
        if bias {
            vm.set_one(
                "c.bias",
                on(
                    dev,
                    &randn(seed + 1, &[cout], 0.5, 1.0).to_dtype(DType::F32)?,
                ),
            )?;
        }
        let theirs = match bias {
            true => candle_nn::conv2d(cin, cout, k, cfg, vb.pp("c"))?,
            false => candle_nn::conv2d_no_bias(cin, cout, k, cfg, vb.pp("c"))?,
        };
        let x = Var::from_tensor(&on(
            dev,
            &randn(seed + 2, &[3, cin, 9, width], 0.0, 1.0).to_dtype(DType::F32)?,
        ))?;
        let (a, b) = (ours.forward(x.as_tensor())?, theirs.forward(x.as_tensor())?);
        assert_eq!(a.dims(), b.dims(), "case {i}");
        let rel = max_rel(&a, &b)?;
        assert!(
            rel < 1e-6,
            "case {i}: the forward off by {rel:e} (relative)"
        );
        let r = on(
            dev,
            &randn(seed + 3, a.dims(), 0.0, 1.0).to_dtype(DType::F32)?,
        );
        let (ga, gb) = (
            (&a * &r)?.sum_all()?.backward()?,
            (&b * &r)?.sum_all()?.backward()?,
        );
        let vars = vm.all_vars();
        for v in vars.iter().chain([&x]) {
            let rel = max_rel(ga.get(v).unwrap(), gb.get(v).unwrap())?;
            assert!(
                rel < 1e-5,
                "case {i}: a gradient {:?} off by {rel:e} (relative)",
                v.dims()
            );
        }
        let empty = on(
            dev,
            &Tensor::zeros((0, cin, 9, width), DType::F32, &Device::Cpu)?,
        );
        // candle-nn's layer fails on it (candle's CPU convolution panics); ours gives an empty
        // output, and nothing to the weight's gradient (here 1 from the added sum alone).
        let y = ours.forward(&empty)?;
        assert_eq!(y.dims(), [0, cout, a.dim(2)?, a.dim(3)?], "case {i}");
        let w = vm.data().lock().unwrap()["c.weight"].clone();
        let g = (y.sum_all()? + w.as_tensor().sum_all()?)?.backward()?;
        let gw = g.get(&w).unwrap().flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(gw, vec![1f32; gw.len()], "case {i}");
    }
    Ok(())
}

device_tests!(
    the_layer_matches_candle_nns,
    gradients_match_candles,
    gradients_match_finite_differences,
    bad_shapes_are_refused,
);
