//! The CUDA floor the ops and the NCCL backend stand on (feature `cuda`): the fatbin images compiled from
//! `kernels/*.cu` by `build.rs` and loaded once per device, kernel lookup by name, the launch of
//! a call built by [`super::args`], device views of inputs, and the
//! persistent arrival counters of the grid-split reductions. Every kernel is enqueued on the
//! candle device's stream; nothing here waits for the GPU.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, DeviceId, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};

use super::args::{Arg, Buffer, Call};
use super::launch::Launch;

/// The fatbin of every `kernels/<file>.cu` (`pub const <FILE>: &[u8]`) and `SASS_ARCHS`.
mod images {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// The architectures whose machine code every kernel image holds (`sm_XX` as `XX`: 80 and 90,
/// and `CUDA_COMPUTE_CAP` at build time when it named another); the newest also ships as PTX,
/// which the driver compiles for GPUs newer than all of them.
pub(crate) fn shipped_archs() -> &'static [u32] {
    images::SASS_ARCHS
}

/// One compiled kernel file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Module {
    Stats,
    Apply,
    BackwardReduce,
    BackwardElemt,
    MaxPool,
}

impl Module {
    /// All of them, for the image checks.
    #[cfg(test)]
    pub const ALL: [Module; 5] = [
        Module::Stats,
        Module::Apply,
        Module::BackwardReduce,
        Module::BackwardElemt,
        Module::MaxPool,
    ];

    /// `(kernel source, fatbin image)`.
    pub fn image(self) -> (&'static str, &'static [u8]) {
        match self {
            Module::Stats => ("kernels/stats.cu", images::STATS),
            Module::Apply => ("kernels/apply.cu", images::APPLY),
            Module::BackwardReduce => ("kernels/backward_reduce.cu", images::BACKWARD_REDUCE),
            Module::BackwardElemt => ("kernels/backward_elemt.cu", images::BACKWARD_ELEMT),
            Module::MaxPool => ("kernels/max_pool.cu", images::MAX_POOL),
        }
    }
}

/// Loaded modules and kernels of each device. candle's own cache of custom kernels takes PTX
/// text only, which the driver compiles at first use (16.6 s for these files on an H100 with
/// an empty driver cache); the images here carry machine code and load in milliseconds.
#[derive(Default)]
struct Loaded {
    modules: HashMap<(DeviceId, Module), Arc<CudaModule>>,
    functions: HashMap<(DeviceId, String), CudaFunction>,
}
static LOADED: Mutex<Option<Loaded>> = Mutex::new(None);

/// `module`'s entry point `name` on `dev`, loading the module's image on first use.
pub(crate) fn function(dev: &CudaDevice, module: Module, name: &str) -> Result<CudaFunction> {
    let mut guard = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    let loaded = guard.get_or_insert_with(Loaded::default);
    let key = (dev.id(), name.to_string());
    if let Some(f) = loaded.functions.get(&key) {
        return Ok(f.clone());
    }
    let m = match loaded.modules.entry((dev.id(), module)) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(e) => {
            let (source, image) = module.image();
            let m = dev
                .cuda_stream()
                .context()
                .load_module(Ptx::from_binary(image.to_vec()))
                .map_err(|err| {
                    candle_core::Error::Msg(format!(
                        "loading the CUDA kernels of {source} on {dev:?} failed ({err}); the \
                         image holds machine code for sm_{:?} and PTX for newer GPUs",
                        shipped_archs()
                    ))
                })?;
            e.insert(m)
        }
    };
    let f = m.load_function(name).w()?;
    loaded.functions.insert(key, f.clone());
    Ok(f)
}

/// cudarc's launch configuration of one of our launches.
fn config(l: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
        block_dim: (l.block[0], l.block[1], l.block[2]),
        shared_mem_bytes: l.shared_mem_bytes,
    }
}

/// The buffers of one launch as [`Buffer`]s for the builders of [`super::args`], holding
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

