//! A collective that fails after its call returned (NCCL: enqueued, then aborted by the
//! watchdog, its output never written): the layer learns it from `Collective::deferred_error` at its
//! next training step and rolls back to the state before the failed step. Emulated on thread
//! ranks by `Deferred`, a communicator whose armed all-reduce returns an unwritten-looking
//! buffer and reports the failure only afterwards (from `deferred_error`), as NCCL does.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_distributed::collective::{Collective, CollectiveError, Decorator, Op, Pending};
use candle_distributed::SyncBatchNormConfig;
use candle_nn::ModuleT;
use common::*;

/// `inner`, except that while `armed` an all-reduce returns its input scaled by 1e3 (not the
/// reduction: the bytes of a buffer nobody wrote) and the communicator then reports a failure
/// from `deferred_error` until `heal`.
#[derive(Debug)]
struct Deferred {
    inner: Arc<dyn Collective>,
    armed: AtomicBool,
    failed: AtomicBool,
}

impl Deferred {
    fn new(inner: Arc<dyn Collective>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            armed: AtomicBool::new(false),
            failed: AtomicBool::new(false),
        })
    }

    fn arm(&self, on: bool) {
        self.armed.store(on, Ordering::SeqCst);
    }

    /// Forgets the failure (a test affordance: a real broken communicator stays broken), so
    /// that the rolled-back state can be observed through a further training step.
    fn heal(&self) {
        self.failed.store(false, Ordering::SeqCst);
    }
}

impl Decorator for Deferred {
    fn inner(&self) -> &Arc<dyn Collective> {
        &self.inner
    }
    fn reports_deferred(&self) -> bool {
        true
    }
    fn check_deferred(&self) -> candle_core::Result<()> {
        if self.failed.load(Ordering::SeqCst) {
            return Err(CollectiveError::RankLeft {
                backend: "test",
                op: "all_reduce",
                call: 0,
                rank: self.rank(),
                reason: "the watchdog aborted the communicator (emulated)".into(),
            }
            .into());
        }
        self.inner.deferred_error()
    }
    /// Armed, an all-reduce returns garbage (its result ×1000) and the failure surfaces
    /// later, from `deferred_error`.
    fn after(&self, op: Op, out: Tensor) -> candle_core::Result<Tensor> {
        if matches!(op, Op::AllReduce(_)) && self.armed.load(Ordering::SeqCst) {
            self.failed.store(true, Ordering::SeqCst);
            return out.affine(1e3, 0.0);
        }
        Ok(out)
    }
    fn after_async(&self, op: Op, pending: Pending) -> candle_core::Result<Pending> {
        if matches!(op, Op::AllReduce(_)) && self.armed.load(Ordering::SeqCst) {
            self.failed.store(true, Ordering::SeqCst);
            return Ok(Pending::new(move || pending.wait()?.affine(1e3, 0.0)));
        }
        Ok(pending)
    }
}

/// Rank `rank`'s batch of step `step`: (4, 3, 2, 2), mean 0.5, not all equal.
fn batch(step: u64, rank: usize, dev: &Device) -> Tensor {
    on(
        dev,
        &randn(100 * step + rank as u64, &[4, 3, 2, 2], 0.5, 2.0),
    )
}

fn bits(t: Option<&Tensor>) -> Vec<u64> {
    t.unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Two clean steps, a step whose all-reduce fails after returning, then: the next training
/// forward fails with the communicator's error (matchable), and the running statistics and
/// `num_batches_tracked` equal those after the two clean steps, bitwise; once the test heals
/// the communicator, a further step gives the outputs and running statistics of a layer that
/// never saw the failed step (which shows the shift was rolled back too).
fn a_step_that_fails_after_returning_is_rolled_back(dev: &Device) -> anyhow::Result<()> {
    let results = run_ranks_on(2, dev, |comm| {
        let rank = comm.rank();
        let deferred = Deferred::new(comm.clone());
        let cfg = SyncBatchNormConfig::default();
        let (bn, _vm) = layer(3, cfg, deferred.clone(), None, DType::F64, dev);
        let (reference, _vm2) = layer(3, cfg, comm, None, DType::F64, dev);
        for step in 1..=2 {
            bn.forward_t(&batch(step, rank, dev), true)?;
            reference.forward_t(&batch(step, rank, dev), true)?;
        }
        let clean = (bits(bn.running_mean()), bits(bn.running_var()));

        deferred.arm(true);
        bn.forward_t(&batch(3, rank, dev), true)?;
        deferred.arm(false);
        let corrupted = bits(bn.running_mean()) != clean.0;

        let err = bn
            .forward_t(&batch(4, rank, dev), true)
            .expect_err("the step after a failed collective must fail");
        let kind = matches!(
            CollectiveError::find(&err),
            Some(CollectiveError::RankLeft { .. })
        );
        let rolled_back = (bits(bn.running_mean()), bits(bn.running_var()));
        let batches = bn.num_batches_tracked();

        deferred.heal();
        let y = bn.forward_t(&batch(5, rank, dev), true)?;
        let y_ref = reference.forward_t(&batch(5, rank, dev), true)?;
        let same_after = (y.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?
            == y_ref
                .to_dtype(DType::F64)?
                .flatten_all()?
                .to_vec1::<f64>()?)
            && bits(bn.running_mean()) == bits(reference.running_mean())
            && bits(bn.running_var()) == bits(reference.running_var());
        Ok((
            corrupted,
            kind,
            rolled_back == clean,
            batches,
            same_after,
            err.to_string(),
        ))
    });
    for (rank, (corrupted, kind, rolled_back, batches, same_after, msg)) in
        results.into_iter().enumerate()
    {
        assert!(corrupted, "rank {rank}: the armed step must have committed garbage statistics (else the test shows nothing)");
        assert!(kind, "rank {rank}: not a matchable RankLeft: {msg}");
        assert!(
            msg.contains("emulated") && msg.contains("before the last training step"),
            "{msg}"
        );
        assert!(
            rolled_back,
            "rank {rank}: running statistics not rolled back"
        );
        assert_eq!(batches, 2, "rank {rank}: num_batches_tracked");
        assert!(same_after, "rank {rank}: the step after the rollback differs from a layer that never saw the failed step");
    }
    Ok(())
}

/// Without a failure `check_collectives` is `Ok` and changes nothing.
fn a_healthy_communicator_changes_nothing(dev: &Device) -> anyhow::Result<()> {
    run_ranks_on(2, dev, |comm| {
        let (bn, _vm) = layer(
            3,
            SyncBatchNormConfig::default(),
            comm.clone(),
            None,
            DType::F32,
            dev,
        );
        bn.forward_t(&batch(1, comm.rank(), dev), true)?;
        let before = bits(bn.running_mean());
        bn.check_collectives()?;
        assert_eq!(bits(bn.running_mean()), before);
        assert_eq!(bn.num_batches_tracked(), 1);
        // No rank leaves (which breaks a thread group) before every rank has checked.
        comm.barrier()?;
        Ok(())
    });
    Ok(())
}

device_tests!(
    a_step_that_fails_after_returning_is_rolled_back,
    a_healthy_communicator_changes_nothing
);
