//! The scratch of the grid-split reductions (`bn_stats_*`, `bn_backward_reduce_*`): their
//! arrival counters and their partial-sum workspace, allocated once per device and stream and
//! reused by every reduction launched there.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::DeviceId;
use candle_core::{CudaDevice, Result};

use crate::device::cuda::on_per_thread_stream;

/// One device and stream's reduction scratch.
pub(crate) struct ReductionScratch {
    /// `u32` arrival counters, zero between launches: the kernels leave them zero again (the
    /// last block of a channel resets its counter), so they are zeroed once, when allocated.
    pub(crate) counters: CudaSlice<u32>,
    /// The partial sums (`[splits, 2, C]` f64), written before they are read: never zeroed.
    pub(crate) work: CudaSlice<f64>,
}

/// Reduction scratch per CUDA device and stream, grown to the largest reduction seen there
/// (at most `2·C·splits` f64 of partials, `splits` ≤ 64, and one counter per channel: kilobytes
/// for the usual widths), never allocated per call. Launches on one stream run in order, so
/// two reductions never use the same scratch at once. A device made with `Device::new_cuda`
/// enqueues on the per-thread default stream: each host thread has a stream of its own there,
/// and thread ranks sharing the device run concurrently, so that scratch is kept per thread
/// (and freed with it).
static SCRATCH: Mutex<Option<HashMap<DeviceId, ReductionScratch>>> = Mutex::new(None);
thread_local! {
    static THREAD_SCRATCH: std::cell::RefCell<HashMap<DeviceId, ReductionScratch>> =
        std::cell::RefCell::new(HashMap::new());
}

/// Runs `f` with `dev`'s stream's scratch: at least `counters` zeroed counters and `work`
/// partial-sum values (at least one, so that the pointer is valid even without a split).
pub(crate) fn with_scratch<R>(
    dev: &CudaDevice,
    counters: usize,
    work: usize,
    f: impl FnOnce(&mut ReductionScratch) -> Result<R>,
) -> Result<R> {
    let work = work.max(1);
    let fresh_enough = |map: &mut HashMap<DeviceId, ReductionScratch>| -> Result<()> {
        let old = map.get(&dev.id());
        if old.is_none_or(|s| s.counters.len() < counters || s.work.len() < work) {
            let keep = |have: Option<usize>, need: usize| have.unwrap_or(0).max(need);
            let counters = keep(old.map(|s| s.counters.len()), counters);
            let work = keep(old.map(|s| s.work.len()), work);
            let scratch = ReductionScratch {
                counters: dev.alloc_zeros::<u32>(counters)?,
                // SAFETY: the kernels write every partial before the last block of its channel
                // reads it.
                work: unsafe { dev.alloc::<f64>(work)? },
            };
            map.insert(dev.id(), scratch);
        }
        Ok(())
    };
    if on_per_thread_stream(dev) {
        return THREAD_SCRATCH.with(|m| {
            let mut map = m.borrow_mut();
            fresh_enough(&mut map)?;
            f(map.get_mut(&dev.id()).expect("inserted above"))
        });
    }
    let mut guard = SCRATCH.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    fresh_enough(map)?;
    f(map.get_mut(&dev.id()).expect("inserted above"))
}
