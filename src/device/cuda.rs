//! The CUDA floor the kernels, the ops and the NCCL backend stand on (feature `cuda`): the
//! launch of a [`Call`] with the guards of its buffers, device views of inputs, the dtype
//! dispatch, and the hand-offs between threads' streams. Every kernel is enqueued on the candle
//! device's stream; nothing here waits for the GPU.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaFunction, CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

use super::{Arg, Buffer, Call, Launch};

/// The buffers of one launch as [`Buffer`]s for the kernels' argument builders, holding
/// cudarc's stream-ordering guards (wait for the buffer's last writer before, record this
/// launch's use after) until the launch is enqueued.
pub(crate) struct Buffers<'a> {
    stream: &'a CudaStream,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Buffers<'a> {
    /// Buffers of a launch on `stream` (the candle device's stream).
    pub fn on(stream: &'a CudaStream) -> Self {
        Self {
            stream,
            guards: Vec::with_capacity(12),
        }
    }

    /// A buffer the kernel reads (or, for the layer's running statistics held under a read
    /// lock, updates in place; see `Running`).
    pub fn read<T>(&mut self, v: &'a impl DevicePtr<T>) -> Buffer {
        let len = v.len();
        let (addr, guard) = v.device_ptr(self.stream);
        self.guards.push(guard);
        Buffer { addr, len }
    }

    /// A buffer the kernel writes.
    pub fn write<T>(&mut self, v: &'a mut impl DevicePtrMut<T>) -> Buffer {
        let len = v.len();
        let (addr, guard) = v.device_ptr_mut(self.stream);
        self.guards.push(guard);
        Buffer { addr, len }
    }
}

/// cudarc's launch configuration of one of our launches.
fn config(l: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
        block_dim: (l.block[0], l.block[1], l.block[2]),
        shared_mem_bytes: l.shared_mem_bytes,
    }
}

/// Enqueues `call` as `func` (the entry point `call.name`) on the stream of `buffers`, then
/// releases their guards.
pub(crate) fn launch_call(func: &CudaFunction, call: &Call, buffers: Buffers<'_>) -> Result<()> {
    let mut builder = buffers.stream.launch_builder(func);
    for arg in &call.args {
        match arg {
            Arg::Ptr(p) => builder.arg(p),
            Arg::I64(v) => builder.arg(v),
            Arg::I32(v) => builder.arg(v),
            Arg::F64(v) => builder.arg(v),
        };
    }
    // SAFETY: `call` comes from the builder of `kernels::args` for this entry point, which lists
    // exactly the parameters of the `extern "C"` function `call.name` in `kernels/*.cu`, in
    // order and with their types (pointers as u64 device addresses, `long long` as i64, `int`
    // as i32, `double` as f64), after checking that every buffer holds at least the elements
    // the launch configuration makes the kernel touch; the addresses come from live views whose
    // guards `buffers` holds until after the launch is enqueued. The emulation tests run the
    // same lists on the host.
    unsafe { builder.launch(config(call.launch)) }.w()?;
    drop(buffers);
    Ok(())
}

/// The contiguous elements of a CUDA input as a view (the ops make their inputs contiguous).
pub(crate) fn view<'a, T: CudaDType>(
    op: &str,
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((lo, hi)) => Ok(s.as_cuda_slice::<T>()?.slice(lo..hi)),
        None => bail!("{op}: {what} must be contiguous on CUDA"),
    }
}

/// The CUDA storage of a tensor an op holds besides its inputs (per-channel statistics and
/// parameters), locked for reading while the launch is enqueued.
pub(crate) struct Aux<'a> {
    /// The caller's name, for errors.
    op: &'static str,
    guard: candle_core::StorageRef<'a>,
    layout: &'a Layout,
}

impl<'a> Aux<'a> {
    /// `t` must be a `dtype` tensor on the op's CUDA device (else an error naming `op`).
    pub fn of(
        op: &'static str,
        t: &'a Tensor,
        dev: &CudaDevice,
        dtype: DType,
        what: &str,
    ) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        match &*guard {
            Storage::Cuda(s) if s.device.id() == dev.id() && t.dtype() == dtype => {}
            _ => bail!(
                "{op}: {what} must be a {dtype:?} tensor on the input's CUDA device, got {:?} on {:?}",
                t.dtype(),
                t.device()
            ),
        }
        Ok(Self { op, guard, layout })
    }

    /// The storage and layout, as a custom op receives its inputs.
    pub fn parts(&self) -> (&CudaStorage, &Layout) {
        match &*self.guard {
            Storage::Cuda(s) => (s, self.layout),
            _ => unreachable!("checked in Aux::of"),
        }
    }

    /// The tensor's values as a device view.
    pub fn view<T: CudaDType>(&self, what: &str) -> Result<CudaView<'_, T>> {
        let (s, l) = self.parts();
        view(self.op, s, l, what)
    }
}

