// A CUDA emulator for the kernels in kernels/*.cu (and, in the simulated device of gpu-sim/,
// candle's kernels), compiled by g++ (test-only).
//
// Blocks run one after another on the calling OS thread (`emu::run`), or on several OS threads
// at once (`emu::run_blocks` from each; the simulated device's GPU_SIM_BLOCK_THREADS), each with
// its own fibers, shared memory and built-in variables. The threads of a block are fibers
// (a small assembly context switch, stacks from a per-thread pool) that switch only at
// __syncthreads, __syncwarp, shuffles and ballots; a thread that never blocks runs to its end
// on one stack, which the next thread then reuses. The order in which runnable fibers resume is
// chosen by the launch's schedule (forward, reverse or a seeded random permutation per round),
// so a missing barrier shows up under some order. Blocks running at once on several OS threads
// meet at preemption points: after an atomic an OS thread parks until the others are parked
// too or gone, and one that arrives while all the others are parked runs on
// (LaunchConfig::preempt), as a GPU's other SMs run on between two instructions of one block.
// Undefined behaviour that a GPU would tolerate silently is a launch error here: a barrier some
// threads never reach (strict mode; the lenient mode counts exited threads as arrived, as sm_70
// and later GPUs do), a warp operation whose mask names exited, absent or diverged lanes, a
// shuffle reading a lane outside its mask.
// Dynamic shared memory is filled with 0xFF bytes (NaN for every float type) at every block
// start; the simulated device does the same to a module's static shared memory.
//
// It cannot see true races, memory-model bugs, occupancy, launch-resource limits or timing.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------- built-in variables and types
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

// Thread-local state read by every kernel: the sim builds these with the initial-exec TLS model
// (EMU_TLS_INITIAL_EXEC), so that a kernel module loaded later reads them without a call.
#ifdef EMU_TLS_INITIAL_EXEC
#define EMU_TLS __attribute__((tls_model("initial-exec")))
#else
#define EMU_TLS
#endif
extern thread_local const dim3* cur_tid EMU_TLS;
extern thread_local dim3 block_idx EMU_TLS, block_dim EMU_TLS, grid_dim EMU_TLS;
void* dynamic_smem();

void syncthreads();
void syncwarp(unsigned mask);
// Warp exchange: every lane of `mask` deposits `value`; returns the value of lane `src(lane)`.
enum class Shfl { Idx, Down, Up, Xor };
uint64_t shfl(unsigned mask, uint64_t value, Shfl kind, int arg, int width);
unsigned ballot(unsigned mask, bool pred);
[[noreturn]] void fail(const std::string& why);
// A preemption point (after every atomic): a no-op unless the launch asked for them
// (LaunchConfig::preempt); then the calling OS thread may park while the others run on.
void preempt();

template <typename T> T shfl_t(unsigned mask, T v, Shfl kind, int arg, int width) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = shfl(mask, bits, kind, arg, width);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

// Type-erased kernel registry: `Reg r("name", &fn)` makes fn launchable by name with void** args.
// Each kernel is registered with its signature, one letter per parameter (see `param_code`),
// which a launch must match: an argument list one short, one long or with an `int` for a
// `long long` is refused instead of read out of bounds. Each parameter also records its size
// (checked against the PTX's `.param` list by the simulated driver) and, for a pointer, whether
// the kernel may write through it (a pointer to non-const) or only reads (a pointer to const).
using Invoker = void (*)(void* fn, void** args);
enum class Access : char { Value, Read, Write };
struct Param {
    unsigned size;
    Access access;
};
void register_kernel(const char* name, void* fn, Invoker invoke, std::string signature,
                     std::vector<Param> params);

// 'p' a pointer, 'l' an 8-byte integer, 'i' a 4-byte integer, 'd' a double, '?' anything else.
template <typename T> constexpr char param_code() {
    if (std::is_pointer<T>::value) return 'p';
    if (std::is_integral<T>::value && sizeof(T) == 8) return 'l';
    if (std::is_integral<T>::value && sizeof(T) == 4) return 'i';
    if (std::is_same<T, double>::value) return 'd';
    return '?';
}
template <typename T> Param param_info() {
    if (!std::is_pointer<T>::value) return Param{(unsigned)sizeof(T), Access::Value};
    using P = typename std::remove_pointer<T>::type;
    return Param{(unsigned)sizeof(T), std::is_const<P>::value ? Access::Read : Access::Write};
}

template <typename... A> struct Unpack {
    template <size_t... I> static void call(void* fn, void** args, std::index_sequence<I...>) {
        reinterpret_cast<void (*)(A...)>(fn)(*static_cast<A*>(args[I])...);
    }
    static void invoke(void* fn, void** args) { call(fn, args, std::index_sequence_for<A...>{}); }
};

struct Reg {
    template <typename... A> Reg(const char* name, void (*fn)(A...)) {
        register_kernel(name, reinterpret_cast<void*>(fn), &Unpack<A...>::invoke,
                        std::string{param_code<A>()...}, std::vector<Param>{param_info<A>()...});
    }
};

}  // namespace emu

#define threadIdx (*::emu::cur_tid)
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
// Shared memory: one copy per OS thread (the blocks a thread runs, one after another, reuse it;
// the simulated device poisons it at each block start through LaunchConfig::block_start).
#define __shared__ static thread_local
#define EMU_REGISTER(name) static ::emu::Reg emu_reg_##name(#name, &name);

inline void __syncthreads() { ::emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::emu::syncwarp(mask); }
inline void __threadfence() {}

template <typename T> T __shfl_sync(unsigned m, T v, int src, int w = 32) {
    return ::emu::shfl_t(m, v, ::emu::Shfl::Idx, src, w);
}
template <typename T> T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) {
    return ::emu::shfl_t(m, v, ::emu::Shfl::Down, (int)d, w);
}
template <typename T> T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) {
    return ::emu::shfl_t(m, v, ::emu::Shfl::Up, (int)d, w);
}
template <typename T> T __shfl_xor_sync(unsigned m, T v, int lane_mask, int w = 32) {
    return ::emu::shfl_t(m, v, ::emu::Shfl::Xor, lane_mask, w);
}
inline unsigned __ballot_sync(unsigned m, int pred) { return ::emu::ballot(m, pred != 0); }

#include "emu_half.h"
#include "emu_math.h"

