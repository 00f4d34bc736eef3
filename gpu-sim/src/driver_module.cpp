// Driver API: modules, functions and cuLaunchKernel. A module image (candle's PTX text, our
// fatbins) is matched by its entry points and their parameter sizes to one of the kernel
// libraries built by gpu-sim/build.sh from the same sources; its kernels then run on the
// emulator, on the stream's worker thread.
#include <dirent.h>
#include <dlfcn.h>
#include <link.h>

#include <cinttypes>
#include <cstring>
#include <set>

#include "emu_runtime.h"
#include "faults.h"
#include "images.h"
#include "sim.h"

namespace {

struct KernelLib {
    std::string path;
    emu::Registry registry;
    bool strict_barriers = false;
    // The library's thread-local storage: its module id and size (0: none). cuda_emu.h makes
    // `__shared__` a `static thread_local`, so a kernel library's TLS holds its kernels'
    // static shared memory (the emulator's own thread-locals live in libgpusim).
    size_t tls_modid = 0, tls_size = 0;
};

// The size of the TLS segment of module `modid` (0 if none), from the loaded objects' headers.
size_t tls_size_of(size_t modid) {
    struct Find {
        size_t modid, size = 0;
    } f{modid};
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* data) {
            auto* f = static_cast<Find*>(data);
            if (info->dlpi_tls_modid != f->modid) return 0;
            for (int i = 0; i < info->dlpi_phnum; i++)
                if (info->dlpi_phdr[i].p_type == PT_TLS) f->size = info->dlpi_phdr[i].p_memsz;
            return 1;
        },
        &f);
    return f.size;
}

}  // namespace

// The dynamic linker's TLS accessor (x86-64 ABI): the calling thread's block of module
// `ti_module` at `ti_offset`, allocated on first use.
struct TlsIndex {
    unsigned long ti_module, ti_offset;
};
extern "C" void* __tls_get_addr(TlsIndex*);

