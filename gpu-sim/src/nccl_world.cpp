// The simulated NCCL's shared-memory worlds, waits, the communicator registry, errors and
// injected faults (see nccl_sim.h).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <vector>

#include "nccl_sim.h"

namespace nccl {

namespace {

size_t data_offset() { return (sizeof(Header) + 4095) & ~size_t(4095); }

std::mutex g_reg;
std::set<const Comm*>* g_live = new std::set<const Comm*>;  // leaked: see sim.h

thread_local std::string t_last_error;

std::vector<Fault> parse_faults() {
    std::vector<Fault> out;
    const char* env = std::getenv("GPU_SIM_NCCL_FAULTS");
    if (!env) return out;
    std::stringstream all(env);
    std::string item;
    while (std::getline(all, item, ';')) {
        if (item.empty()) continue;
        Fault f;
        auto colon = item.find(':');
        f.kind = item.substr(0, colon);
        if (colon != std::string::npos) {
            std::stringstream kv(item.substr(colon + 1));
            std::string p;
            while (std::getline(kv, p, ',')) {
                auto eq = p.find('=');
                std::string k = p.substr(0, eq);
                long v = eq == std::string::npos ? 0 : std::strtol(p.c_str() + eq + 1, nullptr, 0);
                if (k == "rank") f.rank = int(v);
                else if (k == "call") f.call = v;
                else if (k == "code") f.code = int(v);
                else if (k == "stall-ms") f.stall_ms = int(v);
                else if (k == "n") f.code = int(v);
                else sim::fatal("GPU_SIM_NCCL_FAULTS: unknown key '%s' in '%s'", k.c_str(), item.c_str());
            }
        }
        static const char* kinds[] = {"init-never", "skip", "hang", "async-error", "sync-error",
                                      "blocking", "version", "kernel-fault", "split-error"};
        bool known = false;
        for (const char* k : kinds) known |= f.kind == k;
        if (!known) sim::fatal("GPU_SIM_NCCL_FAULTS: unknown fault '%s'", f.kind.c_str());
        sim::log("nccl: injected fault %s (rank %d, call %ld, code %d)", f.kind.c_str(), f.rank,
                 f.call, f.code);
        out.push_back(f);
    }
    return out;
}

const std::vector<Fault>& faults() {
    static const std::vector<Fault>* f = new std::vector<Fault>(parse_faults());
    return *f;
}

// One configuration file as NCCL reads it at start-up: each line NAME=VALUE (split at the
// first '=', the name not trimmed, a trailing CR dropped) is put into the environment without
// overwriting, so the environment wins over the files and, within a file, the first line over
// later ones; '#' makes a comment only in the first column.
void apply_conf(const std::string& path) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.empty() || line[0] == '#') continue;
        auto eq = line.find('=');
        if (eq == std::string::npos || eq == 0) continue;
        setenv(line.substr(0, eq).c_str(), line.c_str() + eq + 1, 0);
    }
}

}  // namespace

ncclResult_t map_world(uint64_t key, int nranks, World* w, std::string& why) {
    char name[64];
    std::snprintf(name, sizeof name, "/gpusim-nccl-%016llx", (unsigned long long)key);
    int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
    if (fd < 0) {
        why = std::string("shm_open ") + name + ": " + std::strerror(errno);
        return ncclSystemError;
    }
    size_t len = data_offset() + size_t(nranks) * kChunk;
    struct stat st;
    // Grown, never shrunk (a peer with another world size may have it mapped already).
    if (fstat(fd, &st) != 0 || (size_t(st.st_size) < len && ftruncate(fd, off_t(len)) != 0)) {
        why = std::string("sizing ") + name + ": " + std::strerror(errno);
        close(fd);
        return ncclSystemError;
    }
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        why = std::string("mmap ") + name + ": " + std::strerror(errno);
        return ncclSystemError;
    }
    w->h = static_cast<Header*>(p);
    w->data = static_cast<uint8_t*>(p) + data_offset();
    w->len = len;
    w->name = name;
    int32_t expect = 0;
    if (!w->h->nranks.compare_exchange_strong(expect, nranks) && expect != nranks) {
        why = "this rank was given nranks " + std::to_string(nranks) + ", a peer " +
              std::to_string(expect);
        unmap_world(*w);
        return ncclInvalidArgument;
    }
    w->h->refs.fetch_add(1);
    return ncclSuccess;
}

