// IEEE binary16 (__half) and bfloat16 (__nv_bfloat16) for the emulator (see cuda_emu.h), with
// the interface cuda_fp16.h / cuda_bf16.h give device code on sm_90 (written from the CUDA Math
// API documentation, not from NVIDIA's headers).
//
// Every operation is correctly rounded to nearest even: the operands are widened exactly to
// double, the operation runs in double and the result is rounded once to 16 bits. Double has
// 53 >= 2p + 2 significand bits (p = 11 for half, 8 for bf16), so that single double operation
// followed by one rounding equals the correctly rounded result for + - * / and sqrt. A NaN result
// is the canonical NaN 0x7fff, as the hardware produces. Elementary functions (hexp, hsin, ...)
// are rounded from double libm values: within CUDA's documented error bounds, not bit-identical
// to the GPU's approximations.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

struct __half_raw {
    unsigned short x;
};
struct __nv_bfloat16_raw {
    unsigned short x;
};

namespace emu {
namespace fp {

// A binary floating-point format of `width` bits with `p` significand bits (the implicit one
// included), smallest normal exponent `emin`, largest exponent `emax`; the encodings (sign bit
// clear) of its largest finite value, of infinity (0: none) and of its canonical NaN.
struct Format {
    int width, p, emin, emax;
    uint32_t max_finite, inf, nan;
};

// Round half to even of a non-negative double to an integer (exact: no rounding mode involved).
inline double round_half_even(double s) {
    const double f = std::floor(s), d = s - f;
    return (d > 0.5 || (d == 0.5 && std::fmod(f, 2.0) != 0.0)) ? f + 1.0 : f;
}

// `v` rounded once to nearest even in format `f`; a magnitude beyond its largest finite value
// becomes `overflow` (infinity for IEEE rounding, the largest finite value when saturating).
inline uint32_t encode(double v, const Format& f, uint32_t overflow) {
    if (std::isnan(v)) return f.nan;
    const uint32_t sign = std::signbit(v) ? 1u << (f.width - 1) : 0u;
    const double a = std::fabs(v);
    if (a == 0.0) return sign;
    int k;
    std::frexp(a, &k);  // a = m·2^k with 0.5 <= m < 1: the exponent of a is k - 1
    if (std::isinf(a) || k - 1 > f.emax) return sign | overflow;
    // Quantum 2^q at a's exponent (the subnormal quantum below emin); r = a / 2^q rounded.
    const int qmin = f.emin - (f.p - 1), q = std::max(k - 1, f.emin) - (f.p - 1);
    const uint32_t r = (uint32_t)round_half_even(std::ldexp(a, -q));
    // Exponent field and significand add up (r = 2^p when rounding carried into the exponent).
    const uint32_t mag = ((uint32_t)(q - qmin) << (f.p - 1)) + r;
    return sign | (mag > f.max_finite ? overflow : mag);
}
inline uint32_t encode(double v, const Format& f) { return encode(v, f, f.inf); }

// The exact value of encoding `bits` of format `f`.
inline double decode(uint32_t bits, const Format& f) {
    const uint32_t sign_bit = 1u << (f.width - 1), mag = bits & (sign_bit - 1);
    const int mbits = f.p - 1, qmin = f.emin - mbits;
    const uint32_t e = mag >> mbits, m = mag & ((1u << mbits) - 1);
    double a;
    if (mag > f.max_finite)
        a = (f.inf != 0 && mag == f.inf) ? HUGE_VAL : std::numeric_limits<double>::quiet_NaN();
    else if (e == 0)
        a = std::ldexp((double)m, qmin);  // subnormal
    else
        a = std::ldexp((double)(m | (1u << mbits)), qmin + (int)e - 1);
    return (bits & sign_bit) ? -a : a;
}

// An integer as a double: exact below 2^53; beyond, rounded to odd (a sticky last bit), so that
// a second rounding to at most 51 bits is the correct rounding of the integer itself.
template <typename I> double int_to_double(I v) {
    const bool neg = std::is_signed<I>::value && (long long)v < 0;
    const unsigned long long u = neg ? 0ull - (unsigned long long)v : (unsigned long long)v;
    double d = (double)u;
    if (u >= (1ull << 53)) {
        const int s = 11 - __builtin_clzll(u);  // drop s bits, keep 53
        d = std::ldexp((double)((u >> s) | ((u & ((1ull << s) - 1)) != 0)), s);
    }
    return neg ? -d : d;
}

// Float to integer, rounding toward zero and saturating, NaN to 0 (the GPU's cvt.rzi).
template <typename I> I to_int_rz(double v) {
    if (std::isnan(v)) return 0;
    const double t = std::trunc(v);
    if (t <= (double)std::numeric_limits<I>::min()) return std::numeric_limits<I>::min();
    if (t >= (double)std::numeric_limits<I>::max()) return std::numeric_limits<I>::max();
    return (I)t;
}

struct HalfTraits {
    static constexpr Format fmt{16, 11, -14, 15, 0x7bffu, 0x7c00u, 0x7fffu};
    using Raw = __half_raw;
};
struct Bf16Traits {
    static constexpr Format fmt{16, 8, -126, 127, 0x7f7fu, 0x7f80u, 0x7fffu};
    using Raw = __nv_bfloat16_raw;
};

// The integer types a 16-bit float converts from (constructors) and to (conversion operators).
#define EMU_FP_FROM_INTS(X)                                                 \
    X(short) X(unsigned short) X(int) X(unsigned int) X(long) X(unsigned long) \
    X(long long) X(unsigned long long)
#define EMU_FP_TO_INTS(X) X(char) X(signed char) X(unsigned char) EMU_FP_FROM_INTS(X)

// The value class behind __half and __nv_bfloat16. Its operators are hidden friends taking two
// values of the class, so, as in CUDA, `h + h` is a 16-bit operation and `h + 1.0f` is ambiguous.
template <typename Tr> struct Small {
    using Raw = typename Tr::Raw;
    unsigned short __x;

    Small() = default;
    constexpr Small(Raw r) : __x(r.x) {}
    Small& operator=(Raw r) {
        __x = r.x;
        return *this;
    }
    operator Raw() const { return Raw{__x}; }

    static Small from_double(double v) { return Small(Raw{(unsigned short)encode(v, Tr::fmt)}); }
    double to_double() const { return decode(__x, Tr::fmt); }

    // Implicit conversions from the arithmetic types, rounded to nearest even.
    Small(float v) : __x((unsigned short)encode(v, Tr::fmt)) {}
    Small(double v) : __x((unsigned short)encode(v, Tr::fmt)) {}
#define EMU_FP_CTOR(I) \
    Small(I v) : __x((unsigned short)encode(int_to_double(v), Tr::fmt)) {}
    EMU_FP_FROM_INTS(EMU_FP_CTOR)
#undef EMU_FP_CTOR

    // Conversions out: exact to float; to integers toward zero, saturating, NaN to 0; to bool
    // true unless +-0 (NaN is true).
    operator float() const { return (float)to_double(); }
#define EMU_FP_CONV(I) \
    operator I() const { return to_int_rz<I>(to_double()); }
    EMU_FP_TO_INTS(EMU_FP_CONV)
#undef EMU_FP_CONV
    operator bool() const { return (__x & 0x7fffu) != 0; }

    bool is_nan() const { return (__x & 0x7fffu) > Tr::fmt.inf; }

    friend Small operator+(Small a, Small b) { return from_double(a.to_double() + b.to_double()); }
    friend Small operator-(Small a, Small b) { return from_double(a.to_double() - b.to_double()); }
    friend Small operator*(Small a, Small b) { return from_double(a.to_double() * b.to_double()); }
    friend Small operator/(Small a, Small b) { return from_double(a.to_double() / b.to_double()); }
    friend Small& operator+=(Small& a, Small b) { return a = a + b; }
    friend Small& operator-=(Small& a, Small b) { return a = a - b; }
    friend Small& operator*=(Small& a, Small b) { return a = a * b; }
    friend Small& operator/=(Small& a, Small b) { return a = a / b; }
    friend Small operator+(Small a) { return a; }
    // Negation flips the sign bit only (a NaN stays the same NaN but for its sign), as __hneg.
    friend Small operator-(Small a) { return Small(Raw{(unsigned short)(a.__x ^ 0x8000u)}); }
    friend Small& operator++(Small& a) { return a += Small(1); }
    friend Small& operator--(Small& a) { return a -= Small(1); }
    friend Small operator++(Small& a, int) { Small old = a; ++a; return old; }
    friend Small operator--(Small& a, int) { Small old = a; --a; return old; }

    // IEEE comparisons: false when either side is NaN, except != (unordered, as __hneu).
    friend bool operator==(Small a, Small b) { return a.to_double() == b.to_double(); }
    friend bool operator!=(Small a, Small b) { return a.to_double() != b.to_double(); }
    friend bool operator<(Small a, Small b) { return a.to_double() < b.to_double(); }
    friend bool operator<=(Small a, Small b) { return a.to_double() <= b.to_double(); }
    friend bool operator>(Small a, Small b) { return a.to_double() > b.to_double(); }
    friend bool operator>=(Small a, Small b) { return a.to_double() >= b.to_double(); }
};

}  // namespace fp
}  // namespace emu

