//! A layer's running statistics as the finalize op sees them: its `running_mean`,
//! `running_var` and `num_batches_tracked` variables, updated in place by the same pass that
//! finalizes the batch statistics (`bn_finalize_<dtype>` on CUDA, [`Running::update_cpu`] on
//! the CPU), so that a training step has no per-channel bookkeeping of its own.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Device, InplaceOp1, Layout, Result, Tensor};

use super::combine::row;
use super::OP;

/// The tensors of a layer's running-statistics variables (they share the variables' storage,
/// so writes through them are the variables' writes).
///
/// `mean`, `var`: `[C]`, one dtype among f32/f64/f16/bf16; `batches`: a scalar i64. They are
/// written only by the finalize op, on the CPU under candle's write locks, on CUDA by one
/// kernel on the device's stream (candle orders every use of them on that stream).
#[derive(Debug, Clone)]
pub(crate) struct Running {
    pub mean: Tensor,
    pub var: Tensor,
    pub batches: Tensor,
}

impl Running {
    /// The running statistics' dtype.
    #[cfg(feature = "cuda")]
    pub fn dtype(&self) -> DType {
        self.mean.dtype()
    }

    /// Errors unless the variables fit a finalize of `c` channels on `dev`.
    pub fn check(&self, c: usize, dev: &Device) -> Result<()> {
        let (m, v, b) = (&self.mean, &self.var, &self.batches);
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
    pub fn update_cpu(&self, out: &mut [f64], c: usize) -> Result<()> {
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
        self.batches.inplace_op1(&Increment)
    }

    /// The variables' CUDA storages, read-locked while the finalize kernel is enqueued.
    #[cfg(feature = "cuda")]
    pub fn aux(&self, dev: &candle_core::CudaDevice) -> Result<RunningAux<'_>> {
        use crate::device::cuda::Aux;
        Ok(RunningAux {
            mean: Aux::of(OP, &self.mean, dev, self.dtype(), "running_mean")?,
            var: Aux::of(OP, &self.var, dev, self.dtype(), "running_var")?,
            batches: Aux::of(OP, &self.batches, dev, DType::I64, "num_batches_tracked")?,
        })
    }
}

/// [`Running`]'s storages during a CUDA launch.
#[cfg(feature = "cuda")]
pub(crate) struct RunningAux<'a> {
    pub mean: crate::device::cuda::Aux<'a>,
    pub var: crate::device::cuda::Aux<'a>,
    pub batches: crate::device::cuda::Aux<'a>,
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
