//! Uneven inputs: ranks that run out of data keep serving the collectives of the others until
//! every rank is done (what PyTorch's `join()` context does for DDP).
//!
//! The loop every rank runs:
//!
//! ```text
//! loop {
//!     let batch = my_batches.next();                   // None once this rank is out of data
//!     let n = batch.map_or(0, |b| b.len());
//!     let step = dp.join_step(n)?;                     // one all-reduce of 2 values
//!     if step.done() { break }                         // every rank is out of data
//!     let x = batch.unwrap_or(empty);                  // an empty batch: [0, C, H, W]
//!     let loss = (per_sample_loss(model(x)).sum() · step.loss_weight())?;
//!     opt.step(&dp.sync_gradients(loss.backward()?)?)?;
//! }
//! ```
//!
//! A rank with no data runs the forward and backward on an empty batch: its
//! [`crate::SyncBatchNorm`] layers take part in their all-reduces with a count of zero (exact:
//! the statistics are those of the other ranks' samples), and its gradients are zero. The
//! gradient average divides by the *initial* world size (PyTorch's default,
//! `divide_by_initial_world_size=True`); weighting each rank's loss *sum* by
//! `W / N_step` ([`JoinStep::loss_weight`]) makes the average the gradient of the mean loss over
//! the `N_step` samples of the step, so the steps are those of one process on the
//! concatenation of the batches the ranks still had.

use candle_core::{bail, DType, Result, Tensor};

use super::DataParallel;
use candle_collective::ReduceOp;

/// One step of a loop over uneven inputs, as every rank sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinStep {
    /// Samples over every rank this step (`N_step`).
    pub samples: usize,
    /// Ranks with at least one sample this step.
    pub active: usize,
    /// The group's size `W` (the divisor of the gradient average).
    pub world_size: usize,
}

impl JoinStep {
    /// Every rank is out of data: leave the loop (on every rank alike).
    pub fn done(&self) -> bool {
        self.samples == 0
    }

    /// `W / N_step`: the weight of this rank's per-sample loss *sum*, so that the averaged
    /// gradient is that of the mean loss over the step's global batch. With a mean loss over
    /// `n` local samples, multiply it by `n · loss_weight()` instead (0 for an empty batch,
    /// whose mean is NaN: use the sum there).
    pub fn loss_weight(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.world_size as f64 / self.samples as f64
        }
    }
}

impl DataParallel {
    /// Collective, once per step on every rank, before the step's forward: `local_samples` is
    /// this rank's batch size (0 once it is out of data). Returns the step's global sample and
    /// active-rank counts, the same on every rank; [`JoinStep::done`] says when every rank is
    /// out of data. One all-reduce of 2 values on the variables' device.
    ///
    /// # Errors
    /// Those of the all-reduce (a rank that left, a timeout), the same on every rank.
    pub fn join_step(&self, local_samples: usize) -> Result<JoinStep> {
        // f64 holds every count below 2⁵³ exactly.
        if local_samples as u64 >= 1 << 53 {
            bail!("data_parallel: join_step: {local_samples} samples on one rank is too many")
        }
        let mine = Tensor::new(
            &[local_samples as f64, f64::from(u8::from(local_samples > 0))],
            &self.device,
        )?;
        let total = self
            .comm
            .all_reduce(&mine, ReduceOp::Sum)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        Ok(JoinStep {
            samples: total[0] as usize,
            active: total[1] as usize,
            world_size: self.comm.world_size(),
        })
    }
}
