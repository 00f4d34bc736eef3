// Running a kernel with its memory faults caught (faults.cpp), its blocks on one OS thread or
// several (block_pool.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "emu_runtime.h"

namespace sim {

// A fault in kernel code: a memory fault (SIGSEGV/SIGBUS at a data address), or an alignment
// check's trap (SIGILL: kernel libraries are built with `-fsanitize=alignment` trapping, so an
// access through a `T*` not aligned to `alignof(T)` stops there; `addr` is then the trapping
// instruction's address).
struct Fault {
    bool happened = false;
    uint64_t addr = 0;
    bool misaligned = false;
};

// Runs `body` (kernel code) on the calling thread with SIGSEGV, SIGBUS and SIGILL turned into a
// return: false with `*fault` set (the thread's unfinished launch abandoned), true when `body`
// returned.
bool guarded(const std::function<void()>& body, Fault* fault);

// The symbol containing code address `addr` (a kernel's name, for a misaligned access), or "".
std::string symbol_at(uint64_t addr);

// GPU_SIM_BLOCK_THREADS, read once: how many OS threads run the blocks of one launch (default
// 1, the stream's own thread; more: the stream's thread and helpers shared by every stream).
unsigned block_threads();
// GPU_SIM_PREEMPT: the longest wait at a preemption point, in microseconds (0: none).
unsigned preempt_max_us();

// emu::run with faults caught, the blocks spread over `block_threads()` OS threads: returns
// false with `error` set, and `*fault` set (`happened`) for a memory fault or a misaligned
// access.
bool guarded_run(const emu::KernelEntry& k, void** args, const emu::LaunchConfig& cfg,
                 std::string& error, Fault* fault);

}  // namespace sim
