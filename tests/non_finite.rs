//! A batch holding NaN or Inf never poisons later steps: its channel keeps the previous shift
//! and running statistics (PyTorch lets them become NaN for good), so clean steps after it give
//! what they give without it. f32, f16, bf16; one and three ranks.

mod common;

use candle_core::{DType, Device, Tensor};
use candle_distributed::SyncBatchNormConfig;
use candle_nn::ModuleT;
use common::*;

const C: usize = 3;

/// Rank `rank`'s clean batch of step `step`: (4, C, 2, 2), far from zero mean so that a lost
/// shift would change the rounding.
fn clean(step: u64, rank: usize, dtype: DType, dev: &Device) -> Tensor {
    on(
        dev,
        &randn(50 * step + rank as u64, &[4, C, 2, 2], 3.0, 1.5)
            .to_dtype(dtype)
            .unwrap(),
    )
}

/// `x` with one value of each listed channel replaced by `v` (on rank 0's first sample).
fn poison(x: &Tensor, channels: &[usize], v: f64) -> Tensor {
    let mut data = x
        .to_dtype(DType::F64)
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    for &c in channels {
        data[c * 4 + 1] = v;
    }
    Tensor::from_vec(data, x.dims(), &Device::Cpu)
        .unwrap()
        .to_dtype(x.dtype())
        .unwrap()
        .to_device(x.device())
        .unwrap()
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// Steps 1, 2 clean; step 3 with NaN (or Inf) in every channel on rank 0; steps 4, 5 clean.
/// Against a layer that ran steps 1, 2, 4, 5: outputs of steps 4 and 5 and the running
/// statistics are bitwise equal; `num_batches_tracked` counts the bad step too, as PyTorch's.
fn a_non_finite_batch_is_skipped(dev: &Device) -> anyhow::Result<()> {
    for (world, dtype, bad) in [
        (1, DType::F32, f64::NAN),
        (3, DType::F32, f64::NAN),
        (3, DType::F32, f64::INFINITY),
        (1, DType::F16, f64::NAN),
        (3, DType::F16, f64::INFINITY),
        (1, DType::BF16, f64::NAN),
        (3, DType::BF16, f64::NAN),
    ] {
        let out = run_ranks_on(world, dev, |comm| {
            let r = comm.rank();
            let cfg = SyncBatchNormConfig::default();
            let (bn, _a) = layer(
                C,
                cfg,
                comm.clone(),
                Some(&Params::random(7, C)),
                dtype,
                dev,
            );
            let (reference, _b) = layer(
                C,
                cfg,
                comm.clone(),
                Some(&Params::random(7, C)),
                dtype,
                dev,
            );
            for step in 1..=2 {
                bn.forward_t(&clean(step, r, dtype, dev), true)?;
                reference.forward_t(&clean(step, r, dtype, dev), true)?;
            }
            let x3 = clean(3, r, dtype, dev);
            let x3 = if r == 0 {
                poison(&x3, &[0, 1, 2], bad)
            } else {
                x3
            };
            let y3 = bn.forward_t(&x3, true)?;
            let poisoned_output = f64s(&y3).iter().any(|v| !v.is_finite());
            let mut same = true;
            for step in 4..=5 {
                let y = bn.forward_t(&clean(step, r, dtype, dev), true)?;
                let y_ref = reference.forward_t(&clean(step, r, dtype, dev), true)?;
                same &= f64s(&y)
                    .iter()
                    .map(|v| v.to_bits())
                    .eq(f64s(&y_ref).iter().map(|v| v.to_bits()));
            }
            let stats_same = f64s(bn.running_mean().unwrap())
                == f64s(reference.running_mean().unwrap())
                && f64s(bn.running_var().unwrap()) == f64s(reference.running_var().unwrap());
            Ok((poisoned_output, same, stats_same, bn.num_batches_tracked()))
        });
        for (rank, (poisoned_output, same, stats_same, batches)) in out.into_iter().enumerate() {
            let case = format!("world {world}, {dtype:?}, {bad}, rank {rank}");
            assert!(poisoned_output, "{case}: the bad step's output must show the bad batch (else the test shows nothing)");
            assert!(
                same,
                "{case}: clean steps after the bad one differ from clean steps alone"
            );
            assert!(stats_same, "{case}: running statistics took the bad batch");
            assert_eq!(
                batches, 5,
                "{case}: num_batches_tracked counts every training step"
            );
        }
    }
    Ok(())
}

/// NaN in channel 1 only: channel 1 keeps its running statistics, the others take the
/// batch's, and every later output is finite.
fn only_the_poisoned_channel_is_held(dev: &Device) -> anyhow::Result<()> {
    let out = run_ranks_on(2, dev, |comm| {
        let r = comm.rank();
        let (bn, _a) = layer(
            C,
            SyncBatchNormConfig::default(),
            comm.clone(),
            None,
            DType::F32,
            dev,
        );
        bn.forward_t(&clean(1, r, DType::F32, dev), true)?;
        let before = (
            f64s(bn.running_mean().unwrap()),
            f64s(bn.running_var().unwrap()),
        );
        let x = clean(2, r, DType::F32, dev);
        let x = if r == 1 {
            poison(&x, &[1], f64::NAN)
        } else {
            x
        };
        bn.forward_t(&x, true)?;
        let after = (
            f64s(bn.running_mean().unwrap()),
            f64s(bn.running_var().unwrap()),
        );
        let later = f64s(&bn.forward_t(&clean(3, r, DType::F32, dev), true)?);
        Ok((before, after, later.iter().all(|v| v.is_finite())))
    });
    for (rank, ((m0, v0), (m1, v1), finite)) in out.into_iter().enumerate() {
        assert_eq!(
            (m1[1], v1[1]),
            (m0[1], v0[1]),
            "rank {rank}: channel 1 must keep its running statistics"
        );
        for c in [0, 2] {
            assert!(
                m1[c] != m0[c] && v1[c] != v0[c],
                "rank {rank}: channel {c} must take the batch's statistics"
            );
        }
        assert!(
            finite,
            "rank {rank}: a later clean step must give finite outputs"
        );
    }
    Ok(())
}

device_tests!(
    a_non_finite_batch_is_skipped,
    only_the_poisoned_channel_is_held
);
