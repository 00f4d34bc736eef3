// The simulated NCCL's communicator life: version, unique id, init (blocking or not, inside a
// group or not), state queries, split, finalize, destroy, abort and error strings.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <random>
#include <vector>

#include "nccl_sim.h"

using nccl::Comm;

namespace nccl {
const char* last_error();
}

namespace {

constexpr char kIdMagic[8] = {'G', 'S', 'N', 'C', 'C', 'L', '0', '1'};

thread_local int t_group_depth = 0;
thread_local std::vector<Comm*> t_group_inits;

using nccl::mix64;

// The init job: arrive, then wait for every rank (forever, unless aborted).
void init_job(Comm* c) {
    if (nccl::find_fault("init-never", c->rank, -1)) {
        nccl::wait_until(c, [] { return false; });
        return;
    }
    if (nccl::join(c)) nccl::wait_until(c, [c] { return nccl::all_joined(c); });
}

// Blocking calls wait for their job; a non-blocking one reports that it is in progress.
ncclResult_t finish_or_progress(Comm* c) {
    if (!c->blocking) return ncclInProgress;
    nccl::join_job(c);
    return c->async_error.load();
}

Comm* new_comm(uint64_t key, int nranks, int rank, int device, bool blocking) {
    auto* c = new Comm;  // never freed: a destroyed handle stays recognisable (quarantine)
    c->key = key;
    c->nranks = nranks;
    c->rank = rank;
    c->device = device;
    c->blocking = blocking;
    c->busy = true;  // until its init job has run
    nccl::register_comm(c);
    return c;
}

// The mode a config asks for, after NCCL_COMM_BLOCKING (which NCCL applies over it).
ncclResult_t config_blocking(const ncclConfigPrefix* config, bool* blocking) {
    int b = NCCL_CONFIG_UNDEF_INT;
    if (config) {
        if (config->magic != NCCL_CONFIG_MAGIC || config->size < offsetof(ncclConfigPrefix, cgaClusterSize))
            return nccl::fail(ncclInvalidArgument,
                              "ncclCommInitRankConfig: config with magic 0x%x and size %zu is not an ncclConfig_t (NCCL_CONFIG_INITIALIZER sets magic 0xcafebeef)",
                              config->magic, config->size);
        b = config->blocking;
    }
    int env = nccl::blocking_override();
    if (env >= 0) b = env;
    *blocking = b != 0;  // undefined: NCCL's default, blocking
    return ncclSuccess;
}

// The release: the communicator leaves its world (the last one out removes the name).
void leave_world(Comm* c) {
    if (!c->world.h) return;
    c->world.h->slots[c->rank].gone.store(1);
    if (c->world.h->refs.fetch_sub(1) == 1) nccl::unlink_world(c->world);
}

// Whether every collective issued on `c` has run (or stopped) on its stream.
bool own_work_done(Comm* c) { return c->finished.load() >= c->issued.load(); }

// Waits until every collective issued on `c` has run (or stopped) on its stream.
void drain(Comm* c) {
    while (c->finished.load() < c->issued.load())
        std::this_thread::sleep_for(std::chrono::microseconds(200));
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
    if (!version) return nccl::fail(ncclInvalidArgument, "ncclGetVersion: null pointer");
    *version = nccl::reported_version();
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    if (!id) return nccl::fail(ncclInvalidArgument, "ncclGetUniqueId: null pointer");
    nccl::init_env();
    std::memset(id->internal, 0, sizeof id->internal);
    std::memcpy(id->internal, kIdMagic, 8);
    std::random_device rd;
    uint64_t key = (uint64_t(rd()) << 32) ^ rd() ^ mix64(uint64_t(getpid()));
    std::memcpy(id->internal + 8, &key, 8);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(Comm** out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfigPrefix* config) {
    const char* call = "ncclCommInitRankConfig";
    if (!out) return nccl::fail(ncclInvalidArgument, "%s: null communicator pointer", call);
    *out = nullptr;
    if (nranks < 1 || nranks > nccl::kMaxRanks)
        return nccl::fail(ncclInvalidArgument, "%s: nranks %d (the simulation takes 1 to %d)", call, nranks, nccl::kMaxRanks);
    if (rank < 0 || rank >= nranks)
        return nccl::fail(ncclInvalidArgument, "%s: rank %d out of range for nranks %d", call, rank, nranks);
    if (std::memcmp(id.internal, kIdMagic, 8) != 0)
        return nccl::fail(ncclInvalidArgument, "%s: the id was not made by ncclGetUniqueId", call);
    sim::Context* ctx = sim::current_context();
    if (!ctx) return nccl::fail(ncclUnhandledCudaError, "%s: the calling thread has no current CUDA context (the rank's GPU)", call);
    bool blocking;
    if (ncclResult_t r = config_blocking(config, &blocking)) return r;
    uint64_t key;
    std::memcpy(&key, id.internal + 8, 8);
    Comm* c = new_comm(key, nranks, rank, ctx->device, blocking);
    *out = c;
    if (t_group_depth > 0) {
        t_group_inits.push_back(c);  // started by the outermost ncclGroupEnd
        return ncclSuccess;
    }
    nccl::start_job(c, [c] { init_job(c); });
    return finish_or_progress(c);
}

ncclResult_t ncclCommInitRank(Comm** out, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(out, nranks, id, rank, nullptr);
}

ncclResult_t ncclGroupStart() {
    ++t_group_depth;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    if (t_group_depth == 0) return nccl::fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--t_group_depth > 0) return ncclSuccess;
    std::vector<Comm*> inits;
    inits.swap(t_group_inits);
    size_t blocking = 0;
    for (Comm* c : inits) blocking += c->blocking;
    if (blocking != 0 && blocking != inits.size()) {
        for (Comm* c : inits) nccl::set_async(c, ncclInvalidArgument, "blocking and non-blocking communicators in one group");
        return nccl::fail(ncclInvalidArgument, "ncclGroupEnd: blocking and non-blocking communicators in one group");
    }
    for (Comm* c : inits) nccl::start_job(c, [c] { init_job(c); });
    if (inits.empty()) return ncclSuccess;
    if (!blocking) return ncclInProgress;
    ncclResult_t first = ncclSuccess;
    for (Comm* c : inits) {
        nccl::join_job(c);
        if (!first) first = c->async_error.load();
    }
    return first;
}

ncclResult_t ncclCommGetAsyncError(Comm* c, ncclResult_t* out) {
    if (!nccl::live(c)) return nccl::fail(ncclInvalidArgument, "ncclCommGetAsyncError: %p is not a live communicator", (void*)c);
    if (!out) return nccl::fail(ncclInvalidArgument, "ncclCommGetAsyncError: null pointer");
    if (int e = c->async_error.load()) *out = e;
    else *out = c->busy.load() ? ncclInProgress : ncclSuccess;
    return ncclSuccess;
}

const char* ncclGetLastError(Comm*) { return nccl::last_error(); }

const char* ncclGetErrorString(ncclResult_t code) {
    switch (code) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
        case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
        case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
        case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
        case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
        case ncclRemoteError: return "remote process exited or there was a network error";
        case ncclInProgress: return "NCCL operation in progress";
        default: return "unknown result code";
    }
}

