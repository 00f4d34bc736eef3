// The simulated NCCL's own tests: each follows a rule of nccl.h or NCCL's user guide that the
// simulation must model, or plants a defect it must catch, and checks the outcome through the
// NCCL and driver APIs. Run by scripts/test-gpu-sim.sh with the simulated libraries first on
// LD_LIBRARY_PATH.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cuda_types.h"
#include "gpusim.h"

extern "C" {
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext*, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr*, size_t);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void*, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void*, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuStreamCreate(CUstream*, unsigned);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamQuery(CUstream);

struct ncclUniqueId {
    char internal[128];
};
struct ncclConfig {
    size_t size;
    unsigned magic, version;
    int blocking, cga, min_ctas, max_ctas;
    const char* net_name;
};
typedef void* ncclComm_t;
int ncclGetVersion(int*);
int ncclGetUniqueId(ncclUniqueId*);
int ncclCommInitRankConfig(ncclComm_t*, int, ncclUniqueId, int, ncclConfig*);
int ncclGroupStart();
int ncclGroupEnd();
int ncclCommGetAsyncError(ncclComm_t, int*);
int ncclAllReduce(const void*, void*, size_t, int, int, ncclComm_t, CUstream);
int ncclAllGather(const void*, void*, size_t, int, ncclComm_t, CUstream);
int ncclReduceScatter(const void*, void*, size_t, int, int, ncclComm_t, CUstream);
int ncclBroadcast(const void*, void*, size_t, int, int, ncclComm_t, CUstream);
int ncclCommSplit(ncclComm_t, int, int, ncclComm_t*, ncclConfig*);
int ncclCommFinalize(ncclComm_t);
int ncclCommDestroy(ncclComm_t);
int ncclCommAbort(ncclComm_t);
int ncclCommCount(ncclComm_t, int*);
int ncclCommUserRank(ncclComm_t, int*);
const char* ncclGetLastError(ncclComm_t);
}

namespace {

constexpr int kSuccess = 0, kInvalidArgument = 4, kInvalidUsage = 5, kRemoteError = 6,
              kInProgress = 7, kFloat32 = 7, kInt32 = 2, kSum = 0, kMax = 2, kAvg = 4;

// What the last `group` call's ncclGroupEnd returned.
int g_group_end = -1;

#define EXPECT(cond, ...)                            \
    do {                                             \
        if (!(cond)) {                               \
            std::printf("    expected %s: ", #cond); \
            std::printf(__VA_ARGS__);                \
            std::printf("\n");                       \
            return false;                            \
        }                                            \
    } while (0)

void bind(int device) {
    CUcontext c;
    cuDevicePrimaryCtxRetain(&c, device);
    cuCtxSetCurrent(c);
}

ncclConfig nonblocking() { return {40, 0xcafebeef, 21700, 0, INT_MIN, INT_MIN, INT_MIN, nullptr}; }

// Polls until the communicator's state is no longer "in progress", for at most `ms`.
int settle(ncclComm_t c, int ms = 5000) {
    int s = kInProgress;
    auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (ncclCommGetAsyncError(c, &s) == kSuccess && s == kInProgress &&
           std::chrono::steady_clock::now() < end)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return s;
}

// `n` ranks on devices first..first+n-1, initialised in one group from this thread (what
// ncclGroupEnd returned in `g_group_end`).
std::vector<ncclComm_t> group(int n, int first = 0) {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    std::vector<ncclComm_t> comms(n);
    ncclGroupStart();
    for (int r = 0; r < n; ++r) {
        bind(first + r);
        ncclConfig cfg = nonblocking();
        ncclCommInitRankConfig(&comms[r], n, id, r, &cfg);
    }
    g_group_end = ncclGroupEnd();
    for (auto c : comms) settle(c);
    return comms;
}

// Runs `f` on a thread of its own and waits for it at most `ms`: false if it had not returned
// by then (the thread is left behind, blocked: the test has failed).
bool returns_within(int ms, std::function<void()> f) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread([done, f = std::move(f)] {
        f();
        *done = true;
    }).detach();
    auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (!*done && std::chrono::steady_clock::now() < end)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return *done;
}

CUdeviceptr upload(const std::vector<float>& v) {
    CUdeviceptr p;
    cuMemAlloc_v2(&p, v.size() * 4);
    cuMemcpyHtoDAsync_v2(p, v.data(), v.size() * 4, nullptr);  // pageable: synchronous
    return p;
}

std::vector<float> download(CUdeviceptr p, size_t n) {
    std::vector<float> v(n);
    cuMemcpyDtoHAsync_v2(v.data(), p, n * 4, nullptr);  // pageable: synchronous
    return v;
}

// Each rank's thread: binds its device, runs `f(rank)`.
void on_ranks(int n, const std::function<void(int)>& f) {
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r) ts.emplace_back([r, &f] {
        bind(r);
        f(r);
    });
    for (auto& t : ts) t.join();
}

