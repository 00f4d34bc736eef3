// Per-channel reductions of two f64 sums over (N, C, HW) or (N·HW rows, C) inputs, shared by the
// statistics and the backward reduce. Each thread accumulates in its own arithmetic type, the
// block combines in f64 in a fixed order, and a split of the reduction over several blocks
// (grid y) is finished by the last block to arrive, which sums the partials in split order
// (deterministic) and resets its counter for the next launch (no memset per call).
#pragma once
#include "compat.cuh"

// Threads per block of the channels-first kernels (a multiple of 32).
#define BN_THREADS 256
// Rows per block of the channels-last kernels: blocks are 32 channels × BN_ROWS rows.
#define BN_ROWS 8

// Sum over the 32 lanes of a full warp, identical on every lane.
__device__ __forceinline__ double warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide sums of (a, b) for a 1-D block of BN_THREADS threads; valid in thread 0.
__device__ __forceinline__ void block_sum2(double& a, double& b) {
    __shared__ double sa[BN_THREADS / 32], sb[BN_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    a = warp_sum(a);
    b = warp_sum(b);
    if (lane == 0) {
        sa[warp] = a;
        sb[warp] = b;
    }
    __syncthreads();
    if (warp == 0) {
        a = lane < BN_THREADS / 32 ? sa[lane] : 0.0;
        b = lane < BN_THREADS / 32 ? sb[lane] : 0.0;
        a = warp_sum(a);
        b = warp_sum(b);
    }
    __syncthreads();
}

// Output layout: `out[k·C + c]`, k = 0 the count (when `count >= 0`), then the two sums.
__device__ __forceinline__ void write_sums(double* out, long long C, long long c, double count,
                                           double a, double b) {
    if (count >= 0) {
        out[c] = count;
        out += C;
    }
    out[c] = a;
    out[C + c] = b;
}

// Sum of the partials of channel c over `splits` ([splits, 2, C] f64), in split order.
__device__ __forceinline__ void sum_partials(const double* work, long long C, long long c,
                                             int splits, double& a, double& b) {
    const volatile double* w = work;
    a = 0.0;
    b = 0.0;
    for (int s = 0; s < splits; s++) {
        a += w[(s * 2) * C + c];
        b += w[(s * 2 + 1) * C + c];
    }
}

// `Acc` accumulates one thread's elements: `Acc acc(ctx, c)`, `acc.add(ctx, index)`,
// `acc.result(ctx, c, a, b)` (f64).
template <typename Acc, typename Ctx>
__device__ void reduce_nchw(const Ctx& ctx, long long N, long long C, long long HW, double* out,
                            double count, double* work, unsigned* counter) {
    const long long c = blockIdx.x;
    const int split = blockIdx.y, splits = gridDim.y;
    const long long M = N * HW, chunk = (M + splits - 1) / splits;
    const long long lo = split * chunk, hi = lo + chunk < M ? lo + chunk : M;
    Acc acc(ctx, c);
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const long long n = i / HW, p = i - n * HW;
        acc.add(ctx, (n * C + c) * HW + p);
    }
    double a, b;
    acc.result(ctx, c, a, b);
    block_sum2(a, b);
    if (splits == 1) {
        if (threadIdx.x == 0) write_sums(out, C, c, count, a, b);
        return;
    }
    if (threadIdx.x == 0) {
        work[(split * 2) * C + c] = a;
        work[(split * 2 + 1) * C + c] = b;
        __threadfence();
        if (atomicAdd(&counter[c], 1u) == (unsigned)splits - 1) {
            __threadfence();
            sum_partials(work, C, c, splits, a, b);
            write_sums(out, C, c, count, a, b);
            counter[c] = 0;
        }
    }
}

template <typename Acc, typename Ctx>
__device__ void reduce_nhwc(const Ctx& ctx, long long rows, long long C, double* out, double count,
                            double* work, unsigned* counter) {
    __shared__ double sa[BN_ROWS][32], sb[BN_ROWS][32];
    __shared__ int last;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long c = blockIdx.x * 32LL + tx;
    const bool valid = c < C;
    const int split = blockIdx.y, splits = gridDim.y;
    const long long chunk = (rows + splits - 1) / splits;
    const long long lo = split * chunk, hi = lo + chunk < rows ? lo + chunk : rows;
    double a = 0.0, b = 0.0;
    if (valid) {
        Acc acc(ctx, c);
        for (long long r = lo + ty; r < hi; r += BN_ROWS) acc.add(ctx, r * C + c);
        acc.result(ctx, c, a, b);
    }
    sa[ty][tx] = a;
    sb[ty][tx] = b;
    __syncthreads();
    if (ty == 0) {
        for (int j = 1; j < BN_ROWS; j++) {
            a += sa[j][tx];
            b += sb[j][tx];
        }
    }
    if (splits == 1) {
        if (ty == 0 && valid) write_sums(out, C, c, count, a, b);
        return;
    }
    if (ty == 0 && valid) {
        work[(split * 2) * C + c] = a;
        work[(split * 2 + 1) * C + c] = b;
        __threadfence();
    }
    __syncthreads();
    if (tx == 0 && ty == 0) last = atomicAdd(&counter[blockIdx.x], 1u) == (unsigned)splits - 1;
    __syncthreads();
    if (last) {
        if (ty == 0 && valid) {
            __threadfence();
            sum_partials(work, C, c, splits, a, b);
            write_sums(out, C, c, count, a, b);
        }
        if (tx == 0 && ty == 0) counter[blockIdx.x] = 0;
    }
}

// Per-channel mean as hi + lo in the arithmetic type A: (x − hi) − lo stays accurate in f32 when
// |mean| ≫ std.
template <typename A> struct SplitMean {
    A hi, lo;
    __device__ __forceinline__ SplitMean() : hi(0), lo(0) {}
    __device__ __forceinline__ explicit SplitMean(double m) {
        hi = (A)m;
        lo = (A)(m - (double)hi);
    }
    __device__ __forceinline__ A centre(A x) const { return (x - hi) - lo; }
};

// 16 bytes of T, read or written in one access (ld/st.global.v4 under nvcc) where the address
// is 16-byte aligned: the vectorised path of the channels-first element-wise kernels.
template <typename T> struct alignas(16) Pack {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};
__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ULL) == 0;
}
template <typename T> __device__ __forceinline__ Pack<T> load_pack(const T* p) {
    return *reinterpret_cast<const Pack<T>*>(p);
}
template <typename T> __device__ __forceinline__ void store_pack(T* p, const Pack<T>& v) {
    *reinterpret_cast<Pack<T>*>(p) = v;
}
