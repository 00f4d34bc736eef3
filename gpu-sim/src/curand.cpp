// The simulated cuRAND host API (libcurand.so.10): the entry points cudarc 0.19.10 and candle
// 0.11.1 call, written from NVIDIA's cuRAND reference (no NVIDIA code or header).
//
// The generator is XORWOW as defined in G. Marsaglia, "Xorshift RNGs" (J. Stat. Softw. 8(14),
// 2003): five 32-bit xorshift words plus a Weyl counter d += 362437, each draw returning
// v + d. Its state is seeded from the 64-bit seed (splitmix64 of the seed xor-ed into the
// paper's initial values). The results are NOT bit-identical to NVIDIA's cuRAND (whose seeding
// and per-thread subsequence layout are its own); they have cuRAND's documented ranges and
// distributions, and a given seed and offset always give the same values.
//
// Sequence and offset: the generator is one stream of 32-bit draws. curandSetGeneratorOffset
// sets the absolute position (in 32-bit draws); curandSetPseudoRandomGeneratorSeed and
// curandSetGeneratorOffset both restart the sequence at (seed, offset) for the next generation,
// as cuRAND regenerates its state lazily from both. Every generation continues where the last
// one ended. The position advances at the call (the state after n draws is computed with
// XORWOW's GF(2) jump matrices), so the values do not depend on when the stream runs.
//
// Draws per value: 1 for curandGenerate, curandGenerateUniform and curandGenerateNormal /
// LogNormal (pairs of uniforms for Box-Muller); 2 for the double forms (53-bit uniforms).
//   uniform float:  ((draw >> 8) + 1) * 2^-24, in (0, 1] (cuRAND's range: excludes 0, includes 1)
//   uniform double: ((a << 21 | b >> 11) + 1) * 2^-53, in (0, 1]
//   normal: Box-Muller on two uniforms u1, u2 in (0, 1]: r = sqrt(-2 ln u1),
//           z0 = r cos(2 pi u2), z1 = r sin(2 pi u2), written in that order, mean + stddev * z
//           (computed in double, rounded once to float for the float forms); log-normal exp()s it.
//
// Generation is stream work on the generator's stream (curandSetStream, default the NULL
// stream, i.e. the legacy stream), one operation (Op kind "curand") writing the output and
// counting one Counts::host_tasks on the stream when enqueued. The output must lie inside one
// live allocation of the generator's device (the context current at curandCreateGenerator);
// otherwise the call logs why and returns CURAND_STATUS_LAUNCH_FAILURE.
//
// Other errors (each logged): a generator that is not live, or whose context was destroyed,
// CURAND_STATUS_NOT_INITIALIZED; a generator type other than PSEUDO_DEFAULT/PSEUDO_XORWOW
// CURAND_STATUS_TYPE_ERROR (curandGenerateLongLong too: it needs a 64-bit quasirandom
// generator); an odd count for the normal and log-normal forms
// CURAND_STATUS_LENGTH_NOT_MULTIPLE; a context with a sticky error
// CURAND_STATUS_PREEXISTING_FAILURE; no current context at creation
// CURAND_STATUS_INITIALIZATION_FAILED. The reference lists no check of stddev, so none is made.
#include <array>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "blas_types.h"
#include "sim.h"
#include "xorwow.h"

using xorwow::jump;
using xorwow::next;
using xorwow::seeded;
using xorwow::uniform_d;
using xorwow::uniform_f;
using xorwow::Xorwow;

struct curandGenerator_st {
    sim::Context* ctx = nullptr;
    CUstream stream = nullptr;  // as given to curandSetStream, resolved at each generation
    int type = CURAND_RNG_PSEUDO_DEFAULT;
    uint64_t seed = 0;    // until set (cudarc always sets one)
    uint64_t offset = 0;  // the absolute offset parameter
    bool restart = true;  // seed or offset set since the last generation
    Xorwow state{};       // the position after the last generation
};

