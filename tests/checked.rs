//! `collective::Checked`, the argument-agreement wrapper (the debug mode for NCCL, which does
//! not check arguments itself), on thread ranks.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::{Checked, Collective, CollectiveError, ReduceOp};
use common::*;

fn checked(comm: Arc<dyn Collective>) -> Arc<dyn Collective> {
    Checked::new(comm, &Device::Cpu)
}

/// Agreeing calls give what the unwrapped communicator gives, unequal all-gather rows included.
#[test]
fn agreeing_calls_pass_through() {
    let out = run_ranks(3, |comm| {
        let c = checked(comm.clone());
        let r = comm.rank();
        let x = randn(r as u64, &[5], 1.0, 2.0).to_dtype(DType::F32)?;
        let sum = c.all_reduce(&x, ReduceOp::Sum)?;
        let reference = comm.all_reduce(&x, ReduceOp::Sum)?;
        let rows = randn(10 + r as u64, &[r + 1, 2], 0.0, 1.0);
        let gathered = c.all_gather(&rows)?;
        let b = c.broadcast(&x, 1)?;
        c.barrier()?;
        let pending = c
            .start_all_reduce(std::slice::from_ref(&x), ReduceOp::Max.into())?
            .wait()?;
        let sub = c.new_group(&[2, 0])?;
        let sub_sum = match &sub {
            Some(s) => Some(s.all_reduce(&x, ReduceOp::Sum)?.to_vec1::<f32>()?),
            None => None,
        };
        c.deferred_error()?;
        Ok((
            sum.to_vec1::<f32>()? == reference.to_vec1::<f32>()?,
            gathered.dims().to_vec(),
            b.to_vec1::<f32>()?,
            pending.to_vec1::<f32>()?,
            sub_sum,
        ))
    });
    let x1 = randn(1, &[5], 1.0, 2.0).to_dtype(DType::F32).unwrap();
    for (rank, (same, gdims, b, max, sub)) in out.iter().enumerate() {
        assert!(
            same,
            "rank {rank}: all_reduce differs from the unwrapped one"
        );
        assert_eq!(gdims, &vec![6, 2], "rank {rank}: 1 + 2 + 3 rows");
        assert_eq!(
            b,
            &x1.to_vec1::<f32>().unwrap(),
            "rank {rank}: broadcast from rank 1"
        );
        assert_eq!(max, &out[0].3, "rank {rank}: max identical on every rank");
        assert_eq!(sub.is_some(), rank != 1, "rank {rank}: subgroup membership");
    }
}

/// One rank passing another dtype, count or root: every rank gets a `Mismatch` naming what
/// each passed, the wrapper stays broken, and nothing was reduced.
#[test]
fn a_disagreement_fails_every_rank_and_breaks_the_wrapper() {
    type Case = fn(usize) -> (Tensor, usize, &'static str);
    let cases: [(&str, Case); 3] = [
        ("dtype", |r| {
            let dt = if r == 2 { DType::F64 } else { DType::F32 };
            (
                Tensor::ones(4, dt, &Device::Cpu).unwrap(),
                0,
                "rank 2: all_reduce(Sum) of F64, rank 1, 4 elements",
            )
        }),
        ("count", |r| {
            (
                Tensor::ones(4 + r, DType::F32, &Device::Cpu).unwrap(),
                0,
                "rank 1: all_reduce(Sum) of F32, rank 1, 5 elements",
            )
        }),
        ("root", |r| {
            (
                Tensor::ones(4, DType::F32, &Device::Cpu).unwrap(),
                r.min(1),
                "rank 2: broadcast(root=1)",
            )
        }),
    ];
    for (what, case) in cases {
        let out = run_ranks(3, |comm| {
            let c = checked(comm.clone());
            let (t, root, _) = case(comm.rank());
            let first = if what == "root" {
                c.broadcast(&t, root).map(|_| ())
            } else {
                c.all_reduce(&t, ReduceOp::Sum).map(|_| ())
            };
            let err = first.expect_err("a mismatch must fail");
            let kind = matches!(
                CollectiveError::find(&err),
                Some(CollectiveError::Mismatch { .. })
            );
            let later = c.barrier().expect_err("the wrapper must stay broken");
            // The inner communicator was never handed the bad call: it still works.
            comm.barrier()?;
            Ok((kind, err.to_string(), later.to_string()))
        });
        let needle = case(0).2;
        for (rank, (kind, msg, later)) in out.into_iter().enumerate() {
            assert!(kind, "{what}, rank {rank}: not a Mismatch: {msg}");
            assert!(
                msg.contains(needle),
                "{what}, rank {rank}: {msg} lacks {needle:?}"
            );
            assert!(
                later.contains("an earlier call broke the group"),
                "{what}, rank {rank}: {later}"
            );
        }
    }
}
