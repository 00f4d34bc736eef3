// The simulated NCCL's collectives: argument and buffer checks at the call, then a task on the
// CUDA stream that meets its peers in the world's shared memory, step by step (each rank posts
// at most kChunk bytes per step), and blocks the stream until they arrive.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include "half_bits.h"
#include "nccl_sim.h"

using nccl::Comm;

namespace {

using nccl::kAllGather;
using nccl::kAllReduce;
using nccl::kBroadcast;
using nccl::kReduceScatter;
using nccl::type_size;

const char* kind_name(int k) {
    return k == kAllReduce ? "ncclAllReduce" : k == kBroadcast ? "ncclBroadcast"
                                          : k == kAllGather  ? "ncclAllGather"
                                                             : "ncclReduceScatter";
}

struct Coll {
    int kind, dtype, op, root;
    size_t count;  // nccl.h's count: per rank for a reduce-scatter's output, an all-gather's input
    const uint8_t* send;
    uint8_t* recv;
    uint64_t call;
};

// Elementwise reduction of `n` inputs of `len` elements in rank order, in the element type.
template <class T>
T combine(T a, T b, int op) {
    if constexpr (std::is_floating_point_v<T>) {
        if (op == ncclMax || op == ncclMin) {
            if (std::isnan(a) || std::isnan(b)) return a + b;  // NaN propagates (strict)
        }
    }
    switch (op) {
        case ncclProd: return T(a * b);
        case ncclMax: return a > b ? a : b;
        case ncclMin: return a < b ? a : b;
        default: return T(a + b);  // ncclSum, ncclAvg (pre-multiplied or divided at the end)
    }
}

// ncclAvg, as NCCL computes it: for floating types a pre-multiplied sum (every rank's value
// times 1/n rounded to the element type, each product rounded, then summed), for integers the
// sum divided by n at the end (truncating). (NCCL's enqueue maps ncclAvg to its PreMulSum
// device op with the scalar 1.0/nRanks converted to the element type for floats, and to
// SumPostDiv for integers.)
template <class T>
void reduce_plain(uint8_t* out, const uint8_t* const* in, int n, size_t len, int op) {
    constexpr bool kFloat = std::is_floating_point_v<T>;
    const bool premul = kFloat && op == ncclAvg;
    const T scale = kFloat ? T(1.0 / double(n)) : T(1);
    for (size_t i = 0; i < len; ++i) {
        T acc;
        std::memcpy(&acc, in[0] + i * sizeof(T), sizeof(T));
        if (premul) acc = T(acc * scale);
        for (int p = 1; p < n; ++p) {
            T x;
            std::memcpy(&x, in[p] + i * sizeof(T), sizeof(T));
            if constexpr (std::is_integral_v<T>) {
                using W = std::make_unsigned_t<T>;
                // Wrapping sums and products, as the GPU's integer arithmetic.
                if (op == ncclSum || op == ncclAvg) acc = T(W(acc) + W(x));
                else if (op == ncclProd) acc = T(W(acc) * W(x));
                else acc = combine(acc, x, op);
            } else {
                if (premul) x = T(x * scale);
                acc = combine(acc, x, op);
            }
        }
        if (!kFloat && op == ncclAvg) acc = T(acc / T(n));  // SumPostDiv: truncating division
        std::memcpy(out + i * sizeof(T), &acc, sizeof(T));
    }
}

// f16 and bf16: each step of the reduction rounded to the type; ncclAvg pre-multiplies each
// value by 1/n rounded to the type, the product rounded to the type (the product of two
// 16-bit values is exact in f32, so rounding it once is the correctly rounded 16-bit product).
template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void reduce_16(uint8_t* out, const uint8_t* const* in, int n, size_t len, int op) {
    const float scale = Load(Store(float(1.0 / double(n))));
    auto value = [&](const uint8_t* p) {
        uint16_t b;
        std::memcpy(&b, p, 2);
        float v = Load(b);
        return op == ncclAvg ? Load(Store(v * scale)) : v;
    };
    for (size_t i = 0; i < len; ++i) {
        float acc = value(in[0] + 2 * i);
        for (int p = 1; p < n; ++p) acc = Load(Store(combine(acc, value(in[p] + 2 * i), op)));
        uint16_t r = Store(acc);
        std::memcpy(out + 2 * i, &r, 2);
    }
}

void reduce(int dtype, uint8_t* out, const uint8_t* const* in, int n, size_t len, int op) {
    switch (dtype) {
        case ncclInt8: return reduce_plain<int8_t>(out, in, n, len, op);
        case ncclUint8: return reduce_plain<uint8_t>(out, in, n, len, op);
        case ncclInt32: return reduce_plain<int32_t>(out, in, n, len, op);
        case ncclUint32: return reduce_plain<uint32_t>(out, in, n, len, op);
        case ncclInt64: return reduce_plain<int64_t>(out, in, n, len, op);
        case ncclUint64: return reduce_plain<uint64_t>(out, in, n, len, op);
        case ncclFloat32: return reduce_plain<float>(out, in, n, len, op);
        case ncclFloat64: return reduce_plain<double>(out, in, n, len, op);
        case ncclFloat16: return reduce_16<gemm::half_to_float, gemm::float_to_half>(out, in, n, len, op);
        case ncclBfloat16: return reduce_16<gemm::bf16_to_float, gemm::float_to_bf16>(out, in, n, len, op);
    }
}

// Blocks until the communicator stops (abort or asynchronous error): an injected fault.
void block(Comm* c) { nccl::wait_until(c, [] { return false; }, true); }

// One step `g` of this rank: post `len` bytes (may be 0), wait for every peer's post of the same
// step, check that they issued the same collective. False when the communicator stopped.
bool post(Comm* c, const Coll& k, uint64_t g, const uint8_t* src, size_t len) {
    nccl::Header* h = c->world.h;
    // Every peer has finished reading the previous step: this rank's slot can be reused.
    if (!nccl::wait_until(c, [&] {
            for (int p = 0; p < c->nranks; ++p)
                if (h->slots[p].consumed.load(std::memory_order_acquire) + 1 < g) return false;
            return true;
        }, true))
        return false;
    nccl::Slot& me = h->slots[c->rank];
    if (len) std::memcpy(c->world.data + size_t(c->rank) * nccl::kChunk, src, len);
    me.call.store(k.call);
    me.kind.store(k.kind);
    me.dtype.store(k.dtype);
    me.op.store(k.op);
    me.root.store(k.root);
    me.count.store(k.count);
    me.posted.store(g, std::memory_order_release);
    if (!nccl::wait_until(c, [&] {
            for (int p = 0; p < c->nranks; ++p)
                if (h->slots[p].posted.load(std::memory_order_acquire) < g) return false;
            return true;
        }, true))
        return false;
    for (int p = 0; p < c->nranks; ++p) {
        const nccl::Slot& s = h->slots[p];
        if (s.kind.load() != k.kind || s.dtype.load() != k.dtype || s.count.load() != k.count ||
            s.op.load() != k.op || s.root.load() != k.root) {
            // Real NCCL does not compare: it hangs or produces garbage. The simulation says so
            // once and then hangs (until abort), so that no result is ever taken from it.
            sim::log("nccl: rank %d's collective #%" PRIu64 " is %s(count %zu, type %d, op %d, root %d) but rank %d's is %s(count %" PRIu64 ", type %d, op %d, root %d): hanging, as NCCL may",
                     c->rank, k.call, kind_name(k.kind), k.count, k.dtype, k.op, k.root, p,
                     kind_name(s.kind.load()), s.count.load(), s.dtype.load(), s.op.load(), s.root.load());
            block(c);
            return false;
        }
    }
    return true;
}

void consumed(Comm* c, uint64_t g) {
    c->world.h->slots[c->rank].consumed.store(g, std::memory_order_release);
}

// The end of collective `k`'s task, run or stopped: the next one may start, and abort,
// finalize and destroy, which wait for every issued collective, count it.
void end_task(Comm* c, const Coll& k) {
    uint64_t next = k.call;  // stopped tasks may end out of order
    while (next < k.call + 1 && !c->done.compare_exchange_weak(next, k.call + 1)) {
    }
    c->finished.fetch_add(1);
}

// The injected `kernel-fault`: collective K's kernel faults at its start, once the rank has
// issued collective K + 1 (queued behind it, so that the fault lies under work the program
// still waits for), or after a second: the context's error becomes sticky, as after an
// illegal address, and K never meets its peers.
bool kernel_fault(Comm* c, const Coll& k, sim::Stream* s) {
    if (!nccl::find_fault("kernel-fault", c->rank, long(k.call))) return false;
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (c->issued.load() <= k.call + 1 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    sim::set_sticky(s->ctx, CUDA_ERROR_ILLEGAL_ADDRESS,
                    std::string("injected kernel-fault: ") + kind_name(k.kind) + " #" +
                        std::to_string(k.call) + " of rank " + std::to_string(c->rank) +
                        " faulted on its stream");
    return true;
}

// The stream task of collective `k` on stream `s`, `turn` its place on the device.
void run(Comm* c, const Coll& k, sim::Stream* s, const nccl::DeviceTurn& turn) {
    // A communicator's collectives run in the order they were issued, whatever their streams
    // (and in the `device` progress mode, every communicator's of the device).
    bool go = nccl::wait_until(c, [&] { return c->done.load() == k.call; }, true) && turn.wait(c);
    if (go && nccl::find_fault("skip", c->rank, long(k.call))) block(c);
    go = go && !c->aborted && !kernel_fault(c, k, s);
    const size_t es = type_size(k.dtype), per = nccl::kChunk / es;
    const int n = c->nranks, r = c->rank;
    const size_t total = k.kind == kReduceScatter ? k.count * size_t(n) : k.count;
    const uint8_t* slots[nccl::kMaxRanks];
    for (int p = 0; p < n; ++p) slots[p] = c->world.data + size_t(p) * nccl::kChunk;
    bool hang = nccl::find_fault("hang", r, long(k.call)) != nullptr;
    size_t lo = 0;
    for (; go && lo < total; lo += per) {
        size_t hi = std::min(total, lo + per), len = hi - lo;
        uint64_t g = ++c->steps;
        bool sends = k.kind != kBroadcast || r == k.root;
        if (!post(c, k, g, sends ? k.send + lo * es : nullptr, sends ? len * es : 0)) break;
        if (hang) {
            block(c);
            break;
        }
        switch (k.kind) {
            case kAllReduce: reduce(k.dtype, k.recv + lo * es, slots, n, len, k.op); break;
            case kBroadcast: std::memcpy(k.recv + lo * es, slots[k.root], len * es); break;
            case kAllGather:
                for (int p = 0; p < n; ++p)
                    std::memcpy(k.recv + (size_t(p) * k.count + lo) * es, slots[p], len * es);
                break;
            case kReduceScatter: {
                size_t a = std::max(lo, size_t(r) * k.count), b = std::min(hi, size_t(r + 1) * k.count);
                if (a < b) {
                    const uint8_t* part[nccl::kMaxRanks];
                    for (int p = 0; p < n; ++p) part[p] = slots[p] + (a - lo) * es;
                    reduce(k.dtype, k.recv + (a - size_t(r) * k.count) * es, part, n, b - a, k.op);
                }
                break;
            }
        }
        consumed(c, g);
    }
    // Stopped (abort, asynchronous error, fault) after `lo` elements: the output is damaged.
    if (lo < total) nccl::damage({k.kind, k.dtype, n, r, k.count, k.send, k.recv}, lo);
    turn.end();
    end_task(c, k);
}

// Whether a non-blocking communicator's enqueue of `k` returns ncclInProgress: always for the
// first collective of its kind and type (its connections), otherwise one in
// `nccl::in_progress_rate()`, decided by the seed, the rank and the collective's number.
bool in_progress(Comm* c, const Coll& k) {
    unsigned key = unsigned(k.kind) * 10 + unsigned(k.dtype);  // dtype < 10, checked at issue
    if (key < 64 && !(c->connected & (1ull << key))) {
        c->connected |= 1ull << key;
        return true;
    }
    unsigned rate = nccl::in_progress_rate();
    if (rate == 0) return false;
    uint64_t h = nccl::mix64(nccl::in_progress_seed() ^ nccl::mix64(uint64_t(c->rank) << 32 ^ k.call));
    return h % rate == 0;
}

ncclResult_t issue(Coll k, Comm* c, CUstream stream) {
    const char* call = kind_name(k.kind);
    if (ncclResult_t r = nccl::enter(c, call)) return r;
    struct Leave {
        Comm* c;
        ~Leave() { nccl::leave(c); }
    } leave{c};
    if (c->finalizing)
        return nccl::fail(ncclInvalidUsage, "%s: the communicator was finalized (ncclCommFinalize): only ncclCommDestroy may follow", call);
    size_t es = type_size(k.dtype);
    if (!es) return nccl::fail(ncclInvalidArgument, "%s: data type %d is not simulated", call, k.dtype);
    if (k.kind != kBroadcast && k.kind != kAllGather && (k.op < ncclSum || k.op > ncclAvg))
        return nccl::fail(ncclInvalidArgument, "%s: reduction %d is not simulated", call, k.op);
    if (k.root < 0 || k.root >= c->nranks)
        return nccl::fail(ncclInvalidArgument, "%s: root %d out of range for %d ranks", call, k.root, c->nranks);
    if (const nccl::Fault* f = nccl::find_fault("sync-error", c->rank, long(c->issued.load())))
        return nccl::fail(f->code, "%s: injected synchronous error %d", call, f->code);
    sim::Context* ctx;
    sim::Stream* s;
    if (sim::stream_of(call, stream, &ctx, &s))
        return nccl::fail(ncclUnhandledCudaError, "%s: the stream is not usable in the calling thread's context", call);
    if (ctx->device != c->device)
        return nccl::fail(ncclInvalidArgument, "%s: the stream is on device %d, the communicator on device %d", call, ctx->device, c->device);
    if (k.count == 0) return ncclSuccess;  // nothing to do (and no peer to meet)
    size_t n = size_t(c->nranks);
    size_t in = k.count * es * (k.kind == kReduceScatter ? n : 1);
    size_t out = k.count * es * (k.kind == kAllGather ? n : 1);
    std::vector<sim::BufferUse> uses;
    std::string why;
    if (k.kind != kBroadcast || c->rank == k.root) {
        auto a = sim::find_range(uint64_t(uintptr_t(k.send)), in, c->device, why);
        if (!a) return nccl::fail(ncclInvalidArgument, "%s: send buffer %p (%zu bytes): %s", call, (const void*)k.send, in, why.c_str());
        uses.push_back({a, false, std::string(call) + " send buffer"});
    }
    auto d = sim::find_range(uint64_t(uintptr_t(k.recv)), out, c->device, why);
    if (!d) return nccl::fail(ncclInvalidArgument, "%s: receive buffer %p (%zu bytes): %s", call, (void*)k.recv, out, why.c_str());
    if (k.kind != kBroadcast || c->rank == k.root) {
        // The in-place forms of the User Guide ("In-place Operations"): one buffer for an
        // all-reduce or a broadcast; the receive buffer at this rank's offset in the send
        // buffer for a reduce-scatter, the send buffer at this rank's offset in the receive
        // buffer for an all-gather. The guide defines no other overlap: refused.
        uint64_t s0 = uint64_t(uintptr_t(k.send)), r0 = uint64_t(uintptr_t(k.recv));
        uint64_t at = uint64_t(c->rank) * k.count * es;
        bool in_place = k.kind == kReduceScatter ? r0 == s0 + at
                        : k.kind == kAllGather   ? s0 == r0 + at
                                                 : s0 == r0;
        if (s0 < r0 + out && r0 < s0 + in && !in_place)
            return nccl::fail(ncclInvalidArgument, "%s: send buffer %p (%zu bytes) and receive buffer %p (%zu bytes) overlap, but not in an in-place form", call, (const void*)k.send, in, (void*)k.recv, out);
    }
    uses.push_back({d, true, std::string(call) + " receive buffer"});
    k.call = c->issued.load();
    const nccl::Fault* err = nccl::find_fault("async-error", c->rank, long(k.call));
    // The injected error is raised before the collective is enqueued, so that the collective
    // itself never completes (it waits for the abort, as every collective after an asynchronous
    // error does): raised after, the stream could run it to completion first, and the fault
    // would sometimes hit nothing.
    if (err) nccl::set_async(c, err->code, "injected asynchronous error at collective #" + std::to_string(k.call));
    const nccl::DeviceTurn turn(c->device);
    sim::Op op;
    op.kind = "launch";
    op.run = [c, k, s, turn] { run(c, k, s, turn); };
    // Dropped after a sticky CUDA error (the stream runs nothing more): the task still ends,
    // or abort, finalize and destroy (and the device's later collectives) would wait for it
    // forever.
    op.dropped = [c, k, turn] {
        turn.end();
        end_task(c, k);
    };
    sim::count(s, &sim::Counts::launches);
    sim::log_launch(call);
    if (CUresult r = sim::enqueue(s, std::move(op), uses)) {
        // A race report: the operation is queued all the same (the context's error is now
        // sticky, so it will be dropped, ending its turn and its task): it counts as issued.
        c->issued.fetch_add(1);
        return nccl::fail(ncclUnhandledCudaError, "%s: enqueue failed (CUDA error %d)", call, r);
    }
    c->issued.fetch_add(1);
    if (err && err->stall_ms) sim::stall_next_driver_call(err->stall_ms);
    // A non-blocking communicator may finish any enqueue in the background (NCCL ends every
    // enqueue with the communicator's asynchronous state, and connects lazily): the first
    // collective of each kind and type, and others at random (GPU_SIM_NCCL_INPROGRESS).
    if (!c->blocking && in_progress(c, k)) {
        nccl::start_job(c, [] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); });
        return ncclInProgress;
    }
    return ncclSuccess;
}

}  // namespace

extern "C" {

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t op, Comm* c, CUstream stream) {
    return issue({kAllReduce, t, op, 0, count, (const uint8_t*)send, (uint8_t*)recv, 0}, c, stream);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root,
                           Comm* c, CUstream stream) {
    return issue({kBroadcast, t, 0, root, count, (const uint8_t*)send, (uint8_t*)recv, 0}, c, stream);
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t t, Comm* c,
                           CUstream stream) {
    return issue({kAllGather, t, 0, 0, count, (const uint8_t*)send, (uint8_t*)recv, 0}, c, stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t op, Comm* c, CUstream stream) {
    return issue({kReduceScatter, t, op, 0, count, (const uint8_t*)send, (uint8_t*)recv, 0}, c, stream);
}

}  // extern "C"
