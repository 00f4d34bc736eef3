// The allocation table: device memory (and pinned host memory) as host mappings with guard
// pages, canaries past the end, quarantine of freed memory, and the range checks every copy,
// launch and library call goes through.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "sim.h"

namespace sim {

namespace {

constexpr size_t kPage = 4096, kAlign = 256;
constexpr unsigned char kCanary = 0xA5;
// Freed mappings stay inaccessible (PROT_NONE) until this many are quarantined; then the
// oldest is unmapped, and its addresses may be reused.
constexpr size_t kQuarantine = 4096;

std::mutex g_mem;
std::map<uint64_t, std::shared_ptr<Allocation>>& live() {  // by base address
    static auto* m = new std::map<uint64_t, std::shared_ptr<Allocation>>;  // never destroyed
    return *m;
}
std::deque<std::shared_ptr<Allocation>>& quarantine() {
    static auto* q = new std::deque<std::shared_ptr<Allocation>>;
    return *q;
}
std::map<int, uint64_t>& used() {
    static auto* u = new std::map<int, uint64_t>;
    return *u;
}
uint64_t g_next_id = 1;
// GPU_SIM_REUSE=1: memory freed in stream order goes back to a pool of its stream once the
// stream has reached the free, contents intact, and the next stream-ordered allocation of the
// same rounded size on that stream takes it (as the stream-ordered allocator's pool does),
// instead of being poisoned.
std::map<std::pair<const Stream*, size_t>, std::vector<std::shared_ptr<Allocation>>>& pool() {
    static auto* p = new std::map<std::pair<const Stream*, size_t>, std::vector<std::shared_ptr<Allocation>>>;
    return *p;
}

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// The live allocation whose [base, base+size) holds addr, or null. Caller holds g_mem.
std::shared_ptr<Allocation> holding(uint64_t addr) {
    auto& m = live();
    auto it = m.upper_bound(addr);
    if (it == m.begin()) return nullptr;
    --it;
    const auto& a = it->second;
    if (addr >= a->base && addr < a->base + a->size) return a;
    return nullptr;
}

std::string hex(uint64_t v) {
    char b[32];
    std::snprintf(b, sizeof b, "0x%" PRIx64, v);
    return b;
}

std::string name(const Allocation& a) {
    char b[160];
    std::snprintf(b, sizeof b, "%s #%" PRIu64 " [%s, +%zu bytes) on device %d",
                  a.pinned_host ? "pinned host allocation" : "allocation", a.id,
                  hex(a.base).c_str(), a.size, a.device);
    return b;
}

// What lies at addr, for a message (caller holds g_mem).
std::string describe_locked(uint64_t addr) {
    auto& m = live();
    auto it = m.upper_bound(addr);
    if (it != m.begin()) {
        auto prev = std::prev(it);
        const Allocation& a = *prev->second;
        if (addr >= a.base + a.size && addr < a.base + a.size + kPage)
            return std::to_string(addr - (a.base + a.size)) + " bytes past the end of " + name(a);
    }
    if (it != m.end()) {
        const Allocation& a = *it->second;
        if (addr < a.base && a.base - addr <= kPage)
            return std::to_string(a.base - addr) + " bytes before the start of " + name(a);
    }
    for (const auto& q : quarantine())
        if (addr >= q->base && addr < q->base + q->size) return "inside freed " + name(*q);
    if (addr == 0) return "a null pointer";
    return "not device memory (a host address or an address never allocated)";
}

void unmap(Allocation& a) {
    if (a.map) munmap(a.map, a.map_len);
    a.map = nullptr;
}

}  // namespace

// /proc/sys/vm/max_map_count, for messages.
static std::string max_map_count() {
    std::ifstream in("/proc/sys/vm/max_map_count");
    std::string v;
    return std::getline(in, v) ? v : "unknown";
}

bool reuse_freed() {
    static const bool on = [] {
        const char* e = std::getenv("GPU_SIM_REUSE");
        return e && std::string(e) == "1";
    }();
    return on;
}

CUresult mem_alloc(int device, size_t size, bool pinned_host, uint64_t* out, const Stream* s) {
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;  // cuMemAlloc: "bytesize is 0" is an error
    const size_t padded = round_up(size, kAlign);
    const size_t body = round_up(padded, kPage);
    {
        std::lock_guard<std::mutex> g(g_mem);
        if (!pinned_host && used()[device] + padded > device_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
        auto it = s ? pool().find({s, padded}) : pool().end();
        if (it != pool().end() && !it->second.empty()) {
            // A block this stream freed: same mapping, same contents, a new allocation record
            // (its own number and race-checker state). Only the slack's canary is renewed.
            auto old = it->second.back();
            it->second.pop_back();
            auto a = std::make_shared<Allocation>();
            a->base = old->base;
            a->size = size;
            a->device = device;
            a->map = old->map;
            a->map_len = old->map_len;
            a->id = g_next_id++;
            std::memset(reinterpret_cast<void*>(a->base + size), kCanary, padded - size);
            used()[device] += padded;
            live()[a->base] = a;
            *out = a->base;
            return CUDA_SUCCESS;
        }
    }
    const size_t len = body + 2 * kPage;
    // Out of host mappings (each allocation is three: guard, body, guard; the kernel allows
    // vm.max_map_count per process) is the simulator's limit, not the device's: said so.
    auto no_map = [&](const char* call) {
        log("%s of %zu bytes for device %d failed (%s): the simulator is out of host memory "
            "mappings or memory (vm.max_map_count %s), not the simulated device: "
            "CUDA_ERROR_OUT_OF_MEMORY",
            call, len, device, std::strerror(errno), max_map_count().c_str());
        return CUDA_ERROR_OUT_OF_MEMORY;
    };
    void* m = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return no_map("mmap");
    char* body_start = static_cast<char*>(m) + kPage;
    if (mprotect(body_start, body, PROT_READ | PROT_WRITE) != 0) {
        CUresult r = no_map("mprotect");
        munmap(m, len);
        return r;
    }
    auto a = std::make_shared<Allocation>();
    a->base = reinterpret_cast<uint64_t>(body_start + body - padded);
    a->size = size;
    a->device = device;
    a->pinned_host = pinned_host;
    a->map = m;
    a->map_len = len;
    // Fresh device memory holds garbage on a GPU: fill it with a NaN pattern (0xFF bytes) so
    // that reading before writing shows (not when kernels are skipped: nothing is computed, and
    // the fill would be the simulator's cost, not the program's); the slack past the end holds
    // the canary.
    if (!skip_kernels()) std::memset(reinterpret_cast<void*>(a->base), 0xFF, size);
    std::memset(reinterpret_cast<void*>(a->base + size), kCanary, padded - size);
    // The gap before the allocation, up to its page's start, holds the canary too.
    std::memset(body_start, kCanary, a->base - reinterpret_cast<uint64_t>(body_start));
    std::lock_guard<std::mutex> g(g_mem);
    a->id = g_next_id++;
    if (!pinned_host) used()[device] += padded;
    live()[a->base] = a;
    *out = a->base;
    return CUDA_SUCCESS;
}

CUresult mem_free_mark(uint64_t ptr, bool pinned_host, std::shared_ptr<Allocation>* out,
                       std::string& why) {
    std::lock_guard<std::mutex> g(g_mem);
    auto it = live().find(ptr);
    if (it == live().end() || it->second->freed || it->second->pinned_host != pinned_host) {
        why = hex(ptr) + " is " +
              (it == live().end() ? describe_locked(ptr)
                                  : std::string(it->second->freed ? "already being freed: "
                                                                  : "the wrong kind: ") +
                                        name(*it->second));
        if (it == live().end() && holding(ptr))
            why = hex(ptr) + " is not the start of its allocation (" + name(*holding(ptr)) + ")";
        return CUDA_ERROR_INVALID_VALUE;
    }
    it->second->freed = true;
    *out = it->second;
    return CUDA_SUCCESS;
}

void mem_free_now(const std::shared_ptr<Allocation>& a, const Stream* s) {
    std::lock_guard<std::mutex> g(g_mem);
    auto it = live().find(a->base);
    if (it == live().end() || it->second != a) return;
    live().erase(it);
    if (!a->pinned_host) used()[a->device] -= round_up(a->size, kAlign);
    if (s && reuse_freed() && !a->pinned_host) {
        // Into `s`'s pool, readable as on a GPU: every use before the free has run (stream
        // order), so the block can be handed to the next allocation on `s`.
        pool()[{s, round_up(a->size, kAlign)}].push_back(a);
        return;
    }
    // Poisoned: every later access faults, and is named as a freed allocation.
    mprotect(a->map, a->map_len, PROT_NONE);
    quarantine().push_back(a);
    if (quarantine().size() > kQuarantine) {
        unmap(*quarantine().front());
        quarantine().pop_front();
    }
}

std::shared_ptr<Allocation> find_range(uint64_t ptr, size_t len, int device, std::string& why) {
    std::lock_guard<std::mutex> g(g_mem);
    auto a = holding(ptr);
    if (!a) {
        why = hex(ptr) + " is " + describe_locked(ptr);
        return nullptr;
    }
    if (a->freed) {
        why = hex(ptr) + " is inside " + name(*a) + ", which is being freed";
        return nullptr;
    }
    if (a->pinned_host) {
        why = hex(ptr) + " is host memory (" + name(*a) + "), not device memory";
        return nullptr;
    }
    if (a->device != device) {
        why = hex(ptr) + " is memory of device " + std::to_string(a->device) + " (" + name(*a) +
              "), used on device " + std::to_string(device);
        return nullptr;
    }
    if (len > a->base + a->size - ptr) {
        why = "[" + hex(ptr) + ", +" + std::to_string(len) + " bytes) runs " +
              std::to_string(ptr + len - (a->base + a->size)) + " bytes past the end of " + name(*a);
        return nullptr;
    }
    return a;
}

std::string describe_address(uint64_t addr) {
    std::lock_guard<std::mutex> g(g_mem);
    return describe_locked(addr);
}

std::string check_canaries(const std::vector<uint64_t>& ptrs) {
    std::lock_guard<std::mutex> g(g_mem);
    for (uint64_t p : ptrs) {
        auto a = holding(p);
        if (!a) continue;
        const unsigned char* end = reinterpret_cast<const unsigned char*>(a->base + a->size);
        const size_t slack = round_up(a->size, kAlign) - a->size;
        for (size_t i = 0; i < slack; i++)
            if (end[i] != kCanary)
                return "a write " + std::to_string(i) + " bytes past the end of " + name(*a);
        const unsigned char* start = reinterpret_cast<const unsigned char*>(a->base);
        const unsigned char* page = static_cast<const unsigned char*>(a->map) + kPage;
        for (const unsigned char* q = start; q > page; --q)
            if (q[-1] != kCanary)
                return "a write " + std::to_string(start - q + 1) + " bytes before the start of " +
                       name(*a);
    }
    return "";
}

bool is_device_memory(uint64_t addr) {
    std::lock_guard<std::mutex> g(g_mem);
    auto a = holding(addr);
    if (a) return !a->pinned_host;
    for (const auto& q : quarantine())
        if (addr >= q->base && addr < q->base + q->size) return !q->pinned_host;
    return false;
}

bool is_pinned_host(const void* p, size_t len) {
    std::lock_guard<std::mutex> g(g_mem);
    auto a = holding(reinterpret_cast<uint64_t>(p));
    return a && a->pinned_host && !a->freed &&
           reinterpret_cast<uint64_t>(p) + len <= a->base + a->size;
}

void mem_reset_device(int device) {
    std::vector<std::shared_ptr<Allocation>> gone;
    {
        std::lock_guard<std::mutex> g(g_mem);
        for (auto& kv : live())
            if (kv.second->device == device && !kv.second->pinned_host) gone.push_back(kv.second);
    }
    for (auto& a : gone) mem_free_now(a);
}

uint64_t mem_used(int device) {
    std::lock_guard<std::mutex> g(g_mem);
    return used()[device];
}

}  // namespace sim
