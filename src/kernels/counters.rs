//! The scratch of the grid-split reductions (`bn_stats_*`, `bn_backward_reduce_*`): their
//! arrival counters, allocated once per device and stream, and their partial-sum workspace.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::DeviceId;
use candle_core::{CudaDevice, Result};

use crate::device::cuda::on_per_thread_stream;

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

/// Scratch of a reduction's partial sums (`[splits, 2, C]` f64), written before it is read:
/// not zeroed. At least one element, so that the pointer is valid even without a split.
pub(crate) fn workspace(dev: &CudaDevice, len: usize) -> Result<CudaSlice<f64>> {
    // SAFETY: the kernels write every partial before the last block of its channel reads it.
    unsafe { dev.alloc::<f64>(len.max(1)) }
}
