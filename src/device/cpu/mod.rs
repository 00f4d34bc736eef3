//! Shared machinery of the CPU kernels: element types, contiguous slices of CPU storage and
//! the dtype dispatch (here), deterministic parallel drivers on candle's worker pool
//! ([`pool`]: fixed work items combined in a fixed order, so results do not depend on the
//! number of threads), and the vectorised reduction loops and run-time SIMD choice ([`simd`]).

use std::ops::{Add, Mul, Sub};

use candle_core::{bail, CpuStorage, Layout, Result, WithDType};
use half::{bf16, f16};

mod pool;
mod simd;

pub(crate) use pool::{
    chunks_on_pool, chunks_on_pool_for, elementwise, pool_threads, reduce2, written,
};
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_imports))]
pub(crate) use simd::{has_avx2_fma, prefetch_l2, row_sums, segment_sums, simd_fn, Terms, LANES};

/// Arithmetic type of the element-wise passes: f32 for f32/f16/bf16, f64 for f64.
pub(crate) trait Real:
    Copy + Send + Sync + PartialOrd + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self>
{
    const ZERO: Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
}

/// A storage element type the kernels accept.
pub(crate) trait Elem: WithDType {
    type R: Real;
    fn load(self) -> Self::R;
    fn store(v: Self::R) -> Self;
}

impl Elem for f32 {
    type R = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        v
    }
}

impl Elem for f64 {
    type R = f64;
    #[inline(always)]
    fn load(self) -> f64 {
        self
    }
    #[inline(always)]
    fn store(v: f64) -> Self {
        v
    }
}

impl Elem for f16 {
    type R = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Elem for bf16 {
    type R = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Splits a per-channel f64 value into `hi + lo` in the arithmetic type, so that `x − hi − lo`
/// stays accurate in f32 when `|mean| ≫ std` (`x − hi` is exact near the mean).
#[inline]
pub(crate) fn split<R: Real>(v: f64) -> (R, R) {
    let hi = R::from_f64(v);
    (hi, R::from_f64(v - hi.to_f64()))
}

/// The contiguous data of a CPU storage as a slice of `T`.
pub(crate) fn slice<'a, T: WithDType>(op: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let data = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => bail!(
            "{op}: expected a contiguous tensor, got strides {:?}",
            l.stride()
        ),
    }
}

/// Calls `$run::<T>(args…)` with the storage type `T` of `$dtype` (f32, f64, f16 or bf16);
/// another dtype is an error naming the caller `$op` (evaluated only then). The CPU twin of
/// `cuda::dispatch!`.
macro_rules! dispatch {
    ($op:expr, $dtype:expr, $run:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            candle_core::DType::F32 => $run::<f32>($($arg),*),
            candle_core::DType::F64 => $run::<f64>($($arg),*),
            candle_core::DType::F16 => $run::<half::f16>($($arg),*),
            candle_core::DType::BF16 => $run::<half::bf16>($($arg),*),
            d => candle_core::bail!(
                "{}: unsupported dtype {d:?} (expected f32, f64, f16 or bf16)",
                $op
            ),
        }
    };
}
pub(crate) use dispatch;
