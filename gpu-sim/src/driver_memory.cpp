// Driver API: allocation, free, copies and memset, with the completion rules of the driver
// API reference ("API synchronization behavior").
#include <cinttypes>
#include <cstring>

#include "sim.h"

namespace {

// A device range an API call touches, or a logged error naming the call and the argument.
std::shared_ptr<sim::Allocation> range(const char* call, const char* arg, CUdeviceptr p, size_t n,
                                      int device) {
    std::string why;
    auto a = sim::find_range(p, n, device, why);
    if (!a) {
        sim::log("%s: %s: %s", call, arg, why.c_str());
        sim::count_fault();
    }
    return a;
}

// A host range a copy touches must not be device memory (the simulated device memory is
// host memory, so the mistake would otherwise go unseen).
bool host_range_ok(const char* call, const char* arg, const void* p, size_t n, int device) {
    (void)device;
    if (!p) {
        sim::log("%s: %s is a null pointer", call, arg);
        return false;
    }
    if (sim::is_device_memory(reinterpret_cast<uint64_t>(p))) {
        sim::log("%s: %s (%p, %zu bytes) is device memory, used as host memory", call, arg, p, n);
        sim::count_fault();
        return false;
    }
    return true;
}

CUresult alloc(CUdeviceptr* out, size_t size, sim::Stream* s, const char* call) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (size == 0) {
        // cuMemAlloc: "If bytesize is 0, cuMemAlloc() returns CUDA_ERROR_INVALID_VALUE". The
        // stream-ordered form succeeds on a GPU (cudarc allocates empty slices so, and they
        // worked on an H100); it returns a null pointer here, which no kernel may dereference.
        if (!s) {
            sim::log("%s: 0 bytes", call);
            return CUDA_ERROR_INVALID_VALUE;
        }
        *out = 0;
        return CUDA_SUCCESS;
    }
    uint64_t p;
    if (CUresult r = sim::mem_alloc(ctx->device, size, false, &p, s)) {
        if (r == CUDA_ERROR_OUT_OF_MEMORY)
            sim::log("%s: %zu bytes do not fit on device %d", call, size, ctx->device);
        return r;
    }
    *out = p;
    if (!s) {
        sim::count_global(&sim::Counts::allocs);
        return CUDA_SUCCESS;
    }
    // Memory from a stream-ordered allocation is usable in stream order from the allocation
    // on: the allocation counts as a write by that stream.
    std::string why;
    auto a = sim::find_range(p, 0, ctx->device, why);
    sim::Op op;
    op.kind = "alloc";
    sim::count(s, &sim::Counts::allocs);
    return sim::enqueue(s, std::move(op), {sim::BufferUse{a, true, call}});
}

}  // namespace

extern "C" {

CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t size) {
    return alloc(out, size, nullptr, "cuMemAlloc");
}

CUresult cuMemAllocAsync(CUdeviceptr* out, size_t size, CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuMemAllocAsync", h, &ctx, &s)) return r;
    return alloc(out, size, s, "cuMemAllocAsync");
}

CUresult cuMemFreeAsync(CUdeviceptr p, CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuMemFreeAsync", h, &ctx, &s)) return r;
    if (p == 0) return CUDA_SUCCESS;  // an empty stream-ordered allocation (see alloc)
    std::shared_ptr<sim::Allocation> a;
    std::string why;
    if (sim::mem_free_mark(p, false, &a, why) != CUDA_SUCCESS) {
        sim::log("cuMemFreeAsync: %s", why.c_str());
        sim::count_fault();
        return CUDA_ERROR_INVALID_VALUE;
    }
    sim::Op op;
    op.kind = "free";
    op.run = [a, s] { sim::mem_free_now(a, s); };
    sim::count(s, &sim::Counts::frees);
    // The free is a write in stream order: work of other streams still using the memory must
    // be ordered before it.
    return sim::enqueue(s, std::move(op), {sim::BufferUse{a, true, "cuMemFreeAsync"}});
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    std::shared_ptr<sim::Allocation> a;
    std::string why;
    if (sim::mem_free_mark(p, false, &a, why) != CUDA_SUCCESS) {
        sim::log("cuMemFree: %s", why.c_str());
        sim::count_fault();
        return CUDA_ERROR_INVALID_VALUE;
    }
    // cuMemFree synchronises: the memory is released once the device is done with it.
    sim::synchronize_context(ctx);
    sim::mem_free_now(a);
    sim::count_global(&sim::Counts::frees);
    return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void** out, size_t size, unsigned flags) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    if (!out || (flags & ~7u)) return CUDA_ERROR_INVALID_VALUE;
    uint64_t p;
    if (CUresult r = sim::mem_alloc(ctx->device, size, true, &p)) return r;
    *out = reinterpret_cast<void*>(p);
    return CUDA_SUCCESS;
}

