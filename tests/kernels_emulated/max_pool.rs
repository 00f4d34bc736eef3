//! The emulated kernels of max pooling (`max_pool2d_fwd_*`, `max_pool2d_bwd_*`) against the CPU op.

use candle_core::{Device, Tensor};
use candle_distributed::args::{Call, MaxPoolBwd, MaxPoolFwd, PoolExtent};
use candle_distributed::ops;

use crate::common::assert_close_rel;
use crate::harness::*;

/// `max_pool2d_{fwd,bwd}_*` against the CPU op (`ops::max_pool2d` and its backward), bitwise:
/// both pick the same element of every window and sum the same gradients in the same order.
/// Values on a coarse grid so that windows are full of ties; shapes with padding, gaps, a
/// 1-pixel-wide plane, an empty batch, and more elements than one grid-stride sweep covers.
#[test]
fn max_pool_matches_the_cpu_op() {
    for (dims, (k, s, p)) in [
        ([2usize, 3, 7, 8], (3usize, 2usize, 1usize)),
        ([1, 2, 6, 5], (3, 1, 1)),
        ([1, 1, 3, 1], (2, 3, 1)),
        ([2, 2, 5, 5], (2, 2, 0)),
        ([0, 2, 5, 5], (3, 2, 1)),
        ([1, 1, 130, 130], (3, 2, 1)),
    ] {
        let (oh, ow) = ((dims[2] + 2 * p - k) / s + 1, (dims[3] + 2 * p - k) / s + 1);
        let odims = [dims[0], dims[1], oh, ow];
        let grid = |d: &[usize]| {
            Tensor::from_vec(
                (0..d.iter().product::<usize>())
                    .map(|i| ((i * 7919 + 13) % 5) as f64 - 2.0)
                    .collect::<Vec<_>>(),
                d,
                &Device::Cpu,
            )
            .unwrap()
        };
        for (dtype, _) in DTYPES {
            let x = grid(&dims).to_dtype(dtype).unwrap();
            let dy = (grid(&odims) * 0.25).unwrap().to_dtype(dtype).unwrap();
            let xv = candle_core::Var::from_tensor(&x).unwrap();
            let y_cpu = ops::max_pool2d(xv.as_tensor(), k, s, p).unwrap();
            let g = (&y_cpu * &dy)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let dx_cpu = g.get(xv.as_tensor()).unwrap().clone();
            let e = PoolExtent {
                planes: dims[0] * dims[1],
                h: dims[2],
                w: dims[3],
                oh,
                ow,
                k,
                s,
                p,
            };
            for sched in SCHEDULES {
                for grid in [as_built as fn(Call) -> Call, one_block] {
                    let (mut xb, mut dyb) = (Buf::of(&x), Buf::of(&dy));
                    let mut yb = Buf::poisoned(dtype, &odims);
                    let mut dxb = Buf::poisoned(dtype, &dims);
                    let what = format!("{dims:?} (k, s, p) = {:?} {dtype:?} {sched}", (k, s, p));
                    let fwd = MaxPoolFwd {
                        x: xb.buffer(),
                        y: yb.buffer(),
                    };
                    if let Some(call) = fwd.call("test", dtype, &e).unwrap() {
                        run(&grid(call), sched);
                        assert_close_rel(&format!("forward {what}"), &yb.tensor(), &y_cpu, 0.0);
                    }
                    let bwd = MaxPoolBwd {
                        x: xb.buffer(),
                        dy: dyb.buffer(),
                        dx: dxb.buffer(),
                    };
                    if let Some(call) = bwd.call("test", dtype, &e).unwrap() {
                        run(&grid(call), sched);
                        assert_close_rel(&format!("backward {what}"), &dxb.tensor(), &dx_cpu, 0.0);
                    }
                }
            }
        }
    }
}

/// The launch the CUDA path makes.
fn as_built(call: Call) -> Call {
    call
}

/// The same launch in one block, which must loop over everything.
fn one_block(mut call: Call) -> Call {
    call.launch.grid = [1, 1, 1];
    call
}
