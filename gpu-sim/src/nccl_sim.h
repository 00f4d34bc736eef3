// The simulated NCCL's internals: the C types of nccl.h that the entry points take, the
// shared-memory "world" through which the ranks of one communicator meet (threads of one
// process and separate processes alike), communicators, waits, and injected faults.
// nccl_world.cpp holds the world and the faults, nccl_comm.cpp the communicator's life
// (init, groups, split, finalize, destroy, abort), nccl_coll.cpp the collectives.
// README.md beside this folder lists the rules and where each comes from.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "sim.h"

// nccl.h's types, with its values (written from nccl.h's declarations).
typedef int ncclResult_t;
enum : int {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};
typedef int ncclDataType_t;
enum : int {
    ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
    ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9,
};
typedef int ncclRedOp_t;
enum : int { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };
struct ncclUniqueId {
    char internal[128];
};
// The fields of ncclConfig_t up to NCCL 2.17's (the prefix every later version keeps).
struct ncclConfigPrefix {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char* netName;
};
constexpr int NCCL_SPLIT_NOCOLOR = -1;
constexpr unsigned NCCL_CONFIG_MAGIC = 0xcafebeef;
constexpr int NCCL_CONFIG_UNDEF_INT = INT32_MIN;

namespace nccl {

enum CollKind : int { kAllReduce = 1, kBroadcast, kAllGather, kReduceScatter };

// Bytes per element of an NCCL data type; 0 for a type the simulation does not know.
inline size_t type_size(int t) {
    switch (t) {
        case ncclInt8: case ncclUint8: return 1;
        case ncclFloat16: case ncclBfloat16: return 2;
        case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
        case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
        default: return 0;
    }
}

// A collective stopped before completing (an abort, an asynchronous error, a fault), after
// `done` elements of its loop (nccl_damage.cpp): its output is scribbled as
// GPU_SIM_NCCL_ABORT_DAMAGE says (default: the completed steps stay, the rest holds half of
// this rank's own contribution; `finite`, `nan`, `none`).
struct Interrupted {
    int kind, dtype, nranks, rank;
    size_t count;
    const uint8_t* send;
    uint8_t* recv;
};
void damage(const Interrupted& k, size_t done);

constexpr int kMaxRanks = 64;
constexpr size_t kChunk = 256 * 1024;  // bytes each rank posts per step of a collective

// One rank's part of a world, in shared memory. Written by that rank, read by every rank.
struct alignas(64) Slot {
    std::atomic<uint32_t> joined;     // 1 once the rank has arrived at init
    std::atomic<int32_t> pid;
    std::atomic<int32_t> device;
    std::atomic<uint64_t> host;       // the host's identity (host_identity in nccl_world.cpp)
    std::atomic<uint32_t> gone;       // 1 once aborted or destroyed
    std::atomic<uint64_t> posted;     // steps whose data this rank has posted
    std::atomic<uint64_t> consumed;   // steps this rank has finished reading
    // The collective the posted step belongs to (compared between ranks).
    std::atomic<uint64_t> call;
    std::atomic<int32_t> kind, dtype, op, root;
    std::atomic<uint64_t> count;
    // ncclCommSplit: how many this rank has called, and its (color, key) for each, in a ring.
    std::atomic<uint64_t> splits;
    std::atomic<int32_t> split_color[4], split_key[4];
};
struct Header {
    std::atomic<int32_t> nranks;  // set by the first rank to arrive
    std::atomic<int32_t> refs;    // ranks mapped and not yet gone
    Slot slots[kMaxRanks];
};

// A world's mapping in this process (each rank maps it, threads included).
struct World {
    Header* h = nullptr;
    uint8_t* data = nullptr;  // kChunk bytes per rank
    size_t len = 0;
    std::string name;
};
// Maps the world of `key` for `nranks` ranks, creating it when first. Error text in `why`.
ncclResult_t map_world(uint64_t key, int nranks, World* w, std::string& why);
// Removes the name (every rank has it mapped, or it is being left): later ranks cannot join.
void unlink_world(const World& w);
void unmap_world(World& w);
// Whether the process `pid` has exited (a zombie counts as exited).
bool process_gone(int pid);

// ------------------------------------------------------------------------------- faults
// GPU_SIM_NCCL_FAULTS, read once: `kind[:key=value,...]` items separated by `;` (see README).
struct Fault {
    std::string kind;
    int rank = -1;    // -1: every rank
    long call = -1;   // the communicator's collective number (0-based); -1: any
    int code = ncclRemoteError;
    int stall_ms = 0;
};
// The fault of `kind` for `rank` at collective `call` (call -1 matches a fault with no call).
const Fault* find_fault(const char* kind, int rank, long call);
int reported_version();  // 22703 unless `version=N` is injected
// GPU_SIM_NCCL_INPROGRESS, read once: a non-blocking communicator's enqueue returns
// ncclInProgress for the first collective of each kind and type and, beyond that, for one in
// `in_progress_rate()` (0: never) chosen by `in_progress_seed()`. Unset: seed 0, one in 4;
// `first`: the first of each kind and type only; `random:SEED` or `random:SEED:RATE`.
unsigned in_progress_rate();
uint64_t in_progress_seed();
// splitmix64's finaliser: ids, split keys and seeded choices.
inline uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
// NCCL's start-up reading of its configuration files, once per process, at the first call
// that initialises NCCL (ncclGetUniqueId, a communicator's init): the lines of NCCL_CONF_FILE
// (when set and not empty; else $HOME/.nccl.conf), then of /etc/nccl.conf, go into the
// environment without overwriting what is there.
void init_env();
// NCCL_COMM_BLOCKING as NCCL finds it after init_env(), read once per process and parsed as
// NCCL parses an integer parameter (strtoll, base 0; empty or out of range: unset); or the
// injected `blocking`. -1 when unset, else 0 or 1.
int blocking_override();

// GPU_SIM_NCCL_PROGRESS, read once (nccl_progress.cpp): `shared` (default) lets every
// communicator of a device progress on its own, as a GPU with free multiprocessors usually
// does; `device` runs at most one collective at a time per device, across all its
// communicators, in the order the host issued them (NCCL's kernels block their
// multiprocessors while they wait for peers, and the User Guide's "Using multiple NCCL
// communicators concurrently" promises nothing else).
bool device_progress();
struct Comm;
// A collective's place in its device's issue order (taken at issue, in the `device` mode; a
// no-op otherwise). `end` must follow exactly once, whether the task ran, stopped or was
// dropped.
struct DeviceTurn {
    int device = 0;
    uint64_t ticket = 0;
    bool held = false;
    DeviceTurn() = default;
    explicit DeviceTurn(int device);
    // Waits until every collective issued before this one on the device has ended; false when
    // the communicator was aborted first.
    bool wait(Comm* c) const;
    void end() const;
};

// ---------------------------------------------------------------------------- communicators
struct Comm {
    uint64_t key = 0;
    int rank = 0, nranks = 0, device = 0;
    bool blocking = true;
    World world;
    // Non-blocking state: a background job in progress (init, split, finalize, connect).
    std::atomic<bool> busy{false};
    std::thread job;
    std::atomic<int> async_error{ncclSuccess};
    std::mutex m;            // guards `why` and `job`
    std::string why;         // the async error's text
    std::atomic<bool> aborted{false};
    std::atomic<int> inside{0};        // host threads inside a call (more than one: misuse)
    std::atomic<bool> joined{false};   // this rank has arrived in its world
    bool finalizing = false;           // ncclCommFinalize was called: no more collectives
    uint64_t connected = 0;            // (kind, type) pairs whose "connections" were made
    uint64_t splits = 0;
    // Collectives: numbered at issue; stream tasks run in that order, one at a time.
    // `done`: the next collective allowed to run; `finished`: tasks that have ended (run or
    // stopped), for abort and finalize.
    std::atomic<uint64_t> issued{0}, done{0}, finished{0};
    uint64_t steps = 0;                // steps of this rank (touched by the running task only)
};

// Whether `c` is a live communicator of this process (not destroyed or aborted).
bool live(const Comm* c);
void register_comm(Comm* c);
void unregister_comm(Comm* c);

// Records `code` with its text as the call's error (ncclGetLastError), logs it, returns it.
ncclResult_t fail(ncclResult_t code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// Makes `code` the communicator's asynchronous error (the first one stays).
void set_async(Comm* c, int code, const std::string& why);
// Polls `cond` until it holds (true) or the communicator stops (false). A peer process that
// exited becomes the asynchronous error ncclRemoteError. A background job stops on an abort
// or an asynchronous error; a collective on the stream (`task`) only on an abort: after an
// error, as in NCCL, its kernel waits (without progress) until the communicator is aborted.
bool wait_until(Comm* c, const std::function<bool()>& cond, bool task = false);
// Arrives in the world (maps it, claims the rank's slot); false on an error (set async).
bool join(Comm* c);
// Whether every rank of the world has arrived; on the first success the name is unlinked.
bool all_joined(Comm* c);
// Starts `body` as the communicator's background job (busy until it returns).
void start_job(Comm* c, std::function<void()> body);
void join_job(Comm* c);

// The entry points' common start: a live, ready communicator entered by one thread. Returns
// ncclSuccess (and the caller must call `leave`) or the error.
ncclResult_t enter(Comm* c, const char* call);
void leave(Comm* c);

}  // namespace nccl
