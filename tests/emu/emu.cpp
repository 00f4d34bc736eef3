// The emulator's runtime: fibers, the block scheduler, warp operations, the kernel registries
// and the C launch API used by tests/kernels_emulated. See cuda_emu.h for what it models and
// what it cannot.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "emu_runtime.h"

// ------------------------------------------------------------------------- the context switch
// emu_ctx_switch(save, load): saves the callee-saved registers, MXCSR and the x87 control word
// on the current stack, stores the stack pointer in *save, and resumes the context whose stack
// pointer is `load` (System V x86-64: rbx, rbp, r12-r15 are callee-saved).
#if !defined(__x86_64__)
#error "the emulator's fibers are written for x86-64"
#endif
extern "C" void emu_ctx_switch(void** save, void* load);
asm(R"(
    .text
    .p2align 4
    .type emu_ctx_switch,@function
emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_ctx_switch, .-emu_ctx_switch
)");

namespace emu {

thread_local const dim3* cur_tid EMU_TLS = nullptr;
thread_local dim3 block_idx EMU_TLS, block_dim EMU_TLS, grid_dim EMU_TLS;

namespace {

// A fiber's stack: 256 KiB with a guard page below it; a thread uses only what it touches.
constexpr size_t kStack = 256 * 1024, kGuard = 4096;

struct StackPool {
    std::vector<char*> free;
    char* get() {
        if (!free.empty()) {
            char* s = free.back();
            free.pop_back();
            return s;
        }
        void* m = mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return nullptr;
        mprotect(m, kGuard, PROT_NONE);
        return static_cast<char*>(m);
    }
    void put(char* s) { free.push_back(s); }
    ~StackPool() {
        for (char* s : free) munmap(s, kStack + kGuard);
    }
};
thread_local StackPool t_stacks;

enum class State : unsigned char { Fresh, Ready, Barrier, Warp, Done };
enum class WarpOp : unsigned char { Sync, Shfl, Ballot };

const dim3 kHostTid(0, 0, 0);

}  // namespace

struct Fiber {
    void* sp = nullptr;
    char* stack = nullptr;
    dim3 tid;
    State state = State::Fresh;
    // Pending warp operation.
    WarpOp op = WarpOp::Sync;
    bool pred = false;
    Shfl kind = Shfl::Idx;
    unsigned mask = 0;
    int arg = 0, width = 32;
    uint64_t value = 0;
    uint64_t result = 0;
};

namespace {

struct Launch {
    void* sched_sp = nullptr;
    std::vector<Fiber> fibers;
    std::vector<unsigned char> smem;
    Fiber* cur = nullptr;
    const KernelEntry* kernel = nullptr;
    void** args = nullptr;
    bool lenient = false;
    bool failed = false;
    std::string error;
    // Preemption points (LaunchConfig::preempt): the longest wait, how many waits are left to
    // the running block, and the grid whose threads meet there.
    bool preempt = false;
    unsigned preempt_max_us = 0, preempts_left = 0;
    Grid* grid = nullptr;
};

thread_local Launch* g_launch = nullptr;

// The scheduler's own failure path: a fiber that calls fail() records the error and never
// resumes; the launch is then abandoned.
struct Abort {};

void release_stacks(Launch& l) {
    for (Fiber& f : l.fibers) {
        if (f.stack) t_stacks.put(f.stack);
        f.stack = nullptr;
    }
}

extern "C" void emu_fiber_entry() {
    Launch* l = g_launch;
    Fiber* f = l->cur;
    l->kernel->invoke(l->kernel->fn, l->args);
    f->state = State::Done;
    emu_ctx_switch(&f->sp, l->sched_sp);
    __builtin_unreachable();
}

// The initial frame of a fiber: what emu_ctx_switch pops (MXCSR and control word, six
// registers), then emu_fiber_entry as the return address, then a null return address for
// emu_fiber_entry itself, which leaves the stack 16-byte aligned minus 8 at its entry.
void* initial_frame(char* stack) {
    auto* top = reinterpret_cast<uint64_t*>(stack + kGuard + kStack);
    uint32_t mxcsr;
    uint16_t fpcw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpcw));
    *--top = 0;
    *--top = reinterpret_cast<uint64_t>(&emu_fiber_entry);
    for (int i = 0; i < 6; i++) *--top = 0;
    *--top = (uint64_t)mxcsr | ((uint64_t)fpcw << 32);
    return top;
}

void resume(Launch& l, Fiber& f) {
    if (f.state == State::Fresh) {
        f.stack = t_stacks.get();
        if (!f.stack) {
            l.failed = true;
            l.error = "no memory for a fiber stack";
            throw Abort{};
        }
        f.sp = initial_frame(f.stack);
    }
    f.state = State::Ready;
    l.cur = &f;
    cur_tid = &f.tid;
    emu_ctx_switch(&l.sched_sp, f.sp);
    cur_tid = &kHostTid;
    l.cur = nullptr;
    if (f.state == State::Done) {
        t_stacks.put(f.stack);
        f.stack = nullptr;
    }
    if (l.failed) throw Abort{};
}