ncclResult_t ncclCommCount(const Comm* c, int* count) {
    if (!nccl::live(c) || !count) return nccl::fail(ncclInvalidArgument, "ncclCommCount: bad argument");
    *count = c->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const Comm* c, int* rank) {
    if (!nccl::live(c) || !rank) return nccl::fail(ncclInvalidArgument, "ncclCommUserRank: bad argument");
    *rank = c->rank;
    return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const Comm* c, int* device) {
    if (!nccl::live(c) || !device) return nccl::fail(ncclInvalidArgument, "ncclCommCuDevice: bad argument");
    *device = c->device;
    return ncclSuccess;
}

ncclResult_t ncclCommSplit(Comm* c, int color, int key, Comm** out, ncclConfigPrefix* config) {
    const char* call = "ncclCommSplit";
    if (ncclResult_t r = nccl::enter(c, call)) return r;
    struct Leave {
        Comm* c;
        ~Leave() { nccl::leave(c); }
    } leave{c};
    if (!out) return nccl::fail(ncclInvalidArgument, "%s: null communicator pointer", call);
    if (c->finalizing)
        return nccl::fail(ncclInvalidUsage, "%s: the communicator was finalized (ncclCommFinalize)", call);
    if (color < NCCL_SPLIT_NOCOLOR)
        return nccl::fail(ncclInvalidArgument, "%s: color %d (a color is >= 0, or NCCL_SPLIT_NOCOLOR)", call, color);
    bool blocking = c->blocking;
    if (config && config_blocking(config, &blocking)) return ncclInvalidArgument;
    if (const nccl::Fault* f = nccl::find_fault("split-error", c->rank, long(c->splits)))
        return nccl::fail(f->code, "%s: injected error %d at split #%llu", call, f->code, (unsigned long long)c->splits);
    uint64_t n = c->splits++;
    nccl::Slot& me = c->world.h->slots[c->rank];
    me.split_color[n % 4].store(color);
    me.split_key[n % 4].store(key);
    me.splits.store(n + 1);
    nccl::start_job(c, [c, n, color, key, out, blocking] {
        Comm* child = nullptr;
        bool all = nccl::wait_until(c, [c, n] {
            for (int p = 0; p < c->nranks; ++p)
                if (c->world.h->slots[p].splits.load() < n + 1) return false;
            return true;
        });
        if (all && color != NCCL_SPLIT_NOCOLOR) {
            // Members: the ranks of this color, ordered by (key, parent rank).
            std::vector<std::pair<int, int>> members;
            for (int p = 0; p < c->nranks; ++p) {
                const nccl::Slot& s = c->world.h->slots[p];
                if (s.split_color[n % 4].load() == color) members.push_back({s.split_key[n % 4].load(), p});
            }
            std::sort(members.begin(), members.end());
            int new_rank = 0;
            while (members[new_rank].second != c->rank) ++new_rank;
            uint64_t child_key = mix64(c->key ^ mix64(n + 1) ^ mix64(uint64_t(uint32_t(color)) << 20));
            child = new_comm(child_key, int(members.size()), new_rank, c->device, blocking);
            // NCCL initialises the child inside the split's job: it is ready when the parent is.
            // (Waited for under the parent's conditions: aborting the parent ends it.)
            bool ready = nccl::join(child) &&
                         nccl::wait_until(c, [child] { return nccl::all_joined(child); });
            child->busy = false;
            if (!ready || child->async_error.load()) {
                if (!c->aborted) nccl::set_async(c, ncclInternalError, "the split's child failed to start");
                nccl::unregister_comm(child);
                leave_world(child);
                child = nullptr;
            }
        }
        (void)key;
        // Written from this job's thread before the parent's result is published.
        __atomic_store_n(out, child, __ATOMIC_RELEASE);
    });
    return finish_or_progress(c);
}

