// A CUDA emulator for the kernels in kernels/*.cu, compiled by g++ (test-only).
//
// Blocks run one after another on the calling OS thread. The threads of a block are fibers
// (ucontext) that switch only at __syncthreads, __syncwarp, shuffles and ballots; the order in
// which runnable fibers resume is chosen by the launch's schedule (forward, reverse or a seeded
// random permutation per round), so a missing barrier shows up under some order. Undefined
// behaviour that a GPU would tolerate silently is a launch error here: a barrier some threads
// never reach, a warp operation whose mask names exited, absent or diverged lanes, a shuffle
// reading a lane outside its mask. Dynamic shared memory is filled with 0xFF bytes (NaN for
// every float type) at every block start.
//
// It cannot see true races, memory-model bugs, occupancy, launch-resource limits or timing.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------- built-in variables and types
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

struct Fiber;
Fiber* current();
const dim3& thread_idx();
extern thread_local dim3 block_idx, block_dim, grid_dim;
void* dynamic_smem();

void syncthreads();
void syncwarp(unsigned mask);
// Warp exchange: every lane of `mask` deposits `value`; returns the value of lane `src(lane)`.
enum class Shfl { Idx, Down, Up, Xor };
uint64_t shfl(unsigned mask, uint64_t value, Shfl kind, int arg, int width);
unsigned ballot(unsigned mask, bool pred);
[[noreturn]] void fail(const std::string& why);

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
// `long long` is refused instead of read out of bounds.
using Invoker = void (*)(void* fn, void** args);
void register_kernel(const char* name, void* fn, Invoker invoke, std::string signature);

// 'p' a pointer, 'l' an 8-byte integer, 'i' a 4-byte integer, 'd' a double, '?' anything else.
template <typename T> constexpr char param_code() {
    if (std::is_pointer<T>::value) return 'p';
    if (std::is_integral<T>::value && sizeof(T) == 8) return 'l';
    if (std::is_integral<T>::value && sizeof(T) == 4) return 'i';
    if (std::is_same<T, double>::value) return 'd';
    return '?';
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
                        std::string{param_code<A>()...});
    }
};

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
// Shared memory: one copy per OS thread (blocks of one launch run one after another on it).
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

// Blocks run sequentially and fibers switch only at the calls above, so an atomic is a plain
// read-modify-write here.
template <typename T> T atomicAdd(T* p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}
inline unsigned atomicInc(unsigned* p, unsigned limit) {
    unsigned old = *p;
    *p = old >= limit ? 0 : old + 1;
    return old;
}

template <typename T> T __ldg(const T* p) { return *p; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
// Round-to-nearest double arithmetic that is never fused (the host compiler does not contract
// these calls into an FMA).
inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
inline double __dsub_rn(double a, double b) { volatile double r = a - b; return r; }
inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
inline float __fdividef(float a, float b) { return a / b; }
using std::fmaxf;
using std::max;
using std::min;

// ---------------------------------------------------------------- half and bfloat16 storage
// IEEE binary16 and bfloat16 with round-to-nearest-even conversions, as cuda_fp16.h and
// cuda_bf16.h provide (only what the kernels use).
struct __half {
    uint16_t bits;
};
struct __nv_bfloat16 {
    uint16_t bits;
};

inline float __half2float(__half h) {
    uint32_t s = (uint32_t)(h.bits & 0x8000u) << 16, e = (h.bits >> 10) & 0x1f, m = h.bits & 0x3ff;
    uint32_t f;
    if (e == 0) {
        if (m == 0) {
            f = s;
        } else {  // subnormal: normalise
            e = 127 - 15 + 1;
            while ((m & 0x400u) == 0) {
                m <<= 1;
                e--;
            }
            f = s | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        f = s | 0x7f800000u | (m << 13);
    } else {
        f = s | ((e + 127 - 15) << 23) | (m << 13);
    }
    float out;
    std::memcpy(&out, &f, 4);
    return out;
}

inline __half __float2half(float v) {
    uint32_t f;
    std::memcpy(&f, &v, 4);
    uint32_t s = (f >> 16) & 0x8000u;
    int32_t e = (int32_t)((f >> 23) & 0xff) - 127 + 15;
    uint32_t m = f & 0x7fffffu;
    uint16_t bits;
    if (((f >> 23) & 0xff) == 0xff) {  // inf or nan
        bits = (uint16_t)(s | 0x7c00u | (m ? 0x200u : 0));
    } else if (e >= 31) {
        bits = (uint16_t)(s | 0x7c00u);
    } else if (e <= 0) {  // subnormal or zero
        if (e < -10) {
            bits = (uint16_t)s;
        } else {
            m |= 0x800000u;
            uint32_t shift = (uint32_t)(14 - e);
            uint32_t half_m = m >> shift, rem = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
            if (rem > mid || (rem == mid && (half_m & 1))) half_m++;
            bits = (uint16_t)(s | half_m);
        }
    } else {
        uint32_t half_m = m >> 13, rem = m & 0x1fffu;
        uint32_t out = s | ((uint32_t)e << 10) | half_m;
        if (rem > 0x1000u || (rem == 0x1000u && (half_m & 1))) out++;  // may carry into e
        bits = (uint16_t)out;
    }
    return __half{bits};
}

inline float __bfloat162float(__nv_bfloat16 b) {
    uint32_t f = (uint32_t)b.bits << 16;
    float out;
    std::memcpy(&out, &f, 4);
    return out;
}

inline __nv_bfloat16 __float2bfloat16(float v) {
    uint32_t f;
    std::memcpy(&f, &v, 4);
    if ((f & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((f >> 16) | 0x40)};
    f += 0x7fffu + ((f >> 16) & 1);
    return __nv_bfloat16{(uint16_t)(f >> 16)};
}
