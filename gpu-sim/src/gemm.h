// The arithmetic of the simulated cuBLAS GEMMs, callable without the driver (gpu-sim/tests/
// blas_ref.cpp tests it directly; cublas_gemm.cpp and cublas_level2.cpp run it as stream work).
//
// C = alpha * op(A) * op(B) + beta * C, column-major, op(A) m x k, op(B) k x n, C m x n, for
// `batch` matrices `stride_*` elements apart (cuBLAS reference, "cublas<t>gemm" and
// "cublasGemmStridedBatchedEx"). Written from the documentation; the arithmetic of each mode:
//
//   F64        f64 data, products and a double accumulator.
//   F32        f32/f16/bf16 data converted exactly to float, float products, float accumulator,
//              the result rounded once to the storage type (round to nearest even).
//              (CUBLAS_COMPUTE_32F, _32F_PEDANTIC, and the _FAST_* types with 16-bit data,
//              whose inputs already are 16-bit: the tensor cores take them as they are.)
//   F32_TF32   as F32, but f32 inputs are first rounded to TF32 (10 explicit mantissa bits,
//              round to nearest even), as the tensor cores do (CUBLAS_COMPUTE_32F_FAST_TF32).
//   F32_F16    as F32, but f32 inputs are first rounded to binary16 (_32F_FAST_16F).
//   F32_BF16   as F32, but f32 inputs are first rounded to bfloat16 (_32F_FAST_16BF).
//   F16        f16 data, a binary16 accumulator rounded after every multiply-add (the product
//              of two halves is exact in float, the sum exact in double for the magnitudes
//              where it matters, then rounded once to binary16), then alpha * acc rounded to
//              binary16, then + beta * C rounded once (CUBLAS_COMPUTE_16F, _16F_PEDANTIC).
//
// Summation order (every mode): each element of C is one plain loop over p = 0 .. k-1,
// acc = 0; acc += op(A)[i,p] * op(B)[p,j], then C = alpha * acc (+ beta * C). No split-k, no
// pairwise or blocked partial sums: the blocking below only changes which elements are
// computed together, not the order of any element's additions, so the result does not depend
// on the blocking or on the vector width. (x86-64's baseline has no FMA, so a*b+c is never
// contracted and the result equals a scalar loop bit for bit, which blas_ref.cpp checks; a
// build for a target with FMA may contract, differently in different loops.)
//
// Special cases (the reference BLAS's rules; cuBLAS documents the beta == 0 one):
//   m == 0 or n == 0: nothing is touched;
//   k == 0 or alpha == 0: C = beta * C, A and B are not read;
//   beta == 0: C is not read (NaN or Inf in C does not propagate), C = alpha * op(A) op(B).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_types.h"
#include "half_bits.h"

