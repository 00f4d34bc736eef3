// The blocks of a launch on several OS threads (GPU_SIM_BLOCK_THREADS): the stream's thread
// runs blocks itself and offers the launch to a pool of helper threads shared by every stream;
// each idle helper joins in, taking blocks in the schedule's order until none is left. So the
// blocks of one launch really run at the same time, and a kernel whose blocks coordinate
// through global memory ("the last block to finish sums the partials") meets interleavings
// that one thread running blocks one after another never shows. After an atomic a thread
// parks until every other one is parked too or has left the launch (emu::LaunchConfig::preempt;
// GPU_SIM_PREEMPT, the longest park in microseconds, 20000 by default, 0 for none), so that a
// window of a few instructions between one block's announcement and its write stays open
// while the other blocks run on.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>

#include "faults.h"
#include "sim.h"

namespace sim {

namespace {

struct Job {
    emu::Grid grid;
    std::mutex m;                    // guards `fault`
    Fault fault;                     // the first fault's
    int active = 0;                  // helpers inside run_blocks (guarded by the pool's mutex)
};

// Leaked, like the stream tables: helpers wait on them while the process exits (destroying a
// condition variable with waiters blocks the exit).
struct Pool {
    std::mutex m;
    std::condition_variable work;  // a job was offered
    std::condition_variable idle;  // a helper left a job
    std::deque<Job*> open;         // jobs with blocks left to take, oldest first
    unsigned waiting = 0;          // helpers waiting for a job
};
Pool& pool() {
    static Pool* p = new Pool;
    return *p;
}

// Runs blocks of `j` on this thread, guarded; a memory fault fails the whole grid.
void work_on(Job& j) {
    Fault fault;
    if (!guarded([&j] { emu::run_blocks(j.grid); }, &fault)) {
        {
            std::lock_guard<std::mutex> lk(j.m);
            if (!j.fault.happened) j.fault = fault;
        }
        j.grid.fail(fault.misaligned ? "misaligned access" : "memory fault");
    }
}

bool exhausted(const Job& j) {
    return j.grid.failed.load() || j.grid.next.load() >= j.grid.nblocks;
}

void helper() {
    for (;;) {
        Job* j;
        {
            std::unique_lock<std::mutex> lk(pool().m);
            for (;;) {
                pool().waiting++;
                pool().work.wait(lk, [] { return !pool().open.empty(); });
                pool().waiting--;
                j = pool().open.front();
                if (!exhausted(*j)) break;
                pool().open.pop_front();  // nothing left to take: its launcher waits for helpers
            }
            j->active++;
        }
        work_on(*j);
        {
            std::lock_guard<std::mutex> lk(pool().m);
            j->active--;
        }
        pool().idle.notify_all();
    }
}

void start_helpers() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (unsigned i = 1; i < block_threads(); i++) std::thread(helper).detach();
        // Until they wait for work (up to 100 ms): the first launch counts on them too.
        for (int tries = 0; tries < 100; tries++) {
            {
                std::lock_guard<std::mutex> lk(pool().m);
                if (pool().waiting + 1 >= block_threads()) break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
    });
}

}  // namespace

unsigned block_threads() {
    static const unsigned n = [] {
        const char* e = std::getenv("GPU_SIM_BLOCK_THREADS");
        if (!e || !*e) return 1u;
        char* end = nullptr;
        unsigned long v = std::strtoul(e, &end, 10);
        if (*end || v < 1 || v > 64)
            fatal("GPU_SIM_BLOCK_THREADS=%s: expected a number of threads from 1 to 64", e);
        log("the blocks of a launch run on %lu OS threads (GPU_SIM_BLOCK_THREADS)", v);
        return unsigned(v);
    }();
    return n;
}

unsigned preempt_max_us() {
    static const unsigned n = [] {
        const char* e = std::getenv("GPU_SIM_PREEMPT");
        if (!e || !*e) return 20000u;
        char* end = nullptr;
        unsigned long v = std::strtoul(e, &end, 10);
        if (*end || v > 1000000)
            fatal("GPU_SIM_PREEMPT=%s: expected the longest wait at a preemption point in "
                  "microseconds, 0 to 1000000 (0: no preemption points)", e);
        if (block_threads() > 1)
            log("preemption points wait up to %lu microseconds (GPU_SIM_PREEMPT)", v);
        return unsigned(v);
    }();
    return n;
}

bool guarded_run(const emu::KernelEntry& k, void** args, const emu::LaunchConfig& cfg,
                 std::string& error, Fault* fault) {
    *fault = Fault{};
    Job j;
    if (!emu::prepare(k, args, cfg, j.grid, error)) return false;
    const bool pooled = block_threads() > 1 && j.grid.nblocks > 1;
    if (pooled) {
        // Blocks at once on several threads: they park after atomics, where a GPU's
        // other SMs would run on (emu::LaunchConfig::preempt).
        j.grid.cfg.preempt = preempt_max_us() > 0;
        j.grid.cfg.preempt_max_us = preempt_max_us();
        start_helpers();
        {
            std::lock_guard<std::mutex> lk(pool().m);
            // The helpers waiting for a job take this one; busy ones (another stream's launch)
            // are not waited for at the start.
            j.grid.expected_runners =
                1 + unsigned(std::min<size_t>(pool().waiting, j.grid.nblocks - 1));
            pool().open.push_back(&j);
        }
        pool().work.notify_all();
    }
    work_on(j);
    if (pooled) {
        std::unique_lock<std::mutex> lk(pool().m);
        auto& open = pool().open;
        for (auto it = open.begin(); it != open.end(); ++it)
            if (*it == &j) {
                open.erase(it);
                break;
            }
        pool().idle.wait(lk, [&j] { return j.active == 0; });
    }
    if (!j.grid.failed.load()) return true;
    error = j.grid.error;
    std::lock_guard<std::mutex> lk(j.m);
    *fault = j.fault;
    return false;
}

}  // namespace sim
