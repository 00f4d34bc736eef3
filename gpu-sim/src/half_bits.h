// The 16-bit and TF32 conversions and roundings of the simulated cuBLAS GEMMs (gemm.h), and
// the f16/bf16 storage wrappers its kernels load and store through.
#pragma once

#include <cstdint>
#include <cstring>

namespace gemm {

// --------------------------------------------------------------------- 16-bit conversions
// Bit-level, round to nearest even, a NaN becomes the canonical NaN 0x7fff (as the GPU's cvt
// and tests/emu/emu_half.h produce). Written here rather than taken from emu_half.h because
// these run once per element of every packed operand and output: that header converts through
// frexp/ldexp in double, about 20 times slower. gpu-sim/tests/blas_ref.cpp checks them against
// emu_half.h's __half2float/__float2half/__bfloat162float/__float2bfloat16 (every 16-bit
// pattern, and floats around every rounding boundary).
inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint32_t float_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
        const float v = (float)m * 0x1p-24f;
        return sign ? -v : v;
    }
    if (e == 31) return bits_to_float(sign | 0x7f800000u | (m << 13));  // Inf, NaN
    return bits_to_float(sign | ((e + 112u) << 23) | (m << 13));        // rebias 15 -> 127
}

inline uint16_t float_to_half(float x) {
    const uint32_t f = float_to_bits(x), sign = (f >> 16) & 0x8000u, a = f & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;  // NaN
    if (a >= 0x38800000u) {               // >= 2^-14: a normal half (or Inf)
        if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);  // >= 2^16 (and Inf): Inf
        uint32_t h = (a - 0x38000000u) >> 13;                     // exponent rebased, 10 bits kept
        const uint32_t rem = a & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;  // may carry up to Inf: right
        return (uint16_t)(sign | h);
    }
    if (a <= 0x33000000u) return (uint16_t)sign;  // <= 2^-25 (half the smallest subnormal): 0
    // A subnormal half: the value in units of 2^-24, rounded (2^-25 < |x| < 2^-14).
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;  // 14 .. 24
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
    if (rem > mid || (rem == mid && (h & 1u))) h++;  // may become the smallest normal: right
    return (uint16_t)(sign | h);
}

inline float bf16_to_float(uint16_t b) {
    return bits_to_float((uint32_t)b << 16);
}

inline uint16_t float_to_bf16(float x) {
    uint32_t f = float_to_bits(x);
    if ((f & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN
    f += 0x7fffu + ((f >> 16) & 1u);                      // carries up to Inf where it should
    return (uint16_t)(f >> 16);
}

// Rounds to TF32: 1 sign bit, 8 exponent bits, 10 explicit mantissa bits, round to nearest
// even (a carry into the exponent is right, up to infinity); Inf and NaN unchanged.
inline float round_tf32(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return x;
    u += 0xfffu + ((u >> 13) & 1u);
    u &= ~0x1fffu;
    std::memcpy(&x, &u, 4);
    return x;
}
inline float round_f16(float x) {
    return half_to_float(float_to_half(x));
}
inline float round_bf16(float x) {
    return bf16_to_float(float_to_bf16(x));
}

// Rounds a double once, to nearest even, to binary16 (bit-level, as float_to_half).
inline uint16_t double_to_half(double x) {
    uint64_t u;
    std::memcpy(&u, &x, 8);
    const uint16_t sign = (uint16_t)((u >> 48) & 0x8000u);
    const uint64_t a = u & 0x7fffffffffffffffull, mant = a & 0xfffffffffffffull;
    const int e = (int)(a >> 52);                               // biased by 1023
    if (a > 0x7ff0000000000000ull) return 0x7fffu;              // NaN
    if (e >= 1023 - 14) {                                       // >= 2^-14: normal (or Inf)
        if (e >= 1023 + 16) return (uint16_t)(sign | 0x7c00u);  // >= 2^16: Inf
        uint32_t h = ((uint32_t)(e - 1008) << 10) | (uint32_t)(mant >> 42);
        const uint64_t rem = mant & ((1ull << 42) - 1), mid = 1ull << 41;
        if (rem > mid || (rem == mid && (h & 1u))) h++;  // may carry up to Inf: right
        return (uint16_t)(sign | h);
    }
    if (a <= 0x3e60000000000000ull) return sign;  // <= 2^-25: 0
    // A subnormal half: |x| / 2^-24 rounded; 2^-25 < |x| < 2^-14, so shift is 43 .. 53.
    const uint64_t m = mant | (1ull << 52);
    const int shift = 1051 - e;
    uint32_t h = (uint32_t)(m >> shift);
    const uint64_t rem = m & ((1ull << shift) - 1), mid = 1ull << (shift - 1);
    if (rem > mid || (rem == mid && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}
inline float round_f16_from_double(double x) {
    return half_to_float(double_to_half(x));
}

// Storage wrappers, so that overloads can tell f16 from bf16.
struct H16 {
    uint16_t v;
};
struct B16 {
    uint16_t v;
};
inline float widen(float x) {
    return x;
}
inline double widen(double x) {
    return x;
}
inline float widen(H16 x) {
    return half_to_float(x.v);
}
inline float widen(B16 x) {
    return bf16_to_float(x.v);
}
inline void narrow(float v, float* p) {
    *p = v;
}
inline void narrow(double v, double* p) {
    *p = v;
}
inline void narrow(float v, H16* p) {
    p->v = float_to_half(v);
}
inline void narrow(float v, B16* p) {
    p->v = float_to_bf16(v);
}

}  // namespace gemm
