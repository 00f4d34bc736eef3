//! Turns all-reduced shifted sums into the global mean, variance and inverse std, on the device
//! of the sums (`bn_finalize_<dtype>` of `kernels/stats.cu` on CUDA), and for the layer also
//! updates its running statistics in place in the same pass: nothing is read to the host.

use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

pub(crate) use super::running::Running;
use super::{per_channel_f64, OP};
use crate::device::cpu::slice;

/// Rows of the finalize output `[ROWS, C]` f64.
pub(crate) mod row {
    /// Global count `n`.
    pub const COUNT: usize = 0;
    /// Global mean `K + A/n` (`K` for an empty batch).
    pub const MEAN: usize = 1;
    /// `1/sqrt(M2/n + eps)`; NaN when `n = 1`, 1 when `n = 0`.
    pub const INVSTD: usize = 2;
    /// Biased variance `M2/n`.
    pub const VAR: usize = 3;
    /// Unbiased variance `M2/(n − 1)`, 0 when `n ≤ 1`.
    pub const VAR_UNBIASED: usize = 4;
    /// Running-statistics blend weight: the momentum when `n > 1` and the channel's batch
    /// statistics are finite, else 0.
    pub const BLEND: usize = 5;
    /// The next training step's shift and the running mean's blend target: the mean when the
    /// channel's mean and variance are finite, else the shift `K` it was computed with (a batch
    /// holding NaN or Inf never poisons later steps).
    pub const SHIFT: usize = 6;
    /// The running variance's blend target: `VAR_UNBIASED` when finite as above, else 0 (its
    /// weight is then 0, and `old + (0 − old)·0` keeps `old`, where NaN·0 would not).
    pub const RUN_VAR: usize = 7;
    /// The running mean before this step, as f64 (0 without running statistics): what a
    /// rollback restores.
    pub const OLD_MEAN: usize = 8;
    /// The running variance before this step, as f64 (0 without running statistics).
    pub const OLD_VAR: usize = 9;
    /// Number of rows.
    pub const ROWS: usize = 10;
}

/// The finalize arithmetic of one channel (the CPU twin of `finalize` in `kernels/stats.cu`).
fn finalize_channel(
    n: f64,
    a: f64,
    b: f64,
    k: f64,
    momentum: f64,
    eps: f64,
) -> [f64; row::OLD_MEAN] {
    let d = if n > 0.0 { a / n } else { 0.0 };
    let m2 = (b - a * d).max(0.0);
    let var = if n > 0.0 { m2 / n } else { 0.0 };
    let invstd = if n == 1.0 {
        f64::NAN
    } else if n > 0.0 {
        1.0 / (var + eps).sqrt()
    } else {
        1.0
    };
    let (unbiased, blend) = if n > 1.0 {
        (m2 / (n - 1.0), momentum)
    } else {
        (0.0, 0.0)
    };
    let mean = k + d;
    // The kernel's test, `v − v == 0`, is the same predicate.
    let ok = mean.is_finite() && var.is_finite();
    [
        n,
        mean,
        invstd,
        var,
        unbiased,
        if ok { blend } else { 0.0 },
        if ok { mean } else { k },
        if ok { unbiased } else { 0.0 },
    ]
}

/// Sums `[3, C]` and shift `[C]` (both f64) → `[ROWS, C]` f64; with `running`, also the
/// in-place update of the layer's running statistics (rows `OLD_MEAN`, `OLD_VAR` keep what
/// they were).
pub(crate) struct FinalizeOp {
    pub c: usize,
    /// Running-statistics momentum (the blend weight of row `BLEND` when `n > 1`).
    pub momentum: f64,
    pub eps: f64,
    pub running: Option<Running>,
}