using __half = emu::fp::Small<emu::fp::HalfTraits>;
using __nv_bfloat16 = emu::fp::Small<emu::fp::Bf16Traits>;
using half = __half;
using nv_bfloat16 = __nv_bfloat16;

// Two-lane vectors (4-byte aligned, as CUDA's) and their lane-wise operations.
struct alignas(4) __half2 {
    __half x, y;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
using half2 = __half2;
using nv_bfloat162 = __nv_bfloat162;

// ---------------------------------------------------------------- conversions
inline float __half2float(__half h) { return (float)h.to_double(); }
inline __half __float2half(float v) { return __half::from_double(v); }
inline __half __float2half_rn(float v) { return __half::from_double(v); }
inline __half __double2half(double v) { return __half::from_double(v); }  // one rounding
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b.to_double(); }
inline __nv_bfloat16 __float2bfloat16(float v) { return __nv_bfloat16::from_double(v); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return __nv_bfloat16::from_double(v); }
inline __nv_bfloat16 __double2bfloat16(double v) { return __nv_bfloat16::from_double(v); }

// Integer conversions: to a 16-bit float rounded to nearest even (_rn), from one toward zero
// (_rz), saturating, NaN to 0.
#define EMU_FP_INT_CONV(T, P, NAME, I)                                                       \
    inline T __##NAME##2##P##_rn(I v) { return T(v); }                                     \
    inline I __##P##2##NAME##_rz(T h) { return emu::fp::to_int_rz<I>(h.to_double()); }
