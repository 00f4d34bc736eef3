// The emulator's runtime: fibers, the block scheduler, warp operations and the C launch API
// used by tests/kernels_emulated.rs. See cuda_emu.h for what it models and what it cannot.
#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "cuda_emu.h"

namespace emu {

namespace {

constexpr size_t kStack = 256 * 1024;

enum class State { Ready, Barrier, Warp, Done };
enum class WarpOp { Sync, Shfl, Ballot };

struct KernelEntry {
    void* fn;
    Invoker invoke;
    std::string signature;
};

std::map<std::string, KernelEntry>& registry() {
    static std::map<std::string, KernelEntry> r;
    return r;
}

}  // namespace

struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    unsigned linear = 0;
    State state = State::Ready;
    // Pending warp operation.
    WarpOp op = WarpOp::Sync;
    unsigned mask = 0;
    uint64_t value = 0;
    Shfl kind = Shfl::Idx;
    int arg = 0, width = 32;
    bool pred = false;
    uint64_t result = 0;
};

namespace {

struct Launch {
    ucontext_t scheduler;
    std::vector<Fiber> fibers;
    std::vector<std::unique_ptr<char[]>> stacks;
    std::vector<unsigned char> smem;
    Fiber* cur = nullptr;
    KernelEntry kernel{};
    void** args = nullptr;
    bool failed = false;
    std::string error;
};

thread_local Launch* g_launch = nullptr;

void fiber_main() {
    Launch* l = g_launch;
    l->kernel.invoke(l->kernel.fn, l->args);
    l->cur->state = State::Done;
    swapcontext(&l->cur->ctx, &l->scheduler);
}

void yield_to_scheduler() {
    Launch* l = g_launch;
    swapcontext(&l->cur->ctx, &l->scheduler);
}

std::string where(const Fiber& f) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", block_idx.x, block_idx.y,
                  block_idx.z, f.tid.x, f.tid.y, f.tid.z);
    return buf;
}

// Resolves the warp operations whose lanes have all arrived. Returns true if any was resolved;
// fails on operations that can never complete.
bool resolve_warps(Launch& l) {
    bool any = false;
    const unsigned n = (unsigned)l.fibers.size();
    for (unsigned base = 0; base < n; base += 32) {
        const unsigned lanes = std::min(32u, n - base);
        // Find a waiting lane and check that every lane of its mask waits on the same operation.
        for (unsigned i = 0; i < lanes; i++) {
            Fiber& f = l.fibers[base + i];
            if (f.state != State::Warp) continue;
            const unsigned mask = f.mask;
            if (lanes < 32 && (mask >> lanes) != 0)
                fail(where(f) + ": warp operation mask names lanes absent from the block");
            if (((mask >> i) & 1u) == 0)
                fail(where(f) + ": warp operation mask does not include the calling lane");
            bool ready = true;
            for (unsigned j = 0; j < lanes; j++) {
                if (((mask >> j) & 1u) == 0) continue;
                const Fiber& g = l.fibers[base + j];
                if (g.state == State::Done)
                    fail(where(f) + ": warp operation mask names an exited lane " + std::to_string(j));
                if (g.state == State::Barrier)
                    fail(where(f) + ": warp operation waits for lane " + std::to_string(j) +
                         ", which waits at __syncthreads");
                if (g.state != State::Warp) {
                    ready = false;
                    continue;
                }
                if (g.op != f.op || g.mask != f.mask || (f.op == WarpOp::Shfl && g.kind != f.kind))
                    fail(where(f) + ": lanes of one mask are at different warp operations");
            }
            if (!ready) continue;
            unsigned ballot_bits = 0;
            for (unsigned j = 0; j < lanes; j++)
                if (((mask >> j) & 1u) && l.fibers[base + j].pred) ballot_bits |= 1u << j;
            for (unsigned j = 0; j < lanes; j++) {
                if (((mask >> j) & 1u) == 0) continue;
                Fiber& g = l.fibers[base + j];
                if (g.op == WarpOp::Shfl) {
                    const int w = g.width;
                    if (w <= 0 || w > 32 || (w & (w - 1)) != 0)
                        fail(where(g) + ": shuffle width must be a power of two up to 32");
                    const int lane = (int)j, seg = lane & ~(w - 1);
                    int src = lane;
                    switch (g.kind) {
                        case Shfl::Idx: src = seg + (g.arg & (w - 1)); break;
                        case Shfl::Down: src = lane + g.arg < seg + w ? lane + g.arg : lane; break;
                        case Shfl::Up: src = lane - g.arg >= seg ? lane - g.arg : lane; break;
                        case Shfl::Xor: {
                            const int x = lane ^ g.arg;
                            src = (x >= seg && x < seg + w) ? x : lane;
                            break;
                        }
                    }
                    if (src != lane && ((mask >> src) & 1u) == 0)
                        fail(where(g) + ": shuffle reads lane " + std::to_string(src) +
                             ", which is not in the mask");
                    g.result = l.fibers[base + src].value;
                } else if (g.op == WarpOp::Ballot) {
                    g.result = ballot_bits;
                }
            }
            for (unsigned j = 0; j < lanes; j++)
                if ((mask >> j) & 1u) l.fibers[base + j].state = State::Ready;
            any = true;
        }
    }
    return any;
}

