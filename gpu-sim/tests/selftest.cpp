// The simulator's own tests: each plants one defect of a class the simulator must catch (or
// follows a rule it must model) and checks the outcome through the driver API, the way a
// program on a GPU would see it. Run by scripts/test-gpu-sim.sh with the simulated libcuda
// first on LD_LIBRARY_PATH. `selftest PTX` runs every test; `selftest PTX bench` measures the
// executor's rate on a barrier-free kernel.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "cuda_types.h"
#include "gpusim.h"

extern "C" {
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext*, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuModuleLoadData(CUmodule*, const void*);
CUresult cuModuleGetFunction(CUfunction*, CUmodule, const char*);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void**, void**);
CUresult cuMemAlloc_v2(CUdeviceptr*, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr*, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void*, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void*, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemsetD32Async(CUdeviceptr, unsigned, size_t, CUstream);
CUresult cuStreamCreate(CUstream*, unsigned);
CUresult cuStreamSynchronize(CUstream);
CUresult cuEventCreate(CUevent*, unsigned);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned);
CUresult cuGetErrorName(CUresult, const char**);
int cuGraphCreate(void*, unsigned);
}

namespace {

std::string g_ptx;
int g_failed = 0, g_passed = 0;

// One device's primary context for the duration of a test; released (and so reset) at the end.
struct Device {
    int ordinal;
    CUmodule mod = nullptr;
    explicit Device(int d) : ordinal(d) {
        CUcontext c;
        cuDevicePrimaryCtxRetain(&c, d);
        cuCtxSetCurrent(c);
        cuModuleLoadData(&mod, g_ptx.c_str());
    }
    ~Device() {
        cuCtxSetCurrent(nullptr);
        cuDevicePrimaryCtxRelease_v2(ordinal);
    }
    CUfunction fn(const char* name) {
        CUfunction f = nullptr;
        cuModuleGetFunction(&f, mod, name);
        return f;
    }
};

const char* name(CUresult r) {
    const char* n = "?";
    cuGetErrorName(r, &n);
    return n;
}

#define EXPECT(cond, ...)                                         \
    do {                                                          \
        if (!(cond)) {                                            \
            std::printf("    expected %s: ", #cond);              \
            std::printf(__VA_ARGS__);                             \
            std::printf("\n");                                    \
            return false;                                         \
        }                                                         \
    } while (0)

CUdeviceptr upload(const std::vector<float>& v, CUstream s = nullptr) {
    CUdeviceptr p;
    // A synchronous allocation: usable from every stream.
    cuMemAlloc_v2(&p, v.size() * 4);
    cuMemcpyHtoDAsync_v2(p, v.data(), v.size() * 4, s);
    return p;
}

std::vector<float> download(CUdeviceptr p, size_t n, CUstream s = nullptr) {
    std::vector<float> v(n);
    cuMemcpyDtoHAsync_v2(v.data(), p, n * 4, s);
    return v;
}

CUresult add_one(Device& d, CUdeviceptr in, CUdeviceptr out, int n, CUstream s) {
    void* args[] = {&in, &out, &n};
    return cuLaunchKernel(d.fn("sim_add_one"), (n + 127) / 128, 1, 1, 128, 1, 1, 0, s, args,
                          nullptr);
}

// ------------------------------------------------------------------ pointers a launch touches
bool host_pointer_argument_is_refused() {
    Device d(0);
    std::vector<float> host(64, 1.0f);
    CUdeviceptr out = upload(host);
    auto faults = gpusim_faults();
    CUresult r = add_one(d, (CUdeviceptr)host.data(), out, 64, nullptr);
    EXPECT(r == CUDA_ERROR_INVALID_VALUE, "got %s", name(r));
    EXPECT(gpusim_faults() == faults + 1, "a fault counted");
    return true;
}

bool freed_pointer_argument_is_refused() {
    Device d(0);
    CUdeviceptr in = upload(std::vector<float>(64, 1.0f)), out = upload(std::vector<float>(64));
    cuMemFree_v2(in);
    CUresult r = add_one(d, in, out, 64, nullptr);
    EXPECT(r == CUDA_ERROR_INVALID_VALUE, "got %s", name(r));
    return true;
}

bool other_devices_pointer_is_refused() {
    CUdeviceptr elsewhere;
    {
        CUcontext c;
        cuDevicePrimaryCtxRetain(&c, 1);
        cuCtxSetCurrent(c);
        cuMemAlloc_v2(&elsewhere, 256);
    }
    bool ok = [&] {
        Device d(0);
        CUdeviceptr out = upload(std::vector<float>(64));
        CUresult r = add_one(d, elsewhere, out, 64, nullptr);
        EXPECT(r == CUDA_ERROR_INVALID_VALUE, "got %s", name(r));
        return true;
    }();
    cuDevicePrimaryCtxRelease_v2(1);
    return ok;
}

bool write_past_the_end_faults_and_sticks() {
    Device d(0);
    // 1024 floats fill their pages exactly: the next address is a guard page.
    CUdeviceptr out = upload(std::vector<float>(1024));
    int n = 1024, past = 0;
    void* args[] = {&out, &n, &past};
    CUresult r = cuLaunchKernel(d.fn("sim_write_past"), 1, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr);
    EXPECT(r == CUDA_SUCCESS, "the launch itself is accepted, got %s", name(r));
    r = cuCtxSynchronize();
    EXPECT(r == CUDA_ERROR_ILLEGAL_ADDRESS, "got %s", name(r));
    CUdeviceptr more;
    r = cuMemAlloc_v2(&more, 64);
    EXPECT(r == CUDA_ERROR_ILLEGAL_ADDRESS, "the error is sticky, got %s", name(r));
    return true;
}

// An access through a pointer not aligned to its type (a float4 4 bytes past a 16-byte
// boundary) fails the launch with CUDA_ERROR_MISALIGNED_ADDRESS, naming the kernel, and the
// error is sticky, as on a GPU; the same load at an aligned address runs.
bool a_misaligned_vector_load_is_refused() {
    const char* kernel = "sim_misaligned_vector_load";
    {
        Device d(0);
        CUdeviceptr in = upload(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}), out = upload({0});
        CUdeviceptr aligned = in + 12;  // the kernel's in + 1 is then 16 bytes in
        void* args[] = {&aligned, &out};
        cuLaunchKernel(d.fn(kernel), 1, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr);
        EXPECT(cuCtxSynchronize() == CUDA_SUCCESS, "the aligned load runs");
        float sum = 0;
        cuMemcpyDtoHAsync_v2(&sum, out, 4, nullptr);
        EXPECT(sum == 26.0f, "the aligned load reads 5 + 6 + 7 + 8: got %g", sum);
    }
    Device d(0);
    CUdeviceptr in = upload(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}), out = upload({0});
    void* args[] = {&in, &out};
    cuLaunchKernel(d.fn(kernel), 1, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr);
    CUresult r = cuCtxSynchronize();
    EXPECT(r == CUDA_ERROR_MISALIGNED_ADDRESS, "got %s", name(r));
    CUdeviceptr more;
    r = cuMemAlloc_v2(&more, 64);
    EXPECT(r == CUDA_ERROR_MISALIGNED_ADDRESS, "the error is sticky, got %s", name(r));
    return true;
}

