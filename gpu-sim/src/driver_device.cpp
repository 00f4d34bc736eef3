// Driver API: initialisation, devices, contexts and error names.
#include <cstring>

#include "sim.h"

namespace sim {
Context* primary_retain(int device);
CUresult primary_release(int device);
}  // namespace sim

namespace {

std::atomic<bool> g_init{false};

CUresult need_init() { return g_init ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED; }

// Device attributes of the simulated device (an H100-like sm_90 part), by the numeric values of
// CUdevice_attribute. Anything not listed is refused with its number, never invented.
bool attribute(int attr, int* out) {
    switch (attr) {
        case 1: *out = 1024; return true;        // MAX_THREADS_PER_BLOCK
        case 2: *out = 1024; return true;        // MAX_BLOCK_DIM_X
        case 3: *out = 1024; return true;        // MAX_BLOCK_DIM_Y
        case 4: *out = 64; return true;          // MAX_BLOCK_DIM_Z
        case 5: *out = 2147483647; return true;  // MAX_GRID_DIM_X
        case 6: *out = 65535; return true;       // MAX_GRID_DIM_Y
        case 7: *out = 65535; return true;       // MAX_GRID_DIM_Z
        case 8: *out = 49152; return true;       // MAX_SHARED_MEMORY_PER_BLOCK
        case 9: *out = 65536; return true;       // TOTAL_CONSTANT_MEMORY
        case 10: *out = 32; return true;         // WARP_SIZE
        case 12: *out = 65536; return true;      // MAX_REGISTERS_PER_BLOCK
        case 16: *out = 132; return true;        // MULTIPROCESSOR_COUNT
        case 39: *out = 2048; return true;       // MAX_THREADS_PER_MULTIPROCESSOR
        case 41: *out = 1; return true;          // UNIFIED_ADDRESSING
        case 75: *out = 9; return true;          // COMPUTE_CAPABILITY_MAJOR
        case 76: *out = 0; return true;          // COMPUTE_CAPABILITY_MINOR
        case 81: *out = 233472; return true;     // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        case 97: *out = 232448; return true;     // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        case 115: *out = 1; return true;         // MEMORY_POOLS_SUPPORTED
        default: return false;
    }
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    g_init = true;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 13000;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* n) {
    if (CUresult r = need_init()) return r;
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = sim::device_count();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (CUresult r = need_init()) return r;
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= sim::device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    if (CUresult r = need_init()) return r;
    if (d < 0 || d >= sim::device_count()) return CUDA_ERROR_INVALID_DEVICE;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    std::strncpy(name, sim::device_name(), (size_t)len - 1);
    name[len - 1] = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    if (CUresult r = need_init()) return r;
    if (d < 0 || d >= sim::device_count()) return CUDA_ERROR_INVALID_DEVICE;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = sim::device_memory();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(unsigned char* uuid, CUdevice d) {
    if (CUresult r = need_init()) return r;
    if (d < 0 || d >= sim::device_count()) return CUDA_ERROR_INVALID_DEVICE;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    std::memset(uuid, 0, 16);
    std::memcpy(uuid, "gpu-sim", 7);
    uuid[15] = (unsigned char)d;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid_v2(unsigned char* uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }

CUresult cuDeviceGetAttribute(int* out, int attr, CUdevice d) {
    if (CUresult r = need_init()) return r;
    if (d < 0 || d >= sim::device_count()) return CUDA_ERROR_INVALID_DEVICE;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (!attribute(attr, out)) {
        sim::log("cuDeviceGetAttribute: attribute %d is not simulated", attr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
    if (CUresult r = need_init()) return r;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    sim::Context* c = sim::primary_retain(d);
    if (!c) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = reinterpret_cast<CUcontext>(c);
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    if (CUresult r = need_init()) return r;
    if (d < 0 || d >= sim::device_count()) return CUDA_ERROR_INVALID_DEVICE;
    return sim::primary_release(d);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (CUresult r = need_init()) return r;
    auto* c = reinterpret_cast<sim::Context*>(ctx);
    if (c && !sim::valid_context(c)) return CUDA_ERROR_INVALID_CONTEXT;
    sim::set_current_context(c);
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* ctx) {
    if (CUresult r = need_init()) return r;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = reinterpret_cast<CUcontext>(sim::current_context());
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* d) {
    sim::Context* c;
    if (CUresult r = sim::enter(&c)) return r;
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    *d = c->device;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    sim::Context* c;
    if (CUresult r = sim::enter(&c)) return r;
    sim::synchronize_context(c);
    return c->sticky.load();
}

CUresult cuGetErrorName(CUresult e, const char** out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    switch (e) {
#define NAME(x) \
    case x: *out = #x; return CUDA_SUCCESS;
        NAME(CUDA_SUCCESS) NAME(CUDA_ERROR_INVALID_VALUE) NAME(CUDA_ERROR_OUT_OF_MEMORY)
        NAME(CUDA_ERROR_NOT_INITIALIZED) NAME(CUDA_ERROR_DEINITIALIZED) NAME(CUDA_ERROR_NO_DEVICE)
        NAME(CUDA_ERROR_INVALID_DEVICE) NAME(CUDA_ERROR_INVALID_IMAGE)
        NAME(CUDA_ERROR_INVALID_CONTEXT) NAME(CUDA_ERROR_NO_BINARY_FOR_GPU)
        NAME(CUDA_ERROR_INVALID_PTX) NAME(CUDA_ERROR_INVALID_SOURCE) NAME(CUDA_ERROR_INVALID_HANDLE)
        NAME(CUDA_ERROR_ILLEGAL_STATE) NAME(CUDA_ERROR_NOT_FOUND) NAME(CUDA_ERROR_NOT_READY)
        NAME(CUDA_ERROR_ILLEGAL_ADDRESS) NAME(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
        NAME(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED) NAME(CUDA_ERROR_CONTEXT_IS_DESTROYED)
        NAME(CUDA_ERROR_MISALIGNED_ADDRESS) NAME(CUDA_ERROR_LAUNCH_FAILED)
        NAME(CUDA_ERROR_NOT_PERMITTED) NAME(CUDA_ERROR_NOT_SUPPORTED)
        NAME(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) NAME(CUDA_ERROR_UNKNOWN)
#undef NAME
        default:
            *out = nullptr;
            return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuGetErrorString(CUresult e, const char** out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    const char* name;
    if (cuGetErrorName(e, &name) != CUDA_SUCCESS) {
        *out = nullptr;
        return CUDA_ERROR_INVALID_VALUE;
    }
    switch (e) {
        case CUDA_ERROR_ILLEGAL_ADDRESS:
            *out = "an illegal memory access was encountered (gpu-sim: see its report on stderr)";
            break;
        case CUDA_ERROR_LAUNCH_FAILED:
            *out = "unspecified launch failure (gpu-sim: see its report on stderr)";
            break;
        default:
            *out = name;
    }
    return CUDA_SUCCESS;
}

}  // extern "C"
