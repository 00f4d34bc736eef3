// The simulated cuBLAS's handles (cublas_internal.h describes the library): the table of live
// handles, cublasCreate/Destroy, the handle's stream, pointer mode, math mode and workspace, and
// the status names.
#include <cstdint>
#include <mutex>
#include <set>
#include <vector>

#include "cublas_internal.h"

namespace {

std::mutex g_handles_m;
// Leaked on purpose: handles may be destroyed from static destructors after main returns.
std::set<cublasContext*>& handles() {
    static auto* s = new std::set<cublasContext*>;
    return *s;
}

}  // namespace

namespace cublas_sim {

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

}  // namespace cublas_sim

using namespace cublas_sim;

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

}  // extern "C"