// ------------------------------------------------------------------------------- the rules
bool a_nonblocking_group_init_is_in_progress_then_ready() {
    int v = 0;
    EXPECT(ncclGetVersion(&v) == kSuccess && v >= 22700, "version %d", v);
    auto comms = group(2);
    EXPECT(g_group_end == kInProgress, "a non-blocking group's ncclGroupEnd returns in progress, got %d", g_group_end);
    for (auto c : comms) {
        int s = -1, n = 0;
        EXPECT(ncclCommGetAsyncError(c, &s) == kSuccess && s == kSuccess, "state %d", s);
        EXPECT(ncclCommCount(c, &n) == kSuccess && n == 2, "count %d", n);
        ncclCommAbort(c);
    }
    return true;
}

bool collectives_compute_across_ranks() {
    auto comms = group(3);
    std::vector<std::vector<float>> sum(3), max(3), gath(3), scat(3), bc(3);
    on_ranks(3, [&](int r) {
        CUstream s;
        cuStreamCreate(&s, 0);
        float x = float(r + 1);
        CUdeviceptr in = upload({x, -x}), out = upload({0, 0}), all = upload(std::vector<float>(6));
        CUdeviceptr six = upload({1, 2, 3, 4, 5, 6}), one = upload({0, 0}), b = upload({x * 10});
        ncclAllReduce((void*)in, (void*)out, 2, kFloat32, kSum, comms[r], s);
        settle(comms[r]);  // any enqueue may return "in progress": polled ready before the next
        sum[r] = (cuStreamSynchronize(s), download(out, 2));
        ncclAllReduce((void*)in, (void*)out, 2, kFloat32, kMax, comms[r], s);
        settle(comms[r]);
        ncclAllGather((void*)in, (void*)all, 2, kFloat32, comms[r], s);
        settle(comms[r]);
        ncclReduceScatter((void*)six, (void*)one, 2, kFloat32, kSum, comms[r], s);
        settle(comms[r]);
        ncclBroadcast((void*)b, (void*)b, 1, kFloat32, 2, comms[r], s);
        settle(comms[r]);
        cuStreamSynchronize(s);
        max[r] = download(out, 2), gath[r] = download(all, 6), scat[r] = download(one, 2);
        bc[r] = download(b, 1);
    });
    for (int r = 0; r < 3; ++r) {
        EXPECT(sum[r] == std::vector<float>({6, -6}), "rank %d sum %g %g", r, sum[r][0], sum[r][1]);
        EXPECT(max[r] == std::vector<float>({3, -1}), "rank %d max", r);
        EXPECT(gath[r] == std::vector<float>({1, -1, 2, -2, 3, -3}), "rank %d all-gather", r);
        EXPECT(scat[r] == std::vector<float>({3.f * (2 * r + 1), 3.f * (2 * r + 2)}), "rank %d reduce-scatter", r);
        EXPECT(bc[r] == std::vector<float>({30}), "rank %d broadcast", r);
    }
    for (auto c : comms) ncclCommAbort(c);
    return true;
}

// The in-place forms (User Guide, "In-place Operations"): an all-reduce into its own buffer,
// an all-gather whose send buffer is the rank's part of the receive buffer, a reduce-scatter
// whose receive buffer is the rank's part of the send buffer.
bool in_place_forms_compute_across_ranks() {
    auto comms = group(2);
    std::vector<std::vector<float>> sum(2), gath(2), scat(2);
    on_ranks(2, [&](int r) {
        CUstream s;
        cuStreamCreate(&s, 0);
        float x = float(r + 1);
        CUdeviceptr a = upload({x, -x});
        ncclAllReduce((void*)a, (void*)a, 2, kFloat32, kSum, comms[r], s);
        settle(comms[r]);  // any enqueue may return "in progress": polled ready before the next
        std::vector<float> parts(4, 0.f);
        parts[2 * r] = x, parts[2 * r + 1] = 10 * x;
        CUdeviceptr g = upload(parts), rs = upload({x, 2 * x, 3 * x, 4 * x});
        ncclAllGather((void*)(g + 8 * r), (void*)g, 2, kFloat32, comms[r], s);
        settle(comms[r]);
        ncclReduceScatter((void*)rs, (void*)(rs + 8 * r), 2, kFloat32, kSum, comms[r], s);
        settle(comms[r]);
        cuStreamSynchronize(s);
        sum[r] = download(a, 2), gath[r] = download(g, 4), scat[r] = download(rs + 8 * r, 2);
    });
    for (int r = 0; r < 2; ++r) {
        EXPECT(sum[r] == std::vector<float>({3, -3}), "rank %d in-place sum %g %g", r, sum[r][0], sum[r][1]);
        EXPECT(gath[r] == std::vector<float>({1, 10, 2, 20}), "rank %d in-place all-gather", r);
        // Each rank's {x, 2x, 3x, 4x} summed over x = 1, 2: {3, 6, 9, 12}, rank r keeps part r.
        EXPECT(scat[r] == std::vector<float>({3.f * (2 * r + 1), 3.f * (2 * r + 2)}), "rank %d in-place reduce-scatter", r);
    }
    for (auto c : comms) ncclCommAbort(c);
    return true;
}

