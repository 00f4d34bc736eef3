// Devices, primary contexts, the per-thread current context, sticky errors and logging.
#include <dlfcn.h>
#include <execinfo.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <thread>

#include "sim.h"

namespace sim {

static void vlog(const char* prefix, const char* fmt, va_list ap) {
    char buf[4096];
    vsnprintf(buf, sizeof buf, fmt, ap);
    std::fprintf(stderr, "gpu-sim: %s%s\n", prefix, buf);
}

void log(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog("", fmt, ap);
    va_end(ap);
}

void fatal(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog("fatal: ", fmt, ap);
    va_end(ap);
    std::abort();
}

int device_count() {
    static const int n = [] {
        const char* v = std::getenv("GPU_SIM_DEVICES");
        int k = v ? std::atoi(v) : 4;
        if (k < 0 || k > 64) fatal("GPU_SIM_DEVICES=%s: expected 0 to 64", v);
        return k;
    }();
    return n;
}

bool skip_kernels() {
    static const bool skip = [] {
        const char* v = std::getenv("GPU_SIM_SKIP_KERNELS");
        if (!v || !*v || std::string(v) == "0") return false;
        if (std::string(v) != "1") fatal("GPU_SIM_SKIP_KERNELS=%s: expected 0 or 1", v);
        log("GPU_SIM_SKIP_KERNELS=1: kernels are not run and memory contents are meaningless");
        return true;
    }();
    return skip;
}

const char* device_name() { return "gpu-sim (simulated on the CPU, not a GPU)"; }

uint64_t device_memory() { return 16ull << 30; }

namespace {

struct Primary {
    Context* ctx = nullptr;
    int refs = 0;
};

std::mutex g_ctx_mutex;
std::map<int, Primary>& primaries() {
    static auto* p = new std::map<int, Primary>;  // never destroyed (see sim.h)
    return *p;
}
std::set<Context*>& live_contexts() {
    static auto* s = new std::set<Context*>;
    return *s;
}
thread_local Context* t_current = nullptr;

}  // namespace

Context* primary_context(int device) {
    if (device < 0 || device >= device_count()) return nullptr;
    std::lock_guard<std::mutex> g(g_ctx_mutex);
    Primary& p = primaries()[device];
    if (!p.ctx) {
        p.ctx = new Context;
        p.ctx->device = device;
        live_contexts().insert(p.ctx);
        p.ctx->legacy = create_stream(p.ctx, StreamKind::Legacy);
    }
    return p.ctx;
}

// Retain/release of the primary context (cuDevicePrimaryCtxRetain/Release). On the last
// release the context is reset: its memory is freed and it can no longer be used (the handle
// becomes invalid; a later retain makes a new one), as the driver API reference says of
// cuDevicePrimaryCtxRelease.
Context* primary_retain(int device) {
    Context* c = primary_context(device);
    if (!c) return nullptr;
    std::lock_guard<std::mutex> g(g_ctx_mutex);
    primaries()[device].refs++;
    return c;
}

CUresult primary_release(int device) {
    Context* dead = nullptr;
    {
        std::lock_guard<std::mutex> g(g_ctx_mutex);
        auto it = primaries().find(device);
        if (it == primaries().end() || it->second.refs == 0) return CUDA_ERROR_INVALID_CONTEXT;
        if (--it->second.refs == 0) {
            dead = it->second.ctx;
            it->second.ctx = nullptr;
            live_contexts().erase(dead);
        }
    }
    if (dead) {
        // Work still queued finishes first (the driver waits for the device before a reset).
        synchronize_context(dead);
        std::vector<Stream*> streams;
        {
            std::lock_guard<std::mutex> g(dead->m);
            streams = dead->streams;
        }
        streams.push_back(dead->legacy);
        dead->alive = false;
        for (Stream* s : streams) destroy_stream(s);
        mem_reset_device(device);
    }
    return CUDA_SUCCESS;
}

Context* current_context() { return t_current; }
void set_current_context(Context* c) { t_current = c; }

bool valid_context(Context* c) {
    std::lock_guard<std::mutex> g(g_ctx_mutex);
    return live_contexts().count(c) != 0;
}

void set_sticky(Context* c, CUresult code, const std::string& why) {
    int expected = CUDA_SUCCESS;
    c->sticky.compare_exchange_strong(expected, code);
    log("device %d: %s", c->device, why.c_str());
}

// The nearest exported function on the calling thread's stack (the API entry point that
// called enter(), perhaps through a helper), for messages.
static const char* caller() {
    void* frames[8];
    int n = backtrace(frames, 8);
    for (int i = 1; i < n; i++) {
        Dl_info info;
        if (dladdr(frames[i], &info) && info.dli_sname) return info.dli_sname;
    }
    return "a driver call";
}

namespace {
thread_local int t_stall_ms = 0;
}

void stall_next_driver_call(int ms) { t_stall_ms = ms; }

CUresult enter(Context** out) {
    if (t_stall_ms) {
        std::this_thread::sleep_for(std::chrono::milliseconds(t_stall_ms));
        t_stall_ms = 0;
    }
    Context* c = t_current;
    if (!c) {
        log("%s: the calling thread has no current context (CUDA_ERROR_INVALID_CONTEXT)",
            caller());
        if (std::getenv("GPU_SIM_BACKTRACE")) {
            void* frames[40];
            backtrace_symbols_fd(frames, backtrace(frames, 40), 2);
        }
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (!c->alive) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    int s = c->sticky.load();
    if (s != CUDA_SUCCESS) return s;
    *out = c;
    return CUDA_SUCCESS;
}

}  // namespace sim