namespace gemm {

namespace detail {

template <class T>
struct Vec;
template <>
struct Vec<float> {
    typedef float type __attribute__((vector_size(16)));
    static constexpr int lanes = 4;
};
template <>
struct Vec<double> {
    typedef double type __attribute__((vector_size(16)));
    static constexpr int lanes = 2;
};

constexpr int NR = 6;  // columns of C per micro tile
template <class T>
constexpr int mr() {
    return 2 * Vec<T>::lanes;
}  // rows per micro tile

// The micro kernel: out (MR x NR, column-major) = sum over p of ap[p] (MR rows) * bp[p] (NR
// columns), each element accumulated in order p = 0 .. k-1 from 0.
template <class T>
inline void micro(int64_t k, const T* __restrict ap, const T* __restrict bp, T* __restrict out) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes, MR = 2 * L;
    V c00 = {}, c01 = {}, c10 = {}, c11 = {}, c20 = {}, c21 = {};
    V c30 = {}, c31 = {}, c40 = {}, c41 = {}, c50 = {}, c51 = {};
    for (int64_t p = 0; p < k; ++p, ap += MR, bp += NR) {
        V a0, a1;
        std::memcpy(&a0, ap, sizeof a0);
        std::memcpy(&a1, ap + L, sizeof a1);
        const T b0 = bp[0], b1 = bp[1], b2 = bp[2], b3 = bp[3], b4 = bp[4], b5 = bp[5];
        c00 += a0 * b0;
        c01 += a1 * b0;
        c10 += a0 * b1;
        c11 += a1 * b1;
        c20 += a0 * b2;
        c21 += a1 * b2;
        c30 += a0 * b3;
        c31 += a1 * b3;
        c40 += a0 * b4;
        c41 += a1 * b4;
        c50 += a0 * b5;
        c51 += a1 * b5;
    }
    std::memcpy(out + 0 * L, &c00, sizeof(V));
    std::memcpy(out + 1 * L, &c01, sizeof(V));
    std::memcpy(out + 2 * L, &c10, sizeof(V));
    std::memcpy(out + 3 * L, &c11, sizeof(V));
    std::memcpy(out + 4 * L, &c20, sizeof(V));
    std::memcpy(out + 5 * L, &c21, sizeof(V));
    std::memcpy(out + 6 * L, &c30, sizeof(V));
    std::memcpy(out + 7 * L, &c31, sizeof(V));
    std::memcpy(out + 8 * L, &c40, sizeof(V));
    std::memcpy(out + 9 * L, &c41, sizeof(V));
    std::memcpy(out + 10 * L, &c50, sizeof(V));
    std::memcpy(out + 11 * L, &c51, sizeof(V));
}

enum class Round { None, TF32, F16, BF16 };

template <class T>
inline void round_all(T* p, size_t n, Round r) {
    if (r == Round::None) return;
    for (size_t i = 0; i < n; i++) {
        float v = (float)p[i];
        v = r == Round::TF32 ? round_tf32(v) : r == Round::F16 ? round_f16(v) : round_bf16(v);
        p[i] = (T)v;
    }
}

// C = beta * C (k == 0 or alpha == 0); C is not read when beta == 0.
template <class T, class SC>
void scale_c(int64_t m, int64_t n, SC* c, int64_t ldc, T beta) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < m; i++) {
            SC* p = c + i + j * ldc;
            narrow(beta == T(0) ? T(0) : (T)(beta * widen(*p)), p);
        }
}

