// GPU_SIM_NCCL_PROGRESS: whether the communicators of one simulated device progress
// independently (`shared`, the default) or one collective at a time per device, in the order
// the host issued them (`device`), so that two communicators used in different orders on two
// ranks deadlock every time (see nccl_sim.h, `DeviceTurn`, and README.md).
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

#include "nccl_sim.h"

namespace nccl {

namespace {

struct Device {
    uint64_t next = 0;        // the next ticket to hand out
    std::set<uint64_t> open;  // tickets issued whose task has not ended
};

std::mutex g_turns;
// Leaked, like the stream tables: stream workers may end tasks while the process exits.
std::map<int, Device>* g_devices = new std::map<int, Device>;

}  // namespace

bool device_progress() {
    static const bool v = [] {
        const char* e = std::getenv("GPU_SIM_NCCL_PROGRESS");
        if (!e || !*e || std::strcmp(e, "shared") == 0) return false;
        if (std::strcmp(e, "device") == 0) {
            sim::log("nccl: one collective at a time per device, in issue order (GPU_SIM_NCCL_PROGRESS=device)");
            return true;
        }
        sim::fatal("GPU_SIM_NCCL_PROGRESS=%s: expected shared or device", e);
    }();
    return v;
}

DeviceTurn::DeviceTurn(int device) : device(device) {
    if (!device_progress()) return;
    std::lock_guard<std::mutex> lk(g_turns);
    Device& d = (*g_devices)[device];
    ticket = d.next++;
    d.open.insert(ticket);
    held = true;
}

bool DeviceTurn::wait(Comm* c) const {
    if (!held) return true;
    return wait_until(c, [this] {
        std::lock_guard<std::mutex> lk(g_turns);
        return *(*g_devices)[device].open.begin() == ticket;
    }, true);
}

void DeviceTurn::end() const {
    if (!held) return;
    std::lock_guard<std::mutex> lk(g_turns);
    (*g_devices)[device].open.erase(ticket);
}

}  // namespace nccl
