//! The argument lists of the batch-norm kernels: statistics, finalize, apply and the two
//! backward passes.

use candle_core::{DType, Result};

use super::{launch, root, Arg, Buffer, Call, Geometry, KernelGeometry, List};

/// The scratch of a grid-split reduction: `work` f64 (`Reduction::work_len`, at least 1) and
/// the zeroed u32 arrival counters (`Reduction::counters`).
#[derive(Debug, Clone, Copy)]
pub struct Scratch {
    /// Partial sums `[splits, 2, C]` f64.
    pub work: Buffer,
    /// Arrival counters, zero before the launch and after it.
    pub counters: Buffer,
}

/// `bn_stats_{nchw,nhwc}_<dtype>` (`kernels/stats.cu`): shifted sums `out` `[3, C]` f64 of `x`.
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    /// The input, `len` elements of the storage type.
    pub x: Buffer,
    /// The shift `[C]` f64.
    pub shift: Buffer,
    /// The sums `[3, C]` f64.
    pub out: Buffer,
    /// The reduction's scratch.
    pub scratch: Scratch,
}

impl Stats {
    /// The launch over `e` in `dtype`; `None` when `c` is 0.
    ///
    /// # Errors
    /// A dtype without kernels, or a buffer smaller than the launch touches (naming `op`).
    pub fn call(&self, op: &str, dtype: DType, e: &Geometry) -> Result<Option<Call>> {
        let Some(r) = e.reduction() else {
            return Ok(None);
        };
        let list = List::new(op, &root(e, "bn_stats"), dtype)?
            .buf("x", self.x, e.len())?
            .buf("shift", self.shift, e.c)?
            .buf("out", self.out, 3 * e.c)?;
        Ok(Some(
            scratch(list, &self.scratch, &r)?.geometry(e).call(r.launch),
        ))
    }
}

/// Appends a reduction's scratch buffers, checked against `r`.
fn scratch<'a>(list: List<'a>, s: &Scratch, r: &launch::Reduction) -> Result<List<'a>> {
    list.buf("work", s.work, r.work_len.max(1))?
        .buf("counters", s.counters, r.counters)
}

/// `bn_apply_{nchw,nhwc}_<dtype>` (`kernels/apply.cu`): `y = relu?((x − mean)·invstd·w + b + z)`.
#[derive(Debug, Clone, Copy)]
pub struct Apply {
    /// The input.
    pub x: Buffer,
    /// The residual added before the ReLU, shaped as `x`.
    pub z: Option<Buffer>,
    /// `[C]` f64.
    pub mean: Buffer,
    /// `[C]` f64.
    pub invstd: Buffer,
    /// Weight γ `[C]` in the accumulation type (f64 for f64 inputs, else f32); `None` for 1.
    pub weight: Option<Buffer>,
    /// Bias β `[C]` in the accumulation type; `None` for 0.
    pub bias: Option<Buffer>,
    /// The output, shaped as `x`.
    pub y: Buffer,
    /// Fused ReLU.
    pub relu: bool,
}

impl Apply {
    /// The launch over `e` in `dtype`; `None` for an empty input.
    ///
    /// # Errors
    /// A dtype without kernels, or a buffer smaller than the launch touches (naming `op`).
    pub fn call(&self, op: &str, dtype: DType, e: &Geometry) -> Result<Option<Call>> {
        let Some(l) = e.elementwise() else {
            return Ok(None);
        };
        let list = List::new(op, &root(e, "bn_apply"), dtype)?
            .buf("x", self.x, e.len())?
            .opt("z", self.z, e.len())?
            .buf("mean", self.mean, e.c)?
            .buf("invstd", self.invstd, e.c)?
            .opt("weight", self.weight, e.c)?
            .opt("bias", self.bias, e.c)?
            .buf("y", self.y, e.len())?
            .geometry(e)
            .push(Arg::I32(i32::from(self.relu)));
        Ok(Some(list.call(l)))
    }
}

/// `bn_backward_reduce_{nchw,nhwc}_<dtype>` (`kernels/backward_reduce.cu`): `out` `[2, C]` f64,
/// `Σ dy'` and `Σ dy'·(x − mean)` with `dy' = dy·[y > 0]` when `y` is given.
#[derive(Debug, Clone, Copy)]
pub struct BackwardReduce {
    /// The output gradient, shaped as the input.
    pub dy: Buffer,
    /// The input.
    pub x: Buffer,
    /// The fused ReLU's output, shaped as the input.
    pub y: Option<Buffer>,
    /// `[C]` f64.
    pub mean: Buffer,
    /// `[2, C]` f64.
    pub out: Buffer,
    /// The reduction's scratch.
    pub scratch: Scratch,
}

