// The simulated device's own C interface, for tests: counters and defect reports. These
// symbols exist only in the simulated libcuda.so.1; look them up with dlsym and treat their
// absence as a real driver.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Operations by kind. Copies, memsets, launches, event records, stream waits and host tasks
// (cuBLAS, cuRAND) are counted on the stream they were enqueued on; allocations and frees on
// the stream of a stream-ordered call (cuMemAllocAsync, cuMemFreeAsync) and in the totals;
// host synchronisations on the stream waited for.
typedef struct {
    uint64_t launches, copies_htod, copies_dtoh, copies_dtod, memsets, allocs, frees,
        event_records, stream_waits, host_syncs, host_tasks;
} GpuSimCounts;

// The counts of `stream` (a CUstream of the calling thread's current context; 0x2 is its
// per-thread stream), or of the whole process when `all` is non-zero. Returns a CUresult.
int gpusim_counts(void* stream, int all, GpuSimCounts* out);
// Zeroes the process-wide totals and the launch log (per-stream counts are never reset: read
// them before and after).
void gpusim_reset_counts(void);
// The names of the kernels launched since the last reset, in launch order, one per line, into
// buf (truncated to len); returns the full length.
size_t gpusim_launch_log(char* buf, size_t len);
// Races and faults reported so far (each also made its context's error sticky).
unsigned long long gpusim_races(void);
unsigned long long gpusim_faults(void);

#ifdef __cplusplus
}
#endif
