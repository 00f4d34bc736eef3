// The simulated cuBLAS and cuRAND through their C entry points on the simulated driver, as
// cudarc/candle call them: results, the documented error codes, stream work and its counters,
// the pointer modes, the race checker seeing a GEMM's buffers, and cuRAND's ranges and
// sequence. Build against the simulated library (one library under every soname), e.g.
//   g++ -std=c++17 -O1 -pthread -Wall -Werror -I gpu-sim/src -I gpu-sim/include
//       gpu-sim/tests/blas_sim.cpp -o /tmp/blas_sim -L $OUT/lib -l:libcuda.so.1
//   LD_LIBRARY_PATH=$OUT/lib /tmp/blas_sim
// Prints one line per check and exits non-zero if any failed. Device 1 is made sticky-broken
// by the race check at the end; the other checks use device 0.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "blas_types.h"
#include "gpusim.h"

extern "C" {
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext*, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr*, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void*, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void*, CUdeviceptr, size_t, CUstream);
CUresult cuStreamCreate(CUstream*, unsigned);
CUresult cuStreamSynchronize(CUstream);

cublasStatus_t cublasCreate_v2(cublasHandle_t*);
cublasStatus_t cublasDestroy_v2(cublasHandle_t);
cublasStatus_t cublasSetStream_v2(cublasHandle_t, CUstream);
cublasStatus_t cublasGetStream_v2(cublasHandle_t, CUstream*);
cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t, int);
cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t, int*);
cublasStatus_t cublasSetMathMode(cublasHandle_t, int);
cublasStatus_t cublasSgemm_v2(cublasHandle_t, int, int, int, int, int, const float*, const float*,
                              int, const float*, int, const float*, float*, int);
cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t, int, int, int, int, int, const double*,
                                         const double*, int, long long, const double*, int,
                                         long long, const double*, double*, int, long long, int);
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t, int, int, int, int, int, const void*,
                                          const void*, int, int, long long, const void*, int, int,
                                          long long, const void*, void*, int, int, long long, int,
                                          int, int);
cublasStatus_t cublasGemmEx(cublasHandle_t, int, int, int, int, int, const void*, const void*, int,
                            int, const void*, int, int, const void*, void*, int, int, int, int);
cublasStatus_t cublasSgemv_v2(cublasHandle_t, int, int, int, const float*, const float*, int,
                              const float*, int, const float*, float*, int);
cublasStatus_t cublasSasum_v2(cublasHandle_t, int, const float*, int, float*);

curandStatus_t curandCreateGenerator(curandGenerator_t*, int);
curandStatus_t curandDestroyGenerator(curandGenerator_t);
curandStatus_t curandSetStream(curandGenerator_t, CUstream);
curandStatus_t curandSetPseudoRandomGeneratorSeed(curandGenerator_t, unsigned long long);
curandStatus_t curandSetGeneratorOffset(curandGenerator_t, unsigned long long);
curandStatus_t curandGenerateUniform(curandGenerator_t, float*, size_t);
curandStatus_t curandGenerateUniformDouble(curandGenerator_t, double*, size_t);
curandStatus_t curandGenerateNormal(curandGenerator_t, float*, size_t, float, float);
curandStatus_t curandGenerateNormalDouble(curandGenerator_t, double*, size_t, double, double);
}

namespace {

int failures = 0;
void check(bool ok, const std::string& what) {
    std::printf("%-78s %s\n", what.c_str(), ok ? "ok" : "FAIL");
    if (!ok) failures++;
}

template <class T>
CUdeviceptr upload(const std::vector<T>& v, CUstream s) {
    CUdeviceptr p = 0;
    cuMemAlloc_v2(&p, v.size() * sizeof(T));
    cuMemcpyHtoDAsync_v2(p, v.data(), v.size() * sizeof(T), s);
    return p;
}
template <class T>
std::vector<T> download(CUdeviceptr p, size_t n, CUstream s) {
    std::vector<T> v(n);
    cuMemcpyDtoHAsync_v2(v.data(), p, n * sizeof(T), s);
    cuStreamSynchronize(s);
    return v;
}
uint64_t host_tasks(CUstream s) {
    GpuSimCounts c{};
    gpusim_counts(s, 0, &c);
    return c.host_tasks;
}

// C (m x n) = A (m x k) B (k x n), column-major, in double.
std::vector<double> ref_gemm(const std::vector<float>& a, const std::vector<float>& b, int m, int n,
                             int k) {
    std::vector<double> c(m * n, 0.0);
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++)
            for (int p = 0; p < k; p++) c[i + j * m] += (double)a[i + p * m] * b[p + j * k];
    return c;
}

}  // namespace