// ----------------------------------------------------------------------- planted defects
bool a_call_before_init_completes_is_misuse() {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    bind(0);
    ncclComm_t c;
    ncclConfig cfg = nonblocking();
    EXPECT(ncclCommInitRankConfig(&c, 2, id, 0, &cfg) == kInProgress, "in progress");
    CUdeviceptr p = upload({1});
    int r = ncclAllReduce((void*)p, (void*)p, 1, kFloat32, kSum, c, nullptr);
    EXPECT(r == kInvalidUsage, "a collective while the init is in progress: got %d", r);
    EXPECT(settle(c, 100) == kInProgress, "the missing peer keeps it in progress");
    EXPECT(ncclCommAbort(c) == kSuccess, "abort in any state");
    return true;
}

bool a_buffer_too_small_or_on_another_device_is_refused() {
    auto comms = group(2);
    bind(0);
    CUdeviceptr small = upload({1, 2, 3});
    int r = ncclAllGather((void*)small, (void*)small, 2, kFloat32, comms[0], nullptr);
    EXPECT(r == kInvalidArgument, "a receive buffer of 3 floats for 2x2: got %d", r);
    bind(1);
    CUdeviceptr other = upload({1, 2});
    bind(0);
    r = ncclAllReduce((void*)other, (void*)small, 2, kFloat32, kSum, comms[0], nullptr);
    EXPECT(r == kInvalidArgument, "a send buffer on device 1 for rank 0's device 0: got %d", r);
    for (auto c : comms) ncclCommAbort(c);
    return true;
}

// Buffers that overlap other than in an in-place form: a receive buffer one value into the
// send buffer of an all-reduce, rank 1's all-gather with its send buffer at rank 0's part, and
// rank 1's reduce-scatter receiving into rank 0's part.
bool an_overlap_other_than_in_place_is_refused() {
    auto comms = group(2);
    bind(0);
    CUdeviceptr p = upload({1, 2, 3, 4});
    int r = ncclAllReduce((void*)p, (void*)(p + 4), 2, kFloat32, kSum, comms[0], nullptr);
    EXPECT(r == kInvalidArgument, "an all-reduce into its send buffer shifted by one value: got %d", r);
    bind(1);
    CUdeviceptr q = upload({1, 2, 3, 4});
    r = ncclAllGather((void*)q, (void*)q, 2, kFloat32, comms[1], nullptr);
    EXPECT(r == kInvalidArgument, "rank 1's all-gather sending from rank 0's part: got %d", r);
    r = ncclReduceScatter((void*)q, (void*)q, 2, kFloat32, kSum, comms[1], nullptr);
    EXPECT(r == kInvalidArgument, "rank 1's reduce-scatter receiving into rank 0's part: got %d", r);
    for (auto c : comms) ncclCommAbort(c);
    return true;
}

// What an aborted collective leaves, by GPU_SIM_NCCL_ABORT_DAMAGE: nothing of its steps
// completed (the peer never came), so `partial` and `finite` leave half of this rank's own
// value, `nan` a NaN, `none` the old contents; an in-place call's input is damaged alike.
bool a_missing_peer_blocks_the_stream_until_abort() {
    const char* e = std::getenv("GPU_SIM_NCCL_ABORT_DAMAGE");
    const std::string mode = e && *e ? e : "partial";
    auto comms = group(2);
    bind(0);
    CUstream s;
    cuStreamCreate(&s, 0);
    CUdeviceptr in = upload({5}), out = upload({-7}), both = upload({3});
    ncclAllReduce((void*)in, (void*)out, 1, kFloat32, kSum, comms[0], s);
    settle(comms[0]);
    ncclAllReduce((void*)both, (void*)both, 1, kFloat32, kSum, comms[0], s);
    settle(comms[0]);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT(cuStreamQuery(s) == CUDA_ERROR_NOT_READY, "the stream waits for rank 1");
    EXPECT(ncclCommAbort(comms[0]) == kSuccess, "abort");
    EXPECT(cuStreamSynchronize(s) == CUDA_SUCCESS, "the abort frees the stream");
    float got = download(out, 1)[0], in_place = download(both, 1)[0];
    if (mode == "none") {
        EXPECT(got == -7 && in_place == 3, "nothing written: %g, %g", got, in_place);
    } else if (mode == "nan") {
        EXPECT(std::isnan(got) && std::isnan(in_place), "NaN written: %g, %g", got, in_place);
    } else {
        EXPECT(got == 2.5f && in_place == 1.5f, "half of the own value written (%s): %g, %g", mode.c_str(), got, in_place);
    }
    ncclCommAbort(comms[1]);
    return true;
}

