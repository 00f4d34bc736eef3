// The 8-bit floats of cuda_fp8.h (__nv_fp8_e4m3, __nv_fp8_e5m2) for the emulator, written from
// the CUDA Math API documentation (FP8 intrinsics) and the OCP 8-bit floating point formats:
//   E4M3: bias 7, no infinity, NaN = S.1111.111, largest finite 448, smallest subnormal 2^-9;
//   E5M2: bias 15, IEEE-like (infinity S.11111.00), largest finite 57344, smallest 2^-16.
// Conversions into fp8 round once to nearest even from the exact source value; the class
// constructors saturate (__NV_SATFINITE): a magnitude beyond the largest finite value, infinity
// included, becomes the largest finite value of its sign, and NaN stays NaN.
#pragma once

#include "emu_half.h"

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };

namespace emu {
namespace fp {
struct E4M3Traits {
    static constexpr Format fmt{8, 4, -6, 8, 0x7eu, 0u, 0x7fu};
    static constexpr __nv_fp8_interpretation_t kind = __NV_E4M3;
};
struct E5M2Traits {
    static constexpr Format fmt{8, 3, -14, 15, 0x7bu, 0x7cu, 0x7fu};
    static constexpr __nv_fp8_interpretation_t kind = __NV_E5M2;
};
inline const Format& fp8_format(__nv_fp8_interpretation_t kind) {
    return kind == __NV_E4M3 ? E4M3Traits::fmt : E5M2Traits::fmt;
}
// Without saturation an overflow is infinity in E5M2 and NaN in E4M3 (which has no infinity).
inline __nv_fp8_storage_t to_fp8(double v, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
    const Format& f = fp8_format(kind);
    const uint32_t overflow = sat == __NV_SATFINITE ? f.max_finite : (f.inf ? f.inf : f.nan);
    return (__nv_fp8_storage_t)encode(v, f, overflow);
}
}  // namespace fp
}  // namespace emu

inline __nv_fp8_storage_t __nv_cvt_double_to_fp8(double v, __nv_saturation_t sat,
                                                 __nv_fp8_interpretation_t kind) {
    return emu::fp::to_fp8(v, sat, kind);
}
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float v, __nv_saturation_t sat,
                                                __nv_fp8_interpretation_t kind) {
    return emu::fp::to_fp8(v, sat, kind);
}
inline __nv_fp8_storage_t __nv_cvt_halfraw_to_fp8(__half_raw v, __nv_saturation_t sat,
                                                  __nv_fp8_interpretation_t kind) {
    return emu::fp::to_fp8(__half(v).to_double(), sat, kind);
}
inline __nv_fp8_storage_t __nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw v, __nv_saturation_t sat,
                                                      __nv_fp8_interpretation_t kind) {
    return emu::fp::to_fp8(__nv_bfloat16(v).to_double(), sat, kind);
}
// Every fp8 value is exact in half; an E4M3 NaN becomes the canonical half NaN 0x7fff.
inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t kind) {
    if (kind == __NV_E5M2) return __half_raw{(unsigned short)(x << 8)};  // E5M2 is half's top byte
    return __half::from_double(emu::fp::decode(x, emu::fp::E4M3Traits::fmt));
}

// The value classes. As in cuda_fp8.h every conversion in or out is explicit; integers convert
// through float; conversions to integers round toward zero, saturate, and take NaN to 0.
namespace emu {
namespace fp {
template <typename Tr> struct Fp8 {
    __nv_fp8_storage_t __x;

    Fp8() = default;
    explicit Fp8(float v) : __x(to_fp8(v, __NV_SATFINITE, Tr::kind)) {}
    explicit Fp8(double v) : __x(to_fp8(v, __NV_SATFINITE, Tr::kind)) {}
    explicit Fp8(__half v) : __x(to_fp8(v.to_double(), __NV_SATFINITE, Tr::kind)) {}
    explicit Fp8(__nv_bfloat16 v) : __x(to_fp8(v.to_double(), __NV_SATFINITE, Tr::kind)) {}
#define EMU_FP8_CTOR(I) \
    explicit Fp8(I v) : __x(to_fp8((float)v, __NV_SATFINITE, Tr::kind)) {}
    EMU_FP_FROM_INTS(EMU_FP8_CTOR)
#undef EMU_FP8_CTOR

    double to_double() const { return decode(__x, Tr::fmt); }
    explicit operator float() const { return (float)to_double(); }
    explicit operator double() const { return to_double(); }
    explicit operator __half_raw() const { return __nv_cvt_fp8_to_halfraw(__x, Tr::kind); }
    explicit operator __half() const { return __half(__nv_cvt_fp8_to_halfraw(__x, Tr::kind)); }
    explicit operator __nv_bfloat16() const { return __nv_bfloat16::from_double(to_double()); }
#define EMU_FP8_CONV(I) \
    explicit operator I() const { return to_int_rz<I>(to_double()); }
    EMU_FP_TO_INTS(EMU_FP8_CONV)
#undef EMU_FP8_CONV
    explicit operator bool() const { return (__x & 0x7fu) != 0; }  // +-0 only are false
};
}  // namespace fp
}  // namespace emu

using __nv_fp8_e4m3 = emu::fp::Fp8<emu::fp::E4M3Traits>;
using __nv_fp8_e5m2 = emu::fp::Fp8<emu::fp::E5M2Traits>;
