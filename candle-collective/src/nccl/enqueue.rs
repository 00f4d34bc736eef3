//! The enqueue path: a collective as a candle op on the communicator's GPU, so that its output
//! is an ordinary device tensor, and the padding that lets NCCL's equal-size all-gather carry
//! unequal row counts.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, DType, InplaceOp1, Layout, Result, Shape, Tensor,
};

use super::super::Op;
use super::raw::Buffers;
use super::watchdog::CallError;
use super::{invalid, NcclCollective};
use crate::device::cuda::view;

/// One collective of `c` on a tensor, enqueued on `stream` (the device's stream when `None`).
pub(super) struct Enqueue<'a> {
    pub c: &'a NcclCollective,
    pub what: Op,
    /// The collective's number in its communicator.
    pub call: u64,
    pub stream: Option<Arc<CudaStream>>,
}

impl Enqueue<'_> {
    /// The output's element count and shape for an input of `dims` (`n` elements).
    fn output(&self, n: usize, dims: &[usize]) -> Result<(usize, Vec<usize>)> {
        let world = self.c.world;
        let mut d = dims.to_vec();
        Ok(match self.what {
            Op::AllReduce(_) | Op::Broadcast(_) => (n, d),
            Op::ReduceScatter(_) => {
                d[0] /= world;
                (n / world, d)
            }
            Op::AllGather => {
                d[0] *= world;
                (n * world, d)
            }
            Op::Barrier | Op::Split => {
                return Err(invalid(
                    self.what.name(),
                    "not a collective NCCL enqueues".into(),
                ))
            }
        })
    }

    fn run<T: DeviceRepr + CudaDType>(
        &self,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = &self.c.device;
        let src = view::<T>("nccl", s, l, "input")?;
        let n = l.shape().elem_count();
        let (out_len, out_dims) = self.output(n, l.dims())?;
        // SAFETY: NCCL writes every element of the output.
        let mut out = unsafe { dev.alloc::<T>(out_len)? };
        let stream = self.stream.clone().unwrap_or_else(|| dev.cuda_stream());
        if let Some(side) = &self.stream {
            // The side stream starts after everything on the device's stream so far: the
            // input and the output's allocation.
            side.join(&dev.cuda_stream()).w()?;
        }
        let (sp, _read) = src.device_ptr(&stream);
        let (dp, _write) = out.device_ptr_mut(&stream);
        // NCCL's count: per rank for a reduce-scatter, the input's otherwise.
        let count = if matches!(self.what, Op::ReduceScatter(_)) {
            out_len
        } else {
            n
        };
        // SAFETY: both buffers live on this communicator's GPU with the sizes NCCL needs (`n`
        // in, `out_len` out, computed from the operation above); the input is kept alive by
        // the caller's tensor and the output by `out`, both until the stream has run the call
        // (candle's stream-ordered allocations; `_read`/`_write` record the use on `stream`).
        unsafe { self.issue(sp, dp, count, s.dtype(), &stream) }?;
        drop((_read, _write));
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from(out_dims),
        ))
    }

    /// Enqueues the collective from `send` into `recv` (`count` values of `dtype`) on `stream`.
    ///
    /// # Safety
    ///
    /// `send` and `recv` are device buffers on this communicator's GPU, as large as the
    /// operation needs for `count` (see `raw::Comm::enqueue`), that stay valid until `stream`
    /// has run the call; they are one buffer or do not overlap.
    unsafe fn issue(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        stream: &CudaStream,
    ) -> Result<()> {
        let (c, op) = (self.c, self.what.name());
        let bufs = Buffers {
            send: send as *const std::ffi::c_void,
            recv: recv as *mut std::ffi::c_void,
            count,
            dtype,
            stream: stream.cu_stream() as super::ffi::Stream,
        };
        // SAFETY: the buffers are what `raw::Comm::enqueue` needs (this function's contract).
        let res = c.watch.call(op, |comm| {
            unsafe { comm.enqueue(self.what, &bufs) }.map(|p| ((), p))
        });
        match res {
            Ok(()) => Ok(()),
            Err(CallError::Broken(why)) => Err(super::rank_left(c.rank, op, self.call, why)),
            Err(CallError::Nccl(f)) => Err(f.error(op, c.rank)),
        }
    }

    /// The collective with the send buffer as its receive buffer (NCCL's in-place form), on
    /// `s`'s values at `l`, on the device's stream: an all-reduce or a broadcast, whose output
    /// is as large as their input.
    fn run_in_place<T: DeviceRepr + CudaDType>(
        &self,
        s: &mut CudaStorage,
        l: &Layout,
    ) -> Result<()> {
        let op = self.what.name();
        if !matches!(self.what, Op::AllReduce(_) | Op::Broadcast(_)) {
            return Err(invalid(op, "has no in-place form here".into()));
        }
        let Some((lo, hi)) = l.contiguous_offsets() else {
            return Err(invalid(op, "an in-place input must be contiguous".into()));
        };
        if self.stream.is_some() {
            return Err(invalid(
                op,
                "runs in place on the device's stream only".into(),
            ));
        }
        let stream = self.c.device.cuda_stream();
        let dtype = s.dtype();
        let mut buf = s.as_cuda_slice_mut::<T>()?.slice_mut(lo..hi);
        let (p, _write) = buf.device_ptr_mut(&stream);
        // SAFETY: one buffer of `hi - lo` values on this communicator's GPU (the storage is on
        // its device: checked by the caller), sent and received in place; the caller's tensor
        // keeps it alive until the stream has run the call (candle's stream-ordered frees;
        // `_write` records the use on `stream`).
        unsafe { self.issue(p, p, hi - lo, dtype, &stream) }
    }
}

