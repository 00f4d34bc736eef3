//! The public functional ops, composed by hand as a user building their own synchronized batch
//! norm would, against the reference; at sizes that take every parallel path (planes split into
//! several work items, many row blocks).

mod common;

use candle_core::{DType, Tensor, Var};
use candle_distributed::collective::ReduceOp;
use candle_distributed::ops::*;
use common::*;

const TOL: f64 = 1e-9;

/// Asserts each rank's `[y, dx, dz, dγ, dβ]` against candle's autograd through the f64
/// reference on the whole batch `inputs = [x, z, dy]` (loss `Σ y·dy`; dγ and dβ summed over
/// the ranks); returns the reference's biased variance.
fn assert_matches_reference(
    what: &str,
    ranks: &[[Tensor; 5]],
    [x, z, dy]: [&Tensor; 3],
    p: &Params,
    eps: f64,
    batches: &[usize],
) -> Tensor {
    let xv = Var::from_tensor(x).unwrap();
    let zv = Var::from_tensor(z).unwrap();
    let wv = Var::new(p.weight.as_slice(), x.device()).unwrap();
    let bv = Var::new(p.bias.as_slice(), x.device()).unwrap();
    let (y, _, var) = reference_bn(
        xv.as_tensor(),
        Some(wv.as_tensor()),
        Some(bv.as_tensor()),
        Some(zv.as_tensor()),
        true,
        eps,
    );
    let g = (&y * dy).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |v: &Var| g.get(v.as_tensor()).unwrap().clone();
    let split = |t: &Tensor| split_batch(t, batches);
    let want = [split(&y), split(&grad(&xv)), split(&grad(&zv))];
    for (r, o) in ranks.iter().enumerate() {
        for (i, name) in ["y", "dx", "dz"].iter().enumerate() {
            assert_close(&format!("{what}{name} rank {r}"), &o[i], &want[i][r], TOL);
        }
    }
    for (i, name, v) in [(3, "Σ dγ", &wv), (4, "Σ dβ", &bv)] {
        let sum = ranks
            .iter()
            .map(|o| o[i].clone())
            .reduce(|a, b| (a + b).unwrap())
            .unwrap();
        assert_close(&format!("{what}{name}"), &sum, &grad(v), TOL * 1e3);
    }
    var
}

/// `t` (channels-first) in the layout under test.
fn layout(t: &Tensor, channels_last: bool) -> Tensor {
    if channels_last {
        to_channels_last(t)
    } else {
        t.clone()
    }
}

/// A tensor of the layout under test back in channels-first order.
fn channels_first(t: &Tensor, channels_last: bool) -> Tensor {
    if channels_last {
        to_channels_first(t)
    } else {
        t.clone()
    }
}

fn check(dims_cf: &[usize], batches: &[usize], channels_last: bool) {
    let c = dims_cf[1];
    let x = randn(11, dims_cf, 3.0, 2.0);
    let dy = randn(12, dims_cf, 0.0, 1.0);
    let z = randn(13, dims_cf, 0.5, 1.0);
    let p = Params::random(14, c);
    let eps = 1e-5;
    let lay = |t: &Tensor| layout(t, channels_last);
    let unlay = |t: &Tensor| channels_first(t, channels_last);
    let outs = run_ranks(batches.len(), |comm| {
        let r = comm.rank();
        let (x, dy, z) = (
            lay(&split_batch(&x, batches)[r]),
            lay(&split_batch(&dy, batches)[r]),
            lay(&split_batch(&z, batches)[r]),
        );
        let w = Tensor::new(p.weight.as_slice(), x.device())?;
        let b = Tensor::new(p.bias.as_slice(), x.device())?;
        let shift = Tensor::full(2.5f64, c, x.device())?;
        let sums = comm.all_reduce(
            &batch_norm_stats(&x, &shift, layout_of(channels_last))?,
            ReduceOp::Sum,
        )?;
        let st = batch_norm_gather_stats(&sums, &shift, eps)?;
        let y = batch_norm_elemt(
            &x,
            &st.mean,
            &st.invstd,
            ElemtConfig {
                weight: Some(&w),
                bias: Some(&b),
                residual: Some(&z),
                relu: true,
                layout: layout_of(channels_last),
            },
        )?;
        let local =
            batch_norm_backward_reduce(&dy, &x, &st.mean, Some(&y), layout_of(channels_last))?;
        let red = comm.all_reduce(&local, ReduceOp::Sum)?;
        let (dx, dz) = batch_norm_backward_elemt(
            &dy,
            &x,
            &st.mean,
            &st.invstd,
            &red,
            &st.count,
            BackwardElemtConfig {
                weight: Some(&w),
                relu_output: Some(&y),
                want_dz: true,
                layout: layout_of(channels_last),
            },
        )?;
        let dgamma = (local.get(1)? * &st.invstd)?;
        Ok((
            unlay(&y),
            unlay(&dx),
            unlay(&dz.unwrap()),
            dgamma,
            local.get(0)?,
            st.var_unbiased,
        ))
    });
    let ranks: Vec<[Tensor; 5]> = outs
        .iter()
        .map(|o| [&o.0, &o.1, &o.2, &o.3, &o.4].map(Tensor::clone))
        .collect();
    let var = assert_matches_reference("", &ranks, [&x, &z, &dy], &p, eps, batches);
    let n = (x.elem_count() / c) as f64;
    assert_close(
        "unbiased var",
        &outs[0].5,
        &(var * (n / (n - 1.0))).unwrap(),
        TOL,
    );
}