void unlink_world(const World& w) {
    if (!w.name.empty()) shm_unlink(w.name.c_str());  // ENOENT: already unlinked by a peer
}

void unmap_world(World& w) {
    if (w.h) munmap(w.h, w.len);
    w.h = nullptr;
    w.data = nullptr;
}

bool process_gone(int pid) {
    if (pid <= 0 || pid == getpid()) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return true;
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
    std::ifstream in(path);
    std::string stat;
    if (!std::getline(in, stat)) return true;
    auto close_paren = stat.rfind(')');
    if (close_paren == std::string::npos || close_paren + 2 >= stat.size()) return false;
    char state = stat[close_paren + 2];
    return state == 'Z' || state == 'X';
}

const Fault* find_fault(const char* kind, int rank, long call) {
    for (const Fault& f : faults())
        if (f.kind == kind && (f.rank < 0 || f.rank == rank) && (f.call < 0 || f.call == call))
            return &f;
    return nullptr;
}

int reported_version() {
    const Fault* f = find_fault("version", -1, -1);
    return f ? f->code : 22703;
}

namespace {
struct InProgress {
    unsigned rate = 4;
    uint64_t seed = 0;
};
const InProgress& in_progress_setting() {
    static const InProgress v = [] {
        InProgress p;
        const char* e = std::getenv("GPU_SIM_NCCL_INPROGRESS");
        if (!e || !*e) return p;
        std::string s = e;
        unsigned long long seed = 0;
        unsigned rate = p.rate;
        if (s == "first") {
            p.rate = 0;
        } else if (std::sscanf(s.c_str(), "random:%llu:%u", &seed, &rate) >= 1 && rate > 0) {
            p.seed = seed;
            p.rate = rate;
        } else {
            sim::fatal("GPU_SIM_NCCL_INPROGRESS=%s: expected first, random:SEED or random:SEED:RATE (RATE > 0)", e);
        }
        return p;
    }();
    return v;
}
}  // namespace

unsigned in_progress_rate() { return in_progress_setting().rate; }
uint64_t in_progress_seed() { return in_progress_setting().seed; }

void init_env() {
    static std::once_flag once;
    std::call_once(once, [] {
        const char* f = std::getenv("NCCL_CONF_FILE");
        if (f && *f) apply_conf(f);
        else if (const char* h = std::getenv("HOME")) apply_conf(std::string(h) + "/.nccl.conf");
        apply_conf("/etc/nccl.conf");
    });
}

int blocking_override() {
    if (find_fault("blocking", -1, -1)) return 1;
    static const int v = [] {
        init_env();
        const char* e = std::getenv("NCCL_COMM_BLOCKING");
        if (!e || !*e) return -1;
        errno = 0;
        long long x = std::strtoll(e, nullptr, 0);
        return errno ? -1 : int(x != 0);
    }();
    return v;
}

bool live(const Comm* c) {
    std::lock_guard<std::mutex> lk(g_reg);
    return c && g_live->count(c);
}
void register_comm(Comm* c) {
    std::lock_guard<std::mutex> lk(g_reg);
    g_live->insert(c);
}
void unregister_comm(Comm* c) {
    std::lock_guard<std::mutex> lk(g_reg);
    g_live->erase(c);
}

ncclResult_t fail(ncclResult_t code, const char* fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    t_last_error = buf;
    sim::log("nccl: %s", buf);
    return code;
}

const char* last_error() { return t_last_error.c_str(); }

void set_async(Comm* c, int code, const std::string& why) {
    std::lock_guard<std::mutex> lk(c->m);
    int expect = ncclSuccess;
    if (c->async_error.compare_exchange_strong(expect, code)) {
        c->why = why;
        sim::log("nccl: rank %d: asynchronous error %d: %s", c->rank, code, why.c_str());
    }
}

bool wait_until(Comm* c, const std::function<bool()>& cond, bool task) {
    auto last_scan = std::chrono::steady_clock::now();
    for (unsigned spins = 0;; ++spins) {
        if (c->aborted.load()) return false;
        bool failed = c->async_error.load() != ncclSuccess;
        if (failed && !task) return false;
        if (!failed && cond()) return true;
        auto now = std::chrono::steady_clock::now();
        if (c->world.h && now - last_scan > std::chrono::milliseconds(20)) {
            last_scan = now;
            for (int p = 0; p < c->nranks; ++p) {
                const Slot& s = c->world.h->slots[p];
                if (p != c->rank && s.joined.load() && !s.gone.load() &&
                    process_gone(s.pid.load())) {
                    set_async(c, ncclRemoteError,
                              "rank " + std::to_string(p) + " (process " +
                                  std::to_string(s.pid.load()) + ") exited");
                    if (!task) return false;
                }
            }
        }
        if (spins < 200) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(spins < 2000 ? 50 : 500));
    }
}

