// Happens-before between host threads, for the race checker. Each host thread has a clock of
// its own (GPU_SIM_HOST_CLOCK=thread, the default): what that thread has observed complete
// through its own synchronisations, queries and copies, merged into every stream it enqueues
// on. Thread creation and join carry clocks (the child starts with what its parent had
// observed; a join hands the finished child's clock to the joining thread), through
// pthread_create and pthread_join, which this library interposes (it is loaded before libc).
// Hand-offs the driver cannot see (a channel, an atomic flag) order nothing: such a program
// must use an event or a synchronisation, as on a GPU. GPU_SIM_HOST_CLOCK=global keeps one
// clock for every host thread (any thread's synchronisation orders every thread).
//
// A thread's clock is read and written only by that thread (the enqueue, the synchronisation,
// the create and the join all run on it), so it needs no lock of its own.
#include <dlfcn.h>
#include <pthread.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "sim.h"

namespace sim {

namespace {

Clock g_global_clock;                 // GPU_SIM_HOST_CLOCK=global (guarded by the race checker)
thread_local Clock* t_clock = nullptr;  // never freed: a thread's clock may outlive its TLS
std::mutex g_exited_m;
// Clocks of threads that have ended and not been joined yet, by thread handle.
std::map<pthread_t, Clock>& exited() {
    static auto* m = new std::map<pthread_t, Clock>;  // never destroyed (detached threads)
    return *m;
}

struct Start {
    void* (*start)(void*);
    void* arg;
    Clock clock;  // the parent's, at pthread_create
};

void* trampoline(void* p) {
    auto* s = static_cast<Start*>(p);
    t_clock = new Clock(std::move(s->clock));
    void* (*start)(void*) = s->start;
    void* arg = s->arg;
    delete s;
    void* ret = start(arg);
    std::lock_guard<std::mutex> g(g_exited_m);
    exited()[pthread_self()] = *t_clock;
    return ret;
}

}  // namespace

bool global_host_clock() {
    static const bool global = [] {
        const char* e = std::getenv("GPU_SIM_HOST_CLOCK");
        if (!e || !*e || std::strcmp(e, "thread") == 0) return false;
        if (std::strcmp(e, "global") == 0) return true;
        fatal("GPU_SIM_HOST_CLOCK=%s: expected thread (the default) or global", e);
    }();
    return global;
}

Clock& host_clock() {
    if (global_host_clock()) return g_global_clock;
    if (!t_clock) t_clock = new Clock;
    return *t_clock;
}

}  // namespace sim

extern "C" {

int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*),
                   void* arg) {
    using Create = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
    static const Create real = reinterpret_cast<Create>(dlsym(RTLD_NEXT, "pthread_create"));
    if (sim::global_host_clock()) return real(thread, attr, start, arg);
    auto* s = new sim::Start{start, arg, sim::host_clock()};
    int r = real(thread, attr, sim::trampoline, s);
    if (r != 0) delete s;
    return r;
}

int pthread_join(pthread_t thread, void** ret) {
    using Join = int (*)(pthread_t, void**);
    static const Join real = reinterpret_cast<Join>(dlsym(RTLD_NEXT, "pthread_join"));
    int r = real(thread, ret);
    if (r != 0 || sim::global_host_clock()) return r;
    sim::Clock child;
    {
        std::lock_guard<std::mutex> g(sim::g_exited_m);
        auto it = sim::exited().find(thread);
        if (it == sim::exited().end()) return r;  // ended without returning (pthread_exit)
        child = std::move(it->second);
        sim::exited().erase(it);
    }
    sim::merge_clock(sim::host_clock(), child);
    return r;
}

}  // extern "C"