bool resolve_barrier(Launch& l) {
    size_t waiting = 0, done = 0;
    for (const Fiber& f : l.fibers) {
        if (f.state == State::Barrier) waiting++;
        if (f.state == State::Done) done++;
    }
    if (waiting == 0) return false;
    if (waiting + done == l.fibers.size() && done > 0) {
        for (const Fiber& f : l.fibers)
            if (f.state == State::Barrier)
                fail(where(f) + ": __syncthreads not reached by " + std::to_string(done) +
                     " exited threads of the block");
    }
    if (waiting != l.fibers.size()) return false;
    for (Fiber& f : l.fibers) f.state = State::Ready;
    return true;
}

struct Schedule {
    enum { Forward, Reverse, Random } mode = Forward;
    uint64_t seed = 0;
};

bool parse_schedule(const char* s, Schedule& out) {
    std::string v = s ? s : "forward";
    if (v == "forward") {
        out.mode = Schedule::Forward;
    } else if (v == "reverse") {
        out.mode = Schedule::Reverse;
    } else if (v.rfind("random:", 0) == 0) {
        out.mode = Schedule::Random;
        out.seed = std::strtoull(v.c_str() + 7, nullptr, 10);
    } else {
        return false;
    }
    return true;
}

// The scheduler's own failure path: a fiber that calls fail() records the error and never
// resumes; the launch is then abandoned.
struct Abort {};

void run_block(Launch& l, const Schedule& sched, std::mt19937_64& rng) {
    const unsigned n = (unsigned)l.fibers.size();
    std::fill(l.smem.begin(), l.smem.end(), (unsigned char)0xFF);
    for (unsigned i = 0; i < n; i++) {
        Fiber& f = l.fibers[i];
        f = Fiber{};
        f.linear = i;
        f.tid = dim3(i % block_dim.x, (i / block_dim.x) % block_dim.y, i / (block_dim.x * block_dim.y));
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = l.stacks[i].get();
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
    }
    std::vector<unsigned> order(n);
    for (unsigned i = 0; i < n; i++) order[i] = i;
    for (;;) {
        if (sched.mode == Schedule::Reverse) {
            for (unsigned i = 0; i < n; i++) order[i] = n - 1 - i;
        } else if (sched.mode == Schedule::Random) {
            std::shuffle(order.begin(), order.end(), rng);
        }
        for (unsigned i : order) {
            Fiber& f = l.fibers[i];
            if (f.state != State::Ready) continue;
            l.cur = &f;
            swapcontext(&l.scheduler, &f.ctx);
            l.cur = nullptr;
            if (l.failed) throw Abort{};
        }
        bool all_done = std::all_of(l.fibers.begin(), l.fibers.end(),
                                    [](const Fiber& f) { return f.state == State::Done; });
        if (all_done) return;
        // Both throw Abort (through fail) on an operation that can never complete.
        const bool progressed = resolve_warps(l) || resolve_barrier(l);
        if (!progressed) {
            l.failed = true;
            l.error = "deadlock: no thread of block can make progress (a warp operation or "
                      "barrier that can never complete)";
            throw Abort{};
        }
    }
}

}  // namespace

thread_local dim3 block_idx, block_dim, grid_dim;

Fiber* current() { return g_launch ? g_launch->cur : nullptr; }

const dim3& thread_idx() {
    static thread_local dim3 host(0, 0, 0);
    Fiber* f = current();
    return f ? f->tid : host;
}

void* dynamic_smem() { return g_launch->smem.data(); }

[[noreturn]] void fail(const std::string& why) {
    Launch* l = g_launch;
    if (!l->failed) {
        l->failed = true;
        l->error = why;
    }
    if (l->cur) {
        // Never resumed: the scheduler abandons the launch.
        swapcontext(&l->cur->ctx, &l->scheduler);
    }
    // Called from the scheduler itself.
    throw Abort{};
}