// Two communicators over the same two devices, used in opposite orders: rank 0 issues an
// all-reduce on A then one on B, rank 1 on B then on A, each on a stream of its own. With
// communicators progressing independently (GPU_SIM_NCCL_PROGRESS unset or `shared`) both
// complete; with one collective at a time per device in issue order (`device`) the inversion
// deadlocks every time, until the communicators are aborted (run in both modes).
bool communicators_in_opposite_orders_deadlock_one_collective_per_device() {
    const char* e = std::getenv("GPU_SIM_NCCL_PROGRESS");
    const bool device = e && std::string(e) == "device";
    auto a = group(2), b = group(2);
    std::vector<CUstream> first(2), second(2);
    // Per rank: the result of A and of B, each in an allocation of its own (the race checker
    // tracks whole allocations).
    std::vector<CUdeviceptr> out_a(2), out_b(2);
    on_ranks(2, [&](int r) {
        cuStreamCreate(&first[r], CU_STREAM_NON_BLOCKING);
        cuStreamCreate(&second[r], CU_STREAM_NON_BLOCKING);
        CUdeviceptr x = upload({float(r + 1)}), y = upload({float(10 * (r + 1))});
        out_a[r] = upload({0});
        out_b[r] = upload({0});
        cuStreamSynchronize(nullptr);  // the uploads happen before the non-blocking streams' work
        if (r == 0) {
            ncclAllReduce((void*)x, (void*)out_a[r], 1, kFloat32, kSum, a[r], first[r]);
            settle(a[r]);
            ncclAllReduce((void*)y, (void*)out_b[r], 1, kFloat32, kSum, b[r], second[r]);
            settle(b[r]);
        } else {
            ncclAllReduce((void*)y, (void*)out_b[r], 1, kFloat32, kSum, b[r], first[r]);
            settle(b[r]);
            ncclAllReduce((void*)x, (void*)out_a[r], 1, kFloat32, kSum, a[r], second[r]);
            settle(a[r]);
        }
    });
    if (!device) {
        for (int r = 0; r < 2; ++r) {
            bind(r);
            EXPECT(cuStreamSynchronize(first[r]) == CUDA_SUCCESS && cuStreamSynchronize(second[r]) == CUDA_SUCCESS, "rank %d completes", r);
            float sa = download(out_a[r], 1)[0], sb = download(out_b[r], 1)[0];
            EXPECT(sa == 3 && sb == 30, "rank %d: A's sum %g (want 3), B's %g (want 30)", r, sa, sb);
        }
    } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        for (int r = 0; r < 2; ++r) {
            bind(r);
            EXPECT(cuStreamQuery(first[r]) == CUDA_ERROR_NOT_READY && cuStreamQuery(second[r]) == CUDA_ERROR_NOT_READY,
                   "rank %d: both collectives wait (the first for its peer, the second for the device)", r);
        }
    }
    for (int r = 0; r < 2; ++r) {
        ncclCommAbort(a[r]);
        ncclCommAbort(b[r]);
    }
    for (int r = 0; r < 2; ++r) {
        bind(r);
        EXPECT(cuStreamSynchronize(first[r]) == CUDA_SUCCESS && cuStreamSynchronize(second[r]) == CUDA_SUCCESS,
               "rank %d: the aborts free both streams", r);
    }
    return true;
}

bool an_unordered_read_of_the_output_is_a_race() {
    auto comms = group(1);
    bind(0);
    CUstream a, b;
    cuStreamCreate(&a, CU_STREAM_NON_BLOCKING);
    cuStreamCreate(&b, CU_STREAM_NON_BLOCKING);
    CUdeviceptr in = upload({1}), out = upload({0}), copy = upload({0});
    cuStreamSynchronize(nullptr);  // the uploads happen before everything below
    auto races = gpusim_races();
    int nr = ncclAllReduce((void*)in, (void*)out, 1, kFloat32, kSum, comms[0], a);
    EXPECT(nr == kSuccess || nr == kInProgress, "the all-reduce is ordered after the uploads: %d", nr);
    settle(comms[0]);
    CUresult r = cuMemcpyDtoDAsync_v2(copy, out, 4, b);
    EXPECT(r == CUDA_ERROR_LAUNCH_FAILED && gpusim_races() == races + 1,
           "reading the all-reduce's output on another stream without an event is a race (got %d)", r);
    ncclCommAbort(comms[0]);
    return true;
}