/// Calls `$run::<T>(args…)` with the storage type `T` of `$dtype`; another dtype is an error
/// naming the caller `$op`.
macro_rules! dispatch {
    ($op:expr, $dtype:expr, $run:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            candle_core::DType::F32 => $run::<f32>($($arg),*),
            candle_core::DType::F64 => $run::<f64>($($arg),*),
            candle_core::DType::F16 => $run::<half::f16>($($arg),*),
            candle_core::DType::BF16 => $run::<half::bf16>($($arg),*),
            d => candle_core::bail!(
                "{}: unsupported dtype {d:?} on CUDA (expected f32, f64, f16 or bf16)",
                $op
            ),
        }
    };
}
pub(crate) use dispatch;

/// Whether `dev` enqueues on the calling thread's per-thread default stream.
pub(crate) fn on_per_thread_stream(dev: &CudaDevice) -> bool {
    dev.cuda_stream().cu_stream() as usize == PER_THREAD_STREAM
}

/// The driver's handle of the per-thread default stream (`CU_STREAM_PER_THREAD`).
const PER_THREAD_STREAM: usize = 0x2;

/// An event recorded on the writing thread's stream of a device, for [`super::Handoff`].
pub(crate) struct Handoff {
    stream: Arc<CudaStream>,
    event: CudaEvent,
}

impl Handoff {
    /// Records the work the calling thread enqueued so far on `dev`'s stream.
    pub(crate) fn mark(dev: &CudaDevice) -> Result<Self> {
        let stream = dev.cuda_stream();
        let event = stream.record_event(None).w()?;
        Ok(Self { stream, event })
    }

    /// Makes the calling thread's stream of the same device wait for the recorded work.
    pub(crate) fn wait(self) -> Result<()> {
        self.stream.wait(&self.event).w()
    }
}

/// What a rank thread hands back with its result: its GPU work is complete (see
/// [`finish_thread_work`]), and the CUDA context it last used, which the receiving thread makes
/// current if it has none ([`RankContext::adopt`]).
pub(crate) struct RankContext(Option<usize>);

/// Waits until the work the calling thread enqueued on its per-thread default stream (that of
/// its current CUDA context, if any) has completed: what another thread may read of it is then
/// written. Per-thread streams are not ordered with each other, so a tensor a thread rank
/// computed on a device made with `Device::new_cuda` must not be read by another thread before
/// this. Returns the context, for the receiving thread.
pub(crate) fn finish_thread_work() -> Result<RankContext> {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    match result::ctx::get_current() {
        // A driver never initialised in this process: the thread enqueued nothing.
        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_INITIALIZED => Ok(RankContext(None)),
        Err(e) => Err(e).w(),
        Ok(None) => Ok(RankContext(None)),
        Ok(Some(ctx)) => {
            // SAFETY: the handle is the driver's constant for the calling thread's per-thread
            // default stream, valid in the current context.
            unsafe { result::stream::synchronize(PER_THREAD_STREAM as _) }.w()?;
            Ok(RankContext(Some(ctx as usize)))
        }
    }
}

impl RankContext {
    /// On the thread that received a rank's tensors: makes the rank's context current if the
    /// thread has none. cudarc frees a dropped tensor's memory on the dropping thread's
    /// per-thread stream without making its context current first, and the driver refuses
    /// that call on a thread without a current context (`CUDA_ERROR_INVALID_CONTEXT`), which
    /// cudarc then reports from a later call of any thread.
    pub(crate) fn adopt(&self) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let Some(ctx) = self.0 else { return Ok(()) };
        if result::ctx::get_current().w()?.is_some() {
            return Ok(());
        }
        // SAFETY: `ctx` is a context that a rank thread had current, kept alive (retained) by
        // the tensors it returned; making it current only changes the calling thread's state.
        unsafe { result::ctx::set_current(ctx as sys::CUcontext) }.w()
    }
}