/// `$e.$run::<T>($s, $l)` for the element type `T` of `$s`'s dtype, among those NCCL takes
/// here; an error naming the dtype otherwise.
macro_rules! by_dtype {
    ($e:expr, $run:ident, $s:expr, $l:expr) => {
        match $s.dtype() {
            DType::F32 => $e.$run::<f32>($s, $l),
            DType::F64 => $e.$run::<f64>($s, $l),
            DType::F16 => $e.$run::<half::f16>($s, $l),
            DType::BF16 => $e.$run::<half::bf16>($s, $l),
            DType::I64 => $e.$run::<i64>($s, $l),
            DType::U32 => $e.$run::<u32>($s, $l),
            DType::U8 => $e.$run::<u8>($s, $l),
            d => Err(invalid($e.what.name(), format!("unsupported dtype {d:?}"))),
        }
    };
}

impl Enqueue<'_> {
    /// The error for a tensor on the CPU.
    fn on_cpu(&self) -> candle_core::Error {
        invalid(
            self.what.name(),
            "NCCL needs tensors on the communicator's GPU, got a CPU tensor".into(),
        )
    }

    /// Errors unless `s` is on this communicator's GPU.
    fn check_device(&self, s: &CudaStorage) -> Result<()> {
        if s.device().id() != self.c.device.id() {
            return Err(invalid(
                self.what.name(),
                "the tensor is on another CUDA device than the communicator".into(),
            ));
        }
        Ok(())
    }
}

impl CustomOp1 for Enqueue<'_> {
    fn name(&self) -> &'static str {
        "nccl-collective"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(self.on_cpu())
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        self.check_device(s)?;
        by_dtype!(self, run, s, l)
    }
}

impl InplaceOp1 for Enqueue<'_> {
    fn name(&self) -> &'static str {
        "nccl-collective-in-place"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        Err(self.on_cpu())
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
        self.check_device(s)?;
        by_dtype!(self, run_in_place, s, l)
    }
}

impl NcclCollective {
    /// Every rank's row count (read back: one synchronisation) and `t` padded with zero rows to
    /// the largest count, as NCCL's all-gather needs equal sizes.
    pub(super) fn pad_for_gather(&self, t: &Tensor) -> Result<(Tensor, Vec<usize>, usize)> {
        if t.rank() == 0 {
            return Err(invalid(
                "all_gather",
                "expected a tensor of rank ≥ 1".into(),
            ));
        }
        let n = t.dims()[0];
        let counts = Tensor::new(&[n as i64], &self.device())?;
        let counts = self.enqueue(Op::AllGather, &counts)?.to_vec1::<i64>()?;
        // The read waited for the stream: if the watchdog aborted the gather meanwhile, the
        // buffer was never written, and its bytes are not row counts.
        self.check_usable("all_gather")?;
        let row: usize = t.dims()[1..].iter().product::<usize>().max(1);
        let limit = (isize::MAX as usize / row / t.dtype().size_in_bytes()) as i64;
        if let Some(bad) = counts.iter().find(|&&c| !(0..=limit).contains(&c)) {
            return Err(invalid(
                "all_gather",
                format!(
                    "a rank reported {bad} rows (row counts {counts:?}): not a valid row count"
                ),
            ));
        }
        let counts: Vec<usize> = counts.into_iter().map(|c| c as usize).collect();
        let max = counts.iter().copied().max().unwrap_or(0);
        if n == max {
            return Ok((t.clone(), counts, max));
        }
        let mut pad = t.dims().to_vec();
        pad[0] = max - n;
        let padded = Tensor::cat(&[t, &Tensor::zeros(pad, t.dtype(), t.device())?], 0)?;
        Ok((padded, counts, max))
    }
}

/// Rank r's `counts[r]` rows out of each block of `max` rows of a padded all-gather.
pub(super) fn unpad(all: &Tensor, counts: &[usize], max: usize) -> Result<Tensor> {
    if counts.iter().all(|&c| c == max) {
        return Ok(all.clone());
    }
    let pieces: Vec<Tensor> = counts
        .iter()
        .enumerate()
        .map(|(r, &c)| all.narrow(0, r * max, c))
        .collect::<Result<_>>()?;
    Tensor::cat(&pieces, 0)
}
