// Atomics, math functions, bit casts and vector types for the emulator (see cuda_emu.h), with the
// signatures and semantics the CUDA C++ Programming Guide and the CUDA Math API give device code.
#pragma once

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "emu_half.h"

// ---------------------------------------------------------------- atomics
// GCC __atomic builtins (sequentially consistent), so they stay atomic whichever OS threads run
// the blocks; each is followed by a preemption point (emu::preempt, see cuda_emu.h). CUDA has
// exactly these overloads: no atomicAdd on long long or on uint64_t (an unsigned long on
// Linux), as nvcc.
namespace emu {
// Replace *p by f(*p) atomically (a compare-and-swap loop on the object's bytes, so a NaN
// cannot make it spin); returns the old value.
template <typename T, typename F> T atomic_update(T* p, F f) {
    T old, next;
    __atomic_load(p, &old, __ATOMIC_SEQ_CST);
    do {
        next = f(old);
    } while (!__atomic_compare_exchange(p, &old, &next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    preempt();
    return old;
}
// The result of an atomic, after the preemption point that follows every atomic.
template <typename T> T after_atomic(T old) {
    preempt();
    return old;
}
// atom.add.f32 flushes subnormal inputs and results to sign-preserving zero (PTX ISA, atom);
// the f64, f16 and bf16 additions keep them.
inline float ftz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }
}  // namespace emu

#define EMU_ATOMIC_INT(T)                                                                  \
    inline T atomicAdd(T* p, T v) {                                                        \
        return emu::after_atomic(__atomic_fetch_add(p, v, __ATOMIC_SEQ_CST));              \
    }                                                                                      \
    inline T atomicSub(T* p, T v) {                                                        \
        return emu::after_atomic(__atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST));              \
    }                                                                                      \
    inline T atomicExch(T* p, T v) {                                                       \
        return emu::after_atomic(__atomic_exchange_n(p, v, __ATOMIC_SEQ_CST));             \
    }                                                                                      \
    inline T atomicAnd(T* p, T v) {                                                        \
        return emu::after_atomic(__atomic_fetch_and(p, v, __ATOMIC_SEQ_CST));              \
    }                                                                                      \
    inline T atomicOr(T* p, T v) {                                                         \
        return emu::after_atomic(__atomic_fetch_or(p, v, __ATOMIC_SEQ_CST));               \
    }                                                                                      \
    inline T atomicXor(T* p, T v) {                                                        \
        return emu::after_atomic(__atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST));              \
    }                                                                                      \
    inline T atomicMax(T* p, T v) {                                                        \
        return emu::atomic_update(p, [v](T o) { return o < v ? v : o; });                  \
    }                                                                                      \
    inline T atomicMin(T* p, T v) {                                                        \
        return emu::atomic_update(p, [v](T o) { return v < o ? v : o; });                  \
    }                                                                                      \
    inline T atomicCAS(T* p, T compare, T val) {                                           \
        __atomic_compare_exchange_n(p, &compare, val, false, __ATOMIC_SEQ_CST,             \
                                    __ATOMIC_SEQ_CST);                                     \
        return emu::after_atomic(compare); /* the old value, swapped or not */             \
    }
EMU_ATOMIC_INT(int)
EMU_ATOMIC_INT(unsigned int)
EMU_ATOMIC_INT(unsigned long long)
#undef EMU_ATOMIC_INT
// Signed 64-bit: only max and min (compute capability 5.0+); 16-bit: only CAS (7.0+).
inline long long atomicMax(long long* p, long long v) {
    return emu::atomic_update(p, [v](long long o) { return o < v ? v : o; });
}
inline long long atomicMin(long long* p, long long v) {
    return emu::atomic_update(p, [v](long long o) { return v < o ? v : o; });
}
inline unsigned short atomicCAS(unsigned short* p, unsigned short compare, unsigned short val) {
    __atomic_compare_exchange_n(p, &compare, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return emu::after_atomic(compare);
}
inline float atomicExch(float* p, float v) {
    float old;
    __atomic_exchange(p, &v, &old, __ATOMIC_SEQ_CST);
    return emu::after_atomic(old);
}
inline float atomicAdd(float* p, float v) {
    return emu::atomic_update(p, [v](float o) { return emu::ftz(emu::ftz(o) + emu::ftz(v)); });
}
inline double atomicAdd(double* p, double v) {
    return emu::atomic_update(p, [v](double o) { return o + v; });
}
inline __half atomicAdd(__half* p, __half v) {
    return emu::atomic_update(p, [v](__half o) { return o + v; });
}
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
    return emu::atomic_update(p, [v](__nv_bfloat16 o) { return o + v; });
}
// ((old >= limit) ? 0 : old + 1) and (((old == 0) || (old > limit)) ? limit : old - 1).
inline unsigned atomicInc(unsigned* p, unsigned limit) {
    return emu::atomic_update(p, [limit](unsigned o) { return o >= limit ? 0u : o + 1; });
}
inline unsigned atomicDec(unsigned* p, unsigned limit) {
    return emu::atomic_update(p, [limit](unsigned o) { return (o == 0 || o > limit) ? limit : o - 1; });
}