// The identity of the host a rank runs on, as NCCL's getHostHash forms it: NCCL_HOSTID when
// set, else the host name followed by the kernel's boot id; FNV-1a of that text. Read at each
// init (NCCL reads it once per process; the self-test forks a child that sets NCCL_HOSTID).
uint64_t host_identity() {
    std::string text;
    if (const char* id = std::getenv("NCCL_HOSTID")) {
        text = id;
    } else {
        char name[1024] = {0};
        if (gethostname(name, sizeof name - 1) != 0) std::strcpy(name, "unknown");
        text = name;
        if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
            char boot[128] = {0};
            if (std::fscanf(f, "%127s", boot) == 1) text += boot;
            std::fclose(f);
        }
    }
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char ch : text) h = (h ^ ch) * 0x100000001b3ull;
    return h;
}

bool join(Comm* c) {
    std::string why;
    if (ncclResult_t r = map_world(c->key, c->nranks, &c->world, why)) {
        set_async(c, r, why);
        return false;
    }
    Slot& s = c->world.h->slots[c->rank];
    uint32_t zero = 0;
    s.pid.store(getpid());
    s.device.store(c->device);
    s.host.store(host_identity());
    if (!s.joined.compare_exchange_strong(zero, 1)) {
        set_async(c, ncclInvalidUsage,
                  "rank " + std::to_string(c->rank) + " was claimed twice in one communicator");
        return false;
    }
    c->joined = true;
    return true;
}

bool all_joined(Comm* c) {
    for (int p = 0; p < c->nranks; ++p)
        if (!c->world.h->slots[p].joined.load()) return false;
    // NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU
    // detected": same host hash and bus id); the same ordinal on two hosts is two GPUs.
    const uint64_t host = c->world.h->slots[c->rank].host.load();
    for (int p = 0; p < c->nranks; ++p) {
        const Slot& s = c->world.h->slots[p];
        int d = s.device.load();
        if (p != c->rank && d == c->device && s.host.load() == host) {
            set_async(c, ncclInvalidUsage,
                      "ranks " + std::to_string(c->rank) + " and " + std::to_string(p) +
                          " of one communicator are both on device " + std::to_string(d) +
                          " of one host");
            return false;
        }
    }
    unlink_world(c->world);  // every rank has it mapped: nothing can join any more
    return true;
}

void start_job(Comm* c, std::function<void()> body) {
    std::lock_guard<std::mutex> lk(c->m);
    if (c->job.joinable()) c->job.join();  // the previous job is over (the state was ready)
    c->busy = true;
    c->job = std::thread([c, body = std::move(body)] {
        body();
        c->busy = false;
    });
}

void join_job(Comm* c) {
    std::thread t;
    {
        std::lock_guard<std::mutex> lk(c->m);
        t = std::move(c->job);
    }
    if (t.joinable()) t.join();
}

ncclResult_t enter(Comm* c, const char* call) {
    if (!live(c)) return fail(ncclInvalidArgument, "%s: %p is not a live communicator (never made, destroyed or aborted)", call, (void*)c);
    if (c->inside.fetch_add(1) != 0) {
        c->inside.fetch_sub(1);
        return fail(ncclInvalidUsage, "%s: another thread is inside a call on this communicator (NCCL allows one at a time)", call);
    }
    if (int e = c->async_error.load()) {
        c->inside.fetch_sub(1);
        std::lock_guard<std::mutex> lk(c->m);
        return fail(e, "%s: the communicator has an error: %s", call, c->why.c_str());
    }
    if (c->busy.load()) {
        c->inside.fetch_sub(1);
        return fail(ncclInvalidUsage, "%s: the previous call is still in progress (poll ncclCommGetAsyncError until ncclSuccess first)", call);
    }
    return ncclSuccess;
}

void leave(Comm* c) { c->inside.fetch_sub(1); }

}  // namespace nccl
