//! The CUDA floor the kernels, the ops and the NCCL backend stand on (feature `cuda`): the
//! launch of a [`Call`] with the guards of its buffers, device views of inputs, the dtype
//! dispatch (device views of storage and the hand-offs between threads' streams are
//! `crate::collective::device::cuda`'s). Every kernel is enqueued on the candle
//! device's stream; nothing here waits for the GPU.

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
    SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

use super::{Arg, Buffer, Call, Launch};
// Views of storage and the per-thread stream are the NCCL backend's too: one definition, below.
pub(crate) use candle_collective::device::cuda::{on_per_thread_stream, view};

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
