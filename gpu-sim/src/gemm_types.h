// The data types, arithmetic modes and problem description of the simulated cuBLAS GEMMs
// (gemm.h runs a Problem; the cuBLAS entry points build one and check its extents).
#pragma once

#include <cstddef>
#include <cstdint>

namespace gemm {

// ------------------------------------------------------------------------------ data types
enum class Type { F32, F64, F16, BF16 };

inline size_t type_size(Type t) {
    switch (t) {
        case Type::F64: return 8;
        case Type::F32: return 4;
        default: return 2;
    }
}
inline const char* type_name(Type t) {
    switch (t) {
        case Type::F32: return "f32";
        case Type::F64: return "f64";
        case Type::F16: return "f16";
        default: return "bf16";
    }
}

enum class Mode { F64, F32, F32_TF32, F32_F16, F32_BF16, F16 };

inline const char* mode_name(Mode m) {
    switch (m) {
        case Mode::F64: return "f64";
        case Mode::F32: return "f32";
        case Mode::F32_TF32: return "f32 (tf32 inputs)";
        case Mode::F32_F16: return "f32 (f16 inputs)";
        case Mode::F32_BF16: return "f32 (bf16 inputs)";
        default: return "f16 accumulation";
    }
}

// The data type combinations each mode takes (A and B always of one type):
//   F64: f64/f64/f64; F16: f16/f16/f16;
//   F32 and its _FAST variants: A=B in {f32, f16, bf16}, C = A's type or f32.
inline bool supported(Mode mode, Type a, Type b, Type c) {
    if (a != b) return false;
    switch (mode) {
        case Mode::F64: return a == Type::F64 && c == Type::F64;
        case Mode::F16: return a == Type::F16 && c == Type::F16;
        default: return a != Type::F64 && (c == a || c == Type::F32);
    }
}

// ------------------------------------------------------------------------------ the problem
struct Problem {
    bool trans_a = false, trans_b = false;  // op(X) = X^T (CUBLAS_OP_T or _C for real data)
    int64_t m = 0, n = 0, k = 0;
    Type a_type = Type::F32, b_type = Type::F32, c_type = Type::F32;
    const void* a = nullptr;
    int64_t lda = 0, stride_a = 0;  // strides in elements
    const void* b = nullptr;
    int64_t ldb = 0, stride_b = 0;
    void* c = nullptr;
    int64_t ldc = 0, stride_c = 0;
    int64_t batch = 1;
    Mode mode = Mode::F32;
    // The scale factors, exactly (they come from float, double or half values).
    double alpha = 1, beta = 0;
};

// The bytes a column-major matrix (rows x cols, leading dimension ld) and its `batch - 1`
// followers `stride` elements apart can touch, relative to its pointer: [*lo, *lo + *len).
// *len is 0 when there is nothing to touch. False if the range does not fit in 63 bits.
inline bool extent(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch,
                   size_t elem, int64_t* lo, uint64_t* len) {
    *lo = 0;
    *len = 0;
    if (rows <= 0 || cols <= 0 || batch <= 0) return true;
    __int128 one = (__int128)ld * (cols - 1) + rows;  // elements of one matrix
    __int128 span = (__int128)stride * (batch - 1);
    __int128 first = span < 0 ? span : 0;
    __int128 last = one + (span > 0 ? span : 0);
    __int128 lo_b = first * (__int128)elem, len_b = (last - first) * (__int128)elem;
    const __int128 lim = (__int128)1 << 62;
    if (lo_b < -lim || lo_b > lim || len_b > lim) return false;
    *lo = (int64_t)lo_b;
    *len = (uint64_t)len_b;
    return true;
}

}  // namespace gemm
