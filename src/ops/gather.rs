//! Turns all-reduced shifted sums into the global mean, variance and inverse std, on the device
//! of the sums (`bn_finalize_<dtype>` of `kernels/stats.cu` on CUDA), and for a layer also
//! updates its running statistics in place in the same pass ([`RunningStats`]: its
//! `running_mean`, `running_var` and `num_batches_tracked` variables, the CPU update in
//! [`RunningStats::update_cpu`]): nothing is read to the host, and a training step has no
//! per-channel bookkeeping of its own.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Device, InplaceOp1, Layout, Result, Shape, Tensor,
};

use super::{per_channel_f64, OP};
use crate::device::cpu::slice;

/// Rows of the finalize output `[ROWS, C]` f64.
mod row {
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
    pub running: Option<RunningStats>,
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
fn finalize_cuda<R: crate::kernels::KernelElem + candle_core::WithDType>(
    op: &FinalizeOp,
    (ss, sl): (&candle_core::CudaStorage, &Layout),
    (ks, kl): (&candle_core::CudaStorage, &Layout),
    running: Option<&RunningAux<'_>>,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<f64>> {
    use crate::device::cuda::{view, Buffers};
    use crate::kernels::args::{Finalize, RunningBuffers};
    use crate::kernels::{launch, Module};
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
            r.num_batches_tracked.view::<i64>("num_batches_tracked")?,
        )),
        None => None,
    };
    let stream = dev.cuda_stream();
    let mut b = Buffers::on(&stream);
    // The running statistics are written through their (read-locked) views: device memory that
    // no Rust reference covers, written only by kernels on this stream (the layer's variables;
    // see `RunningStats`).
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
fn finalize(
    sums: &Tensor,
    shift: &Tensor,
    momentum: f64,
    eps: f64,
    running: Option<RunningStats>,
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
fn host_count(stats: &Tensor) -> Result<Option<f64>> {
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
    crate::device::check_supported(OP, sums.device())?;
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

/// What a training step's statistics are, as [`batch_norm_gather_stats_update`] finalized them:
/// typed views of one `[10, C]` f64 tensor on the sums' device (each accessor is a view, no
/// copy and no kernel).
#[derive(Debug, Clone)]
pub struct GatheredStats {
    rows: Tensor,
}

impl GatheredStats {
    fn row(&self, r: usize) -> Result<Tensor> {
        self.rows.get(r)
    }

    /// Values per channel over all ranks (`n`), `[C]`.
    ///
    /// # Errors
    ///
    /// Never for a value this crate built; candle's error if the view fails.
    pub fn count(&self) -> Result<Tensor> {
        self.row(row::COUNT)
    }

    /// Global mean `[C]` (the shift for a channel without values).
    ///
    /// # Errors
    ///
    /// As [`Self::count`].
    pub fn mean(&self) -> Result<Tensor> {
        self.row(row::MEAN)
    }

    /// `1 / sqrt(var + eps)`, `[C]`: NaN where `n = 1`, 1 where `n = 0`.
    ///
    /// # Errors
    ///
    /// As [`Self::count`].
    pub fn invstd(&self) -> Result<Tensor> {
        self.row(row::INVSTD)
    }

    /// Biased variance `M2 / n`, `[C]`.
    ///
    /// # Errors
    ///
    /// As [`Self::count`].
    pub fn var(&self) -> Result<Tensor> {
        self.row(row::VAR)
    }

    /// Unbiased variance `M2 / (n − 1)`, `[C]`, 0 where `n ≤ 1`.
    ///
    /// # Errors
    ///
    /// As [`Self::count`].
    pub fn var_unbiased(&self) -> Result<Tensor> {
        self.row(row::VAR_UNBIASED)
    }

    /// The next training step's shift, `[C]`: the mean, or the shift this step used for a
    /// channel whose mean or variance is not finite (so a batch holding NaN or Inf never
    /// poisons later steps). Identical on every rank, as it comes from all-reduced sums.
    ///
    /// # Errors
    ///
    /// As [`Self::count`].
    pub fn next_shift(&self) -> Result<Tensor> {
        self.row(row::SHIFT)
    }

    /// The running mean and variance from before this step, each `[C]` f64 (zeros when no
    /// running statistics were given): what undoing the step's update writes back.
    ///
    /// # Errors
    ///
    /// As [`Self::count`].
    pub fn previous_running(&self) -> Result<(Tensor, Tensor)> {
        Ok((self.row(row::OLD_MEAN)?, self.row(row::OLD_VAR)?))
    }

    /// The global count when it can be read without waiting for a GPU (CPU tensors); `None`
    /// on other devices, where reading it would stall the stream.
    ///
    /// # Errors
    ///
    /// When the statistics' storage cannot be read.
    pub fn host_count(&self) -> Result<Option<f64>> {
        host_count(&self.rows)
    }
}

/// [`batch_norm_gather_stats`] for a training step of a layer: also updates the layer's running
/// statistics in place, in the same pass (one kernel on CUDA; nothing read back to the host).
///
/// Per channel, `running ← running + w·(target − running)` with `w = momentum` and the targets
/// the global mean and the unbiased variance, `num_batches_tracked` plus 1. A channel with
/// fewer than 2 values, or whose mean or variance is not finite, gets weight 0: its running
/// statistics stay bitwise as they were (`num_batches_tracked` still counts the step).
///
/// # Arguments
/// * `sums`, `shift`, `eps` - as for [`batch_norm_gather_stats`].
/// * `momentum` - the blend weight of the new statistics, in `[0, 1]`.
/// * `running` - the running statistics to update, or `None` (then `momentum` is unused).
///
/// Unlike [`batch_norm_gather_stats`], a global count of at most 1 is not an error here: the
/// caller decides, from [`GatheredStats::host_count`] where it is at hand.
///
/// # Errors
///
/// When `momentum` is not in `[0, 1]`, `shift` not `[C]` in a float dtype or `sums` not
/// `[3, C]`, when the running
/// statistics are not contiguous `[C]` tensors of one float dtype and a scalar i64 on the sums'
/// device; on a GPU, when a CUDA allocation or kernel launch fails. The running statistics are
/// untouched by a failed call.
pub fn batch_norm_gather_stats_update(
    sums: &Tensor,
    shift: &Tensor,
    eps: f64,
    momentum: f64,
    running: Option<&RunningStats>,
) -> Result<GatheredStats> {
    crate::device::check_supported(OP, sums.device())?;
    if !(0.0..=1.0).contains(&momentum) {
        bail!("{OP}: momentum must be in [0, 1], got {momentum}")
    }
    let rows = finalize(sums, shift, momentum, eps, running.cloned())?;
    Ok(GatheredStats { rows })
}

/// A layer's running statistics, which [`batch_norm_gather_stats_update`] updates **in place**:
/// the tensors of its variables (`Var::as_tensor`), which share the variables' storage, so that
/// writes through them are the variables' writes.
///
/// Written only by the finalize op: on the CPU under candle's write locks, on CUDA by one kernel
/// on the device's stream (candle orders every use of them on that stream).
#[derive(Debug, Clone)]
pub struct RunningStats {
    /// `running_mean`: `[C]`, contiguous, f32, f64, f16 or bf16.
    pub mean: Tensor,
    /// `running_var`: `[C]`, contiguous, in `mean`'s dtype.
    pub var: Tensor,
    /// `num_batches_tracked`: one i64 value (PyTorch's checkpoints hold it so).
    pub num_batches_tracked: Tensor,
}

impl RunningStats {
    /// The running statistics' dtype.
    #[cfg(feature = "cuda")]
    fn dtype(&self) -> DType {
        self.mean.dtype()
    }

    /// Errors unless the variables fit a finalize of `c` channels on `dev`.
    fn check(&self, c: usize, dev: &Device) -> Result<()> {
        let (m, v, b) = (&self.mean, &self.var, &self.num_batches_tracked);
        let float = |d: DType| matches!(d, DType::F32 | DType::F64 | DType::F16 | DType::BF16);
        let here = |t: &Tensor| t.device().same_device(dev) && t.is_contiguous();
        if m.dims() != [c]
            || v.dims() != [c]
            || b.elem_count() != 1
            || v.dtype() != m.dtype()
            || !float(m.dtype())
            || b.dtype() != DType::I64
            || !(here(m) && here(v) && here(b))
        {
            bail!(
                "{OP}: running statistics must be contiguous [{c}] f32/f64/f16/bf16 tensors of one dtype and a scalar i64 on {dev:?}, got running_mean {:?} {:?}, running_var {:?} {:?}, num_batches_tracked {:?} {:?}",
                m.dims(),
                m.dtype(),
                v.dims(),
                v.dtype(),
                b.dims(),
                b.dtype()
            )
        }
        Ok(())
    }

    /// The CPU update: reads the variables into rows `OLD_MEAN`/`OLD_VAR` of `out` (`[ROWS,
    /// C]`, rows up to `RUN_VAR` already finalized), blends them towards rows `SHIFT`/`RUN_VAR`
    /// with weight `BLEND` (rounded as the kernel does: f64 arithmetic, no fused multiply-add,
    /// stored through f32 for f16/bf16) and adds 1 to `num_batches_tracked`.
    fn update_cpu(&self, out: &mut [f64], c: usize) -> Result<()> {
        let rows = |r: usize| r * c..(r + 1) * c;
        for (var, target, old) in [
            (&self.mean, row::SHIFT, row::OLD_MEAN),
            (&self.var, row::RUN_VAR, row::OLD_VAR),
        ] {
            let (before, after) = out.split_at_mut(row::OLD_MEAN * c);
            let old_row = &mut after[rows(old - row::OLD_MEAN)];
            var.inplace_op1(&Blend {
                target: &before[rows(target)],
                weight: &before[rows(row::BLEND)],
                old: std::sync::Mutex::new(old_row),
            })?;
        }
        self.num_batches_tracked.inplace_op1(&Increment)
    }

    /// The variables' CUDA storages, read-locked while the finalize kernel is enqueued.
    #[cfg(feature = "cuda")]
    fn aux(&self, dev: &candle_core::CudaDevice) -> Result<RunningAux<'_>> {
        use crate::device::cuda::Aux;
        Ok(RunningAux {
            mean: Aux::of(OP, &self.mean, dev, self.dtype(), "running_mean")?,
            var: Aux::of(OP, &self.var, dev, self.dtype(), "running_var")?,
            num_batches_tracked: Aux::of(
                OP,
                &self.num_batches_tracked,
                dev,
                DType::I64,
                "num_batches_tracked",
            )?,
        })
    }
}

/// [`RunningStats`]' storages during a CUDA launch.
#[cfg(feature = "cuda")]
struct RunningAux<'a> {
    pub mean: crate::device::cuda::Aux<'a>,
    pub var: crate::device::cuda::Aux<'a>,
    pub num_batches_tracked: crate::device::cuda::Aux<'a>,
}