CUresult cuMemAllocHost_v2(void** out, size_t size) { return cuMemHostAlloc(out, size, 0); }

CUresult cuMemFreeHost(void* p) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    std::shared_ptr<sim::Allocation> a;
    std::string why;
    if (sim::mem_free_mark(reinterpret_cast<uint64_t>(p), true, &a, why) != CUDA_SUCCESS) {
        sim::log("cuMemFreeHost: %s", why.c_str());
        return CUDA_ERROR_INVALID_VALUE;
    }
    sim::mem_free_now(a);
    return CUDA_SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    *total = sim::device_memory();
    *free_bytes = *total - sim::mem_used(ctx->device);
    return CUDA_SUCCESS;
}

// Host to device: "For transfers from pageable host memory to device memory, host memory is
// copied to a staging buffer immediately (no device synchronization is performed)" — the
// source is read at the call; pinned memory is read when the stream reaches the copy.
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuMemcpyHtoDAsync", h, &ctx, &s)) return r;
    if (n == 0) return CUDA_SUCCESS;
    auto a = range("cuMemcpyHtoDAsync", "destination", dst, n, ctx->device);
    if (!a || !host_range_ok("cuMemcpyHtoDAsync", "source", src, n, ctx->device))
        return CUDA_ERROR_INVALID_VALUE;
    sim::Op op;
    op.kind = "copy";
    if (sim::is_pinned_host(src, n)) {
        op.run = [dst, src, n] { std::memcpy(reinterpret_cast<void*>(dst), src, n); };
    } else {
        auto staged = std::make_shared<std::vector<unsigned char>>(
            static_cast<const unsigned char*>(src), static_cast<const unsigned char*>(src) + n);
        op.run = [dst, staged] {
            std::memcpy(reinterpret_cast<void*>(dst), staged->data(), staged->size());
        };
    }
    sim::count(s, &sim::Counts::copies_htod);
    return sim::enqueue(s, std::move(op), {sim::BufferUse{a, true, "cuMemcpyHtoDAsync destination"}});
}