#[test]
fn planes_larger_than_a_work_item() {
    // H·W = 40 000 > 32 768 elements per work item.
    check(&[3, 2, 200, 200], &[2, 1], false);
}

#[test]
fn many_row_blocks_channels_last() {
    check(&[6, 3, 100, 120], &[4, 0, 2], true);
}

#[test]
fn single_channel_and_odd_sizes() {
    check(&[5, 1, 7, 13], &[3, 2], false);
    check(&[5, 65, 3, 1], &[1, 4], true);
    check(&[5, 65, 3, 1], &[1, 4], false);
}

/// Channel counts and plane lengths that are not multiples of the CPU kernels' 16 lanes, over
/// many of their row sub-blocks: full tiles of channels and the channels left over, whole rows
/// of lanes and the values left over.
#[test]
fn lane_tiles_with_remainders() {
    check(&[3, 20, 17, 19], &[2, 1], false);
    check(&[3, 20, 17, 19], &[2, 1], true);
    check(&[3, 40, 9, 11], &[1, 2], true);
}

#[test]
fn half_inputs_give_f64_statistics() -> anyhow::Result<()> {
    let x = randn(1, &[4, 3, 5], 2.0, 1.0);
    let shift = Tensor::zeros(3, DType::F64, x.device())?;
    let s64 = batch_norm_stats(
        &x.to_dtype(DType::F16)?.to_dtype(DType::F64)?,
        &shift,
        ChannelLayout::ChannelsFirst,
    )?;
    let s16 = batch_norm_stats(
        &x.to_dtype(DType::F16)?,
        &shift,
        ChannelLayout::ChannelsFirst,
    )?;
    assert_eq!(s16.dtype(), DType::F64);
    assert_close("f16 stats", &s16, &s64, 1e-12);
    Ok(())
}

/// `batch_norm_elemt_autograd` with the layer's all-reduce (`batch_norm::synced`) on 3 ranks (one of them empty), its
/// gradients from candle's autograd: y, dx, dz, Σdγ and Σdβ equal the whole-batch f64
/// reference's.
#[test]
fn the_autograd_form_matches_the_whole_batch_reference() -> anyhow::Result<()> {
    let (dims, batches, c, eps) = (&[5, 3, 4, 6][..], &[3, 0, 2][..], 3, 1e-5);
    let x = randn(21, dims, 1.5, 2.0);
    let dy = randn(22, dims, 0.0, 1.0);
    let z = randn(23, dims, 0.3, 1.0);
    let p = Params::random(24, c);
    for channels_last in [false, true] {
        let lay = |t: &Tensor| layout(t, channels_last);
        let unlay = |t: &Tensor| channels_first(t, channels_last);
        let outs = run_ranks(batches.len(), |comm| {
            let r = comm.rank();
            let xv = Var::from_tensor(&lay(&split_batch(&x, batches)[r]))?;
            let zv = Var::from_tensor(&lay(&split_batch(&z, batches)[r]))?;
            let dy = lay(&split_batch(&dy, batches)[r]);
            let wv = Var::new(p.weight.as_slice(), xv.device())?;
            let bv = Var::new(p.bias.as_slice(), xv.device())?;
            let shift = Tensor::full(1.0f64, c, xv.device())?;
            let local = batch_norm_stats(xv.as_tensor(), &shift, layout_of(channels_last))?;
            let sums = comm.all_reduce(&local, ReduceOp::Sum)?;
            let st = batch_norm_gather_stats(&sums, &shift, eps)?;
            let y = batch_norm_elemt_autograd(
                xv.as_tensor(),
                &st.mean,
                &st.invstd,
                &st.count,
                ElemtConfig {
                    weight: Some(wv.as_tensor()),
                    bias: Some(bv.as_tensor()),
                    residual: Some(zv.as_tensor()),
                    relu: true,
                    layout: layout_of(channels_last),
                },
                candle_distributed::batch_norm::synced(comm.clone()),
            )?;
            let g = (&y * &dy)?.sum_all()?.backward()?;
            let grad = |v: &Var| g.get(v.as_tensor()).cloned().expect("a gradient");
            Ok([
                unlay(&y),
                unlay(&grad(&xv)),
                unlay(&grad(&zv)),
                grad(&wv),
                grad(&bv),
            ])
        });
        let what = if channels_last { "NHWC " } else { "NCHW " };
        assert_matches_reference(what, &outs, [&x, &z, &dy], &p, eps, batches);
    }
    Ok(())
}