/// `v ← v + w·(target − v)` per channel, keeping the old values (as f64) in `old`.
struct Blend<'a> {
    target: &'a [f64],
    weight: &'a [f64],
    old: std::sync::Mutex<&'a mut [f64]>,
}

/// The blend of the kernel (`blend` in `kernels/stats.cu`): f64 steps, never fused.
fn blend(old: f64, target: f64, w: f64) -> f64 {
    old + (target - old) * w
}

impl InplaceOp1 for Blend<'_> {
    fn name(&self) -> &'static str {
        "sync-batch-norm-running-update"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let Some((lo, hi)) = l.contiguous_offsets() else {
            bail!("{OP}: running statistics must be contiguous")
        };
        let mut old = self.old.lock().unwrap_or_else(|e| e.into_inner());
        macro_rules! update {
            ($v:expr, $load:expr, $store:expr) => {
                for (j, v) in $v[lo..hi].iter_mut().enumerate() {
                    let o: f64 = $load(*v);
                    old[j] = o;
                    *v = $store(blend(o, self.target[j], self.weight[j]));
                }
            };
        }
        match s {
            CpuStorage::F64(v) => update!(v, |x| x, |x| x),
            CpuStorage::F32(v) => update!(v, |x: f32| x as f64, |x: f64| x as f32),
            CpuStorage::F16(v) => {
                update!(v, |x: half::f16| x.to_f64(), |x: f64| half::f16::from_f32(
                    x as f32
                ))
            }
            CpuStorage::BF16(v) => {
                update!(
                    v,
                    |x: half::bf16| x.to_f64(),
                    |x: f64| half::bf16::from_f32(x as f32)
                )
            }
            s => bail!(
                "{OP}: running statistics must be f32, f64, f16 or bf16, got {:?}",
                s.dtype()
            ),
        }
        Ok(())
    }
}

/// `num_batches_tracked += 1`.
struct Increment;

impl InplaceOp1 for Increment {
    fn name(&self) -> &'static str {
        "sync-batch-norm-count-batch"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        match s {
            CpuStorage::I64(v) => v[l.start_offset()] += 1,
            s => bail!("{OP}: num_batches_tracked must be i64, got {:?}", s.dtype()),
        }
        Ok(())
    }
}