bool write_into_the_alignment_slack_is_caught() {
    Device d(0);
    CUdeviceptr out = upload(std::vector<float>(10));  // 40 bytes in a 256-byte slot
    int n = 10, past = 3;
    void* args[] = {&out, &n, &past};
    cuLaunchKernel(d.fn("sim_write_past"), 1, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr);
    CUresult r = cuCtxSynchronize();
    EXPECT(r == CUDA_ERROR_ILLEGAL_ADDRESS, "got %s", name(r));
    return true;
}

bool a_write_just_before_the_start_is_caught() {
    Device d(0);
    CUdeviceptr out = upload(std::vector<float>(10));  // at the end of its page: a gap before
    int n = 0, past = -1;                              // out[-1]
    void* args[] = {&out, &n, &past};
    cuLaunchKernel(d.fn("sim_write_past"), 1, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr);
    CUresult r = cuCtxSynchronize();
    EXPECT(r == CUDA_ERROR_ILLEGAL_ADDRESS, "got %s", name(r));
    return true;
}

bool an_overlapping_device_copy_is_refused() {
    Device d(0);
    CUdeviceptr p = upload(std::vector<float>(64, 1.0f));
    CUresult r = cuMemcpyDtoDAsync_v2(p + 4, p, 128, nullptr);
    EXPECT(r == CUDA_ERROR_INVALID_VALUE, "a copy into its own source shifted by one value, got %s", name(r));
    EXPECT(cuMemcpyDtoDAsync_v2(p + 128, p, 128, nullptr) == CUDA_SUCCESS, "adjacent halves");
    return true;
}