/// `batch_norm_elemt_autograd` with `StatsGrad::Constant` (running statistics): no gradient
/// through the statistics, `dx = γ·invstd·dy` (no ReLU here); `γ` without `β`, or `β` without
/// `γ`, is refused.
#[test]
fn the_autograd_form_with_constant_statistics() -> anyhow::Result<()> {
    let (dims, c) = (&[5, 3, 4, 6][..], 3);
    let x = randn(21, dims, 1.5, 2.0);
    let dy = randn(22, dims, 0.0, 1.0);
    let p = Params::random(24, c);
    let (mean, invstd) = (
        Tensor::new(&[0.5f64, -1.0, 2.0], x.device())?,
        Tensor::new(&[1.5f64, 0.25, 2.0], x.device())?,
    );
    let count = Tensor::new(&[0f64], x.device())?;
    let xv = Var::from_tensor(&x)?;
    let w = Tensor::new(p.weight.as_slice(), x.device())?;
    let b = Tensor::new(p.bias.as_slice(), x.device())?;
    let y = batch_norm_elemt_autograd(
        xv.as_tensor(),
        &mean,
        &invstd,
        &count,
        ElemtConfig {
            weight: Some(&w),
            bias: Some(&b),
            ..Default::default()
        },
        StatsGrad::Constant,
    )?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let want = dy.broadcast_mul(&(&w * &invstd)?.reshape((1, c, 1, 1))?)?;
    assert_close(
        "constant-statistics dx",
        g.get(xv.as_tensor()).unwrap(),
        &want,
        TOL,
    );
    // The gradient is taken for γ and β together: one without the other is refused by name.
    for (weight, bias, named) in [(Some(&w), None, "weight"), (None, Some(&b), "bias")] {
        let config = ElemtConfig {
            weight,
            bias,
            ..Default::default()
        };
        let e = batch_norm_elemt_autograd(&x, &mean, &invstd, &count, config, StatsGrad::Constant)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("batch_norm_elemt") && e.contains(&format!("got only the {named}")),
            "{e}"
        );
    }
    Ok(())
}

