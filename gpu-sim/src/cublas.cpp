// The simulated cuBLAS (libcublas.so.13): the entry points cudarc 0.19.10 and candle 0.11.1
// call, written from NVIDIA's cuBLAS reference (no NVIDIA code or header). The arithmetic is in
// gemm.h; this file checks the arguments as the reference describes, reads the host-side
// scalars at the call, validates every matrix's full extent against the allocation table and
// enqueues the computation as stream work on the handle's stream.
//
// Handles: a handle belongs to the context current at cublasCreate (a later call from a thread
// with another current context still uses the handle's). Its stream (cublasSetStream, default
// the NULL stream, i.e. the legacy stream) is kept as the CUstream value and resolved at every
// call, so CU_STREAM_PER_THREAD means the calling thread's per-thread stream, as in CUDA.
//
// Each GEMM, GEMV or ASUM is one operation on the stream (Op kind "gemm" or "asum") and counts
// one Counts::host_tasks on it, counted when enqueued. A call that returns early (m, n or
// batchCount 0, or C left unchanged by the reference's quick-return rule) enqueues nothing.
//
// Errors (each one logged with the function, the argument and the value): a handle that is
// not live (never created, destroyed) gives CUBLAS_STATUS_NOT_INITIALIZED; a negative size,
// a too small leading dimension, a bad transpose code or a NULL scalar
// CUBLAS_STATUS_INVALID_VALUE; a type/compute-type combination or algo outside the simulated
// set CUBLAS_STATUS_NOT_SUPPORTED; a context with a sticky error, an unusable stream or a race
// found when enqueueing CUBLAS_STATUS_EXECUTION_FAILED. cublasDestroy synchronises the
// handle's context, as the reference says it does (cudaDeviceSynchronize).
//
// Deviations, all reported: an argument whose extent is not inside one live allocation of the
// handle's device is refused at the call with CUBLAS_STATUS_INVALID_VALUE (a GPU would fault
// later); with CUBLAS_POINTER_MODE_HOST, alpha/beta/result pointing into device memory are
// refused the same way (a real process would crash reading them).
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "blas_types.h"
#include "gemm.h"
#include "sim.h"

struct cublasContext {
    sim::Context* ctx = nullptr;
    CUstream stream = nullptr;  // as given to cublasSetStream
    int pointer_mode = CUBLAS_POINTER_MODE_HOST;
    int math_mode = CUBLAS_DEFAULT_MATH;
    void* workspace = nullptr;  // cublasSetWorkspace (kept, not used: no kernel needs one)
    size_t workspace_size = 0;
};

