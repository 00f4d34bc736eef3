//! The emulated kernels of the backward reduction and elementwise passes (`bn_backward_reduce_*`, `bn_backward_elemt_*`) against the CPU op.

use candle_core::{DType, Device, Tensor};
use candle_distributed::args::{BackwardElemt, BackwardReduce};
use candle_distributed::ops;

use crate::common::{assert_close_rel, tol};
use crate::harness::*;

#[test]
fn backward_reduce_matches_the_cpu_op() {
    for_each_launch(|dtype, case, k, sched| {
        let relu = k != 1;
        let dy = case.data(13, 0.0, dtype);
        let x = case.data(14, 1.0, dtype);
        // A fused-ReLU output whose sign varies: y = x − 1 (mean 0).
        let y = case.data(14, 0.0, dtype);
        let mean = per_channel(case.c, 15, 0.5, 1.5);
        let want = ops::batch_norm_backward_reduce(
            &dy,
            &x,
            &mean,
            relu.then_some(&y),
            crate::common::layout_of(case.cl),
        )
        .unwrap();
        let (mut db, mut xb, mut yb, mut mb) =
            (Buf::of(&dy), Buf::of(&x), Buf::of(&y), Buf::of(&mean));
        let (name, got) = reduce(&case, 2, sched, |out, scratch| {
            let reduce = BackwardReduce {
                dy: db.buffer(),
                x: xb.buffer(),
                y: relu.then(|| yb.buffer()),
                mean: mb.buffer(),
                out,
                scratch,
            };
            reduce.call("test", dtype, &case.extent()).unwrap().unwrap()
        });
        assert_close_rel(
            &format!("{name} {case:?} {sched}"),
            &got,
            &want,
            tol::emulated_reduce(dtype),
        );
    });
}

#[test]
fn backward_elemt_matches_the_cpu_op() {
    for_each_launch(|dtype, case, k, sched| {
        let (relu, want_dz, affine) = (k != 1, k != 2, k != 0);
        let dy = case.data(16, 0.0, dtype);
        let x = case.data(17, 1.0, dtype);
        let y = case.data(17, 0.0, dtype);
        let mean = per_channel(case.c, 18, 0.5, 1.5);
        let invstd = per_channel(case.c, 19, 0.5, 2.0);
        let w = per_channel(case.c, 20, 0.5, 1.5)
            .to_dtype(acc(dtype))
            .unwrap();
        let sums = Tensor::stack(
            &[
                per_channel(case.c, 21, -5.0, 5.0),
                per_channel(case.c, 22, -5.0, 5.0),
            ],
            0,
        )
        .unwrap();
        let count = 37.0;
        let counts = Tensor::full(count, case.c, &Device::Cpu).unwrap();
        let (dx_want, dz_want) = ops::batch_norm_backward_elemt(
            &dy,
            &x,
            &mean,
            &invstd,
            &sums,
            &counts,
            ops::BackwardElemtConfig {
                weight: affine.then_some(&w),
                relu_output: relu.then_some(&y),
                want_dz,
                layout: crate::common::layout_of(case.cl),
            },
        )
        .unwrap();
        let (mut db, mut xb, mut yb, mut mb, mut ib, mut wb, mut sb, mut cb) = (
            Buf::of(&dy),
            Buf::of(&x),
            Buf::of(&y),
            Buf::of(&mean),
            Buf::of(&invstd),
            Buf::of(&w),
            Buf::of(&sums),
            Buf::of(&counts),
        );
        let mut dx = Buf::poisoned(dtype, &case.dims());
        let mut dz = Buf::poisoned(dtype, &case.dims());
        let elemt = BackwardElemt {
            dy: db.buffer(),
            x: xb.buffer(),
            y: relu.then(|| yb.buffer()),
            mean: mb.buffer(),
            invstd: ib.buffer(),
            weight: affine.then(|| wb.buffer()),
            sums: sb.buffer(),
            count: cb.buffer(),
            dx: dx.buffer(),
            dz: want_dz.then(|| dz.buffer()),
        };
        let Some(call) = elemt.call("test", dtype, &case.extent()).unwrap() else {
            assert_eq!(dx_want.elem_count(), 0);
            return;
        };
        run(&call, sched);
        let name = &call.name;
        let what = format!("{name} {case:?} {sched}");
        let want = (dx_want, dz_want, want_dz);
        assert_gradients(&what, dtype, (&dx.tensor(), &dz.tensor()), want);
    });
}

/// The kernel's dx and dz buffers against the CPU op's dx and dz (which the CPU op returns
/// whenever it is asked for, `want_dz`).
fn assert_gradients(
    what: &str,
    dtype: DType,
    (dx, dz): (&Tensor, &Tensor),
    (dx_want, dz_want, want_dz): (Tensor, Option<Tensor>, bool),
) {
    let t = tol::emulated_elem(dtype);
    assert_close_rel(&format!("{what} dx"), dx, &dx_want, t);
    if want_dz {
        let dz_want = dz_want.expect("the CPU op returns dz when asked");
        assert_close_rel(&format!("{what} dz"), dz, &dz_want, t);
    }
}
