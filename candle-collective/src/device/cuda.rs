//! The CUDA side (feature `cuda`): device views of storage, the per-thread default stream, and
//! the hand-offs between threads' streams. Nothing here waits for the GPU except
//! `finish_thread_work`.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, CudaView};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result};

/// The contiguous elements of a CUDA input as a view (the ops make their inputs contiguous).
pub fn view<'a, T: CudaDType>(
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

/// Whether `dev` enqueues on the calling thread's per-thread default stream.
pub fn on_per_thread_stream(dev: &CudaDevice) -> bool {
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