#define EMU_FP_INT_CONVS(T, P)                                                              \
    EMU_FP_INT_CONV(T, P, short, short) EMU_FP_INT_CONV(T, P, ushort, unsigned short)         \
    EMU_FP_INT_CONV(T, P, int, int) EMU_FP_INT_CONV(T, P, uint, unsigned int)                 \
    EMU_FP_INT_CONV(T, P, ll, long long) EMU_FP_INT_CONV(T, P, ull, unsigned long long)
EMU_FP_INT_CONVS(__half, half)
EMU_FP_INT_CONVS(__nv_bfloat16, bfloat16)
#undef EMU_FP_INT_CONVS
#undef EMU_FP_INT_CONV

// Bit reinterpretations.
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return (short)h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
inline __half __short_as_half(short s) { return __half(__half_raw{(unsigned short)s}); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return (short)h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    return __nv_bfloat16(__nv_bfloat16_raw{u});
}
inline __nv_bfloat16 __short_as_bfloat16(short s) {
    return __nv_bfloat16(__nv_bfloat16_raw{(unsigned short)s});
}

// ---------------------------------------------------------------- arithmetic, comparisons, math
namespace emu {
namespace fp {

template <typename T> T canonical_nan() { return T(typename T::Raw{0x7fff}); }
template <typename T> T apply(double (*fn)(double), T a) {
    return T::from_double(fn(a.to_double()));
}
inline double rsqrt_d(double v) { return 1.0 / std::sqrt(v); }
inline double rcp_d(double v) { return 1.0 / v; }
inline double exp10_d(double v) { return std::pow(10.0, v); }
inline double rint_d(double v) { return std::nearbyint(v); }  // ties to even (default mode)

// a·b + c rounded once: the product of two 16-bit values is exact in double; the sum is rounded
// to odd (TwoSum gives its exact error), which a second rounding to 16 bits cannot spoil.
template <typename T> T fma(T a, T b, T c) {
    const double x = a.to_double() * b.to_double(), y = c.to_double(), s = x + y;
    if (!std::isfinite(s)) return T::from_double(s);
    const double bb = s - x, err = (x - (s - bb)) + (y - bb);
    double r = s;
    if (err != 0.0) {
        uint64_t bits;
        std::memcpy(&bits, &s, 8);
        if ((bits & 1) == 0) r = std::nextafter(s, err > 0 ? HUGE_VAL : -HUGE_VAL);
    }
    return T::from_double(r);
}

// __hmax/__hmin return the other operand when one is NaN (canonical NaN when both are);
// the _nan variants return the canonical NaN when either is. Both order -0 below +0.
template <typename T> T pick(T a, T b, bool want_max, bool nan_wins) {
    const bool na = a.is_nan(), nb = b.is_nan();
    if (na || nb) return (nan_wins || (na && nb)) ? canonical_nan<T>() : (na ? b : a);
    const double x = a.to_double(), y = b.to_double();
    if (x == y) return (std::signbit(x) != want_max) ? a : b;  // +-0: by sign
    return ((x > y) == want_max) ? a : b;
}

}  // namespace fp
}  // namespace emu

