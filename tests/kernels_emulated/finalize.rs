//! The emulated kernels of finalize (`bn_finalize_*`) against the CPU op.

use candle_core::{DType, Device, Tensor};
use candle_distributed::args::{Finalize, RunningBuffers};
use candle_distributed::ops;

use crate::common::assert_close_rel;
use crate::harness::*;

/// Launches `bn_finalize_<dtype>` on sums `[3, C]` and shift `[C]` (f64), with the running
/// mean, variance and `num_batches_tracked` buffers when given (null pointers otherwise);
/// returns the output rows `[10, C]`.
fn finalize(
    dtype: DType,
    sums: &Tensor,
    shift: &Tensor,
    running: Option<(&mut Buf, &mut Buf, &mut Buf)>,
    momentum: f64,
    eps: f64,
    sched: &str,
) -> Tensor {
    let c = shift.elem_count();
    let (mut sb, mut kb) = (Buf::of(sums), Buf::of(shift));
    let mut out = Buf::poisoned(DType::F64, &[10, c]);
    let f = Finalize {
        sums: sb.buffer(),
        shift: kb.buffer(),
        out: out.buffer(),
        running: running.map(|(m, v, b)| RunningBuffers {
            mean: m.buffer(),
            var: v.buffer(),
            batches: b.buffer(),
        }),
        momentum,
        eps,
    };
    run(&f.call("test", dtype, c).unwrap().unwrap(), sched);
    out.tensor()
}

#[test]
fn finalize_matches_gather_stats_and_the_blend_weight() {
    let (eps, momentum) = (1e-5, 0.1);
    // The CPU finalize (which `batch_norm_gather_stats` runs) errors on n ≤ 1: those counts are
    // checked against the documented values directly.
    for (c, n, hw) in [
        (1usize, 3, 5),
        (3, 3, 5),
        (65, 2, 7),
        (300, 3, 5),
        (4, 1, 1),
        (4, 0, 3),
    ] {
        let case = Case {
            n,
            c,
            hw,
            cl: false,
        };
        let x = case.data(3, 7.0, DType::F64);
        let shift = per_channel(c, 4, 6.5, 7.5);
        let sums =
            ops::batch_norm_stats(&x, &shift, candle_distributed::ChannelLayout::ChannelsFirst)
                .unwrap();
        let got = finalize(DType::F64, &sums, &shift, None, momentum, eps, "random:3");
        let row = |i: usize| got.get(i).unwrap();
        let count = (n * hw) as f64;
        assert_close_rel(
            "count",
            &row(0),
            &Tensor::full(count, c, &Device::Cpu).unwrap(),
            0.0,
        );
        if count > 1.0 {
            let st = ops::batch_norm_gather_stats(&sums, &shift, eps).unwrap();
            for (i, want, what) in [
                (1, &st.mean, "mean"),
                (2, &st.invstd, "invstd"),
                (3, &st.var, "var"),
                (4, &st.var_unbiased, "var_unbiased"),
            ] {
                assert_close_rel(
                    &format!("bn_finalize_f64 {what} C={c}"),
                    &row(i),
                    want,
                    1e-12,
                );
            }
            let w = Tensor::full(momentum, c, &Device::Cpu).unwrap();
            assert_close_rel("blend weight", &row(5), &w, 0.0);
            // Finite batch: the next shift is the mean, the running variance's target the
            // unbiased variance.
            assert_close_rel("next shift", &row(6), &row(1), 0.0);
            assert_close_rel("running-variance target", &row(7), &row(4), 0.0);
        } else {
            let v = row(2).to_vec1::<f64>().unwrap();
            if count == 1.0 {
                assert!(v.iter().all(|v| v.is_nan()), "n = 1: invstd NaN, got {v:?}");
            } else {
                assert!(v.iter().all(|&v| v == 1.0), "n = 0: invstd 1, got {v:?}");
                assert_close_rel("n = 0: mean is the shift", &row(1), &shift, 0.0);
            }
            let zeros = Tensor::zeros(c, DType::F64, &Device::Cpu).unwrap();
            assert_close_rel("n ≤ 1: unbiased var 0", &row(4), &zeros, 0.0);
            assert_close_rel("n ≤ 1: blend weight 0", &row(5), &zeros, 0.0);
        }
    }
}