namespace {

std::mutex g_handles_m;
// Leaked on purpose: handles may be destroyed from static destructors after main returns.
std::set<cublasContext*>& handles() {
    static auto* s = new std::set<cublasContext*>;
    return *s;
}

// A copy of a live handle's state, taken under the registry's lock.
struct HandleState {
    sim::Context* ctx;
    CUstream stream;
    int pointer_mode;
    int math_mode;
};

bool lookup(const char* fn, cublasHandle_t h, HandleState* out) {
    {
        std::lock_guard<std::mutex> g(g_handles_m);
        if (h && handles().count(h)) {
            *out = HandleState{h->ctx, h->stream, h->pointer_mode, h->math_mode};
            return true;
        }
    }
    sim::log(
        "%s: handle %p is not a live cuBLAS handle (never created, or destroyed): "
        "CUBLAS_STATUS_NOT_INITIALIZED",
        fn, (void*)h);
    return false;
}

// The handle's context must still be usable: alive, without a sticky error.
cublasStatus_t check_context(const char* fn, sim::Context* c) {
    if (!sim::valid_context(c) || !c->alive) {
        sim::log("%s: the handle's context has been destroyed: CUBLAS_STATUS_NOT_INITIALIZED", fn);
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    int st = c->sticky.load();
    if (st != CUDA_SUCCESS) {
        sim::log(
            "%s: device %d's context has a sticky error (CUresult %d), nothing can run on it: "
            "CUBLAS_STATUS_EXECUTION_FAILED",
            fn, c->device, st);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

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

// The scale type of alpha and beta.
enum class Scale { Half, Float, Double };
size_t scale_size(Scale s) {
    return s == Scale::Half ? 2 : s == Scale::Float ? 4 : 8;
}
double read_scale(const void* p, Scale s) {
    switch (s) {
        case Scale::Half: {
            uint16_t b;
            std::memcpy(&b, p, 2);
            return gemm::half_to_float(b);
        }
        case Scale::Float: {
            float f;
            std::memcpy(&f, p, 4);
            return f;
        }
        default: {
            double d;
            std::memcpy(&d, p, 8);
            return d;
        }
    }
}

bool valid_op(const char* fn, const char* arg, int op) {
    if (op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C) return true;
    sim::log(
        "%s: %s = %d is not CUBLAS_OP_N, CUBLAS_OP_T or CUBLAS_OP_C: CUBLAS_STATUS_INVALID_VALUE",
        fn, arg, op);
    return false;
}

cublasStatus_t invalid(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
cublasStatus_t invalid(const char* fmt, ...) {
    char b[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    sim::log("%s: CUBLAS_STATUS_INVALID_VALUE", b);
    return CUBLAS_STATUS_INVALID_VALUE;
}

// Validates the bytes [ptr + lo, ptr + lo + len) as one live allocation of `device` and adds
// the use. `desc` describes the argument for the message.
bool check_range(const char* fn, const char* arg, const std::string& desc, uint64_t ptr, int64_t lo,
                 uint64_t len, int device, bool write, std::vector<sim::BufferUse>& uses) {
    if (len == 0) return true;
    std::string why;
    std::shared_ptr<sim::Allocation> a;
    const bool wraps = lo < 0 ? ptr < (uint64_t)(-lo) : ptr + (uint64_t)lo < ptr;
    if (!wraps)
        a = sim::find_range(ptr + (uint64_t)lo, (size_t)len, device, why);
    else
        why = "the range wraps around the address space";
    if (!a) {
        invalid("%s: %s = %#" PRIx64 " (%s) needs bytes [%#" PRIx64 ", +%" PRIu64
                ") inside one live allocation of device %d: %s",
                fn, arg, ptr, desc.c_str(), ptr + (uint64_t)lo, len, device, why.c_str());
        return false;
    }
    uses.push_back(sim::BufferUse{a, write, std::string(fn) + " " + arg});
    return true;
}

// A column-major matrix argument (rows x cols, ld, batch matrices stride elements apart).
bool check_matrix(const char* fn, const char* arg, const void* p, int64_t rows, int64_t cols,
                  int64_t ld, int64_t stride, int64_t batch, size_t elem, int device, bool write,
                  std::vector<sim::BufferUse>& uses) {
    char desc[256];
    std::snprintf(desc, sizeof desc,
                  "%" PRId64 " x %" PRId64 ", leading dimension %" PRId64 ", stride %" PRId64
                  ", batch %" PRId64 ", %zu-byte elements",
                  rows, cols, ld, stride, batch, elem);
    int64_t lo;
    uint64_t len;
    if (!gemm::extent(rows, cols, ld, stride, batch, elem, &lo, &len)) {
        invalid("%s: %s (%s) spans more than 2^62 bytes", fn, arg, desc);
        return false;
    }
    return check_range(fn, arg, desc, (uint64_t)(uintptr_t)p, lo, len, device, write, uses);
}

// A strided vector (n elements, inc apart; a negative inc walks from the far end, as BLAS).
bool check_vector(const char* fn, const char* arg, const void* p, int64_t n, int64_t inc,
                  size_t elem, int device, bool write, std::vector<sim::BufferUse>& uses) {
    char desc[128];
    std::snprintf(desc, sizeof desc, "%" PRId64 " elements, increment %" PRId64, n, inc);
    if (n <= 0) return true;
    const uint64_t a = inc < 0 ? (uint64_t)-inc : (uint64_t)inc;
    return check_range(fn, arg, desc, (uint64_t)(uintptr_t)p, 0, ((uint64_t)(n - 1) * a + 1) * elem,
                       device, write, uses);
}

// Host pointer mode: a scalar must be host memory, read now.
bool host_scalar(const char* fn, const char* arg, const void* p, Scale s, double* out) {
    if (!p) {
        invalid("%s: %s is NULL", fn, arg);
        return false;
    }
    if (sim::is_device_memory((uint64_t)(uintptr_t)p)) {
        invalid(
            "%s: %s = %p is device memory but the handle's pointer mode is "
            "CUBLAS_POINTER_MODE_HOST (a real process would crash reading it)",
            fn, arg, p);
        return false;
    }
    *out = read_scale(p, s);
    return true;
}

// Device pointer mode: a scalar must be device memory of the handle's device, read when the
// operation runs.
bool device_scalar(const char* fn, const char* arg, const void* p, Scale s, int device,
                   std::vector<sim::BufferUse>& uses) {
    if (!p) {
        invalid("%s: %s is NULL", fn, arg);
        return false;
    }
    return check_range(fn, arg, "a scalar (CUBLAS_POINTER_MODE_DEVICE)", (uint64_t)(uintptr_t)p, 0,
                       scale_size(s), device, false, uses);
}

// Enqueues `run` on the handle's stream after the checks; counts it.
cublasStatus_t submit(const char* fn, const HandleState& hs, const char* kind,
                      std::function<void()> run, const std::vector<sim::BufferUse>& uses,
                      sim::Stream* s) {
    sim::Op op;
    op.run = std::move(run);
    op.kind = kind;
    CUresult r = sim::enqueue(s, std::move(op), uses);
    sim::count(s, &sim::Counts::host_tasks);  // enqueue always queues the operation
    if (r != CUDA_SUCCESS) {
        sim::log("%s: enqueueing on device %d failed (CUresult %d): CUBLAS_STATUS_EXECUTION_FAILED",
                 fn, hs.ctx->device, r);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

sim::Stream* stream_of(const char* fn, const HandleState& hs) {
    std::string why;
    sim::Stream* s = sim::resolve_stream(hs.ctx, hs.stream, why);
    if (!s)
        sim::log("%s: the handle's stream cannot be used: %s: CUBLAS_STATUS_EXECUTION_FAILED", fn,
                 why.c_str());
    return s;
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

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
    if (!handle) return invalid("cublasCreate_v2: handle is NULL");
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) {
        sim::log(
            "cublasCreate_v2: no usable current context (CUresult %d): "
            "CUBLAS_STATUS_NOT_INITIALIZED",
            r);
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    auto* h = new cublasContext;
    h->ctx = ctx;
    {
        std::lock_guard<std::mutex> g(g_handles_m);
        handles().insert(h);
    }
    *handle = h;
    return CUBLAS_STATUS_SUCCESS;
}

// "The release of those resources by calling cublasDestroy() will implicitly call
// cudaDeviceSynchronize()" (cublasDestroy): every stream of the handle's context is waited for
// (a host synchronisation for the race checker, as cuCtxSynchronize).
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    sim::Context* ctx;
    {
        std::lock_guard<std::mutex> g(g_handles_m);
        if (!handle || !handles().erase(handle)) {
            sim::log(
                "cublasDestroy_v2: handle %p is not a live cuBLAS handle: "
                "CUBLAS_STATUS_NOT_INITIALIZED",
                (void*)handle);
            return CUBLAS_STATUS_NOT_INITIALIZED;
        }
        ctx = handle->ctx;
    }
    delete handle;
    if (sim::valid_context(ctx) && ctx->alive) {
        sim::synchronize_context(ctx);
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, CUstream stream) {
    std::lock_guard<std::mutex> g(g_handles_m);
    if (!handle || !handles().count(handle)) {
        sim::log(
            "cublasSetStream_v2: handle %p is not a live cuBLAS handle: "
            "CUBLAS_STATUS_NOT_INITIALIZED",
            (void*)handle);
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    handle->stream = stream;  // resolved at each call
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, CUstream* stream) {
    HandleState hs;
    if (!lookup("cublasGetStream_v2", handle, &hs)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream) return invalid("cublasGetStream_v2: streamId is NULL");
    *stream = hs.stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, int mode) {
    HandleState hs;
    if (!lookup("cublasSetPointerMode_v2", handle, &hs)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE)
        return invalid("cublasSetPointerMode_v2: mode = %d is not a cublasPointerMode_t", mode);
    std::lock_guard<std::mutex> g(g_handles_m);
    if (handles().count(handle)) handle->pointer_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, int* mode) {
    HandleState hs;
    if (!lookup("cublasGetPointerMode_v2", handle, &hs)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return invalid("cublasGetPointerMode_v2: mode is NULL");
    *mode = hs.pointer_mode;
    return CUBLAS_STATUS_SUCCESS;
}

// Math modes: DEFAULT, PEDANTIC, TF32_TENSOR_OP (f32 GEMMs with COMPUTE_32F use TF32 inputs),
// the deprecated TENSOR_OP (f32 GEMMs use COMPUTE_32F_FAST_16F), each optionally with
// DISALLOW_REDUCED_PRECISION_REDUCTION (no effect here: every reduction is in the compute
// type). The emulation modes (FP32_EMULATED_BF16X9, FP64_EMULATED_FIXEDPOINT) are not simulated.
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, int mode) {
    HandleState hs;
    if (!lookup("cublasSetMathMode", handle, &hs)) return CUBLAS_STATUS_NOT_INITIALIZED;
    const int base = mode & ~CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    if (base == CUBLAS_FP32_EMULATED_BF16X9_MATH || base == CUBLAS_FP64_EMULATED_FIXEDPOINT_MATH) {
        sim::log(
            "cublasSetMathMode: mode %d (an emulation math mode) is not simulated: "
            "CUBLAS_STATUS_NOT_SUPPORTED",
            mode);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (base != CUBLAS_DEFAULT_MATH && base != CUBLAS_TENSOR_OP_MATH &&
        base != CUBLAS_PEDANTIC_MATH && base != CUBLAS_TF32_TENSOR_OP_MATH)
        return invalid("cublasSetMathMode: mode = %d is not a cublasMath_t", mode);
    std::lock_guard<std::mutex> g(g_handles_m);
    if (handles().count(handle)) handle->math_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, int* mode) {
    HandleState hs;
    if (!lookup("cublasGetMathMode", handle, &hs)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return invalid("cublasGetMathMode: mode is NULL");
    *mode = hs.math_mode;
    return CUBLAS_STATUS_SUCCESS;
}

// The workspace must be device memory of the handle's device, 256-byte aligned (the
// reference's rule); it is kept, but nothing here needs one.
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t size) {
    const char* fn = "cublasSetWorkspace_v2";
    HandleState hs;
    if (!lookup(fn, handle, &hs)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (size > 0) {
        if ((uintptr_t)workspace % 256 != 0)
            return invalid("%s: workspace = %p is not aligned to 256 bytes", fn, workspace);
        if (cublasStatus_t st = check_context(fn, hs.ctx)) return st;
        std::vector<sim::BufferUse> uses;
        if (!check_range(fn, "workspace", "the workspace", (uint64_t)(uintptr_t)workspace, 0, size,
                         hs.ctx->device, true, uses))
            return CUBLAS_STATUS_INVALID_VALUE;
    }
    std::lock_guard<std::mutex> g(g_handles_m);
    if (handles().count(handle)) {
        handle->workspace = size > 0 ? workspace : nullptr;
        handle->workspace_size = size;
    }
    return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
        case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
        default: return "CUBLAS_STATUS_UNKNOWN";
    }
}

const char* cublasGetStatusString(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
        case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
        case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
        case CUBLAS_STATUS_ARCH_MISMATCH:
            return "an absent device architectural feature is required";
        case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
        case CUBLAS_STATUS_LICENSE_ERROR:
            return "an error was detected when checking the current licensing";
        default: return "unknown cuBLAS status";
    }
}

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