// NCCL's finalize synchronises the communicator's own work, with no barrier between ranks;
// nothing but ncclCommDestroy may follow it.
bool finalize_waits_for_its_own_work_only_and_destroy_then_forgets_the_handle() {
    auto comms = group(2);
    bind(0);
    CUstream s0;
    cuStreamCreate(&s0, 0);
    CUdeviceptr p0 = upload({1});
    ncclAllReduce((void*)p0, (void*)p0, 1, kFloat32, kSum, comms[0], s0);
    settle(comms[0]);
    EXPECT(ncclCommFinalize(comms[0]) == kInProgress, "finalize is asynchronous");
    EXPECT(settle(comms[0], 100) == kInProgress, "rank 0's all-reduce waits for rank 1: finalize still in progress");
    bind(1);
    CUdeviceptr p1 = upload({2});
    ncclAllReduce((void*)p1, (void*)p1, 1, kFloat32, kSum, comms[1], nullptr);
    settle(comms[1]);
    EXPECT(settle(comms[0]) == kSuccess, "rank 0's own work done: finalized, though rank 1 never finalized");
    bind(0);
    EXPECT(download(p0, 1) == std::vector<float>({3}), "the all-reduce ran");
    int r = ncclAllReduce((void*)p0, (void*)p0, 1, kFloat32, kSum, comms[0], s0);
    EXPECT(r == kInvalidUsage, "a collective after finalize: got %d", r);
    EXPECT(ncclCommDestroy(comms[0]) == kSuccess, "destroy");
    int st;
    EXPECT(ncclCommGetAsyncError(comms[0], &st) == kInvalidArgument, "a destroyed handle is refused");
    bind(1);
    EXPECT(returns_within(2000, [c = comms[1]] { ncclCommDestroy(c); }),
           "a destroy without finalize returns without waiting for peers");
    return true;
}

// NCCL's ncclCommDestroy without finalize waits for the rank's own work, not for the peers'
// destroy: a rank whose peer is still running may leave.
bool destroy_without_finalize_does_not_wait_for_peers() {
    auto comms = group(2);
    EXPECT(returns_within(2000, [c = comms[0]] { ncclCommDestroy(c); }),
           "rank 0's destroy, rank 1 live and idle");
    ncclCommAbort(comms[1]);
    return true;
}

// An abort must return when the context's error is sticky: a collective queued behind one
// that waits for a peer is dropped by the stream, and still counts as ended. Devices 2 and 3
// (device 3's error stays sticky for the rest of the process).
bool an_abort_after_a_sticky_error_returns() {
    auto comms = group(2, 2);
    bind(3);
    CUstream a, b, c;
    cuStreamCreate(&a, CU_STREAM_NON_BLOCKING);
    cuStreamCreate(&b, CU_STREAM_NON_BLOCKING);
    cuStreamCreate(&c, CU_STREAM_NON_BLOCKING);
    CUdeviceptr x = upload({1}), y = upload({2}), q = upload({0}), z = upload({0}), w = upload({0});
    cuStreamSynchronize(nullptr);
    // Rank 1 (device 3) issues two all-reduces; rank 0 never does: the first waits, the
    // second is queued behind it.
    ncclAllReduce((void*)x, (void*)x, 1, kFloat32, kSum, comms[1], a);
    settle(comms[1]);
    ncclAllReduce((void*)y, (void*)y, 1, kFloat32, kSum, comms[1], a);
    settle(comms[1]);
    // A race on device 3 makes its error sticky.
    cuMemcpyDtoDAsync_v2(q, z, 4, b);
    CUresult r = cuMemcpyDtoDAsync_v2(w, q, 4, c);
    EXPECT(r == CUDA_ERROR_LAUNCH_FAILED, "the planted race, got %d", r);
    EXPECT(returns_within(5000, [k = comms[1]] { ncclCommAbort(k); }),
           "ncclCommAbort after a sticky error returns");
    ncclCommAbort(comms[0]);
    return true;
}

