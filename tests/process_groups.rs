//! Reduce-scatter and process groups (`split`, `new_group`) on `ThreadGroup`, and
//! `SyncBatchNorm` synchronising within subgroups.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::ReduceOp;
use candle_distributed::SyncBatchNormConfig;
use candle_nn::ModuleT;
use common::*;

/// f64 throughout: rounding only.
const TOL_F64: f64 = 1e-10;

#[test]
fn reduce_scatter_gives_each_rank_its_rows_of_the_reduction() {
    let outs = run_ranks(4, |comm| {
        let t = randn(comm.rank() as u64, &[8, 3], 0.0, 1.0);
        let full = comm.all_reduce(&t, ReduceOp::Sum)?;
        let part = comm.reduce_scatter(&t, ReduceOp::Sum)?;
        let max = comm.reduce_scatter(&t, ReduceOp::Max)?;
        let full_max = comm.all_reduce(&t, ReduceOp::Max)?;
        let r = comm.rank();
        Ok((
            part.to_vec2::<f64>()? == full.narrow(0, 2 * r, 2)?.to_vec2::<f64>()?,
            max.to_vec2::<f64>()? == full_max.narrow(0, 2 * r, 2)?.to_vec2::<f64>()?,
            part.dims().to_vec(),
        ))
    });
    for (r, (sum_ok, max_ok, dims)) in outs.into_iter().enumerate() {
        assert!(
            sum_ok && max_ok,
            "rank {r}: rows differ from the all-reduce"
        );
        assert_eq!(dims, vec![2, 3]);
    }
}

#[test]
fn reduce_scatter_of_indivisible_rows_fails_on_every_rank() {
    let errs = run_ranks(3, |comm| {
        let t = Tensor::ones((4, 2), DType::F32, &Device::Cpu)?;
        Ok(comm
            .reduce_scatter(&t, ReduceOp::Sum)
            .unwrap_err()
            .to_string())
    });
    for e in errs {
        assert!(e.contains("multiple of the world size 3"), "{e}");
    }
}

#[test]
fn split_forms_groups_by_color_ordered_by_key() {
    // Colors: ranks 0, 2, 4 → 0; 1, 3 → 1; rank 5 → none. Keys reverse the order.
    let outs = run_ranks(6, |comm| {
        let r = comm.rank();
        let color = (r != 5).then_some((r % 2) as u32);
        let sub = comm.split(color, (10 - r) as u32)?;
        let Some(sub) = sub else {
            return Ok(None);
        };
        let t = Tensor::new(&[r as f32], &Device::Cpu)?;
        let sum = comm_sum(&*sub, &t)?;
        let order = sub.all_gather(&t)?.to_vec1::<f32>()?;
        Ok(Some((sub.rank(), sub.world_size(), sum, order)))
    });
    assert_eq!(outs[5], None);
    assert_eq!(outs[0], Some((2, 3, 6.0, vec![4.0, 2.0, 0.0])));
    assert_eq!(outs[4], Some((0, 3, 6.0, vec![4.0, 2.0, 0.0])));
    assert_eq!(outs[1], Some((1, 2, 4.0, vec![3.0, 1.0])));
    assert_eq!(outs[3], Some((0, 2, 4.0, vec![3.0, 1.0])));
}

fn comm_sum(
    comm: &dyn candle_distributed::collective::Collective,
    t: &Tensor,
) -> candle_core::Result<f32> {
    Ok(comm.all_reduce(t, ReduceOp::Sum)?.to_vec1::<f32>()?[0])
}

#[test]
fn new_group_checks_its_ranks_and_leaves_others_out() {
    let outs = run_ranks(4, |comm| {
        let bad = comm.new_group(&[0, 0]).unwrap_err().to_string();
        let sub = comm.new_group(&[3, 1])?;
        Ok((bad, sub.map(|s| (s.rank(), s.world_size()))))
    });
    for (r, (bad, sub)) in outs.into_iter().enumerate() {
        assert!(bad.contains("distinct"), "{bad}");
        let want = match r {
            3 => Some((0, 2)),
            1 => Some((1, 2)),
            _ => None,
        };
        assert_eq!(sub, want, "rank {r}");
    }
}

/// Ranks {0, 1} and {2, 3} of 4 normalise over their own subgroup's batch (PyTorch's
/// `process_group`), with unequal and empty per-rank batches: outputs against single-process
/// batch norm over each subgroup's concatenated batch, and the running mean.
#[test]
fn sync_batch_norm_synchronises_within_subgroups() {
    let batches = [3usize, 0, 2, 5];
    let (c, hw) = (4, [3usize, 2]);
    let global = randn(11, &[10, c, hw[0], hw[1]], 2.0, 1.5);
    let pieces = split_batch(&global, &batches);
    let params = Params::random(5, c);
    let outs = run_ranks(4, |comm| {
        let r = comm.rank();
        // As with PyTorch's new_group: every rank creates every group.
        let low = comm.new_group(&[0, 1])?;
        let high = comm.new_group(&[2, 3])?;
        let sub = low.or(high).expect("every rank is in one subgroup");
        let (bn, _vm) = layer(
            c,
            SyncBatchNormConfig::default(),
            sub,
            Some(&params),
            DType::F64,
            &Device::Cpu,
        );
        let y = bn.forward_t(&pieces[r], true)?;
        Ok((y, bn.running_mean().unwrap().copy()?))
    });
    let w = Tensor::new(params.weight.as_slice(), &Device::Cpu).unwrap();
    let b = Tensor::new(params.bias.as_slice(), &Device::Cpu).unwrap();
    for group in [[0usize, 1], [2, 3]] {
        let xs: Vec<&Tensor> = group.iter().map(|&r| &pieces[r]).collect();
        let x = Tensor::cat(&xs, 0).unwrap();
        let (want, mean, _) = reference_bn(&x, Some(&w), Some(&b), None, false, 1e-5);
        let want = split_batch(&want, &[batches[group[0]], batches[group[1]]]);
        for (i, &r) in group.iter().enumerate() {
            assert_close(&format!("rank {r} output"), &outs[r].0, &want[i], TOL_F64);
            let running = (mean.clone() * 0.1).unwrap();
            assert_close(
                &format!("rank {r} running mean"),
                &outs[r].1,
                &running,
                TOL_F64,
            );
        }
    }
}
