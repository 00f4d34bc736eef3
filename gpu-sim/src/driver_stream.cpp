// Driver API: streams and events.
#include <chrono>
#include <set>

#include "sim.h"

namespace {

std::mutex g_events;
std::set<sim::Event*>& events() {
    static auto* s = new std::set<sim::Event*>;  // never destroyed (see sim.h)
    return *s;
}


sim::Event* event_of(const char* call, CUevent h) {
    auto* e = reinterpret_cast<sim::Event*>(h);
    if (!sim::valid_event(e)) {
        sim::log("%s: %p is not a live event (never created, or destroyed)", call, (void*)h);
        return nullptr;
    }
    return e;
}

}  // namespace

namespace sim {
bool valid_event(Event* e) {
    std::lock_guard<std::mutex> g(g_events);
    return events().count(e) && !e->destroyed;
}
}  // namespace sim

extern "C" {

CUresult cuStreamCreate(CUstream* out, unsigned flags) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    if (!out || (flags & ~CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    auto kind = (flags & CU_STREAM_NON_BLOCKING) ? sim::StreamKind::NonBlocking
                                                 : sim::StreamKind::Blocking;
    *out = reinterpret_cast<CUstream>(sim::create_stream(ctx, kind));
    return CUDA_SUCCESS;
}

CUresult cuStreamCreateWithPriority(CUstream* out, unsigned flags, int priority) {
    (void)priority;  // priorities only order scheduling on a GPU; every stream has its worker here
    return cuStreamCreate(out, flags);
}

CUresult cuStreamGetPriority(CUstream h, int* priority) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuStreamGetPriority", h, &ctx, &s)) return r;
    if (!priority) return CUDA_ERROR_INVALID_VALUE;
    *priority = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuStreamDestroy", h, &ctx, &s)) return r;
    if (s->kind == sim::StreamKind::Legacy || s->kind == sim::StreamKind::PerThread) {
        sim::log("cuStreamDestroy: the legacy and per-thread streams cannot be destroyed");
        return CUDA_ERROR_INVALID_HANDLE;
    }
    sim::destroy_stream(s);
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuStreamSynchronize", h, &ctx, &s)) return r;
    sim::wait_stream(s);
    return ctx->sticky.load();
}

CUresult cuStreamQuery(CUstream h) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuStreamQuery", h, &ctx, &s)) return r;
    sim::Clock observed = sim::stream_clock(s);
    uint64_t seq;
    {
        std::lock_guard<std::mutex> lk(s->m);
        seq = s->enqueued;
    }
    if (!sim::stream_done(s, seq)) return CUDA_ERROR_NOT_READY;
    sim::merge_into_host(observed);
    return ctx->sticky.load();
}

// Stream capture is not simulated: no stream is ever capturing.
CUresult cuStreamIsCapturing(CUstream h, int* status) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuStreamIsCapturing", h, &ctx, &s)) return r;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    *status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* out, unsigned flags) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    if (!out || (flags & ~(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)))
        return CUDA_ERROR_INVALID_VALUE;
    if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE;  // the reference: INTERPROCESS needs DISABLE_TIMING
    auto* e = new sim::Event;
    e->flags = flags;
    std::lock_guard<std::mutex> g(g_events);
    events().insert(e);
    *out = reinterpret_cast<CUevent>(e);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent h) {
    sim::Event* e = event_of("cuEventDestroy", h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    // The object stays allocated (work may still reference it); the handle is dead from now on.
    std::lock_guard<std::mutex> g(g_events);
    e->destroyed = true;
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent h, CUstream hs) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuEventRecord", hs, &ctx, &s)) return r;
    sim::Event* e = event_of("cuEventRecord", h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    auto stamp = std::make_shared<double>(0);
    sim::Op op;
    op.kind = "event record";
    if (!(e->flags & CU_EVENT_DISABLE_TIMING))
        op.run = [stamp] {
            *stamp = std::chrono::duration<double, std::milli>(
                         std::chrono::steady_clock::now().time_since_epoch())
                         .count();
        };
    uint64_t seq;
    if (CUresult r = sim::enqueue(s, std::move(op), {}, &seq)) return r;
    sim::count(s, &sim::Counts::event_records);
    std::lock_guard<std::mutex> g(e->m);
    e->recorded = true;
    e->stream = s;
    e->seq = seq;
    e->clock = sim::stream_clock(s);
    e->stamp = stamp;
    return CUDA_SUCCESS;
}

CUresult cuEventRecordWithFlags(CUevent h, CUstream hs, unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    return cuEventRecord(h, hs);
}

CUresult cuEventQuery(CUevent h) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    sim::Event* e = event_of("cuEventQuery", h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    std::lock_guard<std::mutex> g(e->m);
    // "If cuEventRecord() has not been called on this event, the function returns
    // CUDA_SUCCESS" (cuEventQuery).
    if (!e->recorded) return CUDA_SUCCESS;
    if (!sim::stream_done(e->stream, e->seq)) return CUDA_ERROR_NOT_READY;
    sim::merge_into_host(e->clock);
    return e->stream->ctx->sticky.load();
}

CUresult cuEventSynchronize(CUevent h) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    sim::Event* e = event_of("cuEventSynchronize", h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    sim::Stream* s;
    uint64_t seq;
    sim::Clock c;
    {
        std::lock_guard<std::mutex> g(e->m);
        if (!e->recorded) return CUDA_SUCCESS;
        s = e->stream;
        seq = e->seq;
        c = e->clock;
    }
    sim::wait_seq(s, seq);
    sim::merge_into_host(c);
    return s->ctx->sticky.load();
}

CUresult cuStreamWaitEvent(CUstream hs, CUevent h, unsigned flags) {
    sim::Context* ctx;
    sim::Stream* s;
    if (CUresult r = sim::stream_of("cuStreamWaitEvent", hs, &ctx, &s)) return r;
    sim::Event* e = event_of("cuStreamWaitEvent", h);
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    sim::Op op;
    op.kind = "stream wait";
    {
        std::lock_guard<std::mutex> g(e->m);
        // A wait on an event never recorded completes at once (it captured no work).
        if (!e->recorded) return CUDA_SUCCESS;
        op.deps.push_back(sim::Dep{e->stream, e->seq});
        sim::merge_into_stream(s, e->clock);
    }
    if (CUresult r = sim::enqueue(s, std::move(op), {})) return r;
    sim::count(s, &sim::Counts::stream_waits);
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
    sim::Event* a = event_of("cuEventElapsedTime", start);
    sim::Event* b = event_of("cuEventElapsedTime", end);
    if (!a || !b || !ms) return CUDA_ERROR_INVALID_HANDLE;
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    if (!a->recorded || !b->recorded) return CUDA_ERROR_INVALID_HANDLE;
    if (!sim::stream_done(a->stream, a->seq) || !sim::stream_done(b->stream, b->seq))
        return CUDA_ERROR_NOT_READY;
    *ms = (float)(*b->stamp - *a->stamp);
    return CUDA_SUCCESS;
}

}  // extern "C"
