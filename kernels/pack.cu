// Packing of up to PACK_SEGS gradients into consecutive ranges of one flat buffer, in one
// launch: segment k (source s_k, PACK_SEGS sources per launch) fills out[o_k .. o_{k+1}); a
// null source fills its range with zeros (a variable without a gradient on this rank). With
// flags_at ≥ 0, out[flags_at + k] is then 1 for each of the first `segs` segments whose bit k of
// `present` is set and 0 for the others: the flags that ride along in the gradients' all-reduce.
// Each source is its own pointer argument, so that the driver sees every buffer the launch
// reads. Values are copied as they are (bit for bit); grid-stride loops within each segment.
#include "compat.cuh"

#define PACK_SEGS 32

template <typename T>
__device__ void pack_segments(T* out, const T* const* src, const long long* off, int segs,
                              unsigned int present, long long flags_at) {
    const long long step = (long long)blockDim.x * gridDim.x;
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    // Unrolled, so that every index into `src` and `off` is a constant: the arrays then stay
    // in registers and kernel parameters instead of local memory.
    BN_UNROLL
    for (int k = 0; k < PACK_SEGS; k++) {
        if (k >= segs) break;
        const T* s = src[k];
        T* o = out + off[k];
        const long long n = off[k + 1] - off[k];
        if (s)
            for (long long i = first; i < n; i += step) o[i] = s[i];
        else
            for (long long i = first; i < n; i += step) o[i] = store_as<T>(0);
    }
    if (flags_at >= 0 && first < segs)
        out[flags_at + first] = store_as<T>((present >> first) & 1u ? 1 : 0);
}

// X(i, T) for i = 0 .. PACK_SEGS − 1.
#define PACK_EACH8(X, T, b) X(b##0, T) X(b##1, T) X(b##2, T) X(b##3, T) X(b##4, T) X(b##5, T) X(b##6, T) X(b##7, T)
#define PACK_EACH(X, T) PACK_EACH8(X, T, 0) PACK_EACH8(X, T, 1) PACK_EACH8(X, T, 2) PACK_EACH8(X, T, 3)
#define PACK_SRC_PARAM(i, T) const T* s##i,
#define PACK_OFF_PARAM(i, T) long long o##i,
#define PACK_SRC_NAME(i, T) s##i,
#define PACK_OFF_NAME(i, T) o##i,

// pack_<dtype>(out, s00 .. s37, o00 .. o37, end, segs, present, flags_at): the sources and
// offsets numbered in octal-like pairs (group, index), 32 of each; `end` closes the last range.
#define PACK_ENTRIES(suffix, T)                                                                 \
    extern "C" __global__ void pack_##suffix(T* out, PACK_EACH(PACK_SRC_PARAM, T)              \
                                                 PACK_EACH(PACK_OFF_PARAM, T) long long end,    \
                                             int segs, unsigned int present, long long flags_at) { \
        const T* src[PACK_SEGS] = {PACK_EACH(PACK_SRC_NAME, T)};                                \
        const long long off[PACK_SEGS + 1] = {PACK_EACH(PACK_OFF_NAME, T) end};                 \
        pack_segments<T>(out, src, off, segs, present, flags_at);                               \
    }                                                                                           \
    EMU_REGISTER(pack_##suffix)
STAMP(PACK_ENTRIES)
