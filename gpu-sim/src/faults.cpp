// Running a kernel with its faults caught: a SIGSEGV or SIGBUS raised by kernel code (an access
// to a guard page, to freed or unmapped memory) ends the launch with the faulting address
// instead of killing the process, as a GPU reports an illegal address; a SIGILL (the trap of
// the alignment check the kernel libraries are built with) ends it as a misaligned address.
// Signals raised outside a kernel go to the handler that was installed before (Rust's, or the
// default).
#include <dlfcn.h>
#include <setjmp.h>
#include <signal.h>

#include <cstdlib>
#include <cstring>
#include <functional>

#include "faults.h"
#include "sim.h"

namespace sim {

namespace {

struct sigaction g_old_segv, g_old_bus, g_old_ill;
std::once_flag g_installed;
thread_local sigjmp_buf t_jump;
thread_local volatile sig_atomic_t t_guarded = 0;
thread_local volatile uintptr_t t_fault_addr = 0;
thread_local volatile sig_atomic_t t_fault_sig = 0;
thread_local char* t_altstack = nullptr;

void handler(int sig, siginfo_t* info, void* uctx) {
    if (t_guarded) {
        t_guarded = 0;
        t_fault_addr = reinterpret_cast<uintptr_t>(info->si_addr);
        t_fault_sig = sig;
        siglongjmp(t_jump, 1);
    }
    const struct sigaction& old = sig == SIGSEGV ? g_old_segv : sig == SIGBUS ? g_old_bus : g_old_ill;
    if (old.sa_flags & SA_SIGINFO) {
        if (old.sa_sigaction) old.sa_sigaction(sig, info, uctx);
        return;
    }
    if (old.sa_handler == SIG_IGN) return;
    if (old.sa_handler != SIG_DFL && old.sa_handler) {
        old.sa_handler(sig);
        return;
    }
    // Default action: reinstall it; returning re-executes the faulting access, which kills.
    signal(sig, SIG_DFL);
}

void install() {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
    sigaction(SIGILL, &sa, &g_old_ill);
}

// Fiber stacks are small and a fault may hit one: the handler runs on a stack of its own.
void ensure_altstack() {
    if (t_altstack) return;
    const size_t size = 64 * 1024;
    t_altstack = static_cast<char*>(std::malloc(size));
    stack_t st;
    st.ss_sp = t_altstack;
    st.ss_size = size;
    st.ss_flags = 0;
    sigaltstack(&st, nullptr);
}

}  // namespace

bool guarded(const std::function<void()>& body, Fault* fault) {
    std::call_once(g_installed, install);
    ensure_altstack();
    *fault = Fault{};
    if (sigsetjmp(t_jump, 1) != 0) {
        emu::abandon();
        fault->happened = true;
        fault->addr = t_fault_addr;
        fault->misaligned = t_fault_sig == SIGILL;
        return false;
    }
    t_guarded = 1;
    body();
    t_guarded = 0;
    return true;
}

std::string symbol_at(uint64_t addr) {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(addr), &info) && info.dli_sname) return info.dli_sname;
    return "";
}

}  // namespace sim