namespace {

std::mutex g_gen_m;
std::set<curandGenerator_st*>& generators() {
    static auto* s = new std::set<curandGenerator_st*>;  // leaked: used from static destructors
    return *s;
}

void log_not_live(const char* fn, curandGenerator_t g) {
    sim::log(
        "%s: generator %p is not a live cuRAND generator (never created, or destroyed): "
        "CURAND_STATUS_NOT_INITIALIZED",
        fn, (void*)g);
}

bool live(const char* fn, curandGenerator_t g) {
    {
        std::lock_guard<std::mutex> lk(g_gen_m);
        if (g && generators().count(g)) return true;
    }
    log_not_live(fn, g);
    return false;
}

enum class Dist { Bits32, Uniform, Normal, LogNormal };

// Every generation: checks, then one stream operation writing `n` values of `elem` bytes.
// `draws` is the number of 32-bit draws it consumes.
template <class T>
curandStatus_t generate(const char* fn, curandGenerator_t g, T* out, size_t n, Dist dist,
                        double mean, double stddev) {
    sim::Context* ctx = nullptr;
    CUstream stream = nullptr;
    {
        std::lock_guard<std::mutex> lk(g_gen_m);
        if (g && generators().count(g)) {
            ctx = g->ctx;
            stream = g->stream;
        }
    }
    if (!ctx) {
        log_not_live(fn, g);
        return CURAND_STATUS_NOT_INITIALIZED;
    }
    if (!sim::valid_context(ctx) || !ctx->alive) {
        sim::log("%s: the generator's context has been destroyed: CURAND_STATUS_NOT_INITIALIZED",
                 fn);
        return CURAND_STATUS_NOT_INITIALIZED;
    }
    if (int st = ctx->sticky.load()) {
        sim::log(
            "%s: device %d's context has a sticky error (CUresult %d): "
            "CURAND_STATUS_PREEXISTING_FAILURE",
            fn, ctx->device, st);
        return CURAND_STATUS_PREEXISTING_FAILURE;
    }
    const bool pairs = dist == Dist::Normal || dist == Dist::LogNormal;
    if (pairs && n % 2 != 0) {
        sim::log(
            "%s: n = %zu is odd; a pseudorandom generator makes normal values in pairs: "
            "CURAND_STATUS_LENGTH_NOT_MULTIPLE",
            fn, n);
        return CURAND_STATUS_LENGTH_NOT_MULTIPLE;
    }
    if (n == 0) return CURAND_STATUS_SUCCESS;
    if (n > ((size_t)1 << 58)) {
        sim::log("%s: n = %zu values is more than any allocation: CURAND_STATUS_LAUNCH_FAILURE", fn,
                 n);
        return CURAND_STATUS_LAUNCH_FAILURE;
    }
    std::string why;
    auto alloc = sim::find_range((uint64_t)(uintptr_t)out, n * sizeof(T), ctx->device, why);
    if (!alloc) {
        sim::log(
            "%s: outputPtr = %p (%zu values, %zu bytes) is not inside one live allocation of "
            "device %d: %s: CURAND_STATUS_LAUNCH_FAILURE",
            fn, (void*)out, n, n * sizeof(T), ctx->device, why.c_str());
        return CURAND_STATUS_LAUNCH_FAILURE;
    }
    sim::Stream* s = sim::resolve_stream(ctx, stream, why);
    if (!s) {
        sim::log("%s: the generator's stream cannot be used: %s: CURAND_STATUS_LAUNCH_FAILURE", fn,
                 why.c_str());
        return CURAND_STATUS_LAUNCH_FAILURE;
    }
    const uint64_t draws = (uint64_t)n * (sizeof(T) == 8 && dist != Dist::Bits32 ? 2 : 1);
    Xorwow start;
    {
        std::lock_guard<std::mutex> lk(g_gen_m);
        if (!generators().count(g)) {
            sim::log(
                "%s: generator %p was destroyed during the call: CURAND_STATUS_NOT_INITIALIZED", fn,
                (void*)g);
            return CURAND_STATUS_NOT_INITIALIZED;
        }
        if (g->restart) {
            g->state = jump(seeded(g->seed), g->offset);
            g->restart = false;
        }
        start = g->state;
        g->state = jump(g->state, draws);
    }
    sim::Op op;
    op.kind = "curand";
    op.run = [start, out, n, dist, mean, stddev]() mutable {
        Xorwow st = start;
        const bool dbl = sizeof(T) == 8;
        auto uni = [&]() -> double {
            if (dbl) {
                const uint32_t a = next(st);
                return uniform_d(a, next(st));
            }
            return uniform_f(next(st));
        };
        switch (dist) {
            case Dist::Bits32:
                for (size_t i = 0; i < n; i++) out[i] = (T)next(st);
                break;
            case Dist::Uniform:
                for (size_t i = 0; i < n; i++) out[i] = (T)uni();
                break;
            case Dist::Normal:
            case Dist::LogNormal:
                for (size_t i = 0; i < n; i += 2) {
                    const double u1 = uni(), u2 = uni();
                    double z0, z1;
                    xorwow::box_muller(u1, u2, &z0, &z1);
                    z0 = mean + stddev * z0;
                    z1 = mean + stddev * z1;
                    if (dist == Dist::LogNormal) {
                        z0 = std::exp(z0);
                        z1 = std::exp(z1);
                    }
                    out[i] = (T)z0;
                    out[i + 1] = (T)z1;
                }
                break;
        }
    };
    CUresult r = sim::enqueue(s, std::move(op),
                              {sim::BufferUse{alloc, true, std::string(fn) + " outputPtr"}});
    sim::count(s, &sim::Counts::host_tasks);  // enqueue always queues the operation
    if (r != CUDA_SUCCESS) {
        sim::log("%s: enqueueing on device %d failed (CUresult %d): CURAND_STATUS_LAUNCH_FAILURE",
                 fn, ctx->device, r);
        return CURAND_STATUS_LAUNCH_FAILURE;
    }
    return CURAND_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

// Only the pseudorandom XORWOW generator (CURAND_RNG_PSEUDO_DEFAULT is XORWOW, as in cuRAND);
// every other type is refused with CURAND_STATUS_TYPE_ERROR and a message.
curandStatus_t curandCreateGenerator(curandGenerator_t* generator, int rng_type) {
    if (!generator) {
        sim::log("curandCreateGenerator: generator is NULL: CURAND_STATUS_NOT_INITIALIZED");
        return CURAND_STATUS_NOT_INITIALIZED;
    }
    if (rng_type != CURAND_RNG_PSEUDO_DEFAULT && rng_type != CURAND_RNG_PSEUDO_XORWOW) {
        sim::log(
            "curandCreateGenerator: rng_type %d is not simulated (only CURAND_RNG_PSEUDO_DEFAULT "
            "and CURAND_RNG_PSEUDO_XORWOW): CURAND_STATUS_TYPE_ERROR",
            rng_type);
        return CURAND_STATUS_TYPE_ERROR;
    }
    sim::Context* ctx;
    if (CUresult r = sim::enter(&ctx)) {
        sim::log(
            "curandCreateGenerator: no usable current context (CUresult %d): "
            "CURAND_STATUS_INITIALIZATION_FAILED",
            r);
        return CURAND_STATUS_INITIALIZATION_FAILED;
    }
    auto* g = new curandGenerator_st;
    g->ctx = ctx;
    g->type = rng_type;
    {
        std::lock_guard<std::mutex> lk(g_gen_m);
        generators().insert(g);
    }
    *generator = g;
    return CURAND_STATUS_SUCCESS;
}

// Work already enqueued keeps its own copy of the state, so destroying does not wait.
curandStatus_t curandDestroyGenerator(curandGenerator_t generator) {
    {
        std::lock_guard<std::mutex> lk(g_gen_m);
        if (generator && generators().erase(generator)) {
            delete generator;
            return CURAND_STATUS_SUCCESS;
        }
    }
    sim::log(
        "curandDestroyGenerator: generator %p is not a live cuRAND generator: "
        "CURAND_STATUS_NOT_INITIALIZED",
        (void*)generator);
    return CURAND_STATUS_NOT_INITIALIZED;
}

curandStatus_t curandSetStream(curandGenerator_t generator, CUstream stream) {
    if (!live("curandSetStream", generator)) return CURAND_STATUS_NOT_INITIALIZED;
    std::lock_guard<std::mutex> lk(g_gen_m);
    if (generators().count(generator)) generator->stream = stream;
    return CURAND_STATUS_SUCCESS;
}

curandStatus_t curandSetPseudoRandomGeneratorSeed(curandGenerator_t generator,
                                                  unsigned long long seed) {
    if (!live("curandSetPseudoRandomGeneratorSeed", generator))
        return CURAND_STATUS_NOT_INITIALIZED;
    std::lock_guard<std::mutex> lk(g_gen_m);
    if (generators().count(generator)) {
        generator->seed = seed;
        generator->restart = true;
    }
    return CURAND_STATUS_SUCCESS;
}

curandStatus_t curandSetGeneratorOffset(curandGenerator_t generator, unsigned long long offset) {
    if (!live("curandSetGeneratorOffset", generator)) return CURAND_STATUS_NOT_INITIALIZED;
    std::lock_guard<std::mutex> lk(g_gen_m);
    if (generators().count(generator)) {
        generator->offset = offset;
        generator->restart = true;
    }
    return CURAND_STATUS_SUCCESS;
}

curandStatus_t curandGenerate(curandGenerator_t generator, unsigned int* outputPtr, size_t num) {
    return generate("curandGenerate", generator, outputPtr, num, Dist::Bits32, 0, 0);
}

// 64-bit results come only from the 64-bit quasirandom generators (cuRAND reference).
curandStatus_t curandGenerateLongLong(curandGenerator_t generator, unsigned long long* outputPtr,
                                      size_t num) {
    (void)outputPtr;
    (void)num;
    if (!live("curandGenerateLongLong", generator)) return CURAND_STATUS_NOT_INITIALIZED;
    sim::log(
        "curandGenerateLongLong: the generator is XORWOW, not a 64-bit quasirandom generator: "
        "CURAND_STATUS_TYPE_ERROR");
    return CURAND_STATUS_TYPE_ERROR;
}

curandStatus_t curandGenerateUniform(curandGenerator_t generator, float* outputPtr, size_t num) {
    return generate("curandGenerateUniform", generator, outputPtr, num, Dist::Uniform, 0, 0);
}

curandStatus_t curandGenerateUniformDouble(curandGenerator_t generator, double* outputPtr,
                                           size_t num) {
    return generate("curandGenerateUniformDouble", generator, outputPtr, num, Dist::Uniform, 0, 0);
}

// The reference lists no range check on stddev (a negative one mirrors the values, 0 gives
// `mean`), so none is made.
curandStatus_t curandGenerateNormal(curandGenerator_t generator, float* outputPtr, size_t n,
                                    float mean, float stddev) {
    return generate("curandGenerateNormal", generator, outputPtr, n, Dist::Normal, mean, stddev);
}

curandStatus_t curandGenerateNormalDouble(curandGenerator_t generator, double* outputPtr, size_t n,
                                          double mean, double stddev) {
    return generate("curandGenerateNormalDouble", generator, outputPtr, n, Dist::Normal, mean,
                    stddev);
}

curandStatus_t curandGenerateLogNormal(curandGenerator_t generator, float* outputPtr, size_t n,
                                       float mean, float stddev) {
    return generate("curandGenerateLogNormal", generator, outputPtr, n, Dist::LogNormal, mean,
                    stddev);
}

curandStatus_t curandGenerateLogNormalDouble(curandGenerator_t generator, double* outputPtr,
                                             size_t n, double mean, double stddev) {
    return generate("curandGenerateLogNormalDouble", generator, outputPtr, n, Dist::LogNormal, mean,
                    stddev);
}

}  // extern "C"