bool freed_memory_is_poisoned() {
    Device d(0);
    CUdeviceptr victim = upload(std::vector<float>(64, 5.0f));
    uint64_t addr = victim;
    CUdeviceptr where, out = upload(std::vector<float>(1));
    cuMemAlloc_v2(&where, 8);
    cuMemcpyHtoDAsync_v2(where, &addr, 8, nullptr);
    cuMemFree_v2(victim);
    void* args[] = {&where, &out};
    cuLaunchKernel(d.fn("sim_read_indirect"), 1, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr);
    CUresult r = cuCtxSynchronize();
    EXPECT(r == CUDA_ERROR_ILLEGAL_ADDRESS, "reading freed memory faults, got %s", name(r));
    return true;
}

bool copies_are_range_checked() {
    Device d(0);
    CUdeviceptr p;
    cuMemAlloc_v2(&p, 100);
    std::vector<char> host(200);
    CUresult r = cuMemcpyHtoDAsync_v2(p, host.data(), 101, nullptr);
    EXPECT(r == CUDA_ERROR_INVALID_VALUE, "one byte too many, got %s", name(r));
    r = cuMemcpyDtoHAsync_v2(host.data(), p + 50, 51, nullptr);
    EXPECT(r == CUDA_ERROR_INVALID_VALUE, "from an offset, got %s", name(r));
    r = cuMemcpyHtoDAsync_v2(p, reinterpret_cast<void*>(p), 10, nullptr);
    EXPECT(r == CUDA_ERROR_INVALID_VALUE, "device memory as the host source, got %s", name(r));
    cuMemFree_v2(p);
    r = cuMemFree_v2(p);
    EXPECT(r == CUDA_ERROR_INVALID_VALUE, "a double free, got %s", name(r));
    return true;
}

bool a_divergent_barrier_fails_a_strict_launch() {
    Device d(0);
    CUdeviceptr out = upload(std::vector<float>(64));
    void* args[] = {&out};
    cuLaunchKernel(d.fn("sim_divergent_barrier"), 1, 1, 1, 64, 1, 1, 0, nullptr, args, nullptr);
    CUresult r = cuCtxSynchronize();
    EXPECT(r == CUDA_ERROR_LAUNCH_FAILED, "got %s", name(r));
    return true;
}

// Blocks run in the schedule's order (GPU_SIM_SCHEDULE): a kernel assuming that block 0 runs
// first is right under `forward` only. Run under each schedule by scripts/test-gpu-sim.sh.
bool several_block_threads() {
    const char* e = std::getenv("GPU_SIM_BLOCK_THREADS");
    return e && std::atoi(e) > 1;
}

bool blocks_run_in_the_schedules_order() {
    const char* e = std::getenv("GPU_SIM_SCHEDULE");
    const bool forward = !e || !*e || std::string(e) == "forward";
    Device d(0);
    CUdeviceptr flag, out;
    cuMemAlloc_v2(&flag, 4);
    cuMemAlloc_v2(&out, 64 * 4);
    cuMemsetD32Async(flag, 0, 1, nullptr);
    cuMemsetD32Async(out, 7, 64, nullptr);
    void* args[] = {&flag, &out};
    cuLaunchKernel(d.fn("sim_block_zero_first"), 64, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr);
    std::vector<int> v(64);
    cuMemcpyDtoHAsync_v2(v.data(), out, 64 * 4, nullptr);
    int early = 0;  // blocks that ran before block 0
    for (int b = 1; b < 64; ++b) early += v[b] == 0;
    if (!forward) EXPECT(early > 0, "under %s some block runs before block 0: none did", e);
    // On several threads (GPU_SIM_BLOCK_THREADS) blocks start in index order but run at once.
    else if (!several_block_threads())
        EXPECT(early == 0, "in index order every block runs after block 0: %d did not", early);
    return true;
}

// Static shared memory (`__shared__` arrays of a kernel) holds 0xFF bytes at every block
// start, as dynamic shared memory does: a block reading it before writing it reads -1, never
// what the previous block left (7) nor zeros.
bool static_shared_memory_is_poisoned_at_every_block_start() {
    Device d(0);
    CUdeviceptr out;
    cuMemAlloc_v2(&out, 8 * 4);
    cuMemsetD32Async(out, 3, 8, nullptr);
    void* args[] = {&out};
    cuLaunchKernel(d.fn("sim_static_shared_read_first"), 8, 1, 1, 32, 1, 1, 0, nullptr, args, nullptr);
    std::vector<int> v(8);
    cuMemcpyDtoHAsync_v2(v.data(), out, 8 * 4, nullptr);
    for (int b = 0; b < 8; ++b)
        EXPECT(v[b] == -1, "block %d read %d from static shared memory at its start, not the poison -1", b, v[b]);
    return true;
}

