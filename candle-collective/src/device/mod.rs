//! The device floor the collectives stand on, and which `candle-distributed`'s ops share (one
//! definition of each): the run-time choice of the AVX2 + FMA builds and cache hints ([`cpu`]);
//! with feature `cuda`, device views of storage, the per-thread default stream and the
//! hand-offs between threads' streams (`cuda`). Not part of the API: it may change in any
//! release.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

/// A copy of `t` in storage of its own, on `t`'s device, on every candle device: `Tensor::copy`
/// on the CPU and CUDA; elsewhere through the host, because candle 0.11's Metal `copy` (its
/// storage's `try_clone`) shares the buffer, so that a later write into `t` (`Var::set`, an
/// optimizer step) would show through the "copy".
///
/// # Errors
///
/// When the copy or a transfer fails.
pub fn fresh_copy(t: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    use candle_core::Device;
    match t.device() {
        Device::Cpu | Device::Cuda(_) => t.copy(),
        other => t.to_device(&Device::Cpu)?.to_device(other),
    }
}

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

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    /// A fresh copy keeps the values it was made with when the original variable is written
    /// afterwards. (On the CPU: the branch for candle's Metal buffers needs
    /// a Mac.)
    #[test]
    fn a_fresh_copy_does_not_follow_its_original() -> candle_core::Result<()> {
        let v = Var::new(&[1.5f32, -2.0, 3.25], &Device::Cpu)?;
        let copy = super::fresh_copy(v.as_tensor())?;
        v.set(&Tensor::new(&[7f32, 8., 9.], &Device::Cpu)?)?;
        assert_eq!(copy.to_vec1::<f32>()?, [1.5, -2.0, 3.25]);
        assert_eq!(v.as_tensor().to_vec1::<f32>()?, [7., 8., 9.]);
        Ok(())
    }
}