namespace {

// At every block start: the kernel library's static shared memory, on the running thread,
// is filled with 0xFF bytes (NaN for every float type), as dynamic shared memory is: a GPU
// promises nothing about shared memory at a block's start, and a block that reads what the
// previous block on the same multiprocessor left must fail here.
void poison_static_shared(const void* arg) {
    const auto* lib = static_cast<const KernelLib*>(arg);
    TlsIndex ti{lib->tls_modid, 0};
    std::memset(__tls_get_addr(&ti), 0xFF, lib->tls_size);
}

struct Module;
struct Function {
    Module* module;
    std::string name;
    const emu::KernelEntry* entry;
    size_t max_dynamic_smem = 48 * 1024;
};

struct Module {
    KernelLib* lib;
    sim::Context* ctx;
    std::map<std::string, std::unique_ptr<Function>> functions;
    bool unloaded = false;
};

std::mutex g_mod;
std::set<Module*>& modules() {
    static auto* s = new std::set<Module*>;  // never destroyed (see sim.h)
    return *s;
}
std::set<Function*>& functions() {
    static auto* s = new std::set<Function*>;
    return *s;
}

// The kernel libraries: every *.so in the folders of GPU_SIM_KERNELS (colon-separated; set by
// scripts/gpu-sim-env.sh), or in the folder `kernels` beside this library.
std::vector<KernelLib*>& libs() {
    static std::vector<KernelLib*> v = [] {
        std::vector<KernelLib*> out;
        std::string dirs;
        if (const char* e = std::getenv("GPU_SIM_KERNELS")) {
            dirs = e;
        } else {
            Dl_info info;
            if (dladdr(reinterpret_cast<void*>(&libs), &info) && info.dli_fname) {
                dirs = info.dli_fname;
                dirs = dirs.substr(0, dirs.rfind('/')) + "/../kernels";
            }
        }
        size_t start = 0;
        while (start <= dirs.size()) {
            size_t end = dirs.find(':', start);
            if (end == std::string::npos) end = dirs.size();
            std::string dir = dirs.substr(start, end - start);
            start = end + 1;
            if (dir.empty()) continue;
            DIR* d = opendir(dir.c_str());
            if (!d) sim::fatal("no kernel libraries: cannot open %s (GPU_SIM_KERNELS)", dir.c_str());
            std::vector<std::string> names;
            while (dirent* ent = readdir(d)) {
                std::string n = ent->d_name;
                if (n.size() > 3 && n.substr(n.size() - 3) == ".so") names.push_back(n);
            }
            closedir(d);
            for (const auto& n : names) {
                auto* lib = new KernelLib;
                lib->path = dir + "/" + n;
                void* h;
                {
                    emu::ModuleLoad load(&lib->registry);
                    h = dlopen(lib->path.c_str(), RTLD_NOW | RTLD_LOCAL);
                }
                if (!h) sim::fatal("cannot load kernel library %s: %s", lib->path.c_str(), dlerror());
                lib->strict_barriers = dlsym(h, "gpusim_strict_barriers") != nullptr;
                if (dlinfo(h, RTLD_DI_TLS_MODID, &lib->tls_modid) == 0 && lib->tls_modid)
                    lib->tls_size = tls_size_of(lib->tls_modid);
                out.push_back(lib);
            }
        }
        return out;
    }();
    return v;
}

std::string sizes(const std::vector<unsigned>& v) {
    std::string s = "(";
    for (size_t i = 0; i < v.size(); i++) s += (i ? "," : "") + std::to_string(v[i]);
    return s + ")";
}

// The library holding every entry of the image with the same parameter sizes.
KernelLib* match(const std::vector<sim::Entry>& entries, std::string& why) {
    for (KernelLib* lib : libs()) {
        bool all = true;
        for (const auto& e : entries) {
            auto it = lib->registry.find(e.name);
            if (it == lib->registry.end()) {
                all = false;
                break;
            }
            std::vector<unsigned> have;
            for (const auto& p : it->second.params) have.push_back(p.size);
            if (have != e.param_sizes) {
                why = "kernel " + e.name + ": the image's parameters " + sizes(e.param_sizes) +
                      " differ from the compiled kernel's " + sizes(have) + " in " + lib->path +
                      " (sources of another version?)";
                return nullptr;
            }
        }
        if (all) return lib;
    }
    why = "no kernel library holds all " + std::to_string(entries.size()) + " entry points (first: " +
          entries.front().name + ")";
    return nullptr;
}

Function* function_of(CUfunction h) {
    auto* f = reinterpret_cast<Function*>(h);
    std::lock_guard<std::mutex> g(g_mod);
    if (!functions().count(f) || f->module->unloaded) return nullptr;
    return f;
}

}  // namespace

extern "C" {

CUresult cuModuleLoadData(CUmodule* out, const void* image) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    if (!out || !image) return CUDA_ERROR_INVALID_VALUE;
    std::vector<sim::Entry> entries;
    std::string why;
    uint32_t magic;
    std::memcpy(&magic, image, 4);
    bool ok;
    if (magic == sim::kFatbinMagic) {
        uint64_t fsize;
        uint16_t hsize;
        std::memcpy(&hsize, static_cast<const char*>(image) + 6, 2);
        std::memcpy(&fsize, static_cast<const char*>(image) + 8, 8);
        ok = sim::parse_fatbin(static_cast<const unsigned char*>(image), hsize + fsize, entries, why);
    } else {
        ok = sim::parse_ptx(static_cast<const char*>(image), entries, why);
    }
    if (!ok) {
        sim::log("cuModuleLoadData: %s", why.c_str());
        return magic == sim::kFatbinMagic ? CUDA_ERROR_NO_BINARY_FOR_GPU : CUDA_ERROR_INVALID_PTX;
    }
    KernelLib* lib = match(entries, why);
    if (!lib) {
        sim::log("cuModuleLoadData: %s", why.c_str());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    auto* m = new Module{lib, ctx, {}, false};
    for (const auto& e : entries) {
        auto f = std::make_unique<Function>();
        f->module = m;
        f->name = e.name;
        f->entry = &lib->registry.at(e.name);
        m->functions[e.name] = std::move(f);
    }
    std::lock_guard<std::mutex> g(g_mod);
    modules().insert(m);
    for (auto& kv : m->functions) functions().insert(kv.second.get());
    *out = reinterpret_cast<CUmodule>(m);
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule h) {
    auto* m = reinterpret_cast<Module*>(h);
    std::lock_guard<std::mutex> g(g_mod);
    if (!modules().count(m) || m->unloaded) return CUDA_ERROR_INVALID_HANDLE;
    m->unloaded = true;  // its functions' handles are dead from now on
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* out, CUmodule h, const char* name) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    auto* m = reinterpret_cast<Module*>(h);
    std::lock_guard<std::mutex> g(g_mod);
    if (!modules().count(m) || m->unloaded) return CUDA_ERROR_INVALID_HANDLE;
    if (!out || !name) return CUDA_ERROR_INVALID_VALUE;
    auto it = m->functions.find(name);
    if (it == m->functions.end()) {
        sim::log("cuModuleGetFunction: the module has no entry point %s", name);
        return CUDA_ERROR_NOT_FOUND;
    }
    *out = reinterpret_cast<CUfunction>(it->second.get());
    return CUDA_SUCCESS;
}

// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (8) is the one attribute simulated.
CUresult cuFuncSetAttribute(CUfunction h, int attr, int value) {
    Function* f = function_of(h);
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    if (attr != 8) {
        sim::log("cuFuncSetAttribute: attribute %d is not simulated", attr);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (value < 0 || value > 232448) return CUDA_ERROR_INVALID_VALUE;
    f->max_dynamic_smem = (size_t)value;
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction h, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned smem, CUstream hs, void** params,
                        void** extra) {
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) return r;
    Function* f = function_of(h);
    if (!f) {
        sim::log("cuLaunchKernel: %p is not a function of a loaded module", (void*)h);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    const char* kname = f->name.c_str();
    if (f->module->ctx != ctx) {
        sim::log("cuLaunchKernel(%s): the function's module belongs to device %d, the current "
                 "context to device %d", kname, f->module->ctx->device, ctx->device);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    std::string why;
    sim::Stream* s = sim::resolve_stream(ctx, hs, why);
    if (!s) {
        sim::log("cuLaunchKernel(%s): %s", kname, why.c_str());
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (extra) {
        sim::log("cuLaunchKernel(%s): the `extra` argument form is not simulated", kname);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    const unsigned long long threads = (unsigned long long)bx * by * bz;
    if (gx == 0 || gy == 0 || gz == 0 || threads == 0 || threads > 1024 || bx > 1024 ||
        by > 1024 || bz > 64 || gy > 65535 || gz > 65535 || gx > 2147483647u ||
        smem > f->max_dynamic_smem) {
        sim::log("cuLaunchKernel(%s): invalid launch: grid (%u,%u,%u), block (%u,%u,%u), %u bytes "
                 "of dynamic shared memory (limit %zu)", kname, gx, gy, gz, bx, by, bz, smem,
                 f->max_dynamic_smem);
        return CUDA_ERROR_INVALID_VALUE;
    }
    const auto& ps = f->entry->params;
    if (!params && !ps.empty()) return CUDA_ERROR_INVALID_VALUE;
    // The driver copies the argument values at the call (the caller's storage may change after
    // it returns).
    size_t total = 0;
    for (const auto& p : ps) total += (p.size + 7) / 8 * 8;
    auto storage = std::make_shared<std::vector<uint64_t>>(total / 8 + 1);
    auto ptrs = std::make_shared<std::vector<void*>>(ps.size());
    std::vector<sim::BufferUse> uses;
    std::vector<uint64_t> pointer_args;
    std::vector<std::pair<size_t, std::shared_ptr<sim::Allocation>>> arg_allocs;
    size_t off = 0;
    for (size_t i = 0; i < ps.size(); i++) {
        auto* slot = reinterpret_cast<unsigned char*>(storage->data()) + off;
        std::memcpy(slot, params[i], ps[i].size);
        (*ptrs)[i] = slot;
        off += (ps[i].size + 7) / 8 * 8;
        if (ps[i].access == emu::Access::Value) continue;
        uint64_t p;
        std::memcpy(&p, slot, 8);
        if (p == 0) continue;  // optional pointers may be null; dereferencing one faults
        auto a = sim::find_range(p, 0, ctx->device, why);
        if (!a) {
            sim::log("cuLaunchKernel(%s): argument %zu: %s", kname, i, why.c_str());
            sim::count_fault();
            return CUDA_ERROR_INVALID_VALUE;
        }
        bool write = ps[i].access == emu::Access::Write;
        uses.push_back(sim::BufferUse{a, write,
                                      "kernel " + f->name + " (argument " + std::to_string(i) +
                                          (write ? ", written" : ", read") + ")"});
        pointer_args.push_back(p);
        arg_allocs.emplace_back(i, a);
    }
    emu::LaunchConfig cfg;
    cfg.grid = dim3(gx, gy, gz);
    cfg.block = dim3(bx, by, bz);
    cfg.smem = smem;
    cfg.lenient_barriers = !f->module->lib->strict_barriers;
    if (f->module->lib->tls_size) {
        cfg.block_start = poison_static_shared;
        cfg.block_start_arg = f->module->lib;
    }
    static const emu::Schedule schedule = [] {
        emu::Schedule sc;
        const char* v = std::getenv("GPU_SIM_SCHEDULE");
        if (v && !emu::parse_schedule(v, sc))
            sim::fatal("GPU_SIM_SCHEDULE=%s: expected forward, reverse or random:SEED", v);
        return sc;
    }();
    cfg.schedule = schedule;
    const emu::KernelEntry* entry = f->entry;
    std::string name = f->name;
    sim::Op op;
    op.kind = "launch";
    op.run = [entry, storage, ptrs, cfg, name, ctx, pointer_args, arg_allocs] {
        if (sim::skip_kernels()) return;  // checked, counted and ordered above; not run
        std::string error;
        sim::Fault fault;
        if (!sim::guarded_run(*entry, ptrs->data(), cfg, error, &fault)) {
            sim::count_fault();
            if (fault.misaligned) {
                std::string where = sim::symbol_at(fault.addr);
                sim::set_sticky(ctx, CUDA_ERROR_MISALIGNED_ADDRESS,
                                "kernel " + name + ": misaligned address: an access through a "
                                "pointer not aligned to its type's alignment (the alignment "
                                "check's trap" + (where.empty() ? "" : " in " + where) + ")");
            } else if (fault.happened) {
                const uint64_t addr = fault.addr;
                // Name the argument whose allocation the address is in or next to.
                std::string arg;
                for (const auto& ia : arg_allocs) {
                    const sim::Allocation& a = *ia.second;
                    if (addr + 4096 >= a.base && addr < a.base + a.size + 4096)
                        arg = " (argument " + std::to_string(ia.first) + ")";
                }
                char text[32];
                std::snprintf(text, sizeof text, "0x%" PRIx64, addr);
                sim::set_sticky(ctx, CUDA_ERROR_ILLEGAL_ADDRESS,
                                "kernel " + name + ": illegal address " + text + arg + ": " +
                                    sim::describe_address(addr));
            }
            else
                sim::set_sticky(ctx, CUDA_ERROR_LAUNCH_FAILED, "kernel " + name + ": " + error);
            return;
        }
        std::string bad = sim::check_canaries(pointer_args);
        if (!bad.empty()) {
            sim::count_fault();
            sim::set_sticky(ctx, CUDA_ERROR_ILLEGAL_ADDRESS, "kernel " + name + ": " + bad);
        }
    };
    sim::count(s, &sim::Counts::launches);
    sim::log_launch(name);
    static const bool trace = std::getenv("GPU_SIM_TRACE") != nullptr;
    if (trace)
        sim::log("launch %s grid (%u,%u,%u) block (%u,%u,%u) smem %u on stream #%llu", kname, gx,
                 gy, gz, bx, by, bz, smem, (unsigned long long)s->id);
    return sim::enqueue(s, std::move(op), uses);
}

}  // extern "C"