// The blocks of one launch run at once on several OS threads (GPU_SIM_BLOCK_THREADS > 1): a
// "last block adds the partials" kernel whose blocks announce their arrival before writing
// their partial is caught (the last block reads an unwritten partial); on one thread, blocks
// run one after another and the same kernel sums right. Run in both settings.
// How many of `runs` launches of `kernel` ("the last block sums the partials", 64 blocks of
// 64 threads over 64·1024 ones) end with a wrong sum. The partials are zeroed before each
// launch, so a partial read before it is written reads 0.
int wrong_sums(Device& d, const char* kernel, int runs) {
    const unsigned blocks = 64;
    CUdeviceptr in = upload(std::vector<float>(blocks * 1024, 1.0f));
    CUdeviceptr partials, counter, out;
    cuMemAlloc_v2(&partials, blocks * 4);
    cuMemAlloc_v2(&counter, 4);
    cuMemAlloc_v2(&out, 4);
    cuMemsetD32Async(counter, 0, 1, nullptr);
    int wrong = 0;
    for (int run = 0; run < runs; run++) {
        cuMemsetD32Async(partials, 0, blocks, nullptr);
        cuMemsetD32Async(out, 0, 1, nullptr);
        void* args[] = {&in, &partials, &counter, &out};
        cuLaunchKernel(d.fn(kernel), blocks, 1, 1, 64, 1, 1, 0, nullptr, args, nullptr);
        float sum = 0;
        cuMemcpyDtoHAsync_v2(&sum, out, 4, nullptr);
        if (sum != float(blocks * 1024)) wrong++;
    }
    return wrong;
}

bool blocks_of_a_launch_run_at_once_on_several_threads() {
    Device d(0);
    const int runs = 20;
    const int caught = wrong_sums(d, "sim_announce_before_writing", runs);
    std::printf("    the announcement before the write caught in %d of %d launches\n", caught, runs);
    const char* p = std::getenv("GPU_SIM_PREEMPT");
    const bool preempt = !(p && std::string(p) == "0");
    if (several_block_threads() && preempt)
        EXPECT(caught >= 18, "a window of two instructions, blocks on several threads with "
               "preemption points: caught in %d of %d launches, want at least 18", caught, runs);
    else if (!several_block_threads())
        EXPECT(caught == 0, "blocks one after another: every partial is written first, yet %d "
               "of %d sums were wrong", caught, runs);
    const int wrong = wrong_sums(d, "sim_announce_after_writing", runs);
    EXPECT(wrong == 0, "the correct protocol (write, fence, announce): %d of %d sums wrong", wrong,
           runs);
    return true;
}

// --------------------------------------------------------------------------- stream order
// Two streams created with `fa` and `fb`, and three buffers of 64 floats: `in` (ones), `mid`
// and `out`, allocated synchronously and with the upload complete (usable from any stream).
struct TwoStreams {
    CUstream a, b;
    CUdeviceptr in, mid, out;
    TwoStreams(unsigned fa, unsigned fb) {
        cuStreamCreate(&a, fa);
        cuStreamCreate(&b, fb);
        in = upload(std::vector<float>(64, 1.0f));
        cuMemAlloc_v2(&mid, 256);
        cuMemAlloc_v2(&out, 256);
        cuCtxSynchronize();
    }
};

bool unordered_cross_stream_use_is_a_race() {
    Device d(0);
    TwoStreams t(CU_STREAM_NON_BLOCKING, CU_STREAM_NON_BLOCKING);
    auto [a, b, in, mid, out] = t;
    auto races = gpusim_races();
    EXPECT(add_one(d, in, mid, 64, a) == CUDA_SUCCESS, "the writer");
    CUresult r = add_one(d, mid, out, 64, b);
    EXPECT(r == CUDA_ERROR_LAUNCH_FAILED, "the reader races, got %s", name(r));
    EXPECT(gpusim_races() == races + 1, "one race counted");
    return true;
}