void syncthreads() {
    Fiber* f = current();
    f->state = State::Barrier;
    yield_to_scheduler();
}

static uint64_t warp_op(WarpOp op, unsigned mask, uint64_t value, Shfl kind, int arg, int width,
                        bool pred) {
    Fiber* f = current();
    f->op = op;
    f->mask = mask;
    f->value = value;
    f->kind = kind;
    f->arg = arg;
    f->width = width;
    f->pred = pred;
    f->state = State::Warp;
    yield_to_scheduler();
    return f->result;
}

void syncwarp(unsigned mask) { warp_op(WarpOp::Sync, mask, 0, Shfl::Idx, 0, 32, false); }

uint64_t shfl(unsigned mask, uint64_t value, Shfl kind, int arg, int width) {
    return warp_op(WarpOp::Shfl, mask, value, kind, arg, width, false);
}

unsigned ballot(unsigned mask, bool pred) {
    return (unsigned)warp_op(WarpOp::Ballot, mask, 0, Shfl::Idx, 0, 32, pred);
}

void register_kernel(const char* name, void* fn, Invoker invoke, std::string signature) {
    registry()[name] = KernelEntry{fn, invoke, std::move(signature)};
}

}  // namespace emu

extern "C" {

// Names of every registered kernel, separated by '\n', into buf (truncated to len).
size_t emu_kernel_names(char* buf, size_t len) {
    std::string all;
    for (const auto& kv : emu::registry()) all += kv.first + "\n";
    if (buf && len) {
        size_t k = std::min(len - 1, all.size());
        std::memcpy(buf, all.data(), k);
        buf[k] = 0;
    }
    return all.size();
}

// Launches kernel `name` on grid × block with `smem` bytes of dynamic shared memory and the
// kernel's arguments as pointers to their values (as cuLaunchKernel takes them), described by
// `signature` (one letter per argument, see `param_code`), which must be the kernel's.
// `schedule`: "forward", "reverse" or "random:SEED". Returns 0, or 1 with a message in err.
int emu_launch(const char* name, const unsigned grid[3], const unsigned block[3], size_t smem,
               void** args, const char* signature, const char* schedule, char* err,
               size_t err_len) {
    auto set_err = [&](const std::string& m) {
        if (err && err_len) {
            size_t k = std::min(err_len - 1, m.size());
            std::memcpy(err, m.data(), k);
            err[k] = 0;
        }
        return 1;
    };
    auto it = emu::registry().find(name);
    if (it == emu::registry().end()) return set_err(std::string("no kernel named ") + name);
    if (it->second.signature != signature)
        return set_err(std::string(name) + ": arguments '" + signature +
                       "' do not match the kernel's parameters '" + it->second.signature + "'");
    emu::Schedule sched;
    if (!emu::parse_schedule(schedule, sched))
        return set_err(std::string("bad schedule '") + schedule + "' (forward|reverse|random:SEED)");
    const unsigned threads = block[0] * block[1] * block[2];
    if (threads == 0 || threads > 1024 || grid[0] * grid[1] * grid[2] == 0 || grid[1] > 65535 ||
        grid[2] > 65535)
        return set_err("invalid launch configuration");
    if (smem > 48 * 1024) return set_err("dynamic shared memory over 48 KiB needs an opt-in");
    emu::Launch l;
    l.kernel = it->second;
    l.args = args;
    l.fibers.resize(threads);
    l.smem.assign(smem, 0xFF);
    for (unsigned i = 0; i < threads; i++) l.stacks.emplace_back(new char[emu::kStack]);
    emu::Launch* saved = emu::g_launch;
    emu::g_launch = &l;
    emu::grid_dim = dim3(grid[0], grid[1], grid[2]);
    emu::block_dim = dim3(block[0], block[1], block[2]);
    std::mt19937_64 rng(sched.seed);
    int rc = 0;
    try {
        for (unsigned z = 0; z < grid[2]; z++)
            for (unsigned y = 0; y < grid[1]; y++)
                for (unsigned x = 0; x < grid[0]; x++) {
                    emu::block_idx = dim3(x, y, z);
                    emu::run_block(l, sched, rng);
                }
    } catch (emu::Abort&) {
        rc = set_err(std::string(name) + ": " + l.error);
    }
    emu::g_launch = saved;
    return rc;
}

}  // extern "C"
