// The emulator's host-side interface, for launchers (the simulated driver of gpu-sim/); kernels
// include cuda_emu.h only.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_emu.h"

namespace emu {

struct KernelEntry {
    void* fn = nullptr;
    Invoker invoke = nullptr;
    std::string signature;
    std::vector<Param> params;
};

// Kernels by entry-point name. One registry per loaded module; kernels register into the
// registry named by `ModuleLoad` while it lives (the static initialisers of a module run inside
// dlopen), into the process-wide one otherwise.
using Registry = std::map<std::string, KernelEntry>;
Registry& global_registry();
struct ModuleLoad {
    explicit ModuleLoad(Registry* into);
    ~ModuleLoad();
    Registry* saved;
};

struct Schedule {
    enum Mode { Forward, Reverse, Random } mode = Forward;
    uint64_t seed = 0;
};
bool parse_schedule(const char* s, Schedule& out);

struct LaunchConfig {
    dim3 grid, block;
    size_t smem = 0;
    Schedule schedule;
    // Exited threads count as arrived at __syncthreads (sm_70 and later); strict otherwise.
    bool lenient_barriers = false;
    // Called on the running OS thread at every block start, after dynamic shared memory is
    // filled (the launcher poisons the kernel module's static shared memory with it).
    void (*block_start)(const void* arg) = nullptr;
    const void* block_start_arg = nullptr;
    // Preemption points, for blocks run by several OS threads at once (the simulated device's
    // GPU_SIM_BLOCK_THREADS): after an atomic the running OS thread parks until every other
    // thread running blocks of the grid is parked too or has left the grid, or
    // `preempt_max_us` microseconds have passed; a thread that arrives while all the others
    // are parked runs on. A block parks at most `preempt_limit` times. So one block's window
    // between an atomic and its next instruction stays open while the other blocks run to
    // their own atomics and past them, as a GPU's other SMs run on between two instructions
    // of one block. Off by default: with one OS thread nothing else runs meanwhile.
    bool preempt = false;
    unsigned preempt_max_us = 20000;
    unsigned preempt_limit = 8;
};

// Runs `kernel` over the grid on the calling thread. Returns true, or false with `error` set
// (a launch configuration the device refuses, or undefined behaviour the emulator detected).
bool run(const KernelEntry& kernel, void** args, const LaunchConfig& cfg, std::string& error);

// A launch's blocks, handed out to the OS threads that run them (`run_blocks`), each block
// once, in the schedule's order of starting; the first failure stops every thread at its next
// block. `run` is `prepare` then `run_blocks` on the calling thread alone.
struct Grid {
    const KernelEntry* kernel = nullptr;
    void** args = nullptr;
    LaunchConfig cfg;
    size_t nblocks = 0;
    std::vector<size_t> order;  // linear block numbers in start order (empty: index order)
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex m;        // guards `error`
    std::string error;   // the first failure's
    // The preemption points (guarded by `pm`): OS threads running blocks of this grid, and how
    // many of them are parked at a point.
    std::mutex pm;
    std::condition_variable pcv;
    unsigned runners = 0, parked = 0;
    // With preemption points, the threads about to run blocks of this grid: each waits (up to
    // 2 ms) for the others to arrive before it takes its first block, or a grid of
    // short blocks would be over before a woken thread got a core.
    unsigned expected_runners = 1;
    void fail(const std::string& why);
};
// Checks the launch configuration and fills `g`. False with `error` set if the device would
// refuse the launch.
bool prepare(const KernelEntry& kernel, void** args, const LaunchConfig& cfg, Grid& g,
             std::string& error);
// Runs blocks of `g` on the calling thread until none is left or one (on any thread) failed.
// Every thread running blocks of one grid at once has its own fibers, shared memory and
// built-in variables. A failure is recorded in `g` (the first one's message).
void run_blocks(Grid& g);

// Frees what an interrupted `run` held (one left by a longjmp out of a kernel, from a signal
// handler): its fiber stacks go back to the pool and the thread is no longer inside a launch.
void abandon();

// Whether the calling thread is executing a kernel's code now (inside `run`).
bool in_kernel();

}  // namespace emu