bool an_event_wait_orders_streams() {
    Device d(0);
    TwoStreams t(CU_STREAM_NON_BLOCKING, CU_STREAM_NON_BLOCKING);
    auto [a, b, in, mid, out] = t;
    CUevent e;
    cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
    EXPECT(add_one(d, in, mid, 64, a) == CUDA_SUCCESS, "the writer");
    cuEventRecord(e, a);
    cuStreamWaitEvent(b, e, 0);
    CUresult r = add_one(d, mid, out, 64, b);
    EXPECT(r == CUDA_SUCCESS, "got %s", name(r));
    auto v = download(out, 64, b);
    EXPECT(v[0] == 3.0f && v[63] == 3.0f, "1 + 1 + 1, got %g", v[0]);
    return true;
}

bool a_write_after_an_unordered_read_is_a_race() {
    Device d(0);
    TwoStreams t(CU_STREAM_NON_BLOCKING, CU_STREAM_NON_BLOCKING);
    auto [a, b, in, mid, out] = t;
    auto races = gpusim_races();
    EXPECT(add_one(d, in, out, 64, b) == CUDA_SUCCESS, "the reader");
    // The host has not waited for the reader: a write of `in` on another stream is unordered
    // with it. The writer reads only `mid`, which nothing has touched since the host's
    // synchronisation, so the write-after-read is the only conflict it can have.
    CUresult r = add_one(d, mid, in, 64, a);
    EXPECT(r == CUDA_ERROR_LAUNCH_FAILED, "got %s", name(r));
    EXPECT(gpusim_races() == races + 1, "one race counted");
    return true;
}

bool the_legacy_stream_orders_blocking_streams_only() {
    Device d(0);
    TwoStreams t(CU_STREAM_DEFAULT, CU_STREAM_NON_BLOCKING);
    auto [blocking, nonblocking, in, mid, out] = t;
    EXPECT(add_one(d, in, mid, 64, blocking) == CUDA_SUCCESS, "the writer");
    CUresult r = add_one(d, mid, out, 64, nullptr);
    EXPECT(r == CUDA_SUCCESS, "legacy after blocking is ordered, got %s", name(r));
    r = add_one(d, in, mid, 64, nonblocking);
    EXPECT(r == CUDA_ERROR_LAUNCH_FAILED, "a non-blocking stream is not ordered, got %s", name(r));
    return true;
}

bool per_thread_streams_are_distinct() {
    Device d(0);
    CUdeviceptr in = upload(std::vector<float>(64, 1.0f)), mid, out;
    cuMemAlloc_v2(&mid, 256);
    cuMemAlloc_v2(&out, 256);
    cuCtxSynchronize();
    CUcontext c;
    cuDevicePrimaryCtxRetain(&c, 0);
    CUresult writer = CUDA_ERROR_UNKNOWN;
    std::thread t([&] {
        cuCtxSetCurrent(c);
        writer = add_one(d, in, mid, 64, SIM_STREAM_PER_THREAD);
    });
    t.join();
    CUresult r = add_one(d, mid, out, 64, SIM_STREAM_PER_THREAD);
    cuDevicePrimaryCtxRelease_v2(0);
    EXPECT(writer == CUDA_SUCCESS, "the other thread's launch, got %s", name(writer));
    EXPECT(r == CUDA_ERROR_LAUNCH_FAILED, "a tensor handed over without a wait, got %s", name(r));
    return true;
}

// A host synchronisation orders the synchronising thread only: thread A writes and
// synchronises; the main thread, told through an atomic flag the driver cannot see, reads on
// another stream: a race (on a GPU nothing orders the read after the write's completion for
// the main thread). With one clock for every host thread (GPU_SIM_HOST_CLOCK=global) it is
// not seen: the test fails there.
bool a_synchronisation_orders_only_its_own_thread() {
    Device d(0);
    TwoStreams t(CU_STREAM_NON_BLOCKING, CU_STREAM_NON_BLOCKING);
    auto [a, b, in, mid, out] = t;
    CUcontext c;
    cuDevicePrimaryCtxRetain(&c, 0);
    std::atomic<bool> written{false};
    CUresult writer = CUDA_ERROR_UNKNOWN, synced = CUDA_ERROR_UNKNOWN;
    std::thread w([&, a = a, in = in, mid = mid] {
        cuCtxSetCurrent(c);
        writer = add_one(d, in, mid, 64, a);
        synced = cuStreamSynchronize(a);
        written = true;
    });
    while (!written) std::this_thread::yield();
    CUresult r = add_one(d, mid, out, 64, b);
    w.join();
    cuDevicePrimaryCtxRelease_v2(0);
    EXPECT(writer == CUDA_SUCCESS && synced == CUDA_SUCCESS, "the writer thread, got %s", name(writer));
    EXPECT(r == CUDA_ERROR_LAUNCH_FAILED, "a read ordered by nothing the driver saw, got %s", name(r));
    return true;
}