// Stamps every function for both __half and __nv_bfloat16 (non-template overloads, as CUDA
// declares them).
#define EMU_FP_BOTH(X) X(__half) X(__nv_bfloat16)

#define EMU_FP_FUNCS(T)                                                                          \
    inline T __hadd(T a, T b) { return a + b; }                                                 \
    inline T __hsub(T a, T b) { return a - b; }                                                 \
    inline T __hmul(T a, T b) { return a * b; }                                                 \
    inline T __hdiv(T a, T b) { return a / b; }                                                 \
    inline T __hadd_rn(T a, T b) { return a + b; }                                              \
    inline T __hsub_rn(T a, T b) { return a - b; }                                              \
    inline T __hmul_rn(T a, T b) { return a * b; }                                              \
    inline T __hfma(T a, T b, T c) { return emu::fp::fma(a, b, c); }                           \
    inline T __hneg(T a) { return -a; }                                                         \
    inline T __habs(T a) { return T(typename T::Raw{(unsigned short)(a.__x & 0x7fffu)}); }      \
    inline bool __hisnan(T a) { return a.is_nan(); }                                             \
    inline int __hisinf(T a) { return std::isinf(a.to_double()) ? ((a.__x >> 15) ? -1 : 1) : 0; } \
    inline T __hmax(T a, T b) { return emu::fp::pick(a, b, true, false); }                      \
    inline T __hmin(T a, T b) { return emu::fp::pick(a, b, false, false); }                     \
    inline T __hmax_nan(T a, T b) { return emu::fp::pick(a, b, true, true); }                   \
    inline T __hmin_nan(T a, T b) { return emu::fp::pick(a, b, false, true); }                  \
    inline bool __heq(T a, T b) { return a == b; }                                              \
    inline bool __hne(T a, T b) { return a < b || a > b; } /* ordered: false on NaN */           \
    inline bool __hlt(T a, T b) { return a < b; }                                               \
    inline bool __hle(T a, T b) { return a <= b; }                                              \
    inline bool __hgt(T a, T b) { return a > b; }                                               \
    inline bool __hge(T a, T b) { return a >= b; }                                              \
    inline bool __hequ(T a, T b) { return !(a < b || a > b); } /* unordered: true on NaN */    \
    inline bool __hneu(T a, T b) { return a != b; }                                             \
    inline bool __hltu(T a, T b) { return !(a >= b); }                                          \
    inline bool __hleu(T a, T b) { return !(a > b); }                                           \
    inline bool __hgtu(T a, T b) { return !(a <= b); }                                          \
    inline bool __hgeu(T a, T b) { return !(a < b); }                                           \
    inline T hsqrt(T a) { return emu::fp::apply<T>(std::sqrt, a); }                            \
    inline T hrsqrt(T a) { return emu::fp::apply<T>(emu::fp::rsqrt_d, a); }                     \
    inline T hrcp(T a) { return emu::fp::apply<T>(emu::fp::rcp_d, a); }                         \
    inline T hexp(T a) { return emu::fp::apply<T>(std::exp, a); }                              \
    inline T hexp2(T a) { return emu::fp::apply<T>(std::exp2, a); }                            \
    inline T hexp10(T a) { return emu::fp::apply<T>(emu::fp::exp10_d, a); }                    \
    inline T hlog(T a) { return emu::fp::apply<T>(std::log, a); }                              \
    inline T hlog2(T a) { return emu::fp::apply<T>(std::log2, a); }                            \
    inline T hlog10(T a) { return emu::fp::apply<T>(std::log10, a); }                          \
    inline T hsin(T a) { return emu::fp::apply<T>(std::sin, a); }                              \
    inline T hcos(T a) { return emu::fp::apply<T>(std::cos, a); }                              \
    inline T htanh(T a) { return emu::fp::apply<T>(std::tanh, a); }                            \
    inline T hfloor(T a) { return emu::fp::apply<T>(std::floor, a); }                          \
    inline T hceil(T a) { return emu::fp::apply<T>(std::ceil, a); }                            \
    inline T htrunc(T a) { return emu::fp::apply<T>(std::trunc, a); }                          \
    inline T hrint(T a) { return emu::fp::apply<T>(emu::fp::rint_d, a); }