// One matrix of the F64/F32 modes, T the accumulator type.
template <class T, class SA, class SB, class SC>
void blocked(const Problem& pr, const SA* a, const SB* b, SC* c, Round rnd, std::vector<T>& abuf,
             std::vector<T>& bbuf) {
    constexpr int MR = mr<T>();
    const int64_t m = pr.m, n = pr.n, k = pr.k, lda = pr.lda, ldb = pr.ldb, ldc = pr.ldc;
    const T alpha = (T)pr.alpha, beta = (T)pr.beta;
    if (k == 0 || alpha == T(0)) return scale_c<T>(m, n, c, ldc, beta);
    // Rows of op(A) packed per block: about 1 MiB of packed A, whole micro panels.
    int64_t mc = ((int64_t)1 << 20) / (k * (int64_t)sizeof(T));
    mc = std::max<int64_t>(MR, mc / MR * MR);
    mc = std::min<int64_t>(mc, (m + MR - 1) / MR * MR);
    abuf.assign((size_t)(mc * k), T(0));
    bbuf.assign((size_t)(k * NR), T(0));
    T tile[MR * NR];
    for (int64_t ic = 0; ic < m; ic += mc) {
        const int64_t mcur = std::min(mc, m - ic), panels = (mcur + MR - 1) / MR;
        // Pack op(A)[ic .. ic+mcur, 0 .. k) as panels of MR rows: abuf[q][p][r].
        for (int64_t q = 0; q < panels; q++) {
            T* dst = abuf.data() + q * MR * k;
            const int64_t i0 = ic + q * MR, rows = std::min<int64_t>(MR, m - i0);
            if (!pr.trans_a) {
                for (int64_t p = 0; p < k; p++) {
                    const SA* src = a + i0 + p * lda;
                    for (int64_t r = 0; r < rows; r++) dst[p * MR + r] = (T)widen(src[r]);
                    for (int64_t r = rows; r < MR; r++) dst[p * MR + r] = T(0);
                }
            } else {
                for (int64_t r = 0; r < rows; r++) {
                    const SA* src = a + (i0 + r) * lda;
                    for (int64_t p = 0; p < k; p++) dst[p * MR + r] = (T)widen(src[p]);
                }
                for (int64_t r = rows; r < MR; r++)
                    for (int64_t p = 0; p < k; p++) dst[p * MR + r] = T(0);
            }
        }
        round_all(abuf.data(), (size_t)(panels * MR * k), rnd);
        for (int64_t jc = 0; jc < n; jc += NR) {
            const int64_t cols = std::min<int64_t>(NR, n - jc);
            // Pack op(B)[0 .. k, jc .. jc+cols) as bbuf[p][col].
            T* dst = bbuf.data();
            if (!pr.trans_b) {
                for (int64_t cc = 0; cc < cols; cc++) {
                    const SB* src = b + (jc + cc) * ldb;
                    for (int64_t p = 0; p < k; p++) dst[p * NR + cc] = (T)widen(src[p]);
                }
            } else {
                for (int64_t p = 0; p < k; p++) {
                    const SB* src = b + jc + p * ldb;
                    for (int64_t cc = 0; cc < cols; cc++) dst[p * NR + cc] = (T)widen(src[cc]);
                }
            }
            for (int64_t cc = cols; cc < NR; cc++)
                for (int64_t p = 0; p < k; p++) dst[p * NR + cc] = T(0);
            round_all(dst, (size_t)(k * NR), rnd);
            for (int64_t q = 0; q < panels; q++) {
                micro<T>(k, abuf.data() + q * MR * k, dst, tile);
                const int64_t i0 = ic + q * MR, rows = std::min<int64_t>(MR, m - i0);
                for (int64_t cc = 0; cc < cols; cc++) {
                    SC* col = c + (jc + cc) * ldc + i0;
                    const T* t = tile + cc * MR;
                    if (beta == T(0)) {
                        for (int64_t r = 0; r < rows; r++) narrow((T)(alpha * t[r]), col + r);
                    } else {
                        for (int64_t r = 0; r < rows; r++) {
                            T v = alpha * t[r];
                            v += beta * (T)widen(col[r]);
                            narrow(v, col + r);
                        }
                    }
                }
            }
        }
    }
}

