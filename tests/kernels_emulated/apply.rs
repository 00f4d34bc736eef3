//! The emulated kernels of the forward elementwise pass (`bn_apply_*`) against the CPU op.

use candle_core::Tensor;
use candle_distributed::launch;
use candle_distributed::ops;

use crate::common::{assert_close_rel, tol};
use crate::harness::*;

#[test]
fn apply_matches_the_cpu_op() {
    for_each_launch(|dtype, suffix, case, k, sched| {
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
            affine.then_some(&w),
            affine.then_some(&b),
            residual.then_some(&z),
            relu,
            case.cl,
        )
        .unwrap();
        let Some(cfg) = launch::elementwise(case.n, case.c, case.hw, case.cl) else {
            assert_eq!(want.elem_count(), 0);
            return;
        };
        let params = Tensor::stack(&[&w, &b], 0).unwrap();
        let (mut xb, mut zb, mut mb, mut ib, mut pb) = (
            Buf::of(&x),
            Buf::of(&z),
            Buf::of(&mean),
            Buf::of(&invstd),
            Buf::of(&params),
        );
        let mut y = Buf::poisoned(dtype, &case.dims());
        let mut args = vec![
            xb.ptr(),
            if residual { zb.ptr() } else { null() },
            mb.ptr(),
            ib.ptr(),
            if affine { pb.ptr() } else { null() },
            y.ptr(),
        ];
        args.extend(case.sizes());
        args.push(Arg::I32(relu as i32));
        let name = format!("bn_apply_{}_{suffix}", layout(case.cl));
        run(&name, &cfg, args, sched);
        assert_close_rel(
            &format!("{name} {case:?} {sched}"),
            &y.tensor(),
            &want,
            tol::emulated_elem(dtype),
        );
    });
}
