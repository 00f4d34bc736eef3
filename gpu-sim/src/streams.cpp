// Streams as FIFO worker threads, the legacy stream's implicit synchronisation, per-thread
// default streams, and the happens-before race checker that runs at every enqueue.
#include <cinttypes>

#include "sim.h"

namespace sim {

namespace {

std::mutex g_hb;  // guards every stream's Clock, Allocation access state, the global host clock
std::atomic<uint64_t> g_next_stream{1};

uint64_t at(const Clock& c, const Stream* s) {
    auto it = c.find(s);
    return it == c.end() ? 0 : it->second;
}


std::string stream_name(const Stream* s) {
    const char* k = s->kind == StreamKind::Legacy      ? "legacy stream"
                    : s->kind == StreamKind::PerThread ? "per-thread stream"
                    : s->kind == StreamKind::Blocking  ? "stream"
                                                       : "non-blocking stream";
    char b[96];
    std::snprintf(b, sizeof b, "%s #%" PRIu64 " of device %d", k, s->id, s->ctx->device);
    return b;
}

void worker_loop(Stream* s) {
    for (;;) {
        std::pair<uint64_t, Op> item;
        {
            std::unique_lock<std::mutex> lk(s->m);
            s->cv.wait(lk, [&] { return !s->queue.empty() || s->destroyed; });
            if (s->queue.empty()) return;  // destroyed and drained
            item = std::move(s->queue.front());
            s->queue.pop_front();
        }
        for (const Dep& d : item.second.deps) {
            std::unique_lock<std::mutex> lk(d.stream->m);
            d.stream->cv.wait(lk, [&] { return d.stream->completed >= d.seq; });
        }
        // After a sticky error the context is unusable: queued work is dropped.
        if (s->ctx->sticky.load() == CUDA_SUCCESS) {
            if (item.second.run) item.second.run();
        } else if (item.second.dropped) {
            item.second.dropped();
        }
        {
            std::lock_guard<std::mutex> lk(s->m);
            s->completed = item.first;
        }
        s->cv.notify_all();
    }
}

// Per-thread default streams of the calling thread, one per context. The map outlives the
// thread's destructors (a pointer, never freed): other thread-local destructors, which run in
// any order relative to the reaper below, may still free memory on the thread's stream.
struct PerThread {
    std::map<Context*, Stream*> streams;
};
thread_local PerThread* t_per_thread = nullptr;
// At thread exit: the thread's streams are marked for destruction (they drain first). A stream
// asked for after that is a new one.
struct Reaper {
    ~Reaper() {
        if (t_per_thread)
            for (auto& kv : t_per_thread->streams) destroy_stream(kv.second);
    }
};
thread_local Reaper t_reaper;

}  // namespace

Stream* create_stream(Context* ctx, StreamKind kind) {
    auto* s = new Stream;
    s->ctx = ctx;
    s->kind = kind;
    s->id = g_next_stream++;
    s->worker = std::thread(worker_loop, s);
    s->worker.detach();
    if (kind != StreamKind::Legacy) {
        std::lock_guard<std::mutex> g(ctx->m);
        ctx->streams.push_back(s);
    }
    return s;
}

void destroy_stream(Stream* s) {
    // The stream object itself stays allocated: events and dependencies may still name it
    // (cuStreamDestroy returns at once and the stream's work completes). Only its worker goes.
    {
        std::lock_guard<std::mutex> lk(s->m);
        s->destroyed = true;
    }
    s->cv.notify_all();
    if (s->kind == StreamKind::Legacy) return;
    std::lock_guard<std::mutex> g(s->ctx->m);
    auto& v = s->ctx->streams;
    for (size_t i = 0; i < v.size(); i++)
        if (v[i] == s) {
            v.erase(v.begin() + i);
            break;
        }
}

CUresult stream_of(const char* call, CUstream h, Context** ctx, Stream** s) {
    if (CUresult r = enter(ctx)) return r;
    std::string why;
    *s = resolve_stream(*ctx, h, why);
    if (!*s) {
        log("%s: %s", call, why.c_str());
        return CUDA_ERROR_INVALID_HANDLE;
    }
    return CUDA_SUCCESS;
}

Stream* resolve_stream(Context* ctx, CUstream h, std::string& why) {
    if (h == nullptr || h == SIM_STREAM_LEGACY) return ctx->legacy;
    if (h == SIM_STREAM_PER_THREAD) {
        (void)&t_reaper;  // registers its destructor on the thread's first per-thread stream
        if (!t_per_thread) t_per_thread = new PerThread;
        Stream*& s = t_per_thread->streams[ctx];
        if (!s || s->destroyed) s = create_stream(ctx, StreamKind::PerThread);
        return s;
    }
    auto* s = reinterpret_cast<Stream*>(h);
    std::lock_guard<std::mutex> g(ctx->m);
    for (Stream* t : ctx->streams)
        if (t == s && !t->destroyed) return s;
    char b[64];
    std::snprintf(b, sizeof b, "%p", (void*)h);
    why = std::string("stream handle ") + b + " is not a live stream of the current context (device " +
          std::to_string(ctx->device) + ")";
    return nullptr;
}

// The legacy stream's implicit synchronisation (CUDA driver API, "Stream synchronization
// behavior"): work on the legacy stream waits for all blocking streams of its context, and
// work on a blocking stream (created without CU_STREAM_NON_BLOCKING, or a per-thread stream)
// waits for the legacy stream. Caller holds g_hb.
static std::vector<Dep> implicit_deps(Stream* s) {
    std::vector<Dep> deps;
    auto add = [&](Stream* t) {
        std::lock_guard<std::mutex> lk(t->m);
        if (t->enqueued > t->completed) deps.push_back(Dep{t, t->enqueued});
        merge_clock(s->clock, t->clock);
    };
    if (s->kind == StreamKind::Legacy) {
        std::vector<Stream*> others;
        {
            std::lock_guard<std::mutex> g(s->ctx->m);
            others = s->ctx->streams;
        }
        for (Stream* t : others)
            if (t->kind != StreamKind::NonBlocking) add(t);
    } else if (s->kind != StreamKind::NonBlocking) {
        add(s->ctx->legacy);
    }
    return deps;
}

// Checks one buffer use of an operation at time `t` of stream `s` whose clock is `now`, then
// records it. Caller holds g_hb. Returns "" or the report.
static std::string check_use(Stream* s, uint64_t t, const Clock& now, Allocation& a,
                             const BufferUse& u) {
    std::string report;
    auto conflict = [&](const Allocation::Access& prior, const char* kind) {
        char b[512];
        std::snprintf(b, sizeof b,
                      "race on allocation #%" PRIu64 " (%zu bytes, device %d): %s on %s is not "
                      "ordered after the %s by %s on %s (no event record/wait or "
                      "synchronisation between them)",
                      a.id, a.size, a.device, u.what.c_str(), stream_name(s).c_str(), kind,
                      prior.what.c_str(), stream_name(prior.stream).c_str());
        report = b;
    };
    const auto& w = a.last_write;
    if (w.stream && w.stream != s && at(now, w.stream) < w.time) conflict(w, "write");
    if (u.write && report.empty())
        for (const auto& r : a.reads)
            if (r.stream != s && at(now, r.stream) < r.time) {
                conflict(r, "read");
                break;
            }
    if (u.write) {
        a.last_write = Allocation::Access{s, t, u.what};
        a.reads.clear();
    } else {
        bool found = false;
        for (auto& r : a.reads)
            if (r.stream == s) {
                r = Allocation::Access{s, t, u.what};
                found = true;
            }
        if (!found) a.reads.push_back(Allocation::Access{s, t, u.what});
    }
    return report;
}

CUresult enqueue(Stream* s, Op op, const std::vector<BufferUse>& uses, uint64_t* seq_out) {
    std::string race;
    uint64_t seq;
    {
        std::lock_guard<std::mutex> hb(g_hb);
        std::vector<Dep> deps = implicit_deps(s);
        op.deps.insert(op.deps.end(), deps.begin(), deps.end());
        merge_clock(s->clock, host_clock());
        const uint64_t t = ++s->clock[s];
        for (const BufferUse& u : uses) {
            std::string r = check_use(s, t, s->clock, *u.alloc, u);
            if (race.empty()) race = r;
        }
        std::lock_guard<std::mutex> lk(s->m);
        seq = ++s->enqueued;
        s->queue.emplace_back(seq, std::move(op));
    }
    s->cv.notify_all();
    if (seq_out) *seq_out = seq;
    if (!race.empty()) {
        set_sticky(s->ctx, CUDA_ERROR_LAUNCH_FAILED, race);
        count_race();
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    return CUDA_SUCCESS;
}

bool stream_done(Stream* s, uint64_t seq) {
    std::lock_guard<std::mutex> lk(s->m);
    return s->completed >= seq;
}

void wait_stream(Stream* s) {
    Clock observed;
    uint64_t seq;
    {
        std::lock_guard<std::mutex> hb(g_hb);  // enqueue advances both under g_hb
        observed = s->clock;
        std::lock_guard<std::mutex> lk(s->m);
        seq = s->enqueued;
    }
    wait_seq(s, seq);
    merge_into_host(observed);
}

void synchronize_context(Context* c) {
    std::vector<Stream*> streams;
    {
        std::lock_guard<std::mutex> g(c->m);
        streams = c->streams;
    }
    streams.push_back(c->legacy);
    for (Stream* s : streams) wait_stream(s);
}

void wait_seq(Stream* s, uint64_t seq) {
    std::unique_lock<std::mutex> lk(s->m);
    s->cv.wait(lk, [&] { return s->completed >= seq; });
    s->counts.host_syncs++;
}

Clock stream_clock(Stream* s) {
    std::lock_guard<std::mutex> hb(g_hb);
    return s->clock;
}

void merge_into_stream(Stream* s, const Clock& c) {
    std::lock_guard<std::mutex> hb(g_hb);
    merge_clock(s->clock, c);
}

void merge_into_host(const Clock& c) {
    std::lock_guard<std::mutex> hb(g_hb);
    merge_clock(host_clock(), c);
}

void merge_clock(Clock& into, const Clock& from) {
    for (const auto& kv : from) {
        uint64_t& v = into[kv.first];
        if (kv.second > v) v = kv.second;
    }
}

}  // namespace sim
