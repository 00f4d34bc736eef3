//! The emulated kernels of the forward elementwise pass (`bn_apply_*`) against the CPU op.

use candle_distributed::args::Apply;
use candle_distributed::ops;

use crate::common::{assert_close_rel, tol};
use crate::harness::*;

#[test]
fn apply_matches_the_cpu_op() {
    for_each_launch(|dtype, case, k, sched| {
        // Alternate the optional parts across schedules: residual, ReLU, parameters.
        let (residual, relu, affine) = (k != 1, k != 0, k != 2);
        let x = case.data(7, 2.0, dtype);
        let z = case.data(8, 0.0, dtype);
        let mean = per_channel(case.c, 9, 1.5, 2.5);
        let invstd = per_channel(case.c, 10, 0.5, 2.0);
        let w = per_channel(case.c, 11, 0.5, 1.5)
            .to_dtype(acc(dtype))
            .unwrap();
        let b = per_channel(case.c, 12, -0.5, 0.5)
            .to_dtype(acc(dtype))
            .unwrap();
        let want = ops::batch_norm_elemt(
            &x,
            &mean,
            &invstd,
            ops::ElemtConfig {
                weight: affine.then_some(&w),
                bias: affine.then_some(&b),
                residual: residual.then_some(&z),
                relu,
                layout: crate::common::layout_of(case.cl),
            },
        )
        .unwrap();
        let (mut xb, mut zb, mut mb, mut ib, mut wb, mut bb) = (
            Buf::of(&x),
            Buf::of(&z),
            Buf::of(&mean),
            Buf::of(&invstd),
            Buf::of(&w),
            Buf::of(&b),
        );
        let mut y = Buf::poisoned(dtype, &case.dims());
        let apply = Apply {
            x: xb.buffer(),
            z: residual.then(|| zb.buffer()),
            mean: mb.buffer(),
            invstd: ib.buffer(),
            weight: affine.then(|| wb.buffer()),
            bias: affine.then(|| bb.buffer()),
            y: y.buffer(),
            relu,
        };
        let Some(call) = apply.call("test", dtype, &case.extent()).unwrap() else {
            assert_eq!(want.elem_count(), 0);
            return;
        };
        run(&call, sched);
        let name = &call.name;
        assert_close_rel(
            &format!("{name} {case:?} {sched}"),
            &y.tensor(),
            &want,
            tol::emulated_elem(dtype),
        );
    });
}