EMU_FP_BOTH(EMU_FP_FUNCS)
#undef EMU_FP_FUNCS

// ---------------------------------------------------------------- two-lane vectors
#define EMU_FP_VEC(V, T, MAKE)                                                   \
    inline V MAKE(T x, T y) { return V{x, y}; }                                  \
    inline V __hadd2(V a, V b) { return V{a.x + b.x, a.y + b.y}; }               \
    inline V __hsub2(V a, V b) { return V{a.x - b.x, a.y - b.y}; }               \
    inline V __hmul2(V a, V b) { return V{a.x * b.x, a.y * b.y}; }               \
    inline V __hdiv2(V a, V b) { return V{a.x / b.x, a.y / b.y}; }               \
    inline V __hmax2(V a, V b) { return V{__hmax(a.x, b.x), __hmax(a.y, b.y)}; } \
    inline V __hmin2(V a, V b) { return V{__hmin(a.x, b.x), __hmin(a.y, b.y)}; }
EMU_FP_VEC(__half2, __half, make_half2)
EMU_FP_VEC(__nv_bfloat162, __nv_bfloat16, make_bfloat162)
#undef EMU_FP_VEC
inline __half2 __halves2half2(__half x, __half y) { return __half2{x, y}; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) {
    return __nv_bfloat162{x, y};
}