// ncclAvg of floats is a pre-multiplied sum (NCCL's PreMulSum: each value times 1/n rounded to
// the type, then summed), not the sum divided by n: they differ when 1/n is inexact.
bool avg_is_a_premultiplied_sum() {
    const int n = 3, len = 64;
    auto comms = group(n);
    std::vector<std::vector<float>> in(n, std::vector<float>(len)), got(n);
    uint32_t state = 12345;
    for (auto& v : in)
        for (float& x : v) {
            state = state * 1664525u + 1013904223u;
            x = float(state >> 8) / float(1 << 24) * 10.f - 5.f;
        }
    on_ranks(n, [&](int r) {
        CUstream s;
        cuStreamCreate(&s, 0);
        CUdeviceptr p = upload(in[r]);
        ncclAllReduce((void*)p, (void*)p, len, kFloat32, kAvg, comms[r], s);
        settle(comms[r]);
        cuStreamSynchronize(s);
        got[r] = download(p, len);
    });
    const float scale = float(1.0 / n);
    int differ = 0;
    for (int i = 0; i < len; ++i) {
        float pre = in[0][i] * scale, div = in[0][i];
        for (int r = 1; r < n; ++r) pre += in[r][i] * scale, div += in[r][i];
        div /= float(n);
        differ += pre != div;
        for (int r = 0; r < n; ++r)
            EXPECT(got[r][i] == pre, "rank %d element %d: %.9g, the pre-multiplied sum is %.9g (sum / n: %.9g)", r, i, got[r][i], pre, div);
    }
    EXPECT(differ > 0, "the inputs tell the two apart (%d of %d elements differ)", differ, len);
    for (auto c : comms) ncclCommAbort(c);
    return true;
}

// A non-blocking communicator may return ncclInProgress from any enqueue, not only its first
// (GPU_SIM_NCCL_INPROGRESS; the default returns it for one in 4 at random).
bool any_enqueue_may_be_in_progress() {
    auto comms = group(2);
    std::vector<int> later(2, 0);
    on_ranks(2, [&](int r) {
        CUdeviceptr p = upload({1});
        for (int i = 0; i < 40; ++i) {
            int res = ncclAllReduce((void*)p, (void*)p, 1, kFloat32, kSum, comms[r], nullptr);
            later[r] += res == kInProgress && i > 0;
            settle(comms[r]);
        }
        cuStreamSynchronize(nullptr);
    });
    for (int r = 0; r < 2; ++r)
        EXPECT(later[r] > 0, "rank %d: no enqueue after the first was in progress", r);
    for (auto c : comms) ncclCommAbort(c);
    return true;
}

bool two_threads_in_one_communicator_is_misuse() {
    auto comms = group(2);
    bind(0);
    std::atomic<int> misuse{0};
    CUdeviceptr a = upload({1}), b = upload({1});
    // The first collective sets up connections ("in progress"): settled before the race.
    ncclAllReduce((void*)a, (void*)b, 1, kFloat32, kSum, comms[0], nullptr);
    settle(comms[0]);
    std::vector<std::thread> ts;
    // Two threads call until one of them is refused (calls take microseconds: thousands of
    // tries overlap on any machine with two cores), or give up after 20000 each.
    for (int t = 0; t < 2; ++t) ts.emplace_back([&] {
        bind(0);
        for (int i = 0; i < 20000 && misuse == 0; ++i) {
            int r = ncclAllReduce((void*)a, (void*)b, 1, kFloat32, kSum, comms[0], nullptr);
            // Not a refusal because a call is still in progress (any enqueue may be): the
            // refusal of a second thread inside the communicator, by its text.
            misuse += r == kInvalidUsage && std::strstr(ncclGetLastError(comms[0]), "another thread");
        }
    });
    for (auto& t : ts) t.join();
    EXPECT(misuse > 0, "concurrent calls on one communicator were reported");
    for (auto c : comms) ncclCommAbort(c);
    return true;
}

bool split_orders_by_key_and_nocolor_gets_none() {
    auto comms = group(3);
    std::vector<ncclComm_t> kids(3, (ncclComm_t)1);
    on_ranks(3, [&](int r) {
        ncclCommSplit(comms[r], r == 0 ? -1 : 5, 10 - r, &kids[r], nullptr);
        settle(comms[r]);
    });
    EXPECT(kids[0] == nullptr, "NCCL_SPLIT_NOCOLOR gives no communicator");
    for (int r = 1; r < 3; ++r) {
        int n = 0, rank = -1;
        EXPECT(kids[r] && ncclCommCount(kids[r], &n) == kSuccess && n == 2, "parent rank %d: a child of 2", r);
        // Keys 9 (parent rank 1) and 8 (parent rank 2): the smaller key is child rank 0.
        EXPECT(ncclCommUserRank(kids[r], &rank) == kSuccess && rank == 2 - r,
               "parent rank %d with key %d: child rank %d, expected %d", r, 10 - r, rank, 2 - r);
    }
    for (auto c : kids)
        if (c) ncclCommAbort(c);
    for (auto c : comms) ncclCommAbort(c);
    return true;
}

