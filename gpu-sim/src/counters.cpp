// Counters that tests read: operations by kind per stream and in total, the names of launched
// kernels in order, and the defects reported. Exported with a `gpusim_` prefix; a test finds
// them with dlsym, and their absence means a real driver.
#include <cstring>

#include "gpusim.h"
#include "sim.h"

namespace sim {

namespace {
std::mutex g_counts;
Counts g_total;
std::vector<std::string>& g_launches = *new std::vector<std::string>;  // never destroyed
std::atomic<uint64_t> g_races{0}, g_faults{0};
}  // namespace

void count(Stream* s, uint64_t Counts::*field) {
    {
        std::lock_guard<std::mutex> lk(s->m);
        s->counts.*field += 1;
    }
    count_global(field);
}

void count_global(uint64_t Counts::*field) {
    std::lock_guard<std::mutex> g(g_counts);
    g_total.*field += 1;
}

void log_launch(const std::string& name) {
    std::lock_guard<std::mutex> g(g_counts);
    if (g_launches.size() < 1000000) g_launches.push_back(name);
}

void count_race() { g_races++; }
void count_fault() { g_faults++; }

}  // namespace sim

namespace {
void fill(GpuSimCounts* out, const sim::Counts& c) {
    out->launches = c.launches;
    out->copies_htod = c.copies_htod;
    out->copies_dtoh = c.copies_dtoh;
    out->copies_dtod = c.copies_dtod;
    out->memsets = c.memsets;
    out->allocs = c.allocs;
    out->frees = c.frees;
    out->event_records = c.event_records;
    out->stream_waits = c.stream_waits;
    out->host_syncs = c.host_syncs;
    out->host_tasks = c.host_tasks;
}
}  // namespace

extern "C" {

int gpusim_counts(void* stream, int all, GpuSimCounts* out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (all) {
        std::lock_guard<std::mutex> g(sim::g_counts);
        fill(out, sim::g_total);
        return CUDA_SUCCESS;
    }
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    std::string why;
    sim::Stream* s = sim::resolve_stream(ctx, static_cast<CUstream>(stream), why);
    if (!s) return CUDA_ERROR_INVALID_HANDLE;
    std::lock_guard<std::mutex> lk(s->m);
    fill(out, s->counts);
    return CUDA_SUCCESS;
}

void gpusim_reset_counts(void) {
    std::lock_guard<std::mutex> g(sim::g_counts);
    sim::g_total = sim::Counts{};
    sim::g_launches.clear();
}

size_t gpusim_launch_log(char* buf, size_t len) {
    std::string all;
    {
        std::lock_guard<std::mutex> g(sim::g_counts);
        for (const auto& n : sim::g_launches) all += n + "\n";
    }
    if (buf && len) {
        size_t k = all.size() < len - 1 ? all.size() : len - 1;
        std::memcpy(buf, all.data(), k);
        buf[k] = 0;
    }
    return all.size();
}

unsigned long long gpusim_races(void) { return sim::g_races.load(); }
unsigned long long gpusim_faults(void) { return sim::g_faults.load(); }

}  // extern "C"
