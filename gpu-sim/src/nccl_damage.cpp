// What an interrupted collective leaves behind. NCCL promises nothing about the output of a
// collective that an abort or an asynchronous error stopped: a ring all-reduce stopped after
// some of its steps has written some chunks and not others, and an in-place call has
// overwritten part of its input. The simulation scribbles, by GPU_SIM_NCCL_ABORT_DAMAGE:
//   partial (default)  the steps already completed stay written; the rest of the output holds
//                      a plausible, finite, wrong value: half of this rank's own contribution
//   finite             the whole output holds that value
//   nan                the whole output holds 0xFF bytes (a NaN in every float type)
//   none               nothing is written (the old behaviour)
// For an in-place reduce-scatter (the output inside the input) the rest of the input is
// scribbled too; the other in-place forms' inputs lie inside their outputs.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "half_bits.h"
#include "nccl_sim.h"

namespace nccl {

namespace {

enum class Damage { Partial, Finite, Nan, None };

Damage damage_mode() {
    static const Damage d = [] {
        const char* e = std::getenv("GPU_SIM_NCCL_ABORT_DAMAGE");
        if (!e || !*e || std::strcmp(e, "partial") == 0) return Damage::Partial;
        if (std::strcmp(e, "finite") == 0) return Damage::Finite;
        if (std::strcmp(e, "nan") == 0) return Damage::Nan;
        if (std::strcmp(e, "none") == 0) return Damage::None;
        sim::fatal("GPU_SIM_NCCL_ABORT_DAMAGE=%s: expected partial, finite, nan or none", e);
    }();
    return d;
}

template <class T>
void halve_as(uint8_t* dst, const uint8_t* src, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        T v;
        std::memcpy(&v, src + i * sizeof(T), sizeof(T));
        v = T(v / T(2));
        std::memcpy(dst + i * sizeof(T), &v, sizeof(T));
    }
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void halve_16(uint8_t* dst, const uint8_t* src, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        b = Store(Load(b) / 2.0f);
        std::memcpy(dst + 2 * i, &b, 2);
    }
}

// dst[i] = src[i] / 2 for n elements of `dtype` (dst may be src).
void halve(int dtype, uint8_t* dst, const uint8_t* src, size_t n) {
    switch (dtype) {
        case ncclInt8: return halve_as<int8_t>(dst, src, n);
        case ncclUint8: return halve_as<uint8_t>(dst, src, n);
        case ncclInt32: return halve_as<int32_t>(dst, src, n);
        case ncclUint32: return halve_as<uint32_t>(dst, src, n);
        case ncclInt64: return halve_as<int64_t>(dst, src, n);
        case ncclUint64: return halve_as<uint64_t>(dst, src, n);
        case ncclFloat32: return halve_as<float>(dst, src, n);
        case ncclFloat64: return halve_as<double>(dst, src, n);
        case ncclFloat16: return halve_16<gemm::half_to_float, gemm::float_to_half>(dst, src, n);
        case ncclBfloat16: return halve_16<gemm::bf16_to_float, gemm::float_to_bf16>(dst, src, n);
    }
}

}  // namespace

void damage(const Interrupted& k, size_t done) {
    const Damage mode = damage_mode();
    if (mode == Damage::None) return;
    const size_t es = type_size(k.dtype), n = size_t(k.nranks), r = size_t(k.rank);
    // `done` counts the collective's steps in elements of its loop: the output's for an
    // all-reduce, a broadcast or an all-gather (of each rank's part), the input's for a
    // reduce-scatter (of which this rank's part is [r·count, (r+1)·count)).
    size_t from = 0;
    if (mode == Damage::Partial) {
        from = k.kind == kReduceScatter
                   ? std::min(k.count, done > r * k.count ? done - r * k.count : 0)
                   : std::min(k.count, done);
    }
    // (dst, src) runs of `len` elements: each output element and the own input it halves.
    auto scribble = [&](uint8_t* dst, const uint8_t* src, size_t len) {
        if (mode == Damage::Nan) std::memset(dst, 0xFF, len * es);
        else halve(k.dtype, dst, src, len);
    };
    const size_t len = k.count - from;
    switch (k.kind) {
        case kAllReduce: scribble(k.recv + from * es, k.send + from * es, len); break;
        case kBroadcast: scribble(k.recv + from * es, k.recv + from * es, len); break;
        case kAllGather:
            // In place, the own part is the input: scribbled last, after the peers' parts
            // were made from it.
            for (size_t p = 0; p < n; ++p)
                if (p != r) scribble(k.recv + (p * k.count + from) * es, k.send + from * es, len);
            scribble(k.recv + (r * k.count + from) * es, k.send + from * es, len);
            break;
        case kReduceScatter: {
            const uint8_t* own = k.send + (r * k.count + from) * es;
            scribble(k.recv + from * es, own, len);
            const uint8_t* s0 = k.send;
            if (k.recv == s0 + r * k.count * es) {  // in place: the rest of the input too
                uint8_t* s = const_cast<uint8_t*>(s0);
                for (size_t p = 0; p < n; ++p)
                    if (p != r) scribble(s + (p * k.count + from) * es, s + (p * k.count + from) * es, len);
            }
            break;
        }
    }
}

}  // namespace nccl