// Thread creation and join carry the order (no false report): the main thread writes and
// synchronises, then starts a thread that reads on its own stream and writes; the main thread
// joins it and reads that write.
bool thread_creation_and_join_carry_the_order() {
    Device d(0);
    TwoStreams t(CU_STREAM_NON_BLOCKING, CU_STREAM_NON_BLOCKING);
    auto [a, b, in, mid, out] = t;
    CUcontext c;
    cuDevicePrimaryCtxRetain(&c, 0);
    EXPECT(add_one(d, in, mid, 64, a) == CUDA_SUCCESS, "the first write");
    cuStreamSynchronize(a);
    CUresult child = CUDA_ERROR_UNKNOWN;
    std::thread k([&, b = b, mid = mid, out = out] {
        cuCtxSetCurrent(c);
        child = add_one(d, mid, out, 64, b);  // ordered by the creation
        cuStreamSynchronize(b);
    });
    k.join();
    CUresult r = add_one(d, out, mid, 64, a);  // ordered by the join
    auto v = download(mid, 64, a);
    cuDevicePrimaryCtxRelease_v2(0);
    EXPECT(child == CUDA_SUCCESS, "the child's read after its creation, got %s", name(child));
    EXPECT(r == CUDA_SUCCESS, "the read after the join, got %s", name(r));
    EXPECT(v[0] == 4.0f && v[63] == 4.0f, "1 + 1 + 1 + 1, got %g", v[0]);
    return true;
}

// A stream-ordered free, then an allocation of the same size on the same stream: by default
// fresh memory (another address, NaN bytes); with GPU_SIM_REUSE=1 the freed block with its old
// contents, as the stream-ordered allocator's pool hands it back on a GPU.
bool a_freed_block_comes_back_only_in_reuse_mode() {
    const char* e = std::getenv("GPU_SIM_REUSE");
    const bool reuse = e && std::string(e) == "1";
    Device d(0);
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    CUdeviceptr p, q;
    EXPECT(cuMemAllocAsync(&p, 256, s) == CUDA_SUCCESS, "alloc");
    std::vector<float> ones(64, 1.0f);
    cuMemcpyHtoDAsync_v2(p, ones.data(), 256, s);
    cuMemFreeAsync(p, s);
    cuStreamSynchronize(s);  // the stream has reached the free: the block is in its pool
    EXPECT(cuMemAllocAsync(&q, 200, s) == CUDA_SUCCESS, "alloc again");
    auto v = download(q, 50, s);
    if (reuse) {
        EXPECT(q == p && v[0] == 1.0f && v[49] == 1.0f, "the same block with its contents: %g", v[0]);
    } else {
        EXPECT(q != p && std::isnan(v[0]) && std::isnan(v[49]), "fresh memory, NaN: %g", v[0]);
    }
    cuMemFreeAsync(q, s);
    cuStreamSynchronize(s);
    return true;
}

bool a_stream_ordered_free_must_follow_other_streams_use() {
    Device d(0);
    CUstream a, b;
    cuStreamCreate(&a, CU_STREAM_NON_BLOCKING);
    cuStreamCreate(&b, CU_STREAM_NON_BLOCKING);
    CUdeviceptr in = upload(std::vector<float>(64, 1.0f), a), buf;
    cuMemAllocAsync(&buf, 256, a);
    EXPECT(add_one(d, in, buf, 64, a) == CUDA_SUCCESS, "use on the allocating stream");
    CUresult r = cuMemFreeAsync(buf, b);
    EXPECT(r == CUDA_ERROR_LAUNCH_FAILED, "a free on another stream, got %s", name(r));
    return true;
}