/// `batch_norm_backward_elemt` with a different global count per channel (`[C]`), one of them 0:
/// each channel uses its own `n` (as the CUDA kernel does), and a channel without values gets
/// no correction terms. Reference: the formula evaluated element by element in f64.
#[test]
fn per_channel_counts_are_per_channel() -> anyhow::Result<()> {
    let (n, c, s) = (2, 3, 4);
    let x = randn(41, &[n, c, s], 1.0, 2.0);
    let dy = randn(42, &[n, c, s], 0.0, 1.0);
    let mean = Tensor::new(&[0.9f64, 1.1, 1.3], &x.device().clone())?;
    let invstd = Tensor::new(&[0.7f64, 1.4, 0.9], x.device())?;
    let w = Tensor::new(&[1.5f64, -0.5, 2.0], x.device())?;
    let sums = Tensor::new(&[[3.0f64, -2.0, 5.0], [7.0, 4.0, -6.0]], x.device())?;
    let counts = [10.0f64, 20.0, 0.0];
    let count = Tensor::new(&counts, x.device())?;
    let (dx, _) = batch_norm_backward_elemt(
        &dy,
        &x,
        &mean,
        &invstd,
        &sums,
        &count,
        BackwardElemtConfig {
            weight: Some(&w),
            ..Default::default()
        },
    )?;
    let (xv, dyv, dxv) = (
        x.flatten_all()?.to_vec1::<f64>()?,
        dy.flatten_all()?.to_vec1::<f64>()?,
        dx.flatten_all()?.to_vec1::<f64>()?,
    );
    let (m, is, wv, sv) = (
        mean.to_vec1::<f64>()?,
        invstd.to_vec1::<f64>()?,
        w.to_vec1::<f64>()?,
        sums.to_vec2::<f64>()?,
    );
    for (i, got) in dxv.iter().enumerate() {
        let j = (i / s) % c;
        let (b, k) = if counts[j] > 0.0 {
            (sv[0][j] / counts[j], is[j] * is[j] * sv[1][j] / counts[j])
        } else {
            (0.0, 0.0)
        };
        let want = wv[j] * is[j] * (dyv[i] - b - (xv[i] - m[j]) * k);
        assert!(
            (got - want).abs() <= 1e-12 * (1.0 + want.abs()),
            "element {i} (channel {j}): {got} vs {want}"
        );
    }
    Ok(())
}

/// Relative error of the statistics of an f32 input against the f64 two-pass computation on
/// the same values (`x` exact in f64), per channel: mean error over the standard deviation, and
/// the variance's relative error. Returns the worst of each.
fn f32_stats_errors(x: &Tensor, shift: f64, channels_last: bool) -> anyhow::Result<(f64, f64)> {
    let c = x.dim(1)?;
    let x32 = x.to_dtype(DType::F32)?;
    let l = if channels_last {
        ChannelLayout::ChannelsLast
    } else {
        ChannelLayout::ChannelsFirst
    };
    let k = Tensor::full(shift, c, x.device())?;
    let sums = batch_norm_stats(&layout(&x32, channels_last), &k, l)?.to_vec2::<f64>()?;
    let exact = x32.to_dtype(DType::F64)?;
    let axes = [0, 2, 3];
    let mean = exact.mean_keepdim(axes)?;
    let var = exact.broadcast_sub(&mean)?.sqr()?.mean_keepdim(axes)?;
    let (mean, var) = (
        mean.flatten_all()?.to_vec1::<f64>()?,
        var.flatten_all()?.to_vec1::<f64>()?,
    );
    let (mut worst_mean, mut worst_var) = (0f64, 0f64);
    for j in 0..c {
        let n = sums[0][j];
        let (a, b) = (sums[1][j] / n, sums[2][j] / n);
        worst_mean = worst_mean.max((a + shift - mean[j]).abs() / var[j].sqrt());
        worst_var = worst_var.max(((b - a * a) - var[j]).abs() / var[j]);
    }
    Ok((worst_mean, worst_var))
}

/// f32 inputs, whose statistics are summed in f64, on both layouts, with channel counts that
/// fill the CPU kernels' lane tiles (16, 48) and leave channels over (19): against the f64
/// two-pass statistics of the same values the variance is off by at most [`tol::F32_VAR`] and
/// the mean by as much of a standard deviation, on data far from zero whose values are not small
/// multiples of one another (so that f32 sums would round: summing in f32 over 16 values per
/// lane before f64 was off by 1e-8 to 3e-8 here), shifted from the mean by 0.4 standard
/// deviations and by 17.
#[test]
fn f32_inputs_get_f64_accurate_statistics() -> anyhow::Result<()> {
    for (seed, c) in [(41, 16), (42, 48), (43, 19)] {
        let x = randn(seed, &[8, c, 20, 20], 10.0, 0.5);
        for channels_last in [false, true] {
            for shift in [9.8, -7.0] {
                let (mean_err, var_err) = f32_stats_errors(&x, shift, channels_last)?;
                assert!(
                    mean_err <= tol::F32_VAR && var_err <= tol::F32_VAR,
                    "C {c}, channels-last {channels_last}, shift {shift}: mean off by {mean_err:e} std, variance by {var_err:e} (relative) > {:e}",
                    tol::F32_VAR
                );
            }
        }
    }
    Ok(())
}
