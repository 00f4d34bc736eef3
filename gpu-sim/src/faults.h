// Running a kernel with its memory faults caught (faults.cpp).
#pragma once

#include <string>

#include "emu_runtime.h"

namespace sim {

// emu::run with SIGSEGV/SIGBUS from kernel code turned into a failed launch: returns false
// with `error` set, and `*fault_addr` non-zero for a memory fault.
bool guarded_run(const emu::KernelEntry& k, void** args, const emu::LaunchConfig& cfg,
                 std::string& error, uint64_t* fault_addr);

}  // namespace sim