bool pageable_copies_follow_the_completion_rules() {
    Device d(0);
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    std::vector<float> host(4096, 2.0f);
    CUdeviceptr p;
    cuMemAllocAsync(&p, host.size() * 4, s);
    cuMemcpyHtoDAsync_v2(p, host.data(), host.size() * 4, s);
    // The source is staged at the call: changing it afterwards does not change the copy.
    std::fill(host.begin(), host.end(), -1.0f);
    std::vector<float> back(4096, 0.0f);
    cuMemcpyDtoHAsync_v2(back.data(), p, back.size() * 4, s);
    // Into pageable memory the copy has completed when the call returns.
    EXPECT(back[0] == 2.0f && back[4095] == 2.0f, "got %g", back[0]);
    return true;
}

bool an_unsupported_call_fails_with_its_name() {
    int r = cuGraphCreate(nullptr, 0);
    EXPECT(r == CUDA_ERROR_NOT_SUPPORTED, "got %d", r);
    return true;
}

bool launches_and_copies_are_counted() {
    Device d(0);
    CUstream s;
    cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    GpuSimCounts before, after;
    gpusim_counts(s, 0, &before);
    CUdeviceptr in = upload(std::vector<float>(64, 1.0f), s), out;
    cuMemAllocAsync(&out, 256, s);
    add_one(d, in, out, 64, s);
    add_one(d, out, in, 64, s);
    download(in, 64, s);
    gpusim_counts(s, 0, &after);
    EXPECT(after.launches - before.launches == 2, "%llu launches",
           (unsigned long long)(after.launches - before.launches));
    EXPECT(after.copies_htod - before.copies_htod == 1, "one upload");
    EXPECT(after.copies_dtoh - before.copies_dtoh == 1, "one download");
    EXPECT(after.allocs - before.allocs == 1, "one stream-ordered allocation");
    return true;
}

// Device work over known values: a launch of sim_add_one (its output is the input plus one), a
// device-to-device copy and a memset, when they run; under GPU_SIM_SKIP_KERNELS=1 their
// destinations are untouched, and each is still counted.
bool launch_outcome(bool runs) {
    Device d(0);
    CUdeviceptr in = upload(std::vector<float>(64, 1.0f)), out = upload(std::vector<float>(64, 5.0f));
    CUdeviceptr copied = upload(std::vector<float>(64, 5.0f));
    CUdeviceptr set = upload(std::vector<float>(64, 5.0f));
    GpuSimCounts before, after;
    gpusim_counts(nullptr, 0, &before);
    CUresult r = add_one(d, in, out, 64, nullptr);
    EXPECT(r == CUDA_SUCCESS, "got %s", name(r));
    EXPECT(cuMemcpyDtoDAsync_v2(copied, in, 64 * 4, nullptr) == CUDA_SUCCESS, "the copy");
    const float three = 3.0f;
    unsigned bits;
    std::memcpy(&bits, &three, 4);
    EXPECT(cuMemsetD32Async(set, bits, 64, nullptr) == CUDA_SUCCESS, "the memset");
    EXPECT(cuCtxSynchronize() == CUDA_SUCCESS, "a clean synchronize");
    gpusim_counts(nullptr, 0, &after);
    EXPECT(after.launches - before.launches == 1, "the launch counted");
    EXPECT(after.copies_dtod - before.copies_dtod == 1, "the copy counted");
    EXPECT(after.memsets - before.memsets == 1, "the memset counted");
    const std::pair<CUdeviceptr, float> outcomes[] = {
        {out, runs ? 2.0f : 5.0f}, {copied, runs ? 1.0f : 5.0f}, {set, runs ? 3.0f : 5.0f}};
    for (const auto& [p, want] : outcomes)
        for (float v : download(p, 64)) EXPECT(v == want, "%g, expected %g", v, want);
    return true;
}

bool device_work_runs() { return launch_outcome(true); }
bool skipped_device_work_does_nothing() { return launch_outcome(false); }

