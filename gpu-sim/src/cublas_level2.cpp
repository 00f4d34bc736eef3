// The simulated cuBLAS's level-2 and level-1 routines, GEMV and ASUM (cublas_internal.h
// describes the library); GEMV runs as a one-row GEMM of gemm.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cublas_internal.h"
#include "gemm.h"

using namespace cublas_sim;

namespace {

// GEMV as a GEMM with one row: y^T = x^T op(A)^T (see cublasSgemv_v2).
template <class T>
cublasStatus_t gemv_entry(const char* fn, cublasHandle_t h, int trans, int m, int n, const T* alpha,
                          const T* A, int lda, const T* x, int incx, const T* beta, T* y,
                          int incy) {
    const bool dbl = sizeof(T) == 8;
    const Scale scale = dbl ? Scale::Double : Scale::Float;
    HandleState hs;
    if (!lookup(fn, h, &hs)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!valid_op(fn, "trans", trans)) return CUBLAS_STATUS_INVALID_VALUE;
    if (m < 0 || n < 0) return invalid("%s: m = %d, n = %d (negative)", fn, m, n);
    if (lda < std::max(1, m)) return invalid("%s: lda = %d < max(1, m = %d)", fn, lda, m);
    if (incx == 0 || incy == 0) return invalid("%s: incx = %d, incy = %d (zero)", fn, incx, incy);
    if (cublasStatus_t st = check_context(fn, hs.ctx)) return st;
    const int device = hs.ctx->device;
    const bool dev_ptrs = hs.pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
    std::vector<sim::BufferUse> uses;
    double al = 0, be = 0;
    if (!dev_ptrs) {
        if (!host_scalar(fn, "alpha", alpha, scale, &al) ||
            !host_scalar(fn, "beta", beta, scale, &be))
            return CUBLAS_STATUS_INVALID_VALUE;
        if (m == 0 || n == 0 || (al == 0 && be == 1)) return CUBLAS_STATUS_SUCCESS;
    } else {
        if (!device_scalar(fn, "alpha", alpha, scale, device, uses) ||
            !device_scalar(fn, "beta", beta, scale, device, uses))
            return CUBLAS_STATUS_INVALID_VALUE;
        if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    }
    const bool t = trans != CUBLAS_OP_N;
    const int64_t xlen = t ? m : n, ylen = t ? n : m;
    if (dev_ptrs || al != 0) {
        if (!check_matrix(fn, "A", A, m, n, lda, 0, 1, sizeof(T), device, false, uses) ||
            !check_vector(fn, "x", x, xlen, incx, sizeof(T), device, false, uses))
            return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (!check_vector(fn, "y", y, ylen, incy, sizeof(T), device, true, uses))
        return CUBLAS_STATUS_INVALID_VALUE;
    sim::Stream* s = stream_of(fn, hs);
    if (!s) return CUBLAS_STATUS_EXECUTION_FAILED;

    // C' (1 x ylen, ld incy) = A' (1 x xlen: x, ld incx) * op'(A); op' = T for y = A x (the
    // GEMM's op(B) = A^T), N for y = A^T x. A negative increment starts at the far end.
    gemm::Problem pr;
    pr.trans_a = false;
    pr.trans_b = !t;
    pr.m = 1;
    pr.n = ylen;
    pr.k = xlen;
    pr.a_type = pr.b_type = pr.c_type = dbl ? gemm::Type::F64 : gemm::Type::F32;
    pr.a = x + (incx < 0 ? (xlen - 1) * (int64_t)-incx : 0);
    pr.lda = incx;
    pr.b = A;
    pr.ldb = lda;
    pr.c = y + (incy < 0 ? (ylen - 1) * (int64_t)-incy : 0);
    pr.ldc = incy;
    pr.mode = dbl ? gemm::Mode::F64 : gemm::Mode::F32;  // GEMV uses no tensor cores: no TF32
    pr.alpha = al;
    pr.beta = be;
    auto run = [pr, dev_ptrs, alpha, beta, scale]() mutable {
        if (dev_ptrs) {
            pr.alpha = read_scale(alpha, scale);
            pr.beta = read_scale(beta, scale);
        }
        gemm::run(pr);
    };
    return submit(fn, hs, "gemm", std::move(run), uses, s);
}

// ASUM: sum of |x_i| in the data type, in index order. With host pointer mode the call waits for
// the result (the stream's earlier work first), as cuBLAS does for a scalar returned to the host.
template <class T>
cublasStatus_t asum_entry(const char* fn, cublasHandle_t h, int n, const T* x, int incx,
                          T* result) {
    HandleState hs;
    if (!lookup(fn, h, &hs)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!result) return invalid("%s: result is NULL", fn);
    if (cublasStatus_t st = check_context(fn, hs.ctx)) return st;
    const int device = hs.ctx->device;
    const bool dev_ptrs = hs.pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
    std::vector<sim::BufferUse> uses;
    if (!dev_ptrs && sim::is_device_memory((uint64_t)(uintptr_t)result))
        return invalid(
            "%s: result = %p is device memory but the handle's pointer mode is "
            "CUBLAS_POINTER_MODE_HOST",
            fn, (void*)result);
    const int64_t len = (n > 0 && incx > 0) ? n : 0;  // n <= 0 or incx <= 0: the sum is 0
    if (!check_vector(fn, "x", x, len, incx, sizeof(T), device, false, uses))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (dev_ptrs && !check_range(fn, "result", "the result (CUBLAS_POINTER_MODE_DEVICE)",
                                 (uint64_t)(uintptr_t)result, 0, sizeof(T), device, true, uses))
        return CUBLAS_STATUS_INVALID_VALUE;
    sim::Stream* s = stream_of(fn, hs);
    if (!s) return CUBLAS_STATUS_EXECUTION_FAILED;
    auto run = [x, len, incx, result]() {
        T acc = 0;
        for (int64_t i = 0; i < len; i++) acc += std::fabs(x[i * incx]);
        *result = acc;
    };
    cublasStatus_t st = submit(fn, hs, "asum", std::move(run), uses, s);
    if (st == CUBLAS_STATUS_SUCCESS && !dev_ptrs) sim::wait_stream(s);
    return st;
}

}  // namespace

extern "C" {

// ------------------------------------------------------------------------------ GEMV, ASUM
cublasStatus_t cublasSgemv_v2(cublasHandle_t handle, int trans, int m, int n, const float* alpha,
                              const float* A, int lda, const float* x, int incx, const float* beta,
                              float* y, int incy) {
    return gemv_entry("cublasSgemv_v2", handle, trans, m, n, alpha, A, lda, x, incx, beta, y, incy);
}

cublasStatus_t cublasDgemv_v2(cublasHandle_t handle, int trans, int m, int n, const double* alpha,
                              const double* A, int lda, const double* x, int incx,
                              const double* beta, double* y, int incy) {
    return gemv_entry("cublasDgemv_v2", handle, trans, m, n, alpha, A, lda, x, incx, beta, y, incy);
}

cublasStatus_t cublasSasum_v2(cublasHandle_t handle, int n, const float* x, int incx,
                              float* result) {
    return asum_entry("cublasSasum_v2", handle, n, x, incx, result);
}

cublasStatus_t cublasDasum_v2(cublasHandle_t handle, int n, const double* x, int incx,
                              double* result) {
    return asum_entry("cublasDasum_v2", handle, n, x, incx, result);
}

}  // extern "C"
