// Running a kernel with its memory faults caught (faults.cpp), its blocks on one OS thread or
// several (block_pool.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "emu_runtime.h"

namespace sim {

// Runs `body` (kernel code) on the calling thread with SIGSEGV/SIGBUS turned into a return:
// false with `*fault_addr` the faulting address (the thread's unfinished launch abandoned),
// true when `body` returned.
bool guarded(const std::function<void()>& body, uint64_t* fault_addr);

// GPU_SIM_BLOCK_THREADS, read once: how many OS threads run the blocks of one launch (default
// 1, the stream's own thread; more: the stream's thread and helpers shared by every stream).
unsigned block_threads();

// emu::run with memory faults caught, the blocks spread over `block_threads()` OS threads:
// returns false with `error` set, and `*fault_addr` non-zero for a memory fault.
bool guarded_run(const emu::KernelEntry& k, void** args, const emu::LaunchConfig& cfg,
                 std::string& error, uint64_t* fault_addr);

}  // namespace sim