/// Enqueues `call` (built by [`super::args`], `None`: nothing to launch) from `module` on the
/// stream of `buffers`, then releases their guards.
pub(crate) fn launch(
    dev: &CudaDevice,
    module: Module,
    call: Option<Call>,
    buffers: Buffers<'_>,
) -> Result<()> {
    let Some(call) = call else {
        return Ok(());
    };
    let func = function(dev, module, &call.name)?;
    let mut builder = buffers.stream.launch_builder(&func);
    for arg in &call.args {
        match arg {
            Arg::Ptr(p) => builder.arg(p),
            Arg::I64(v) => builder.arg(v),
            Arg::I32(v) => builder.arg(v),
            Arg::F64(v) => builder.arg(v),
        };
    }
    // SAFETY: `call` comes from the builder of `device::args` for this entry point, which lists
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

/// A storage type of the kernels with its accumulation type (`AccOf<T>` in
/// `kernels/compat.cuh`): the dtype of the per-channel parameters the kernels read.
pub(crate) trait KernelElem: CudaDType + DeviceRepr {
    type Acc: CudaDType;
}
impl KernelElem for f32 {
    type Acc = f32;
}
impl KernelElem for f64 {
    type Acc = f64;
}
impl KernelElem for half::f16 {
    type Acc = f32;
}
impl KernelElem for half::bf16 {
    type Acc = f32;
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

/// Zeroed `u32` arrival counters per CUDA device and stream, reused by every reduction launched
/// there.
///
/// The kernels leave them zero again (the last block of a channel resets its counter), so they
/// are allocated and zeroed once per device, stream and size, never per call. Launches on one
/// stream run in order, so two reductions never use the same counters at once. A device made
/// with `Device::new_cuda` enqueues on the per-thread default stream: each host thread has a
/// stream of its own there, and thread ranks sharing the device run concurrently, so those
/// counters are kept per thread (and freed with it).
static COUNTERS: Mutex<Option<HashMap<DeviceId, CudaSlice<u32>>>> = Mutex::new(None);
thread_local! {
    static THREAD_COUNTERS: std::cell::RefCell<HashMap<DeviceId, CudaSlice<u32>>> =
        std::cell::RefCell::new(HashMap::new());
}

/// Whether `dev` enqueues on the calling thread's per-thread default stream.
fn on_per_thread_stream(dev: &CudaDevice) -> bool {
    dev.cuda_stream().cu_stream() as usize == PER_THREAD_STREAM
}

/// The driver's handle of the per-thread default stream (`CU_STREAM_PER_THREAD`).
const PER_THREAD_STREAM: usize = 0x2;

/// Runs `f` with at least `len` zeroed counters of `dev`'s stream.
pub(crate) fn with_counters<R>(
    dev: &CudaDevice,
    len: usize,
    f: impl FnOnce(&mut CudaSlice<u32>) -> Result<R>,
) -> Result<R> {
    let fresh_enough = |map: &mut HashMap<DeviceId, CudaSlice<u32>>| -> Result<()> {
        let stale = map.get(&dev.id()).is_none_or(|c| c.len() < len);
        if stale {
            map.insert(dev.id(), dev.alloc_zeros::<u32>(len)?);
        }
        Ok(())
    };
    if on_per_thread_stream(dev) {
        return THREAD_COUNTERS.with(|m| {
            let mut map = m.borrow_mut();
            fresh_enough(&mut map)?;
            f(map.get_mut(&dev.id()).expect("inserted above"))
        });
    }
    let mut guard = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    fresh_enough(map)?;
    f(map.get_mut(&dev.id()).expect("inserted above"))
}

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

/// Scratch of a reduction's partial sums (`[splits, 2, C]` f64), written before it is read:
/// not zeroed. At least one element, so that the pointer is valid even without a split.
pub(crate) fn workspace(dev: &CudaDevice, len: usize) -> Result<CudaSlice<f64>> {
    // SAFETY: the kernels write every partial before the last block of its channel reads it.
    unsafe { dev.alloc::<f64>(len.max(1)) }
}
