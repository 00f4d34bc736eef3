// The argument checks and the enqueueing every simulated cuBLAS operation shares (declared,
// with what each does, in cublas_internal.h): alpha and beta, op codes, matrix and vector
// extents against the allocation table, and the stream work.
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cublas_internal.h"
#include "gemm.h"

namespace {

using cublas_sim::Scale;

size_t scale_size(Scale s) {
    return s == Scale::Half ? 2 : s == Scale::Float ? 4 : 8;
}

}  // namespace

namespace cublas_sim {

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

cublasStatus_t invalid(const char* fmt, ...) {
    char b[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    sim::log("%s: CUBLAS_STATUS_INVALID_VALUE", b);
    return CUBLAS_STATUS_INVALID_VALUE;
}

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

bool check_vector(const char* fn, const char* arg, const void* p, int64_t n, int64_t inc,
                  size_t elem, int device, bool write, std::vector<sim::BufferUse>& uses) {
    char desc[128];
    std::snprintf(desc, sizeof desc, "%" PRId64 " elements, increment %" PRId64, n, inc);
    if (n <= 0) return true;
    const uint64_t a = inc < 0 ? (uint64_t)-inc : (uint64_t)inc;
    return check_range(fn, arg, desc, (uint64_t)(uintptr_t)p, 0, ((uint64_t)(n - 1) * a + 1) * elem,
                       device, write, uses);
}

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

bool device_scalar(const char* fn, const char* arg, const void* p, Scale s, int device,
                   std::vector<sim::BufferUse>& uses) {
    if (!p) {
        invalid("%s: %s is NULL", fn, arg);
        return false;
    }
    return check_range(fn, arg, "a scalar (CUBLAS_POINTER_MODE_DEVICE)", (uint64_t)(uintptr_t)p, 0,
                       scale_size(s), device, false, uses);
}

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

}  // namespace cublas_sim