impl BackwardReduce {
    /// The launch over `e` in `dtype`; `None` when `c` is 0.
    ///
    /// # Errors
    /// A dtype without kernels, or a buffer smaller than the launch touches (naming `op`).
    pub fn call(&self, op: &str, dtype: DType, e: &Geometry) -> Result<Option<Call>> {
        let Some(r) = e.reduction() else {
            return Ok(None);
        };
        let list = List::new(op, &root(e, "bn_backward_reduce"), dtype)?
            .buf("dy", self.dy, e.len())?
            .buf("x", self.x, e.len())?
            .opt("y", self.y, e.len())?
            .buf("mean", self.mean, e.c)?
            .buf("out", self.out, 2 * e.c)?;
        Ok(Some(
            scratch(list, &self.scratch, &r)?.geometry(e).call(r.launch),
        ))
    }
}

/// `bn_backward_elemt_{nchw,nhwc}_<dtype>` (`kernels/backward_elemt.cu`): `dx`, and `dz` (the
/// residual's gradient) when given.
#[derive(Debug, Clone, Copy)]
pub struct BackwardElemt {
    /// The output gradient, shaped as the input.
    pub dy: Buffer,
    /// The input.
    pub x: Buffer,
    /// The fused ReLU's output, shaped as the input.
    pub y: Option<Buffer>,
    /// `[C]` f64.
    pub mean: Buffer,
    /// `[C]` f64.
    pub invstd: Buffer,
    /// `[C]` in the accumulation type.
    pub weight: Option<Buffer>,
    /// The all-reduced `[2, C]` f64 of the backward reduction.
    pub sums: Buffer,
    /// The global count per channel, `[C]` f64.
    pub count: Buffer,
    /// The input's gradient, shaped as the input.
    pub dx: Buffer,
    /// The residual's gradient, shaped as the input.
    pub dz: Option<Buffer>,
}

impl BackwardElemt {
    /// The launch over `e` in `dtype`; `None` for an empty input.
    ///
    /// # Errors
    /// A dtype without kernels, or a buffer smaller than the launch touches (naming `op`).
    pub fn call(&self, op: &str, dtype: DType, e: &Geometry) -> Result<Option<Call>> {
        let Some(l) = e.elementwise() else {
            return Ok(None);
        };
        let list = List::new(op, &root(e, "bn_backward_elemt"), dtype)?
            .buf("dy", self.dy, e.len())?
            .buf("x", self.x, e.len())?
            .opt("y", self.y, e.len())?
            .buf("mean", self.mean, e.c)?
            .buf("invstd", self.invstd, e.c)?
            .opt("weight", self.weight, e.c)?
            .buf("sums", self.sums, 2 * e.c)?
            .buf("count", self.count, e.c)?
            .buf("dx", self.dx, e.len())?
            .opt("dz", self.dz, e.len())?
            .geometry(e);
        Ok(Some(list.call(l)))
    }
}

/// The layer's running statistics, updated in place by `bn_finalize`.
#[derive(Debug, Clone, Copy)]
pub struct RunningBuffers {
    /// `[C]` in the running statistics' dtype.
    pub mean: Buffer,
    /// `[C]` in the running statistics' dtype.
    pub var: Buffer,
    /// `num_batches_tracked`, one i64.
    pub batches: Buffer,
}

/// `bn_finalize_<dtype>` (`kernels/stats.cu`): all-reduced sums → the `[10, C]` f64 rows of
/// `ops::combine`, blending the running statistics (of `dtype`) in place when given (f64
/// without them).
#[derive(Debug, Clone, Copy)]
pub struct Finalize {
    /// `[3, C]` f64.
    pub sums: Buffer,
    /// `[C]` f64.
    pub shift: Buffer,
    /// `[10, C]` f64.
    pub out: Buffer,
    /// The running statistics.
    pub running: Option<RunningBuffers>,
    /// The running statistics' momentum.
    pub momentum: f64,
    /// Added to the variance before the square root.
    pub eps: f64,
}

impl Finalize {
    /// The launch over `c` channels; `None` when `c` is 0.
    ///
    /// # Errors
    /// A dtype without kernels, or a buffer smaller than the launch touches (naming `op`).
    pub fn call(&self, op: &str, dtype: DType, c: usize) -> Result<Option<Call>> {
        let Some(l) = launch::finalize(c) else {
            return Ok(None);
        };
        let r = self.running;
        let list = List::new(op, "bn_finalize", dtype)?
            .buf("sums", self.sums, 3 * c)?
            .buf("shift", self.shift, c)?
            .buf("out", self.out, 10 * c)?
            .opt("running_mean", r.map(|r| r.mean), c)?
            .opt("running_var", r.map(|r| r.var), c)?
            .opt("num_batches_tracked", r.map(|r| r.batches), 1)?
            .push(Arg::F64(self.momentum))
            .push(Arg::F64(self.eps))
            .push(Arg::I64(c as i64));
        Ok(Some(list.call(l)))
    }
}