// ---------------------------------------------------------------- loads
template <typename T> T __ldg(const T* p) { return *p; }

// ---------------------------------------------------------------- bit casts
namespace emu {
template <typename To, typename From> To bit_cast(From v) {
    static_assert(sizeof(To) == sizeof(From), "bit casts keep the size");
    To out;
    std::memcpy(&out, &v, sizeof(To));
    return out;
}
}  // namespace emu
inline float __int_as_float(int v) { return emu::bit_cast<float>(v); }
inline int __float_as_int(float v) { return emu::bit_cast<int>(v); }
inline float __uint_as_float(unsigned int v) { return emu::bit_cast<float>(v); }
inline unsigned int __float_as_uint(float v) { return emu::bit_cast<unsigned int>(v); }
inline double __longlong_as_double(long long v) { return emu::bit_cast<double>(v); }
inline long long __double_as_longlong(double v) { return emu::bit_cast<long long>(v); }

// ---------------------------------------------------------------- vector types
// Alignments as CUDA's vector_types.h documents them (a float4 load is one 16-byte access).
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) double2 { double x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline double2 make_double2(double x, double y) { return double2{x, y}; }
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return uint4{x, y, z, w};
}

// ---------------------------------------------------------------- math
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
// Round-to-nearest arithmetic that is never fused (the host compiler does not contract these
// calls into an FMA).
inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
inline double __dsub_rn(double a, double b) { volatile double r = a - b; return r; }
inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __frcp_rn(float v) { return 1.0f / v; }
inline float __fsqrt_rn(float v) { return std::sqrt(v); }
// Fast intrinsics: the GPU approximates these (documented maximum errors of a few ulp); here
// they are the accurate functions, so results may differ from a GPU's in the last bits.
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float v) { return std::exp(v); }
inline float __exp10f(float v) { return std::pow(10.0f, v); }
inline float __logf(float v) { return std::log(v); }
inline float __log2f(float v) { return std::log2(v); }
inline float __log10f(float v) { return std::log10(v); }
inline float __sinf(float v) { return std::sin(v); }
inline float __cosf(float v) { return std::cos(v); }
inline float __tanf(float v) { return std::tan(v); }
inline float __powf(float a, float b) { return std::pow(a, b); }
// Clamp to [0, 1]; NaN gives 0.
inline float __saturatef(float v) { return v >= 1.0f ? 1.0f : (v > 0.0f ? v : 0.0f); }
// Standard normal CDF: 0.5·erfc(-x/√2) (float evaluated in double, then rounded).
inline double normcdf(double v) { return 0.5 * std::erfc(-v * M_SQRT1_2); }
inline float normcdff(float v) { return (float)normcdf(v); }

// Classification and float min/max reachable unqualified, as in device code.
using std::fmaxf;
using std::fminf;
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

// ---------------------------------------------------------------- min and max
// CUDA's overload set: same-type integers and floats, and signed with unsigned of one width
// giving the unsigned type (the signed operand converted as C does). A call that matches none
// best (say size_t with unsigned int) is ambiguous here as it is under nvcc. Float min/max
// ignore a NaN operand (fminf/fmaxf). std::min/max stay visible for other types.
using std::max;
using std::min;
#define EMU_MINMAX(R, A, B)                                       \
    inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; }  \
    inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
#define EMU_MINMAX_INT(S, U) \
    EMU_MINMAX(S, S, S) EMU_MINMAX(U, U, U) EMU_MINMAX(U, S, U) EMU_MINMAX(U, U, S)
EMU_MINMAX_INT(int, unsigned int)
EMU_MINMAX_INT(long, unsigned long)
EMU_MINMAX_INT(long long, unsigned long long)
#undef EMU_MINMAX_INT
#undef EMU_MINMAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(float a, double b) { return std::fmin((double)a, b); }
inline double max(float a, double b) { return std::fmax((double)a, b); }
inline double min(double a, float b) { return std::fmin(a, (double)b); }
inline double max(double a, float b) { return std::fmax(a, (double)b); }
inline unsigned int umin(unsigned int a, unsigned int b) { return min(a, b); }
inline unsigned int umax(unsigned int a, unsigned int b) { return max(a, b); }
inline long long llmin(long long a, long long b) { return min(a, b); }
inline long long llmax(long long a, long long b) { return max(a, b); }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return min(a, b); }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return max(a, b); }
