// The simulated cuBLAS's GEMMs (cublas_internal.h describes the library): the argument checks
// and type rules every GEMM entry point shares, and the entry points; gemm.h computes them.
#include <algorithm>
#include <string>
#include <vector>

#include "cublas_internal.h"
#include "gemm.h"

using namespace cublas_sim;

namespace {

const char* op_name(int op) {
    switch (op) {
        case CUBLAS_OP_N: return "CUBLAS_OP_N";
        case CUBLAS_OP_T: return "CUBLAS_OP_T";
        case CUBLAS_OP_C: return "CUBLAS_OP_C";
        case CUBLAS_OP_CONJG: return "CUBLAS_OP_CONJG";
        default: return "an unknown cublasOperation_t";
    }
}

std::string dtype_name(int t) {
    switch (t) {
        case CUDA_R_32F: return "CUDA_R_32F";
        case CUDA_R_64F: return "CUDA_R_64F";
        case CUDA_R_16F: return "CUDA_R_16F";
        case CUDA_R_16BF: return "CUDA_R_16BF";
        case CUDA_R_8I: return "CUDA_R_8I";
        case CUDA_R_32I: return "CUDA_R_32I";
        case CUDA_C_32F: return "CUDA_C_32F";
        case CUDA_C_64F: return "CUDA_C_64F";
        case CUDA_C_16F: return "CUDA_C_16F";
        case CUDA_C_16BF: return "CUDA_C_16BF";
        default: return "cudaDataType " + std::to_string(t);
    }
}

std::string compute_name(int c) {
    switch (c) {
        case CUBLAS_COMPUTE_16F: return "CUBLAS_COMPUTE_16F";
        case CUBLAS_COMPUTE_16F_PEDANTIC: return "CUBLAS_COMPUTE_16F_PEDANTIC";
        case CUBLAS_COMPUTE_32F: return "CUBLAS_COMPUTE_32F";
        case CUBLAS_COMPUTE_32F_PEDANTIC: return "CUBLAS_COMPUTE_32F_PEDANTIC";
        case CUBLAS_COMPUTE_64F: return "CUBLAS_COMPUTE_64F";
        case CUBLAS_COMPUTE_64F_PEDANTIC: return "CUBLAS_COMPUTE_64F_PEDANTIC";
        case CUBLAS_COMPUTE_32I: return "CUBLAS_COMPUTE_32I";
        case CUBLAS_COMPUTE_32I_PEDANTIC: return "CUBLAS_COMPUTE_32I_PEDANTIC";
        case CUBLAS_COMPUTE_32F_FAST_16F: return "CUBLAS_COMPUTE_32F_FAST_16F";
        case CUBLAS_COMPUTE_32F_FAST_16BF: return "CUBLAS_COMPUTE_32F_FAST_16BF";
        case CUBLAS_COMPUTE_32F_FAST_TF32: return "CUBLAS_COMPUTE_32F_FAST_TF32";
        case CUBLAS_COMPUTE_32F_EMULATED_16BFX9: return "CUBLAS_COMPUTE_32F_EMULATED_16BFX9";
        case CUBLAS_COMPUTE_64F_EMULATED_FIXEDPOINT:
            return "CUBLAS_COMPUTE_64F_EMULATED_FIXEDPOINT";
        default: return "cublasComputeType_t " + std::to_string(c);
    }
}

bool to_type(int t, gemm::Type* out) {
    switch (t) {
        case CUDA_R_32F: *out = gemm::Type::F32; return true;
        case CUDA_R_64F: *out = gemm::Type::F64; return true;
        case CUDA_R_16F: *out = gemm::Type::F16; return true;
        case CUDA_R_16BF: *out = gemm::Type::BF16; return true;
        default: return false;
    }
}

// Every GEMM entry point. `a_type` etc. are cudaDataType values, `compute` a
// cublasComputeType_t, `algo` a cublasGemmAlgo_t.
cublasStatus_t gemm_entry(const char* fn, cublasHandle_t h, int transa, int transb, int m, int n,
                          int k, const void* alpha, const void* A, int a_type, int lda,
                          long long stride_a, const void* B, int b_type, int ldb,
                          long long stride_b, const void* beta, void* C, int c_type, int ldc,
                          long long stride_c, int batch, int compute, int algo) {
    HandleState hs;
    if (!lookup(fn, h, &hs)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!valid_op(fn, "transa", transa) || !valid_op(fn, "transb", transb))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (m < 0 || n < 0 || k < 0)
        return invalid("%s: m = %d, n = %d, k = %d (negative)", fn, m, n, k);
    if (batch < 0) return invalid("%s: batchCount = %d is negative", fn, batch);
    const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
    const int a_rows = ta ? k : m, b_rows = tb ? n : k;
    if (lda < std::max(1, a_rows))
        return invalid("%s: lda = %d < max(1, %d) (the rows of A as stored, transa = %s)", fn, lda,
                       a_rows, op_name(transa));
    if (ldb < std::max(1, b_rows))
        return invalid("%s: ldb = %d < max(1, %d) (the rows of B as stored, transb = %s)", fn, ldb,
                       b_rows, op_name(transb));
    if (ldc < std::max(1, m)) return invalid("%s: ldc = %d < max(1, m = %d)", fn, ldc, m);
    const bool algo_ok =
        (algo >= CUBLAS_GEMM_DEFAULT && algo <= CUBLAS_GEMM_ALGO23) ||
        (algo >= CUBLAS_GEMM_DEFAULT_TENSOR_OP && algo <= CUBLAS_GEMM_ALGO15_TENSOR_OP) ||
        algo == CUBLAS_GEMM_AUTOTUNE;
    if (!algo_ok) {
        sim::log("%s: algo = %d is not a cublasGemmAlgo_t: CUBLAS_STATUS_NOT_SUPPORTED", fn, algo);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }

    // The types and the arithmetic.
    gemm::Type at = gemm::Type::F32, bt = gemm::Type::F32, ct = gemm::Type::F32;
    const bool types_known = to_type(a_type, &at) && to_type(b_type, &bt) && to_type(c_type, &ct);
    gemm::Mode mode;
    Scale scale;
    bool mode_known = true;
    switch (compute) {
        case CUBLAS_COMPUTE_16F:
        case CUBLAS_COMPUTE_16F_PEDANTIC:
            mode = gemm::Mode::F16;
            scale = Scale::Half;
            break;
        case CUBLAS_COMPUTE_32F:
            // The handle's math mode may allow reduced precision for f32 data (cublasSetMathMode:
            // TF32_TENSOR_OP_MATH uses TF32, the deprecated TENSOR_OP_MATH COMPUTE_32F_FAST_16F).
            mode = gemm::Mode::F32;
            if (types_known && at == gemm::Type::F32) {
                const int mm = hs.math_mode & ~CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
                if (mm == CUBLAS_TF32_TENSOR_OP_MATH) mode = gemm::Mode::F32_TF32;
                if (mm == CUBLAS_TENSOR_OP_MATH) mode = gemm::Mode::F32_F16;
            }
            scale = Scale::Float;
            break;
        case CUBLAS_COMPUTE_32F_PEDANTIC:
            mode = gemm::Mode::F32;
            scale = Scale::Float;
            break;
        case CUBLAS_COMPUTE_32F_FAST_TF32:
            mode = gemm::Mode::F32_TF32;
            scale = Scale::Float;
            break;
        case CUBLAS_COMPUTE_32F_FAST_16F:
            mode = gemm::Mode::F32_F16;
            scale = Scale::Float;
            break;
        case CUBLAS_COMPUTE_32F_FAST_16BF:
            mode = gemm::Mode::F32_BF16;
            scale = Scale::Float;
            break;
        case CUBLAS_COMPUTE_64F:
        case CUBLAS_COMPUTE_64F_PEDANTIC:
            mode = gemm::Mode::F64;
            scale = Scale::Double;
            break;
        default:
            mode_known = false;
            mode = gemm::Mode::F32;
            scale = Scale::Float;
            break;
    }
    if (!types_known || !mode_known || !gemm::supported(mode, at, bt, ct)) {
        sim::log(
            "%s: Atype %s, Btype %s, Ctype %s with computeType %s is not supported by the "
            "simulated cuBLAS (it takes f64/f64/f64 with COMPUTE_64F; f16/f16/f16 with "
            "COMPUTE_16F; A = B of f32, f16 or bf16 with C of that type or f32 with "
            "COMPUTE_32F, _PEDANTIC or _FAST_16F/_16BF/_TF32): CUBLAS_STATUS_NOT_SUPPORTED",
            fn, dtype_name(a_type).c_str(), dtype_name(b_type).c_str(), dtype_name(c_type).c_str(),
            compute_name(compute).c_str());
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }

    if (cublasStatus_t st = check_context(fn, hs.ctx)) return st;
    const int device = hs.ctx->device;
    const bool dev_ptrs = hs.pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
    std::vector<sim::BufferUse> uses;
    double al = 0, be = 0;
    if (!dev_ptrs) {
        if (!host_scalar(fn, "alpha", alpha, scale, &al) ||
            !host_scalar(fn, "beta", beta, scale, &be))
            return CUBLAS_STATUS_INVALID_VALUE;
        // Quick return (the reference BLAS rule): nothing to compute, or C left as it is.
        if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
        if ((k == 0 || al == 0) && be == 1) return CUBLAS_STATUS_SUCCESS;
    } else {
        if (!device_scalar(fn, "alpha", alpha, scale, device, uses) ||
            !device_scalar(fn, "beta", beta, scale, device, uses))
            return CUBLAS_STATUS_INVALID_VALUE;
        if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
    }

    // A and B are read unless k == 0 or (with host scalars) alpha == 0.
    const bool reads_ab = k > 0 && (dev_ptrs || al != 0);
    if (reads_ab) {
        if (!check_matrix(fn, "A", A, ta ? k : m, ta ? m : k, lda, stride_a, batch,
                          gemm::type_size(at), device, false, uses) ||
            !check_matrix(fn, "B", B, tb ? n : k, tb ? k : n, ldb, stride_b, batch,
                          gemm::type_size(bt), device, false, uses))
            return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (!check_matrix(fn, "C", C, m, n, ldc, stride_c, batch, gemm::type_size(ct), device, true,
                      uses))
        return CUBLAS_STATUS_INVALID_VALUE;
    sim::Stream* s = stream_of(fn, hs);
    if (!s) return CUBLAS_STATUS_EXECUTION_FAILED;

    gemm::Problem pr;
    pr.trans_a = ta;
    pr.trans_b = tb;
    pr.m = m;
    pr.n = n;
    pr.k = k;
    pr.a_type = at;
    pr.b_type = bt;
    pr.c_type = ct;
    pr.a = A;
    pr.lda = lda;
    pr.stride_a = stride_a;
    pr.b = B;
    pr.ldb = ldb;
    pr.stride_b = stride_b;
    pr.c = C;
    pr.ldc = ldc;
    pr.stride_c = stride_c;
    pr.batch = batch;
    pr.mode = mode;
    pr.alpha = al;
    pr.beta = be;
    sim::Context* ctx = hs.ctx;
    auto run = [pr, dev_ptrs, alpha, beta, scale, ctx, fn]() mutable {
        if (dev_ptrs) {
            pr.alpha = read_scale(alpha, scale);
            pr.beta = read_scale(beta, scale);
        }
        if (!gemm::run(pr))
            sim::set_sticky(ctx, CUDA_ERROR_LAUNCH_FAILED,
                            std::string(fn) + ": unsupported GEMM types");
    };
    return submit(fn, hs, "gemm", std::move(run), uses, s);
}

}  // namespace

extern "C" {

// ----------------------------------------------------------------------------------- GEMMs
cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                              const float* alpha, const float* A, int lda, const float* B, int ldb,
                              const float* beta, float* C, int ldc) {
    return gemm_entry("cublasSgemm_v2", handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda,
                      0, B, CUDA_R_32F, ldb, 0, beta, C, CUDA_R_32F, ldc, 0, 1, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasDgemm_v2(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                              const double* alpha, const double* A, int lda, const double* B,
                              int ldb, const double* beta, double* C, int ldc) {
    return gemm_entry("cublasDgemm_v2", handle, transa, transb, m, n, k, alpha, A, CUDA_R_64F, lda,
                      0, B, CUDA_R_64F, ldb, 0, beta, C, CUDA_R_64F, ldc, 0, 1, CUBLAS_COMPUTE_64F,
                      CUBLAS_GEMM_DEFAULT);
}

// cublasHgemm: f16 data, f16 alpha/beta, f16 arithmetic (gemm.h's F16 mode).
cublasStatus_t cublasHgemm(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                           const void* alpha, const void* A, int lda, const void* B, int ldb,
                           const void* beta, void* C, int ldc) {
    return gemm_entry("cublasHgemm", handle, transa, transb, m, n, k, alpha, A, CUDA_R_16F, lda, 0,
                      B, CUDA_R_16F, ldb, 0, beta, C, CUDA_R_16F, ldc, 0, 1, CUBLAS_COMPUTE_16F,
                      CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                            const void* alpha, const void* A, int Atype, int lda, const void* B,
                            int Btype, int ldb, const void* beta, void* C, int Ctype, int ldc,
                            int computeType, int algo) {
    return gemm_entry("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B,
                      Btype, ldb, 0, beta, C, Ctype, ldc, 0, 1, computeType, algo);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, int transa, int transb, int m,
                                         int n, int k, const float* alpha, const float* A, int lda,
                                         long long strideA, const float* B, int ldb,
                                         long long strideB, const float* beta, float* C, int ldc,
                                         long long strideC, int batchCount) {
    return gemm_entry("cublasSgemmStridedBatched", handle, transa, transb, m, n, k, alpha, A,
                      CUDA_R_32F, lda, strideA, B, CUDA_R_32F, ldb, strideB, beta, C, CUDA_R_32F,
                      ldc, strideC, batchCount, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t handle, int transa, int transb, int m,
                                         int n, int k, const double* alpha, const double* A,
                                         int lda, long long strideA, const double* B, int ldb,
                                         long long strideB, const double* beta, double* C, int ldc,
                                         long long strideC, int batchCount) {
    return gemm_entry("cublasDgemmStridedBatched", handle, transa, transb, m, n, k, alpha, A,
                      CUDA_R_64F, lda, strideA, B, CUDA_R_64F, ldb, strideB, beta, C, CUDA_R_64F,
                      ldc, strideC, batchCount, CUBLAS_COMPUTE_64F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasHgemmStridedBatched(cublasHandle_t handle, int transa, int transb, int m,
                                         int n, int k, const void* alpha, const void* A, int lda,
                                         long long strideA, const void* B, int ldb,
                                         long long strideB, const void* beta, void* C, int ldc,
                                         long long strideC, int batchCount) {
    return gemm_entry("cublasHgemmStridedBatched", handle, transa, transb, m, n, k, alpha, A,
                      CUDA_R_16F, lda, strideA, B, CUDA_R_16F, ldb, strideB, beta, C, CUDA_R_16F,
                      ldc, strideC, batchCount, CUBLAS_COMPUTE_16F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, int transa, int transb, int m,
                                          int n, int k, const void* alpha, const void* A, int Atype,
                                          int lda, long long strideA, const void* B, int Btype,
                                          int ldb, long long strideB, const void* beta, void* C,
                                          int Ctype, int ldc, long long strideC, int batchCount,
                                          int computeType, int algo) {
    return gemm_entry("cublasGemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A,
                      Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC,
                      batchCount, computeType, algo);
}

}  // extern "C"
