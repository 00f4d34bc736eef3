//! The floor the kernels, the ops and the collectives stand on: what touches a device's memory
//! or launches on it, and nothing about batch normalisation.
//!
//! - `geometry`: the `(N, C, S)` shape of an input, channels-first or channels-last.
//! - `call`: what a kernel launch is (grid, parameters, buffers), with a size-checking builder.
//! - `cpu`: element types, contiguous slices of CPU storage, deterministic parallel drivers on
//!   candle's worker pool, and the SIMD helpers of the CPU paths.
//! - `cuda` (feature `cuda`): launching a call, the buffers of a launch with their
//!   stream-ordering guards, device views of storage, the dtype dispatch of the CUDA paths, and
//!   the hand-offs between threads' streams.
//!
//! Errors raised here name their caller (the `op` argument): an op's errors name the op, the
//! NCCL backend's name NCCL.

mod call;
pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod geometry;
mod support;

pub(crate) use call::List;
pub use call::{Arg, Buffer, Call, Launch};
pub use geometry::Geometry;
pub(crate) use support::check_supported;

/// A point in the stream of the thread that wrote a tensor, which another thread waits for
/// before it reads the tensor: a hand-off between threads that does not wait for the GPU.
///
/// A device made with `Device::new_cuda` enqueues on each host thread's own per-thread default
/// stream, and the streams of two threads are not ordered: a tensor one thread computed and
/// another reads (a collective's input on a communication thread, its result back on the
/// rank's thread) needs an event recorded by the writer and waited for by the reader's
/// stream. Nothing for CPU tensors.
pub(crate) struct Handoff {
    #[cfg(feature = "cuda")]
    event: Option<cuda::Handoff>,
}

impl Handoff {
    /// On the thread that wrote `t`: marks the work enqueued so far on its stream.
    pub(crate) fn mark(t: &candle_core::Tensor) -> candle_core::Result<Self> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = t.device() {
            return Ok(Self {
                event: Some(cuda::Handoff::mark(dev)?),
            });
        }
        let _ = t;
        Ok(Self {
            #[cfg(feature = "cuda")]
            event: None,
        })
    }

    /// On the thread that reads the tensor: its stream waits for the mark (the host does not).
    pub(crate) fn wait(self) -> candle_core::Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(e) = self.event {
            return e.wait();
        }
        Ok(())
    }
}