impl CustomOp2 for FinalizeOp {
    fn name(&self) -> &'static str {
        "sync-batch-norm-finalize"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let c = self.c;
        let (sums, shift) = (slice::<f64>(OP, ss, sl)?, slice::<f64>(OP, ks, kl)?);
        let mut out = vec![0f64; row::ROWS * c];
        for j in 0..c {
            let r = finalize_channel(
                sums[j],
                sums[c + j],
                sums[2 * c + j],
                shift[j],
                self.momentum,
                self.eps,
            );
            for (i, v) in r.into_iter().enumerate() {
                out[i * c + j] = v;
            }
        }
        if let Some(running) = &self.running {
            running.update_cpu(&mut out, c)?;
        }
        Ok((CpuStorage::F64(out), Shape::from((row::ROWS, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dev = &ss.device;
        let out = match &self.running {
            Some(r) => {
                let aux = r.aux(dev)?;
                crate::device::cuda::dispatch!(
                    OP,
                    r.dtype(),
                    finalize_cuda(self, (ss, sl), (ks, kl), Some(&aux))
                )?
            }
            None => finalize_cuda::<f64>(self, (ss, sl), (ks, kl), None)?,
        };
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((row::ROWS, self.c)),
        ))
    }
}

/// One `bn_finalize_<R>` launch, `R` the running statistics' dtype (f64 without them).
#[cfg(feature = "cuda")]
fn finalize_cuda<R: crate::device::cuda::KernelElem + candle_core::WithDType>(
    op: &FinalizeOp,
    (ss, sl): (&candle_core::CudaStorage, &Layout),
    (ks, kl): (&candle_core::CudaStorage, &Layout),
    running: Option<&super::running::RunningAux<'_>>,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<f64>> {
    use crate::device::args::{Finalize, RunningBuffers};
    use crate::device::cuda::{launch, view, Buffers, Module};
    let dev = &ss.device;
    let (sums, shift) = (
        view::<f64>(OP, ss, sl, "sums")?,
        view::<f64>(OP, ks, kl, "shift")?,
    );
    // SAFETY: the kernel writes all ROWS·C values.
    let mut out = unsafe { dev.alloc::<f64>(row::ROWS * op.c)? };
    let running = match running {
        Some(r) => Some((
            r.mean.view::<R>("running_mean")?,
            r.var.view::<R>("running_var")?,
            r.batches.view::<i64>("num_batches_tracked")?,
        )),
        None => None,
    };
    let stream = dev.cuda_stream();
    let mut b = Buffers::on(&stream);
    // The running statistics are written through their (read-locked) views: device memory that
    // no Rust reference covers, written only by kernels on this stream (the layer's variables;
    // see `Running`).
    let call = Finalize {
        sums: b.read(&sums),
        shift: b.read(&shift),
        out: b.write(&mut out),
        running: running.as_ref().map(|(mean, var, batches)| RunningBuffers {
            mean: b.read(mean),
            var: b.read(var),
            batches: b.read(batches),
        }),
        momentum: op.momentum,
        eps: op.eps,
    }
    .call(OP, R::DTYPE, op.c)?;
    launch(dev, Module::Stats, call, b)?;
    Ok(out)
}

/// `[ROWS, C]` f64 statistics from all-reduced sums, on the sums' device; with `running`, the
/// layer's running statistics and `num_batches_tracked` are updated in the same pass.
pub(crate) fn finalize(
    sums: &Tensor,
    shift: &Tensor,
    momentum: f64,
    eps: f64,
    running: Option<Running>,
) -> Result<Tensor> {
    let c = shift.elem_count();
    if sums.dims() != [3, c] {
        bail!(
            "{OP} gather_stats: expected sums of shape [3, {c}], got {:?}",
            sums.dims()
        )
    }
    if let Some(r) = &running {
        r.check(c, sums.device())?;
    }
    let shift = per_channel_f64("shift", shift, &[c])?;
    let sums = sums.to_dtype(DType::F64)?.contiguous()?;
    sums.apply_op2_no_bwd(
        &shift,
        &FinalizeOp {
            c,
            momentum,
            eps,
            running,
        },
    )
}

/// The global count of finalized statistics, when it can be read without waiting for a GPU
/// (CPU tensors); `None` on other devices.
pub(crate) fn host_count(stats: &Tensor) -> Result<Option<f64>> {
    if stats.dim(1)? == 0 {
        return Ok(None);
    }
    // Read in place (no tensor views): the first value of row COUNT.
    let (storage, layout) = stats.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(s) => {
            let c = stats.dim(1)?;
            Ok(Some(slice::<f64>(OP, s, layout)?[row::COUNT * c]))
        }
        _ => Ok(None),
    }
}

/// Global batch statistics, each `[C]` f64 on the device of the sums.
#[derive(Debug, Clone)]
pub struct BatchStats {
    /// Values per channel over all ranks (`n`, identical for every channel).
    pub count: Tensor,
    /// Global mean.
    pub mean: Tensor,
    /// Biased variance `M2 / n` (what normalises the batch).
    pub var: Tensor,
    /// Unbiased variance `M2 / (n − 1)` (what running statistics track; 0 when `n ≤ 1`).
    pub var_unbiased: Tensor,
    /// `1 / sqrt(var + eps)`.
    pub invstd: Tensor,
}

/// Global statistics from the shifted sums of [`super::batch_norm_stats`] summed over ranks.
///
/// # Arguments
/// * `sums` - `[3, C]` f64: `[Σ n_r, Σ A_r, Σ B_r]` (the all-reduced output of `batch_norm_stats`).
/// * `shift` - `[C]`, the same shift `K` every rank passed to `batch_norm_stats`.
/// * `eps` - added to the biased variance before the inverse square root.
///
/// Computed on the sums' device (a CUDA kernel on a GPU), nothing read back to the host.
/// A channel with fewer than 2 values in total cannot be normalised (as in PyTorch's training
/// mode): on the CPU this is an error; on a GPU, where checking would stall the stream, `invstd`
/// is NaN for `n = 1` (the output of the layer becomes NaN) and 1 for `n = 0`.
///
/// # Errors
///
/// When `shift` is not `[C]` in a float dtype or `sums` not `[3, C]`, or the two are on
/// different devices; on the CPU, when the global count is at most 1 (see above); on a GPU, when a
/// CUDA allocation or kernel launch fails.
pub fn batch_norm_gather_stats(sums: &Tensor, shift: &Tensor, eps: f64) -> Result<BatchStats> {
    let stats = finalize(sums, shift, 0.0, eps, None)?;
    if let Some(n) = host_count(&stats)? {
        if n <= 1.0 {
            bail!(
                "{OP}: expected more than 1 value per channel when training, got {n} in the global batch"
            )
        }
    }
    Ok(BatchStats {
        count: stats.get(row::COUNT)?,
        mean: stats.get(row::MEAN)?,
        var: stats.get(row::VAR)?,
        var_unbiased: stats.get(row::VAR_UNBIASED)?,
        invstd: stats.get(row::INVSTD)?,
    })
}