/// Channels whose sums hold NaN (channel 1) or Inf (channel 2): blend weight 0, the next shift
/// is the old shift, the running-variance target 0; channel 0 (finite) as usual. The CPU twin
/// is checked through the layer in `tests/non_finite.rs`.
#[test]
fn finalize_holds_a_non_finite_channel() {
    let (eps, momentum) = (1e-5, 0.1);
    let sums = Tensor::new(
        &[
            [12f64, 12.0, 12.0],
            [3.0, f64::NAN, 3.0],
            [40.0, 40.0, f64::INFINITY],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let shift = Tensor::new(&[1.5f64, -2.0, 0.25], &Device::Cpu).unwrap();
    let got = finalize(DType::F64, &sums, &shift, None, momentum, eps, "random:3")
        .to_vec2::<f64>()
        .unwrap();
    let (mean0, unbiased0) = (1.5 + 3.0 / 12.0, (40.0 - 3.0 * 3.0 / 12.0) / 11.0);
    assert_eq!(
        [got[5][0], got[6][0], got[7][0]],
        [momentum, mean0, unbiased0]
    );
    for c in [1, 2] {
        assert_eq!(
            [got[5][c], got[6][c], got[7][c]],
            [0.0, [1.5, -2.0, 0.25][c], 0.0],
            "channel {c}"
        );
    }
    assert!(
        got[1][1].is_nan() && !got[3][2].is_finite(),
        "the batch rows still show the bad data"
    );
}

/// The running statistics in every dtype, updated in place by `bn_finalize_<dtype>` over two
/// blocks of channels (C = 300): the new values are `old + w·(target − old)` in f64 stored
/// through f32 (an independent host computation from the kernel's own rows), the old ones
/// land in rows 8 and 9, a channel whose sums hold NaN keeps its values bitwise, and
/// `num_batches_tracked` grows by exactly 1.
#[test]
fn finalize_updates_the_running_statistics_in_place() {
    let (eps, momentum, c) = (1e-5, 0.1, 300usize);
    let case = Case {
        n: 3,
        c,
        hw: 5,
        cl: false,
    };
    let x = case.data(13, 4.0, DType::F64);
    let shift = per_channel(c, 14, 3.5, 4.5);
    let mut sums =
        ops::batch_norm_stats(&x, &shift, candle_distributed::ChannelLayout::ChannelsFirst)
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
    sums[1][7] = f64::NAN;
    let sums = Tensor::new(sums, &Device::Cpu).unwrap();
    for (dtype, suffix) in DTYPES {
        let old_mean = per_channel(c, 15, 3.0, 5.0).to_dtype(dtype).unwrap();
        let old_var = per_channel(c, 16, 0.5, 2.0).to_dtype(dtype).unwrap();
        let (mut mb, mut vb) = (Buf::of(&old_mean), Buf::of(&old_var));
        let mut bb = Buf::of(&Tensor::new(&[41i64], &Device::Cpu).unwrap());
        let name = format!("bn_finalize_{suffix}");
        let running = Some((&mut mb, &mut vb, &mut bb));
        let rows = finalize(dtype, &sums, &shift, running, momentum, eps, "random:5")
            .to_vec2::<f64>()
            .unwrap();
        let as_f64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
        let (m0, v0) = (as_f64(&old_mean), as_f64(&old_var));
        let (m1, v1) = (as_f64(&mb.tensor()), as_f64(&vb.tensor()));
        let stored = |v: f64| {
            let t = Tensor::new(&[v], &Device::Cpu).unwrap();
            let t = if dtype == DType::F64 {
                t
            } else {
                t.to_dtype(DType::F32).unwrap().to_dtype(dtype).unwrap()
            };
            as_f64(&t)[0]
        };
        for j in 0..c {
            assert_eq!(
                [rows[8][j], rows[9][j]],
                [m0[j], v0[j]],
                "{name} old rows, channel {j}"
            );
            let w = rows[5][j];
            let want_m = stored(m0[j] + (rows[6][j] - m0[j]) * w);
            let want_v = stored(v0[j] + (rows[7][j] - v0[j]) * w);
            assert_eq!([m1[j], v1[j]], [want_m, want_v], "{name} channel {j}");
            if j == 7 {
                assert_eq!(
                    [w, m1[j], v1[j]],
                    [0.0, m0[j], v0[j]],
                    "{name}: NaN channel held"
                );
            } else {
                assert_eq!(w, momentum, "{name} channel {j}");
                // (A step can round back to the old value in f16/bf16.)
                if matches!(dtype, DType::F32 | DType::F64) {
                    assert_ne!(m1[j], m0[j], "{name}: channel {j} moved");
                }
            }
        }
        let batches = bb.tensor().to_vec1::<i64>().unwrap();
        assert_eq!(batches, [42], "{name}: num_batches_tracked");
    }
}