void yield_to_scheduler() {
    Launch* l = g_launch;
    emu_ctx_switch(&l->cur->sp, l->sched_sp);
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
    if (waiting + done == l.fibers.size() && done > 0 && !l.lenient) {
        for (const Fiber& f : l.fibers)
            if (f.state == State::Barrier)
                fail(where(f) + ": __syncthreads not reached by " + std::to_string(done) +
                     " exited threads of the block");
    }
    if (waiting + done != l.fibers.size()) return false;
    for (Fiber& f : l.fibers)
        if (f.state == State::Barrier) f.state = State::Ready;
    return true;
}

void run_block(Launch& l, const Schedule& sched, std::mt19937_64& rng,
               std::vector<unsigned>& order) {
    const unsigned n = (unsigned)l.fibers.size();
    std::fill(l.smem.begin(), l.smem.end(), (unsigned char)0xFF);
    for (unsigned i = 0; i < n; i++) {
        Fiber& f = l.fibers[i];
        f.state = State::Fresh;
        f.tid = dim3(i % block_dim.x, (i / block_dim.x) % block_dim.y,
                     i / (block_dim.x * block_dim.y));
    }
    for (;;) {
        if (sched.mode == Schedule::Forward) {
            for (unsigned i = 0; i < n; i++) {
                Fiber& f = l.fibers[i];
                if (f.state == State::Fresh || f.state == State::Ready) resume(l, f);
            }
        } else {
            if (sched.mode == Schedule::Random) std::shuffle(order.begin(), order.end(), rng);
            for (unsigned i : order) {
                Fiber& f = l.fibers[i];
                if (f.state == State::Fresh || f.state == State::Ready) resume(l, f);
            }
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

Registry*& loading_registry() {
    static thread_local Registry* r = nullptr;
    return r;
}

}  // namespace

Registry& global_registry() {
    static auto* r = new Registry;  // never destroyed: kernels may run while the process exits
    return *r;
}

ModuleLoad::ModuleLoad(Registry* into) : saved(loading_registry()) { loading_registry() = into; }
ModuleLoad::~ModuleLoad() { loading_registry() = saved; }

void* dynamic_smem() { return g_launch->smem.data(); }

[[noreturn]] void fail(const std::string& why) {
    Launch* l = g_launch;
    if (!l->failed) {
        l->failed = true;
        l->error = why;
    }
    if (l->cur) {
        // Never resumed: the scheduler abandons the launch.
        emu_ctx_switch(&l->cur->sp, l->sched_sp);
    }
    // Called from the scheduler itself.
    throw Abort{};
}

void preempt() {
    Launch* l = g_launch;
    if (!l || !l->preempt || l->preempts_left == 0) return;
    Grid& g = *l->grid;
    std::unique_lock<std::mutex> lk(g.pm);
    // Every other thread is parked at a point, or gone: this one runs on.
    if (g.parked + 1 >= g.runners) return;
    // Parked until every thread still running blocks of the grid is parked too (the last one
    // to run leaves the grid: the others are then free), or the longest wait passed.
    l->preempts_left--;
    g.parked++;
    g.pcv.wait_for(lk, std::chrono::microseconds(l->preempt_max_us),
                   [&] { return g.parked >= g.runners; });
    g.parked--;
}

void syncthreads() {
    Fiber* f = g_launch->cur;
    f->state = State::Barrier;
    yield_to_scheduler();
}

static uint64_t warp_op(WarpOp op, unsigned mask, uint64_t value, Shfl kind, int arg, int width,
                        bool pred) {
    Fiber* f = g_launch->cur;
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

void register_kernel(const char* name, void* fn, Invoker invoke, std::string signature,
                     std::vector<Param> params) {
    Registry* r = loading_registry();
    (r ? *r : global_registry())[name] =
        KernelEntry{fn, invoke, std::move(signature), std::move(params)};
}

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

bool in_kernel() { return g_launch != nullptr; }

void abandon() {
    if (!g_launch) return;
    if (g_launch->preempt && g_launch->grid) {
        // Leaving the grid (at its end, or after a fault that jumped out of it): the threads
        // parked at a point no longer wait for this one.
        Grid& g = *g_launch->grid;
        std::lock_guard<std::mutex> lk(g.pm);
        g.runners--;
        if (g.parked > 0 && g.parked >= g.runners) g.pcv.notify_all();
    }
    release_stacks(*g_launch);
    delete g_launch;
    g_launch = nullptr;
    cur_tid = &kHostTid;
}

void Grid::fail(const std::string& why) {
    std::lock_guard<std::mutex> lk(m);
    if (!failed.exchange(true)) error = why;
}

bool prepare(const KernelEntry& kernel, void** args, const LaunchConfig& cfg, Grid& g,
             std::string& error) {
    const dim3 grid = cfg.grid, block = cfg.block;
    const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 ||
        grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) {
        char buf[200];
        std::snprintf(buf, sizeof buf,
                      "invalid launch configuration: grid (%u,%u,%u), block (%u,%u,%u)", grid.x,
                      grid.y, grid.z, block.x, block.y, block.z);
        error = buf;
        return false;
    }
    if (cfg.smem > 48 * 1024) {
        error = "dynamic shared memory of " + std::to_string(cfg.smem) +
                " bytes: over 48 KiB needs an opt-in (cuFuncSetAttribute)";
        return false;
    }
    if (g_launch) {
        error = "a launch from inside a kernel";
        return false;
    }
    g.kernel = &kernel;
    g.args = args;
    g.cfg = cfg;
    g.nblocks = size_t(grid.x) * grid.y * grid.z;
    // Blocks start in the schedule's order too: x fastest (forward), the reverse, or a seeded
    // shuffle, so that a kernel assuming an order between blocks (block 0 first, say) fails
    // under some schedule. On one thread they run one after another; on several, concurrently.
    if (cfg.schedule.mode != Schedule::Forward) {
        g.order.resize(g.nblocks);
        for (size_t i = 0; i < g.nblocks; i++) g.order[i] = i;
        if (cfg.schedule.mode == Schedule::Reverse) {
            std::reverse(g.order.begin(), g.order.end());
        } else {
            std::mt19937_64 rng(cfg.schedule.seed);
            std::shuffle(g.order.begin(), g.order.end(), rng);
        }
    }
    return true;
}

void run_blocks(Grid& g) {
    const LaunchConfig& cfg = g.cfg;
    const dim3 grid = cfg.grid, block = cfg.block;
    const unsigned threads = block.x * block.y * block.z;
    if (g_launch) {
        g.fail("a launch from inside a kernel");
        return;
    }
    auto* l = new Launch;
    l->kernel = g.kernel;
    l->args = g.args;
    l->lenient = cfg.lenient_barriers;
    l->preempt = cfg.preempt;
    l->preempt_max_us = cfg.preempt_max_us;
    l->grid = &g;
    if (cfg.preempt) {
        std::unique_lock<std::mutex> lk(g.pm);
        g.runners++;
        g.pcv.notify_all();
        const auto limit = std::chrono::microseconds(std::min(cfg.preempt_max_us, 2000u));
        g.pcv.wait_for(lk, limit,
                       [&g] { return g.runners >= g.expected_runners || g.next.load() > 0; });
    }
    l->fibers.resize(threads);
    l->smem.assign(cfg.smem, 0xFF);
    g_launch = l;
    cur_tid = &kHostTid;
    grid_dim = grid;
    block_dim = block;
    std::vector<unsigned> order(threads);
    try {
        for (;;) {
            if (g.failed.load()) break;
            const size_t i = g.next.fetch_add(1);
            if (i >= g.nblocks) break;
            const size_t b = g.order.empty() ? i : g.order[i];
            block_idx = dim3(unsigned(b % grid.x), unsigned(b / grid.x % grid.y),
                             unsigned(b / (size_t(grid.x) * grid.y)));
            // The threads' order within the block: a function of the seed and the block
            // alone, whichever OS thread runs it.
            for (unsigned t = 0; t < threads; t++)
                order[t] = cfg.schedule.mode == Schedule::Reverse ? threads - 1 - t : t;
            std::mt19937_64 rng(cfg.schedule.seed ^ (0x9e3779b97f4a7c15ull * (b + 1)));
            l->preempts_left = cfg.preempt_limit;
            if (cfg.block_start) cfg.block_start(cfg.block_start_arg);
            run_block(*l, cfg.schedule, rng, order);
        }
    } catch (Abort&) {
        g.fail(l->error);
    }
    abandon();
}

bool run(const KernelEntry& kernel, void** args, const LaunchConfig& cfg, std::string& error) {
    Grid g;
    if (!prepare(kernel, args, cfg, g, error)) return false;
    run_blocks(g);
    if (g.failed.load()) {
        error = g.error;
        return false;
    }
    return true;
}

}  // namespace emu

extern "C" {

// Names of every registered kernel, separated by '\n', into buf (truncated to len).
size_t emu_kernel_names(char* buf, size_t len) {
    std::string all;
    for (const auto& kv : emu::global_registry()) all += kv.first + "\n";
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
    auto it = emu::global_registry().find(name);
    if (it == emu::global_registry().end())
        return set_err(std::string("no kernel named ") + name);
    if (it->second.signature != signature)
        return set_err(std::string(name) + ": arguments '" + signature +
                       "' do not match the kernel's parameters '" + it->second.signature + "'");
    emu::LaunchConfig cfg;
    if (!emu::parse_schedule(schedule, cfg.schedule))
        return set_err(std::string("bad schedule '") + schedule + "' (forward|reverse|random:SEED)");
    cfg.grid = dim3(grid[0], grid[1], grid[2]);
    cfg.block = dim3(block[0], block[1], block[2]);
    cfg.smem = smem;
    std::string error;
    if (!emu::run(it->second, args, cfg, error)) return set_err(std::string(name) + ": " + error);
    return 0;
}

}  // extern "C"