// One matrix of the F16 mode (binary16 accumulator, rounded after every multiply-add).
inline void half_acc(const Problem& pr, const H16* a, const H16* b, H16* c,
                     std::vector<float>& abuf, std::vector<float>& bbuf) {
    const int64_t m = pr.m, n = pr.n, k = pr.k, lda = pr.lda, ldb = pr.ldb, ldc = pr.ldc;
    const float alpha = (float)pr.alpha, beta = (float)pr.beta;  // binary16 values
    auto finish = [&](float ab, H16* p) {  // ab = alpha * acc, already a binary16 value
        float v = ab;
        if (beta != 0.0f) v = round_f16_from_double((double)ab + (double)beta * widen(*p));
        p->v = float_to_half(v);
    };
    if (k == 0 || alpha == 0.0f) {
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < m; i++) finish(0.0f, c + i + j * ldc);
        return;
    }
    // op(A) in panels of R rows (abuf[q][p][r]), one column of op(B) at a time (bbuf[p]); the
    // R accumulators of a panel are independent chains, interleaved for the CPU's sake.
    constexpr int R = 8;
    const int64_t panels = (m + R - 1) / R;
    abuf.assign((size_t)(panels * R * k), 0.0f);
    bbuf.resize((size_t)k);
    for (int64_t i = 0; i < m; i++)
        for (int64_t p = 0; p < k; p++)
            abuf[(i / R) * R * k + p * R + i % R] =
                widen(pr.trans_a ? a[p + i * lda] : a[i + p * lda]);
    for (int64_t j = 0; j < n; j++) {
        for (int64_t p = 0; p < k; p++)
            bbuf[p] = widen(pr.trans_b ? b[j + p * ldb] : b[p + j * ldb]);
        for (int64_t q = 0; q < panels; q++) {
            const float* ap = abuf.data() + q * R * k;
            float acc[R] = {};
            for (int64_t p = 0; p < k; p++, ap += R)
                for (int r = 0; r < R; r++) {
                    const float prod = ap[r] * bbuf[p];  // exact: 11 x 11 significant bits
                    acc[r] = round_f16_from_double((double)acc[r] + (double)prod);
                }
            const int64_t rows = std::min<int64_t>(R, m - q * R);
            for (int64_t r = 0; r < rows; r++)  // alpha * acc is exact in float
                finish(round_f16(alpha * acc[r]), c + q * R + r + j * ldc);
        }
    }
}

template <class T, class SA, class SC>
void run_typed(const Problem& pr, Round rnd) {
    std::vector<T> abuf, bbuf;
    const SA* a = static_cast<const SA*>(pr.a);
    const SA* b = static_cast<const SA*>(pr.b);
    SC* c = static_cast<SC*>(pr.c);
    for (int64_t i = 0; i < pr.batch; i++)
        blocked<T, SA, SA, SC>(pr, a + i * pr.stride_a, b + i * pr.stride_b, c + i * pr.stride_c,
                               rnd, abuf, bbuf);
}

}  // namespace detail

// Runs the whole problem (every batch, one after another). The caller has checked
// supported(mode, a_type, b_type, c_type) and the extents. Returns false (doing nothing) for a
// combination `supported` refuses.
inline bool run(const Problem& pr) {
    using namespace detail;
    if (!supported(pr.mode, pr.a_type, pr.b_type, pr.c_type)) return false;
    if (pr.m <= 0 || pr.n <= 0 || pr.batch <= 0) return true;
    if (pr.mode == Mode::F64) {
        run_typed<double, double, double>(pr, Round::None);
        return true;
    }
    if (pr.mode == Mode::F16) {
        std::vector<float> abuf, bbuf;
        const H16* a = static_cast<const H16*>(pr.a);
        const H16* b = static_cast<const H16*>(pr.b);
        H16* c = static_cast<H16*>(pr.c);
        for (int64_t i = 0; i < pr.batch; i++)
            half_acc(pr, a + i * pr.stride_a, b + i * pr.stride_b, c + i * pr.stride_c, abuf, bbuf);
        return true;
    }
    // The float modes: the input rounding applies to f32 inputs only (16-bit inputs already are
    // of a type the fast modes take as is).
    Round rnd = Round::None;
    if (pr.a_type == Type::F32) {
        if (pr.mode == Mode::F32_TF32) rnd = Round::TF32;
        if (pr.mode == Mode::F32_F16) rnd = Round::F16;
        if (pr.mode == Mode::F32_BF16) rnd = Round::BF16;
    }
    const bool c32 = pr.c_type == Type::F32;
    switch (pr.a_type) {
        case Type::F32: run_typed<float, float, float>(pr, rnd); break;
        case Type::F16:
            if (c32)
                run_typed<float, H16, float>(pr, rnd);
            else
                run_typed<float, H16, H16>(pr, rnd);
            break;
        case Type::BF16:
            if (c32)
                run_typed<float, B16, float>(pr, rnd);
            else
                run_typed<float, B16, B16>(pr, rnd);
            break;
        default: return false;
    }
    return true;
}

}  // namespace gemm
