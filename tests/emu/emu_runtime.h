// The emulator's host-side interface, for launchers (the simulated driver of gpu-sim/); kernels
// include cuda_emu.h only.
#pragma once

#include <cstdint>
#include <map>
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
};

// Runs `kernel` over the grid on the calling thread. Returns true, or false with `error` set
// (a launch configuration the device refuses, or undefined behaviour the emulator detected).
bool run(const KernelEntry& kernel, void** args, const LaunchConfig& cfg, std::string& error);

// Frees what an interrupted `run` held (one left by a longjmp out of a kernel, from a signal
// handler): its fiber stacks go back to the pool and the thread is no longer inside a launch.
void abandon();

// Whether the calling thread is executing a kernel's code now (inside `run`).
bool in_kernel();

}  // namespace emu
