// The simulated device's shared internals: devices, contexts, the allocation table, streams as
// FIFO worker threads, events, the happens-before race checker and the counters. The driver API
// entry points (driver_*.cpp), cuBLAS (cublas_*.cpp) and cuRAND (curand.cpp) are built on these.
// README.md beside this folder lists the rules and where each comes from.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_types.h"

// Lifetimes: stream workers are detached threads that may still run while the process exits,
// so every table they can touch (allocations, events, modules, contexts, counters) is
// allocated once and never destroyed, and streams, events and contexts are never freed.

namespace sim {

struct Context;
struct Stream;

// ------------------------------------------------------------------------------------ logging
// Every message goes to stderr prefixed "gpu-sim: ".
void log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// A call outside the supported set: logs its name once and returns the library's
// "not supported" code.
[[noreturn]] void fatal(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// ------------------------------------------------------------------------------------ devices
int device_count();          // GPU_SIM_DEVICES, default 4
// GPU_SIM_SKIP_KERNELS=1: launches, memsets and device-to-device copies are checked, counted
// and ordered, but do nothing, and fresh allocations are not filled; memory contents are then
// meaningless. Copies to and from the host still run. For timing the host side of a program.
bool skip_kernels();
const char* device_name();   // "gpu-sim (simulated, not a GPU)"
uint64_t device_memory();    // bytes per device reported by cuDeviceTotalMem / cuMemGetInfo

// Sticky errors, per context: once set, every call on the context returns it (CUDA: "the
// context cannot be used, so it must be destroyed").
struct Context {
    int device = 0;
    std::atomic<int> sticky{CUDA_SUCCESS};
    std::atomic<bool> alive{true};
    Stream* legacy = nullptr;
    std::mutex m;                   // guards streams and per_thread
    std::vector<Stream*> streams;   // every stream of the context but `legacy`
};
Context* primary_context(int device);  // null for an invalid ordinal
Context* current_context();            // the calling thread's current context (may be null)
void set_current_context(Context* c);
// Validates a context handle: a live context of this process.
bool valid_context(Context* c);
// Sets the context's sticky error (the first one stays) and logs `why`.
void set_sticky(Context* c, CUresult code, const std::string& why);
// For an entry point: the current context, or an error (no context: CUDA_ERROR_INVALID_CONTEXT;
// a sticky error: that error). `*out` is set on success.
__attribute__((noinline)) CUresult enter(Context** out);
// Makes the calling thread's next driver entry sleep `ms` first (an injected NCCL fault that
// widens the window between an NCCL call and the driver calls after it).
void stall_next_driver_call(int ms);

// --------------------------------------------------------------------------- device memory
// Allocations are host memory behind an allocation table; each sits at the end of its pages,
// rounded up to 256 bytes (the GPU's allocation alignment), with an inaccessible page on each
// side, so that a kernel running past either end of the pages faults. The slack past the end
// (up to 255 bytes) and the gap before the start (up to its first page's start) are filled
// with a canary that is checked after every launch.
struct Allocation {
    uint64_t base = 0;
    size_t size = 0;
    int device = 0;
    bool pinned_host = false;  // cuMemHostAlloc: host memory, not device memory
    bool freed = false;        // freed (quarantined: inaccessible) or free pending in a stream
    uint64_t id = 0;           // allocation number, for messages
    // Happens-before state (guarded by the race checker's mutex).
    struct Access {
        Stream* stream = nullptr;
        uint64_t time = 0;
        std::string what;
    };
    Access last_write;
    std::vector<Access> reads;  // since the last write, at most one per stream
    // Where it was mapped.
    void* map = nullptr;
    size_t map_len = 0;
};
// Allocates `size` bytes of device memory on `device` (or pinned host memory); `s`, for a
// stream-ordered allocation, may hand back a block that stream freed (GPU_SIM_REUSE=1).
CUresult mem_alloc(int device, size_t size, bool pinned_host, uint64_t* out,
                   const Stream* s = nullptr);
// Frees now (poisons and quarantines); for a stream-ordered free, `mem_free_mark` at enqueue
// and `mem_free_now` when the stream `s` reaches it (with GPU_SIM_REUSE=1 the block then
// goes, unpoisoned, to `s`'s pool).
CUresult mem_free_mark(uint64_t ptr, bool pinned_host, std::shared_ptr<Allocation>* out,
                       std::string& why);
void mem_free_now(const std::shared_ptr<Allocation>& a, const Stream* s = nullptr);
// GPU_SIM_REUSE=1: freed stream-ordered memory is reused by its stream with its old contents.
bool reuse_freed();
// Finds the live allocation holding [ptr, ptr+len) on `device`. On failure, `why` says what
// the range is (host memory, a freed allocation, another device's, past the end) and the
// result is null. len 0 checks ptr alone.
std::shared_ptr<Allocation> find_range(uint64_t ptr, size_t len, int device, std::string& why);
// Any allocation (live or quarantined) near `addr`, for fault reports.
std::string describe_address(uint64_t addr);
// Checks the canaries past the end of the allocations holding `ptrs`; "" if intact.
std::string check_canaries(const std::vector<uint64_t>& ptrs);
// Whether addr lies in device memory (of any device, live or freed).
bool is_device_memory(uint64_t addr);
// Whether [p, p+len) is pinned host memory from cuMemHostAlloc.
bool is_pinned_host(const void* p, size_t len);
// Frees every allocation of a device (its primary context was reset).
void mem_reset_device(int device);
uint64_t mem_used(int device);

// ---------------------------------------------------------------------- the race checker
// Vector clocks, computed when work is enqueued (so a report does not depend on timing): each
// stream's clock advances by one per operation; an event records its stream's clock; a wait
// merges it; the legacy stream's implicit synchronisation merges both ways; a host
// synchronisation (stream, event or context synchronize, a query that returns success, a copy
// into pageable memory) merges the stream's clock into the calling host thread's, and every later
// enqueue from that thread merges that thread's (host_clock.cpp: a clock per host thread,
// carried by thread creation and join). An access to an allocation conflicts with the last write,
// and a write with every read since, unless those happened before it.
using Clock = std::map<const Stream*, uint64_t>;
struct BufferUse {
    std::shared_ptr<Allocation> alloc;  // as validated by the caller (find_range)
    bool write;
    std::string what;  // e.g. "kernel ucopy_f32, argument 1"
};

// ----------------------------------------------------------------------------- streams
// Each stream is a worker thread running its operations in order. An operation waits for its
// dependencies (other streams' sequence numbers) first.
struct Dep {
    Stream* stream;
    uint64_t seq;
};
struct Op {
    std::vector<Dep> deps;
    std::function<void()> run;  // runs on the worker; errors go to set_sticky
    // Runs instead of `run` when the context's sticky error drops the operation (work that
    // others wait for, such as an NCCL collective, must still say that it ended).
    std::function<void()> dropped;
    const char* kind;           // "launch", "copy", ... for counters
};

enum class StreamKind { Legacy, PerThread, Blocking, NonBlocking };

struct Counts {
    uint64_t launches = 0, copies_htod = 0, copies_dtoh = 0, copies_dtod = 0, memsets = 0,
             allocs = 0, frees = 0, event_records = 0, stream_waits = 0, host_syncs = 0,
             host_tasks = 0;
};

struct Stream {
    Context* ctx = nullptr;
    StreamKind kind = StreamKind::Blocking;
    uint64_t id = 0;
    std::mutex m;
    std::condition_variable cv;   // signalled on every completion and enqueue
    std::deque<std::pair<uint64_t, Op>> queue;
    uint64_t enqueued = 0, completed = 0;
    bool destroyed = false;
    std::thread worker;
    Clock clock;   // guarded by the race checker's mutex
    Counts counts; // guarded by m
};

// Resolves a CUstream handle for the current context: 0 and CU_STREAM_LEGACY are the legacy
// stream, CU_STREAM_PER_THREAD the calling thread's per-thread stream (created on first use);
// anything else must be a live stream of `ctx`. Null with `why` on failure.
Stream* resolve_stream(Context* ctx, CUstream h, std::string& why);
// For an entry point: the current context and the stream `h` names in it, or an error (logged,
// naming `call`).
CUresult stream_of(const char* call, CUstream h, Context** ctx, Stream** s);
Stream* create_stream(Context* ctx, StreamKind kind);
void destroy_stream(Stream* s);

// Enqueues `op` on `s`, adding the legacy stream's implicit dependencies. `uses` are the
// buffers it touches: checked for races against other streams now (a race is reported and
// becomes the context's sticky error, and the call returns CUDA_ERROR_LAUNCH_FAILED). Returns
// the operation's sequence number through `seq` if non-null.
CUresult enqueue(Stream* s, Op op, const std::vector<BufferUse>& uses, uint64_t* seq = nullptr);
// Blocks until `s` has completed every operation enqueued so far, then merges its clock into
// the host's (a host synchronisation).
void wait_stream(Stream* s);
// Blocks until `s` has completed operation `seq` (the caller merges what it observed).
void wait_seq(Stream* s, uint64_t seq);
// wait_stream on every stream of the context, the legacy stream included.
void synchronize_context(Context* c);
bool stream_done(Stream* s, uint64_t seq);
// The clock of `s` now (for events).
Clock stream_clock(Stream* s);
// Merges `c` into the stream's clock (stream wait event) or into the calling host thread's.
void merge_into_stream(Stream* s, const Clock& c);
void merge_into_host(const Clock& c);
// `into` = the element-wise maximum of `into` and `from`.
void merge_clock(Clock& into, const Clock& from);
// What the calling host thread has observed complete (host_clock.cpp): its own clock, or with
// GPU_SIM_HOST_CLOCK=global the one clock of every host thread. Read and merged under the
// race checker's mutex in global mode; a thread's own clock is touched only by that thread.
Clock& host_clock();
bool global_host_clock();

// -------------------------------------------------------------------------------- events
struct Event {
    unsigned flags = 0;
    bool recorded = false;
    bool destroyed = false;
    Stream* stream = nullptr;
    uint64_t seq = 0;
    Clock clock;
    std::shared_ptr<double> stamp;  // completion time in ms, unless DISABLE_TIMING
    std::mutex m;
};
bool valid_event(Event* e);

// ------------------------------------------------------------------------------- counters
// Counts one operation of a kind on `s` (and in the process-wide totals).
void count(Stream* s, uint64_t Counts::*field);
void count_global(uint64_t Counts::*field);
// Every kernel launched, by name, in order (since the last reset), for tests.
void log_launch(const std::string& name);
// Defects found: races reported, faults and launch errors.
void count_race();
void count_fault();

}  // namespace sim