void bench() {
    Device d(0);
    const int n = 1 << 24;
    CUdeviceptr in, out;
    cuMemAlloc_v2(&in, (size_t)n * 4);
    cuMemAlloc_v2(&out, (size_t)n * 4);
    add_one(d, in, out, n, nullptr);  // warm-up: stacks and pages
    cuCtxSynchronize();
    auto t0 = std::chrono::steady_clock::now();
    const int reps = 3;
    for (int i = 0; i < reps; i++) add_one(d, in, out, n, nullptr);
    cuCtxSynchronize();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("sim_add_one: %d launches of %d threads in %.3f s: %.1f M emulated threads/s\n",
                reps, n, s, reps * (double)n / s / 1e6);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: selftest DEFECTS.ptx [bench]\n");
        return 2;
    }
    std::ifstream f(argv[1]);
    g_ptx.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    cuInit(0);
    if (argc > 2 && std::string(argv[2]) == "bench") {
        bench();
        return 0;
    }
    using Test = std::pair<const char*, std::function<bool()>>;
    // `selftest PTX skip`, under GPU_SIM_SKIP_KERNELS=1: kernels do not run, and every check
    // made at the call still applies.
    const Test skipped[] = {
        {"skipped_device_work_does_nothing", skipped_device_work_does_nothing},
        {"host_pointer_argument_is_refused", host_pointer_argument_is_refused},
        {"freed_pointer_argument_is_refused", freed_pointer_argument_is_refused},
        {"other_devices_pointer_is_refused", other_devices_pointer_is_refused},
        {"copies_are_range_checked", copies_are_range_checked},
        {"launches_and_copies_are_counted", launches_and_copies_are_counted},
    };
    const bool skip = argc > 2 && std::string(argv[2]) == "skip";
    const char* env = std::getenv("GPU_SIM_SKIP_KERNELS");
    if (skip != (env && std::string(env) == "1")) {
        std::fprintf(stderr, "selftest: `skip` goes with GPU_SIM_SKIP_KERNELS=1, and only then\n");
        return 2;
    }
    const Test all[] = {
        {"device_work_runs", device_work_runs},
        {"host_pointer_argument_is_refused", host_pointer_argument_is_refused},
        {"freed_pointer_argument_is_refused", freed_pointer_argument_is_refused},
        {"other_devices_pointer_is_refused", other_devices_pointer_is_refused},
        {"write_past_the_end_faults_and_sticks", write_past_the_end_faults_and_sticks},
        {"a_misaligned_vector_load_is_refused", a_misaligned_vector_load_is_refused},
        {"write_into_the_alignment_slack_is_caught", write_into_the_alignment_slack_is_caught},
        {"a_write_just_before_the_start_is_caught", a_write_just_before_the_start_is_caught},
        {"an_overlapping_device_copy_is_refused", an_overlapping_device_copy_is_refused},
        {"freed_memory_is_poisoned", freed_memory_is_poisoned},
        {"copies_are_range_checked", copies_are_range_checked},
        {"a_divergent_barrier_fails_a_strict_launch", a_divergent_barrier_fails_a_strict_launch},
        {"blocks_run_in_the_schedules_order", blocks_run_in_the_schedules_order},
        {"blocks_of_a_launch_run_at_once_on_several_threads", blocks_of_a_launch_run_at_once_on_several_threads},
        {"static_shared_memory_is_poisoned_at_every_block_start", static_shared_memory_is_poisoned_at_every_block_start},
        {"unordered_cross_stream_use_is_a_race", unordered_cross_stream_use_is_a_race},
        {"an_event_wait_orders_streams", an_event_wait_orders_streams},
        {"a_write_after_an_unordered_read_is_a_race", a_write_after_an_unordered_read_is_a_race},
        {"the_legacy_stream_orders_blocking_streams_only", the_legacy_stream_orders_blocking_streams_only},
        {"per_thread_streams_are_distinct", per_thread_streams_are_distinct},
        {"a_synchronisation_orders_only_its_own_thread", a_synchronisation_orders_only_its_own_thread},
        {"a_freed_block_comes_back_only_in_reuse_mode", a_freed_block_comes_back_only_in_reuse_mode},
        {"thread_creation_and_join_carry_the_order", thread_creation_and_join_carry_the_order},
        {"a_stream_ordered_free_must_follow_other_streams_use",
         a_stream_ordered_free_must_follow_other_streams_use},
        {"pageable_copies_follow_the_completion_rules", pageable_copies_follow_the_completion_rules},
        {"an_unsupported_call_fails_with_its_name", an_unsupported_call_fails_with_its_name},
        {"launches_and_copies_are_counted", launches_and_copies_are_counted},
    };
    std::vector<Test> tests;
    if (skip)
        tests.assign(std::begin(skipped), std::end(skipped));
    else
        tests.assign(std::begin(all), std::end(all));
    for (const auto& t : tests) {
        std::printf("test %s ...\n", t.first);
        std::fflush(stdout);
        bool ok = t.second();
        std::printf("test %s ... %s\n", t.first, ok ? "ok" : "FAILED");
        (ok ? g_passed : g_failed)++;
    }
    std::printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
