//! The simulated CUDA driver's own interface (`gpu-sim/include/gpusim.h`), seen from Rust: the
//! counters of what a process asked of the device (launches, copies, allocations, event records
//! and waits, host synchronisations), per stream or for the whole process, and the log of the
//! kernels launched. One binding for every test and example that reads them.
//!
//! The functions are looked up at run time in the `libcuda.so.1` the process already loaded:
//! on a real driver they do not exist, and [`GpuSim::loaded`] returns `None`.

use std::ffi::{c_char, c_int, c_void};

/// `GpuSimCounts` of `gpu-sim/include/gpusim.h`: the simulated driver's calls by kind.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Kernel launches.
    pub launches: u64,
    /// Copies from host to device.
    pub copies_htod: u64,
    /// Copies from device to host.
    pub copies_dtoh: u64,
    /// Copies within the device.
    pub copies_dtod: u64,
    /// Memsets.
    pub memsets: u64,
    /// Allocations.
    pub allocs: u64,
    /// Frees.
    pub frees: u64,
    /// Events recorded.
    pub event_records: u64,
    /// Waits of a stream for an event.
    pub stream_waits: u64,
    /// Host synchronisations (the host waiting for the device).
    pub host_syncs: u64,
    /// Host functions enqueued on a stream.
    pub host_tasks: u64,
}

impl Counts {
    /// The calls of `self` not already in `before` (a later reading minus an earlier one).
    ///
    /// # Panics
    /// When `before` holds more of a kind than `self` (not an earlier reading).
    pub fn minus(self, before: Counts) -> Counts {
        Counts {
            launches: self.launches - before.launches,
            copies_htod: self.copies_htod - before.copies_htod,
            copies_dtoh: self.copies_dtoh - before.copies_dtoh,
            copies_dtod: self.copies_dtod - before.copies_dtod,
            memsets: self.memsets - before.memsets,
            allocs: self.allocs - before.allocs,
            frees: self.frees - before.frees,
            event_records: self.event_records - before.event_records,
            stream_waits: self.stream_waits - before.stream_waits,
            host_syncs: self.host_syncs - before.host_syncs,
            host_tasks: self.host_tasks - before.host_tasks,
        }
    }
}

type CountsFn = unsafe extern "C" fn(*mut c_void, c_int, *mut Counts) -> c_int;
type ResetFn = unsafe extern "C" fn();
type LogFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;

/// The per-thread default stream's handle in the driver API (`CU_STREAM_PER_THREAD`).
const PER_THREAD_STREAM: usize = 0x2;

/// The simulated driver this process runs on.
#[derive(Debug)]
pub struct GpuSim {
    lib: libloading::Library,
}

impl GpuSim {
    /// The simulated driver, when the `libcuda.so.1` this process loaded is the simulated one;
    /// `None` on a real driver (or with no driver loaded).
    pub fn loaded() -> Option<GpuSim> {
        // SAFETY: libcuda.so.1 is already loaded by a process built with CUDA; opening it again
        // only takes a reference and runs no initialiser.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }.ok()?;
        // SAFETY: looking a symbol up has no side effect.
        unsafe { lib.get::<CountsFn>(b"gpusim_counts") }.ok()?;
        Some(GpuSim { lib })
    }

    /// Whether this process runs on the simulated driver.
    pub fn is_loaded() -> bool {
        Self::loaded().is_some()
    }

    fn counts(&self, stream: *mut c_void, all: c_int) -> Counts {
        let mut c = Counts::default();
        // SAFETY: `gpusim_counts` has this signature (gpu-sim/include/gpusim.h), and `c` is a
        // valid `GpuSimCounts`; the stream is a handle the driver knows, or unread when `all`.
        let rc = unsafe {
            let f = self
                .lib
                .get::<CountsFn>(b"gpusim_counts")
                .expect("found by GpuSim::loaded");
            f(stream, all, &mut c)
        };
        assert_eq!(rc, 0, "gpusim_counts failed");
        c
    }

    /// Counts of the calling thread's per-thread default stream (its current context's).
    pub fn stream_counts(&self) -> Counts {
        self.counts(PER_THREAD_STREAM as *mut c_void, 0)
    }

    /// Counts of the whole process since the last [`GpuSim::reset`] (every stream, NCCL's
    /// too).
    pub fn total_counts(&self) -> Counts {
        self.counts(std::ptr::null_mut(), 1)
    }

    /// Clears the launch log and the process-wide counts.
    pub fn reset(&self) {
        // SAFETY: `gpusim_reset_counts` takes nothing (gpu-sim/include/gpusim.h).
        unsafe {
            self.lib
                .get::<ResetFn>(b"gpusim_reset_counts")
                .expect("exported beside gpusim_counts")()
        }
    }

    /// The kernels launched since the last [`GpuSim::reset`], in order, by name.
    pub fn launched(&self) -> Vec<String> {
        let mut buf = vec![0 as c_char; 1 << 16];
        // SAFETY: `gpusim_launch_log` writes at most `len` bytes, NUL-terminated.
        unsafe {
            self.lib
                .get::<LogFn>(b"gpusim_launch_log")
                .expect("exported beside gpusim_counts")(buf.as_mut_ptr(), buf.len())
        };
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|&&b| b != 0)
            .map(|&b| b as u8)
            .collect();
        String::from_utf8_lossy(&bytes)
            .lines()
            .map(str::to_string)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A later reading minus an earlier one counts what happened between them, kind by kind.
    #[test]
    fn minus_counts_the_calls_between_two_readings() {
        let before = Counts {
            launches: 3,
            allocs: 1,
            host_syncs: 2,
            ..Counts::default()
        };
        let after = Counts {
            launches: 10,
            allocs: 1,
            host_syncs: 5,
            stream_waits: 4,
            ..Counts::default()
        };
        let d = after.minus(before);
        assert_eq!(
            (d.launches, d.allocs, d.host_syncs, d.stream_waits),
            (7, 0, 3, 4)
        );
    }
}
