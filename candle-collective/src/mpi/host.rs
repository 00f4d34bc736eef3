//! Host buffers of the MPI collectives (every tensor passes through the CPU) and the codes of
//! the descriptor every rank all-gathers before a collective.

use candle_core::{CpuStorage, DType, Device, Result, Storage, Tensor};

use super::super::{CollectiveError, ReduceOp};
use super::BACKEND;

pub(super) fn invalid(op: &'static str, detail: String) -> candle_core::Error {
    CollectiveError::invalid(BACKEND, op, detail).into()
}

/// A tensor's values on the host in a type MPI knows (f16 and bf16 travel as f32, exactly).
pub(super) enum HostBuf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    U32(Vec<u32>),
    U8(Vec<u8>),
}

/// Runs `$body` with `$v` bound to the vector inside a `HostBuf`.
macro_rules! with_buf {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            HostBuf::F32($v) => $body,
            HostBuf::F64($v) => $body,
            HostBuf::I64($v) => $body,
            HostBuf::U32($v) => $body,
            HostBuf::U8($v) => $body,
        }
    };
}
pub(super) use with_buf;

impl HostBuf {
    pub(super) fn of(t: &Tensor) -> Result<Self> {
        let t = t.to_device(&Device::Cpu)?.flatten_all()?;
        Ok(match t.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => {
                HostBuf::F32(t.to_dtype(DType::F32)?.to_vec1()?)
            }
            DType::F64 => HostBuf::F64(t.to_vec1()?),
            DType::I64 => HostBuf::I64(t.to_vec1()?),
            DType::U32 => HostBuf::U32(t.to_vec1()?),
            DType::U8 => HostBuf::U8(t.to_vec1()?),
            d => return Err(invalid("collective", format!("unsupported dtype {d:?}"))),
        })
    }

    /// The input of a call, copied before the ranks agree on it: a failure becomes this rank's
    /// verdict in [`super::MpiCollective::agree`] (see [`Staged::verdict`]), so that the call
    /// fails on every rank alike instead of leaving the others waiting in MPI.
    pub(super) fn staged(t: &Tensor) -> Staged<HostBuf> {
        Staged(Self::of(t).map_err(|e| format!("copying the input to the host failed: {e}")))
    }

    /// The input of a reduction: a contiguous host tensor of a type MPI knows is read where it
    /// is, without a copy; anything else is copied as by [`HostBuf::staged`].
    pub(super) fn staged_source(t: &Tensor) -> Staged<Source> {
        if t.device().is_cpu() && t.is_contiguous() && in_place_dtype(t.dtype()) {
            return Staged(Ok(Source::InPlace(t.clone())));
        }
        let Staged(copy) = Self::staged(t);
        Staged(copy.map(Source::Copy))
    }

    /// The values as a slice.
    pub(super) fn as_slice(&self) -> HostSlice<'_> {
        match self {
            HostBuf::F32(v) => HostSlice::F32(v),
            HostBuf::F64(v) => HostSlice::F64(v),
            HostBuf::I64(v) => HostSlice::I64(v),
            HostBuf::U32(v) => HostSlice::U32(v),
            HostBuf::U8(v) => HostSlice::U8(v),
        }
    }

    /// Back to a tensor of `dtype`, `dims`, on `device`.
    pub(super) fn into_tensor(
        self,
        dims: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let t = with_buf!(self, v => Tensor::from_vec(v, dims, &Device::Cpu)?);
        t.to_dtype(dtype)?.to_device(device)
    }
}

/// Whether MPI can read a host tensor of `dtype` where it is (f16 and bf16 travel as f32).
fn in_place_dtype(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F32 | DType::F64 | DType::I64 | DType::U32 | DType::U8
    )
}

/// Host values of a type MPI knows, borrowed.
pub(super) enum HostSlice<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    I64(&'a [i64]),
    U32(&'a [u32]),
    U8(&'a [u8]),
}

/// The input of a reduction on the host: read in place, or copied.
pub(super) enum Source {
    /// A contiguous host tensor of a type MPI knows.
    InPlace(Tensor),
    /// Anything else, copied.
    Copy(HostBuf),
}

impl Source {
    /// Runs `f` on the values, borrowed where they are.
    pub(super) fn with_slice<R>(&self, f: impl FnOnce(HostSlice<'_>) -> R) -> Result<R> {
        let t = match self {
            Source::Copy(buf) => return Ok(f(buf.as_slice())),
            Source::InPlace(t) => t,
        };
        let (storage, layout) = t.storage_and_layout();
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("mpi: an in-place input must be contiguous")
        };
        let slice = match &*storage {
            Storage::Cpu(CpuStorage::F32(v)) => HostSlice::F32(&v[a..b]),
            Storage::Cpu(CpuStorage::F64(v)) => HostSlice::F64(&v[a..b]),
            Storage::Cpu(CpuStorage::I64(v)) => HostSlice::I64(&v[a..b]),
            Storage::Cpu(CpuStorage::U32(v)) => HostSlice::U32(&v[a..b]),
            Storage::Cpu(CpuStorage::U8(v)) => HostSlice::U8(&v[a..b]),
            _ => candle_core::bail!("mpi: an in-place input must be a host tensor of an MPI type"),
        };
        Ok(f(slice))
    }
}

/// A call's input on the host (a copy, or a reduction's [`Source`]), or why it is not there.
pub(super) struct Staged<B>(std::result::Result<B, String>);

impl<B> Staged<B> {
    /// This rank's verdict on the call: `checks`, then whether the copy succeeded.
    pub(super) fn verdict(
        &self,
        checks: std::result::Result<(), String>,
    ) -> std::result::Result<(), String> {
        checks.and_then(|()| self.0.as_ref().map(|_| ()).map_err(Clone::clone))
    }

    /// The buffer, once `agree` accepted the call (which it does not when the copy failed).
    pub(super) fn take(self, op: &'static str) -> Result<B> {
        self.0.map_err(|e| invalid(op, e))
    }
}

/// `ReduceOp::Avg` needs a float dtype: this rank's verdict, shared by `agree`.
pub(super) fn avg_dtype(t: &Tensor, op: ReduceOp) -> std::result::Result<(), String> {
    if op == ReduceOp::Avg && !t.dtype().is_float() {
        return Err(format!(
            "ReduceOp::Avg needs a float dtype, got {:?}",
            t.dtype()
        ));
    }
    Ok(())
}

/// What the flight recorder keeps of a call's input `t`: its dtype and element count.
pub(super) fn input_of(t: &Tensor) -> Option<(DType, usize)> {
    Some((t.dtype(), t.elem_count()))
}

pub(super) fn dtype_code(d: DType) -> i64 {
    d as i64
}

/// A stable 63-bit fingerprint of a shape (all dims, or all but the first for all_gather).
pub(super) fn shape_code(dims: &[usize]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &d in dims {
        h = (h ^ d as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h >> 1) as i64
}