// Device to host: "For transfers from device memory to pageable host memory, the function
// will return only once the copy has completed"; into pinned memory it is asynchronous.
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuMemcpyDtoHAsync", h, &ctx, &s)) return r;
    if (n == 0) return CUDA_SUCCESS;
    auto a = range("cuMemcpyDtoHAsync", "source", src, n, ctx->device);
    if (!a || !host_range_ok("cuMemcpyDtoHAsync", "destination", dst, n, ctx->device))
        return CUDA_ERROR_INVALID_VALUE;
    sim::Op op;
    op.kind = "copy";
    op.run = [dst, src, n] { std::memcpy(dst, reinterpret_cast<const void*>(src), n); };
    sim::count(s, &sim::Counts::copies_dtoh);
    uint64_t seq;
    if (CUresult r = sim::enqueue(s, std::move(op),
                                  {sim::BufferUse{a, false, "cuMemcpyDtoHAsync source"}}, &seq))
        return r;
    if (sim::is_pinned_host(dst, n)) return CUDA_SUCCESS;
    sim::Clock observed = sim::stream_clock(s);
    sim::wait_seq(s, seq);
    sim::merge_into_host(observed);
    return ctx->sticky.load();
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuMemcpyDtoDAsync", h, &ctx, &s)) return r;
    if (n == 0) return CUDA_SUCCESS;
    auto d = range("cuMemcpyDtoDAsync", "destination", dst, n, ctx->device);
    auto a = range("cuMemcpyDtoDAsync", "source", src, n, ctx->device);
    if (!d || !a) return CUDA_ERROR_INVALID_VALUE;
    // The driver API defines no overlapping copy (cuMemcpy's documents are silent; a GPU's
    // copy engine does not move as memmove does): refused, the strict choice.
    if (dst < src + n && src < dst + n) {
        sim::log("cuMemcpyDtoDAsync: destination [0x%" PRIx64 ", +%zu) overlaps source [0x%" PRIx64 ", +%zu)",
                 uint64_t(dst), n, uint64_t(src), n);
        sim::count_fault();
        return CUDA_ERROR_INVALID_VALUE;
    }
    sim::Op op;
    op.kind = "copy";
    op.run = [dst, src, n] {
        if (sim::skip_kernels()) return;  // device work: skipped with the kernels
        std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    };
    sim::count(s, &sim::Counts::copies_dtod);
    return sim::enqueue(s, std::move(op),
                        {sim::BufferUse{a, false, "cuMemcpyDtoDAsync source"},
                         sim::BufferUse{d, true, "cuMemcpyDtoDAsync destination"}});
}

CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx,
                           size_t n, CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuMemcpyPeerAsync", h, &ctx, &s)) return r;
    auto* dc = reinterpret_cast<sim::Context*>(dst_ctx);
    auto* sc = reinterpret_cast<sim::Context*>(src_ctx);
    if (!sim::valid_context(dc) || !sim::valid_context(sc)) return CUDA_ERROR_INVALID_CONTEXT;
    if (n == 0) return CUDA_SUCCESS;
    auto d = range("cuMemcpyPeerAsync", "destination", dst, n, dc->device);
    auto a = range("cuMemcpyPeerAsync", "source", src, n, sc->device);
    if (!d || !a) return CUDA_ERROR_INVALID_VALUE;
    sim::Op op;
    op.kind = "copy";
    op.run = [dst, src, n] {
        if (sim::skip_kernels()) return;  // device work: skipped with the kernels
        std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    };
    sim::count(s, &sim::Counts::copies_dtod);
    return sim::enqueue(s, std::move(op),
                        {sim::BufferUse{a, false, "cuMemcpyPeerAsync source"},
                         sim::BufferUse{d, true, "cuMemcpyPeerAsync destination"}});
}

static CUresult memset_async(const char* call, CUdeviceptr dst, uint32_t value, unsigned width,
                             size_t count, CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of(call, h, &ctx, &s)) return r;
    if (count == 0) return CUDA_SUCCESS;
    if (dst % width != 0) {
        sim::log("%s: destination 0x%llx is not %u-byte aligned", call, dst, width);
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto d = range(call, "destination", dst, count * width, ctx->device);
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    sim::Op op;
    op.kind = "memset";
    op.run = [dst, value, width, count] {
        if (sim::skip_kernels()) return;  // device work: skipped with the kernels
        auto* p = reinterpret_cast<unsigned char*>(dst);
        for (size_t i = 0; i < count; i++) std::memcpy(p + i * width, &value, width);
    };
    sim::count(s, &sim::Counts::memsets);
    return sim::enqueue(s, std::move(op), {sim::BufferUse{d, true, std::string(call) + " destination"}});
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream h) {
    return memset_async("cuMemsetD8Async", dst, v, 1, n, h);
}
CUresult cuMemsetD16Async(CUdeviceptr dst, unsigned short v, size_t n, CUstream h) {
    return memset_async("cuMemsetD16Async", dst, v, 2, n, h);
}
CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, CUstream h) {
    return memset_async("cuMemsetD32Async", dst, v, 4, n, h);
}

}  // extern "C"