// In a child process that has made no NCCL call yet: writes `conf` to `dir`/`file`, sets
// NCCL_CONF_FILE to `conf_var` (unset when null), HOME to `dir` and NCCL_COMM_BLOCKING to
// `env` (unset when null), then asks NCCL for a one-rank non-blocking communicator in a group.
// Exit status: bit 0 when ncclGroupEnd returned success (blocking), bit 1 when the environment
// then lacks NCCL_COMM_BLOCKING=`visible` (null: not set).
int mode_in_child(const std::string& dir, const char* file, const char* conf, const char* conf_var,
                  const char* env, const char* visible) {
    std::string path = dir + "/" + file;
    if (FILE* f = std::fopen(path.c_str(), "w")) {
        std::fputs(conf, f);
        std::fclose(f);
    }
    pid_t kid = fork();
    if (kid == 0) {
        if (conf_var) setenv("NCCL_CONF_FILE", conf_var, 1);
        else unsetenv("NCCL_CONF_FILE");
        setenv("HOME", dir.c_str(), 1);
        if (env) setenv("NCCL_COMM_BLOCKING", env, 1);
        else unsetenv("NCCL_COMM_BLOCKING");
        bind(0);
        ncclUniqueId id;
        ncclGetUniqueId(&id);
        ncclComm_t c = nullptr;
        ncclConfig cfg = nonblocking();
        ncclGroupStart();
        ncclCommInitRankConfig(&c, 1, id, 0, &cfg);
        int end = ncclGroupEnd();
        settle(c);
        ncclCommAbort(c);
        const char* seen = std::getenv("NCCL_COMM_BLOCKING");
        bool as_expected = visible ? (seen && std::strcmp(seen, visible) == 0) : !seen;
        _exit((end == kSuccess ? 1 : 0) | (as_expected ? 0 : 2));
    }
    int status = 0;
    waitpid(kid, &status, 0);
    std::remove(path.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

// NCCL's configuration files, as NCCL reads them (each case in a fresh process, since NCCL
// reads them once): the first line of a file wins, a name is not trimmed, '#' comments only
// in the first column, the environment wins over the files, an empty NCCL_CONF_FILE means
// ~/.nccl.conf, and the file's values are in the environment afterwards.
bool conf_files_are_read_as_nccl_reads_them() {
    char tmpl[] = "/tmp/gpusim-conf-XXXXXX";
    std::string dir = mkdtemp(tmpl);
    std::string named = dir + "/named.conf";
    struct Case {
        const char* what;
        const char* file;
        const char* conf;
        const char* conf_var;  // "" or the named file
        const char* env;
        const char* visible;
        int want;
    } cases[] = {
        {"the first line of a file wins", "named.conf", "NCCL_COMM_BLOCKING=1\nNCCL_COMM_BLOCKING=0\n",
         named.c_str(), nullptr, "1", 1},
        {"a name with a space is another variable", "named.conf", "NCCL_COMM_BLOCKING =1\n", named.c_str(),
         nullptr, nullptr, 0},
        {"'#' in the first column is a comment", "named.conf", "#NCCL_COMM_BLOCKING=1\n", named.c_str(),
         nullptr, nullptr, 0},
        {"the environment wins over a file", "named.conf", "NCCL_COMM_BLOCKING=1\n", named.c_str(), "0", "0", 0},
        {"an empty NCCL_CONF_FILE means ~/.nccl.conf (CRLF line ends too)", ".nccl.conf",
         "NCCL_COMM_BLOCKING=1\r\n", "", nullptr, "1", 1},
        {"a named file replaces ~/.nccl.conf", ".nccl.conf", "NCCL_COMM_BLOCKING=1\n", named.c_str(),
         nullptr, nullptr, 0},
        {"values are parsed as integers in any base", "named.conf", "NCCL_COMM_BLOCKING=0x0\n", named.c_str(),
         nullptr, "0x0", 0},
    };
    for (const Case& c : cases) {
        int got = mode_in_child(dir, c.file, c.conf, c.conf_var, c.env, c.visible);
        EXPECT(got == c.want, "%s: child status %d, wanted %d (bit 0: blocking, bit 1: environment)", c.what,
               got, c.want);
    }
    rmdir(dir.c_str());
    return true;
}

bool a_killed_peer_process_is_a_remote_error() {
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    pid_t kid = fork();
    if (kid == 0) {  // rank 1: arrives, then dies without a word
        bind(1);
        ncclComm_t c;
        ncclConfig cfg = nonblocking();
        ncclCommInitRankConfig(&c, 2, id, 1, &cfg);
        settle(c);
        kill(getpid(), SIGKILL);
    }
    bind(0);
    ncclComm_t c;
    ncclConfig cfg = nonblocking();
    ncclCommInitRankConfig(&c, 2, id, 0, &cfg);
    EXPECT(settle(c) == kSuccess, "both processes arrived");
    int status;
    waitpid(kid, &status, 0);
    CUstream s;
    cuStreamCreate(&s, 0);
    CUdeviceptr p = upload({1});
    ncclAllReduce((void*)p, (void*)p, 1, kFloat32, kSum, c, s);
    int state = settle(c, 100);
    for (int i = 0; i < 100 && state != kRemoteError; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        ncclCommGetAsyncError(c, &state);
    }
    EXPECT(state == kRemoteError, "the departed process is reported (state %d)", state);
    EXPECT(cuStreamQuery(s) == CUDA_ERROR_NOT_READY, "the collective waits for the abort");
    ncclCommAbort(c);
    EXPECT(cuStreamSynchronize(s) == CUDA_SUCCESS, "then the stream drains");
    return true;
}

// Two ranks of one communicator on device 0 of two processes: refused (ncclInvalidUsage on
// both) when both processes are on one host; one GPU each, and the init completes, when the
// second process is on another host (NCCL_HOSTID, which NCCL's host hash takes instead of the
// host name and boot id).
bool one_ordinal_is_two_gpus_only_on_two_hosts() {
    for (int two_hosts = 0; two_hosts < 2; ++two_hosts) {
        const int want = two_hosts ? kSuccess : kInvalidUsage;
        ncclUniqueId id;
        ncclGetUniqueId(&id);
        pid_t kid = fork();
        if (kid == 0) {  // rank 1, on device 0 of its own (or the same) host
            if (two_hosts) setenv("NCCL_HOSTID", "another-machine", 1);
            bind(0);
            ncclComm_t c;
            ncclConfig cfg = nonblocking();
            ncclCommInitRankConfig(&c, 2, id, 1, &cfg);
            // Only the init: a forked child has none of the parent's stream workers (the
            // collectives of ranks on two hosts run in the two-node launch of
            // scripts/test-two-nodes.sh).
            _exit(settle(c) == want ? 0 : 1);
        }
        bind(0);
        ncclComm_t c;
        ncclConfig cfg = nonblocking();
        ncclCommInitRankConfig(&c, 2, id, 0, &cfg);
        int state = settle(c);
        EXPECT(state == want, "two hosts %d: init state %d, %d expected", two_hosts, state, want);
        int status = 0;
        waitpid(kid, &status, 0);
        EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "two hosts %d: rank 1 saw it too",
               two_hosts);
        ncclCommAbort(c);
    }
    return true;
}

}  // namespace