ncclResult_t ncclCommFinalize(Comm* c) {
    if (ncclResult_t r = nccl::enter(c, "ncclCommFinalize")) return r;
    c->finalizing = true;
    // Done once this rank's own collectives have run: NCCL's finalize synchronises the
    // communicator's streams, with no barrier between ranks.
    nccl::start_job(c, [c] { nccl::wait_until(c, [c] { return own_work_done(c); }); });
    ncclResult_t r = finish_or_progress(c);
    nccl::leave(c);
    return r;
}

ncclResult_t ncclCommDestroy(Comm* c) {
    if (!nccl::live(c)) return nccl::fail(ncclInvalidArgument, "ncclCommDestroy: %p is not a live communicator", (void*)c);
    if (c->busy.load())
        return nccl::fail(ncclInvalidUsage, "ncclCommDestroy: a call is still in progress (poll ncclCommGetAsyncError until ncclSuccess first)");
    if (!c->finalizing) {
        // Without ncclCommFinalize, NCCL finalizes here, blocking: it waits for this rank's
        // own collectives (which may wait for peers), never for the peers' destroy.
        c->finalizing = true;
        nccl::wait_until(c, [c] { return own_work_done(c); });
    }
    nccl::unregister_comm(c);
    nccl::join_job(c);
    leave_world(c);
    nccl::unmap_world(c->world);
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(Comm* c) {
    if (!nccl::live(c)) return nccl::fail(ncclInvalidArgument, "ncclCommAbort: %p is not a live communicator", (void*)c);
    nccl::unregister_comm(c);
    c->aborted = true;
    nccl::join_job(c);  // the job sees the abort and ends
    drain(c);           // queued collectives stop without writing their outputs
    leave_world(c);
    nccl::unmap_world(c->world);
    return ncclSuccess;
}

}  // extern "C"