int main() {
    cublasHandle_t h0 = nullptr;
    check(cublasCreate_v2(&h0) == CUBLAS_STATUS_NOT_INITIALIZED,
          "cublasCreate without a current context: NOT_INITIALIZED");
    cuInit(0);
    CUcontext ctx;
    cuDevicePrimaryCtxRetain(&ctx, 0);
    cuCtxSetCurrent(ctx);
    CUstream s;
    cuStreamCreate(&s, 0);

    cublasHandle_t h;
    check(cublasCreate_v2(&h) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
    CUstream got_s = (CUstream)0x99;
    check(cublasGetStream_v2(h, &got_s) == 0 && got_s == nullptr, "default stream is NULL");
    check(cublasSetStream_v2(h, s) == 0 && cublasGetStream_v2(h, &got_s) == 0 && got_s == s,
          "cublasSetStream");
    int pm = -1;
    check(cublasGetPointerMode_v2(h, &pm) == 0 && pm == CUBLAS_POINTER_MODE_HOST,
          "default pointer mode is HOST");

    // f32 strided-batched GEMM, as candle calls it.
    const int m = 5, n = 3, k = 4, batch = 2;
    std::vector<float> A(m * k * batch), B(k * n * batch), C(m * n * batch, NAN);
    for (size_t i = 0; i < A.size(); i++) A[i] = (float)((i * 7) % 11) - 5;
    for (size_t i = 0; i < B.size(); i++) B[i] = (float)((i * 5) % 13) - 6;
    CUdeviceptr dA = upload(A, s), dB = upload(B, s), dC = upload(C, s);
    const float one = 1, zero = 0;
    const uint64_t before = host_tasks(s);
    cublasStatus_t st = cublasGemmStridedBatchedEx(
        h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, (void*)dA, CUDA_R_32F, m, m * k, (void*)dB,
        CUDA_R_32F, k, k * n, &zero, (void*)dC, CUDA_R_32F, m, m * n, batch, CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT_TENSOR_OP);
    check(st == 0, "cublasGemmStridedBatchedEx f32 (C starts NaN, beta 0)");
    check(host_tasks(s) == before + 1, "one host task counted on the handle's stream");
    {
        auto c = download<float>(dC, C.size(), s);
        bool ok = true;
        for (int bi = 0; bi < batch; bi++) {
            std::vector<float> a(A.begin() + bi * m * k, A.begin() + (bi + 1) * m * k);
            std::vector<float> b(B.begin() + bi * k * n, B.begin() + (bi + 1) * k * n);
            auto r = ref_gemm(a, b, m, n, k);
            for (int i = 0; i < m * n; i++)
                ok &= c[bi * m * n + i] == (float)r[i];  // small integers: exact
        }
        check(ok, "results equal the reference (exact: small integers)");
    }
    // TF32 and f64.
    st = cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_T, k, k, m, &one, (void*)dA,
                                    CUDA_R_32F, m, 0, (void*)dA, CUDA_R_32F, k, 0, &zero, (void*)dC,
                                    CUDA_R_32F, k, 0, 1, CUBLAS_COMPUTE_32F_FAST_TF32,
                                    CUBLAS_GEMM_DEFAULT_TENSOR_OP);
    check(st == 0, "cublasGemmStridedBatchedEx f32 TT with COMPUTE_32F_FAST_TF32");
    {
        std::vector<double> a64(m * k), b64(k * n);
        for (int i = 0; i < m * k; i++) a64[i] = A[i];
        for (int i = 0; i < k * n; i++) b64[i] = B[i];
        CUdeviceptr da = upload(a64, s), db = upload(b64, s),
                    dc = upload(std::vector<double>(m * n, 1.0), s);
        const double al = 2, be = 1;
        st = cublasDgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &al, (double*)da, m, 0,
                                       (double*)db, k, 0, &be, (double*)dc, m, 0, 1);
        auto c = download<double>(dc, m * n, s);
        auto r = ref_gemm(std::vector<float>(A.begin(), A.begin() + m * k),
                          std::vector<float>(B.begin(), B.begin() + k * n), m, n, k);
        bool ok = st == 0;
        for (int i = 0; i < m * n; i++) ok &= c[i] == 2 * r[i] + 1;
        check(ok, "cublasDgemmStridedBatched alpha 2 beta 1");
        cuMemFree_v2(da);
        cuMemFree_v2(db);
        cuMemFree_v2(dc);
    }
    // f16 and bf16 data (bit patterns of small integers).
    {
        auto h16 = [](float f) {
            uint32_t u;
            std::memcpy(&u, &f, 4);
            return (
                uint16_t)(((u >> 16) & 0x8000) |
                          (f == 0 ? 0 : ((((u >> 23) & 0xff) - 112) << 10) | ((u >> 13) & 0x3ff)));
        };
        auto b16 = [](float f) {
            uint32_t u;
            std::memcpy(&u, &f, 4);
            return (uint16_t)(u >> 16);
        };
        std::vector<uint16_t> ah(m * k), bh(k * n), ab(m * k), bb(k * n);
        for (int i = 0; i < m * k; i++) ah[i] = h16(A[i]), ab[i] = b16(A[i]);
        for (int i = 0; i < k * n; i++) bh[i] = h16(B[i]), bb[i] = b16(B[i]);
        auto r = ref_gemm(std::vector<float>(A.begin(), A.begin() + m * k),
                          std::vector<float>(B.begin(), B.begin() + k * n), m, n, k);
        const int types[2] = {CUDA_R_16F, CUDA_R_16BF};
        const int computes[2] = {CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_16BF};
        for (int t = 0; t < 2; t++) {
            CUdeviceptr da = upload(t ? ab : ah, s), db = upload(t ? bb : bh, s),
                        dc = upload(std::vector<uint16_t>(m * n), s);
            st = cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, (void*)da,
                                            types[t], m, 0, (void*)db, types[t], k, 0, &zero,
                                            (void*)dc, types[t], m, 0, 1, computes[t],
                                            CUBLAS_GEMM_DEFAULT_TENSOR_OP);
            auto c = download<uint16_t>(dc, m * n, s);
            bool ok = st == 0;
            for (int i = 0; i < m * n; i++) ok &= c[i] == (t ? b16((float)r[i]) : h16((float)r[i]));
            check(ok, t ? "bf16 GEMM with COMPUTE_32F_FAST_16BF (candle's reduced precision)"
                        : "f16 GEMM with COMPUTE_32F");
            // f16 with COMPUTE_16F and __half alpha/beta.
            if (!t) {
                const uint16_t one_h = 0x3c00, zero_h = 0;
                st = cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one_h,
                                                (void*)da, CUDA_R_16F, m, 0, (void*)db, CUDA_R_16F,
                                                k, 0, &zero_h, (void*)dc, CUDA_R_16F, m, 0, 1,
                                                CUBLAS_COMPUTE_16F, CUBLAS_GEMM_DEFAULT_TENSOR_OP);
                c = download<uint16_t>(dc, m * n, s);
                ok = st == 0;
                for (int i = 0; i < m * n; i++) ok &= c[i] == h16((float)r[i]);
                check(ok, "f16 GEMM with COMPUTE_16F and __half alpha/beta");
            }
            cuMemFree_v2(da);
            cuMemFree_v2(db);
            cuMemFree_v2(dc);
        }
    }

    // Argument errors.
    auto sgemm = [&](cublasHandle_t hh, int ta, int tb, int mm, int nn, int kk, const float* al,
                     CUdeviceptr a, int lda, CUdeviceptr b, int ldb, const float* be, CUdeviceptr c,
                     int ldc) {
        return cublasSgemm_v2(hh, ta, tb, mm, nn, kk, al, (float*)a, lda, (float*)b, ldb, be,
                              (float*)c, ldc);
    };
    check(sgemm(h, 0, 0, m, n, k, &one, dA, m - 1, dB, k, &zero, dC, m) ==
              CUBLAS_STATUS_INVALID_VALUE,
          "lda < m: INVALID_VALUE");
    check(sgemm(h, 1, 0, m, n, k, &one, dA, k - 1, dB, k, &zero, dC, m) ==
              CUBLAS_STATUS_INVALID_VALUE,
          "lda < k with transa T: INVALID_VALUE");
    check(sgemm(h, 0, 0, m, n, k, &one, dA, m, dB, k, &zero, dC, m - 1) ==
              CUBLAS_STATUS_INVALID_VALUE,
          "ldc < m: INVALID_VALUE");
    check(sgemm(h, 7, 0, m, n, k, &one, dA, m, dB, k, &zero, dC, m) == CUBLAS_STATUS_INVALID_VALUE,
          "transa 7: INVALID_VALUE");
    check(sgemm(h, 0, 0, -1, n, k, &one, dA, m, dB, k, &zero, dC, m) == CUBLAS_STATUS_INVALID_VALUE,
          "m -1: INVALID_VALUE");
    check(sgemm(h, 0, 0, m, n, k * 100, &one, dA, m, dB, k * 100, &zero, dC, m) ==
              CUBLAS_STATUS_INVALID_VALUE,
          "A and B past their allocations: INVALID_VALUE");
    check(sgemm(h, 0, 0, m, n, k, &one, dA, m, dB, k, &zero, (CUdeviceptr)(uintptr_t)C.data(), m) ==
              CUBLAS_STATUS_INVALID_VALUE,
          "C in host memory: INVALID_VALUE");
    check(sgemm(h, 0, 0, m, 0, k, &one, 0, m, 0, k, &zero, 0, m) == 0,
          "n 0: quick return, no pointer read");
    check(sgemm(h, 0, 0, m, n, k, &one, dA, m, dB, k, (const float*)dC, dC, m) ==
              CUBLAS_STATUS_INVALID_VALUE,
          "host pointer mode with beta in device memory: INVALID_VALUE");
    check(cublasGemmEx(h, 0, 0, m, n, k, &one, (void*)dA, CUDA_R_32F, m, (void*)dB, CUDA_R_16F, k,
                       &zero, (void*)dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED,
          "Atype f32 with Btype f16: NOT_SUPPORTED");
    check(cublasGemmEx(h, 0, 0, m, n, k, &one, (void*)dA, CUDA_R_8I, m, (void*)dB, CUDA_R_8I, k,
                       &zero, (void*)dC, CUDA_R_32I, m, CUBLAS_COMPUTE_32I,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED,
          "int8 with COMPUTE_32I: NOT_SUPPORTED");
    check(cublasGemmEx(h, 0, 0, m, n, k, &one, (void*)dA, CUDA_R_32F, m, (void*)dB, CUDA_R_32F, k,
                       &zero, (void*)dC, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                       55) == CUBLAS_STATUS_NOT_SUPPORTED,
          "algo 55: NOT_SUPPORTED");
    check(cublasSetMathMode(h, CUBLAS_FP32_EMULATED_BF16X9_MATH) == CUBLAS_STATUS_NOT_SUPPORTED,
          "emulation math mode: NOT_SUPPORTED");

    // Device pointer mode: alpha and beta read from device memory when the GEMM runs.
    {
        CUdeviceptr dscal = upload(std::vector<float>{3.0f, 0.0f}, s);
        check(cublasSetPointerMode_v2(h, CUBLAS_POINTER_MODE_DEVICE) == 0,
              "cublasSetPointerMode DEVICE");
        st = sgemm(h, 0, 0, m, n, k, (const float*)dscal, dA, m, dB, k, (const float*)(dscal + 4),
                   dC, m);
        auto c = download<float>(dC, m * n, s);
        auto r = ref_gemm(std::vector<float>(A.begin(), A.begin() + m * k),
                          std::vector<float>(B.begin(), B.begin() + k * n), m, n, k);
        bool ok = st == 0;
        for (int i = 0; i < m * n; i++) ok &= c[i] == 3 * (float)r[i];
        check(ok, "Sgemm with alpha 3, beta 0 in device memory");
        check(sgemm(h, 0, 0, m, n, k, &one, dA, m, dB, k, &zero, dC, m) ==
                  CUBLAS_STATUS_INVALID_VALUE,
              "device pointer mode with host alpha: INVALID_VALUE");
        cublasSetPointerMode_v2(h, CUBLAS_POINTER_MODE_HOST);
        cuMemFree_v2(dscal);
    }
    // GEMV and ASUM.
    {
        std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};  // used with incx 2: 1, 3, 5, 7
        CUdeviceptr dx = upload(x, s), dy = upload(std::vector<float>(m, 1.0f), s);
        const float b1 = 1;
        st = cublasSgemv_v2(h, CUBLAS_OP_N, m, k, &one, (float*)dA, m, (float*)dx, 2, &b1,
                            (float*)dy, 1);
        auto y = download<float>(dy, m, s);
        bool ok = st == 0;
        for (int i = 0; i < m; i++) {
            double r = 1;
            for (int p = 0; p < k; p++) r += (double)A[i + p * m] * x[2 * p];
            ok &= y[i] == (float)r;
        }
        check(ok, "Sgemv N, incx 2, beta 1");
        float sum = -1;
        st = cublasSasum_v2(h, 8, (float*)dx, 1, &sum);
        check(st == 0 && sum == 36, "Sasum to host memory (blocking)");
        cuMemFree_v2(dx);
        cuMemFree_v2(dy);
    }

    // Handles.
    cublasHandle_t h2;
    cublasCreate_v2(&h2);
    check(cublasDestroy_v2(h2) == 0, "cublasDestroy");
    check(cublasDestroy_v2(h2) == CUBLAS_STATUS_NOT_INITIALIZED,
          "cublasDestroy twice: NOT_INITIALIZED");
    check(
        sgemm(h2, 0, 0, m, n, k, &one, dA, m, dB, k, &zero, dC, m) == CUBLAS_STATUS_NOT_INITIALIZED,
        "GEMM on a destroyed handle: NOT_INITIALIZED");
    check(sgemm((cublasHandle_t)0x1234, 0, 0, m, n, k, &one, dA, m, dB, k, &zero, dC, m) ==
              CUBLAS_STATUS_NOT_INITIALIZED,
          "GEMM on a made-up handle: NOT_INITIALIZED");

    // cuRAND.
    {
        curandGenerator_t g;
        check(curandCreateGenerator(&g, CURAND_RNG_PSEUDO_DEFAULT) == 0,
              "curandCreateGenerator PSEUDO_DEFAULT");
        curandGenerator_t g2;
        check(curandCreateGenerator(&g2, CURAND_RNG_PSEUDO_MRG32K3A) == CURAND_STATUS_TYPE_ERROR,
              "MRG32K3A: TYPE_ERROR");
        check(curandSetStream(g, s) == 0 && curandSetPseudoRandomGeneratorSeed(g, 299792458) == 0,
              "curandSetStream, seed");
        const size_t N = 1001;
        CUdeviceptr du;
        cuMemAlloc_v2(&du, N * 8);
        const uint64_t t0 = host_tasks(s);
        check(curandGenerateUniform(g, (float*)du, N) == 0, "curandGenerateUniform 1001");
        check(host_tasks(s) == t0 + 1, "one host task counted on the generator's stream");
        auto u = download<float>(du, N, s);
        bool in = true;
        for (float v : u) in &= v > 0 && v <= 1;
        check(in, "uniform floats in (0, 1]");
        check(curandGenerateUniform(g, (float*)du, N) == 0, "a second curandGenerateUniform");
        auto u2 = download<float>(du, N, s);
        check(u2 != u, "the sequence continues across calls");
        check(curandSetPseudoRandomGeneratorSeed(g, 299792458) == 0 &&
                  curandGenerateUniform(g, (float*)du, N) == 0 && download<float>(du, N, s) == u,
              "setting the seed again restarts the sequence");
        check(curandSetGeneratorOffset(g, 1) == 0 &&
                  curandGenerateUniform(g, (float*)du, 10) == 0 &&
                  std::equal(u.begin() + 1, u.begin() + 11, download<float>(du, 10, s).begin()),
              "offset 1 starts one value later");
        check(curandGenerateNormal(g, (float*)du, N, 0, 1) == CURAND_STATUS_LENGTH_NOT_MULTIPLE,
              "odd normal count: LENGTH_NOT_MULTIPLE");
        check(curandGenerateNormalDouble(g, (double*)du, 1000, 5, 2) == 0,
              "curandGenerateNormalDouble 1000");
        auto z = download<double>(du, 1000, s);
        double mean = 0;
        for (double v : z) mean += v / 1000;
        check(std::fabs(mean - 5) < 0.4, "normal mean 5 (std 2) within 6 standard errors");
        check(curandGenerateUniformDouble(g, (double*)du, N + 1) == CURAND_STATUS_LAUNCH_FAILURE,
              "output past the allocation: LAUNCH_FAILURE");
        check(curandGenerateUniform(g, u.data(), N) == CURAND_STATUS_LAUNCH_FAILURE,
              "output in host memory: LAUNCH_FAILURE");
        check(curandDestroyGenerator(g) == 0 &&
                  curandDestroyGenerator(g) == CURAND_STATUS_NOT_INITIALIZED,
              "curandDestroyGenerator, twice: NOT_INITIALIZED");
        check(curandGenerateUniform(g, (float*)du, N) == CURAND_STATUS_NOT_INITIALIZED,
              "generate on a destroyed generator: NOT_INITIALIZED");
        cuMemFree_v2(du);
    }
    cuMemFree_v2(dA);
    cuMemFree_v2(dB);
    check(cublasDestroy_v2(h) == 0, "cublasDestroy (synchronises the device)");
    cuMemFree_v2(dC);

    // A race: the GEMM on stream 2 reads what a copy on stream 1 wrote, with no event between.
    {
        CUcontext c1;
        cuDevicePrimaryCtxRetain(&c1, 1);
        cuCtxSetCurrent(c1);
        CUstream s1, s2;
        cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING);
        cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING);
        std::vector<float> a(16, 1.0f);
        CUdeviceptr da, dc;
        cuMemAlloc_v2(&da, 64);
        cuMemAlloc_v2(&dc, 64);
        cuStreamSynchronize(s1);
        cuMemcpyHtoDAsync_v2(da, a.data(), 64, s1);
        cublasHandle_t hr;
        cublasCreate_v2(&hr);
        cublasSetStream_v2(hr, s2);
        const unsigned long long races = gpusim_races();
        st = cublasSgemm_v2(hr, 0, 0, 4, 4, 4, &one, (float*)da, 4, (float*)da, 4, &zero,
                            (float*)dc, 4);
        check(st == CUBLAS_STATUS_EXECUTION_FAILED && gpusim_races() == races + 1,
              "GEMM reading a buffer another stream writes unordered: race, EXECUTION_FAILED");
        check(cublasSgemm_v2(hr, 0, 0, 4, 4, 4, &one, (float*)da, 4, (float*)da, 4, &zero,
                             (float*)dc, 4) == CUBLAS_STATUS_EXECUTION_FAILED,
              "the context's error is sticky: EXECUTION_FAILED");
        cublasDestroy_v2(hr);
    }
    std::printf("%s (%d failure%s)\n", failures ? "FAILED" : "ALL PASSED", failures,
                failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