int main() {
    cuInit(0);
    // The forks first, before other tests leave threads behind; the configuration files' first,
    // before any NCCL call of this process.
    const std::pair<const char*, std::function<bool()>> tests[] = {
        {"conf_files_are_read_as_nccl_reads_them", conf_files_are_read_as_nccl_reads_them},
        {"a_killed_peer_process_is_a_remote_error", a_killed_peer_process_is_a_remote_error},
        {"one_ordinal_is_two_gpus_only_on_two_hosts", one_ordinal_is_two_gpus_only_on_two_hosts},
        {"a_nonblocking_group_init_is_in_progress_then_ready", a_nonblocking_group_init_is_in_progress_then_ready},
        {"collectives_compute_across_ranks", collectives_compute_across_ranks},
        {"in_place_forms_compute_across_ranks", in_place_forms_compute_across_ranks},
        {"a_call_before_init_completes_is_misuse", a_call_before_init_completes_is_misuse},
        {"a_buffer_too_small_or_on_another_device_is_refused", a_buffer_too_small_or_on_another_device_is_refused},
        {"an_overlap_other_than_in_place_is_refused", an_overlap_other_than_in_place_is_refused},
        {"a_missing_peer_blocks_the_stream_until_abort", a_missing_peer_blocks_the_stream_until_abort},
        {"finalize_waits_for_its_own_work_only_and_destroy_then_forgets_the_handle",
         finalize_waits_for_its_own_work_only_and_destroy_then_forgets_the_handle},
        {"destroy_without_finalize_does_not_wait_for_peers", destroy_without_finalize_does_not_wait_for_peers},
        {"avg_is_a_premultiplied_sum", avg_is_a_premultiplied_sum},
        {"any_enqueue_may_be_in_progress", any_enqueue_may_be_in_progress},
        {"two_threads_in_one_communicator_is_misuse", two_threads_in_one_communicator_is_misuse},
        {"split_orders_by_key_and_nocolor_gets_none", split_orders_by_key_and_nocolor_gets_none},
        {"communicators_in_opposite_orders_deadlock_one_collective_per_device",
         communicators_in_opposite_orders_deadlock_one_collective_per_device},
        // Last: the races they plant make device 3's and device 0's errors sticky.
        {"an_abort_after_a_sticky_error_returns", an_abort_after_a_sticky_error_returns},
        {"an_unordered_read_of_the_output_is_a_race", an_unordered_read_of_the_output_is_a_race},
    };
    int failed = 0, passed = 0;
    for (const auto& t : tests) {
        std::printf("test %s ...\n", t.first);
        std::fflush(stdout);
        bool ok = t.second();
        std::printf("test %s ... %s\n", t.first, ok ? "ok" : "FAILED");
        (ok ? passed : failed)++;
    }
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
