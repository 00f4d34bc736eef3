//! The emulated kernels of statistics (`bn_stats_*`) against the CPU op.

use candle_distributed::args::Stats;
use candle_distributed::ops;

use crate::common::{assert_close_rel, tol};
use crate::harness::*;

#[test]
fn statistics_match_the_cpu_op() {
    for_each_launch(|dtype, case, _, sched| {
        let x = case.data(1, 3.0, dtype);
        let shift = per_channel(case.c, 2, 2.5, 3.5);
        let want = ops::batch_norm_stats(&x, &shift, crate::common::layout_of(case.cl)).unwrap();
        let (mut xb, mut kb) = (Buf::of(&x), Buf::of(&shift));
        let (name, got) = reduce(&case, 3, sched, |out, scratch| {
            let stats = Stats {
                x: xb.buffer(),
                shift: kb.buffer(),
                out,
                scratch,
            };
            stats.call("test", dtype, &case.extent()).unwrap().unwrap()
        });
        assert_close_rel(
            &format!("{name} {case:?} {sched}"),
            &got,
            &want,
            tol::emulated_reduce(dtype),
        );
    });
}
