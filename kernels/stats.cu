// Batch statistics: local shifted sums [n_r, Σ(x − K), Σ(x − K)²] per channel (f64, the payload
// of the forward all-reduce), and the finalize step that turns the reduced sums into mean and
// invstd and updates the running statistics in place, all on the device.
#include "reduce.cuh"

// One thread's sums relative to its first value s (close to its data, so the f32 partial sums
// stay accurate even when the shift K is far), moved to the shift K in f64 at the end.
template <typename T> struct StatsCtx {
    const T* x;          // [N, C, HW] or [N·HW, C]
    const double* shift; // [C]: K, identical on every rank
};

template <typename T> struct StatsAcc {
    using A = typename AccOf<T>::type;
    A s = 0, a = 0, b = 0;
    long long m = 0;
    __device__ StatsAcc(const StatsCtx<T>&, long long) {}
    __device__ __forceinline__ void add(const StatsCtx<T>& ctx, long long i) {
        const A v = to_acc(ctx.x[i]);
        if (m == 0) s = v;
        const A d = v - s;
        a += d;
        b += d * d;
        m++;
    }
    __device__ __forceinline__ void result(const StatsCtx<T>& ctx, long long c, double& A_,
                                           double& B_) const {
        const double d = (double)s - ctx.shift[c], mm = (double)m, aa = (double)a;
        A_ = m ? aa + mm * d : 0.0;
        B_ = m ? (double)b + 2.0 * d * aa + mm * d * d : 0.0;
    }
};

// out: [3, C] f64 = [n_r, Σ(x − K), Σ(x − K)²]; work: [splits, 2, C] f64; counter: [C] u32
// zeroed once. Grid (C, splits), block BN_THREADS.
template <typename T>
__device__ void stats_nchw(const T* x, const double* shift, double* out, double* work,
                           unsigned* counter, long long N, long long C, long long HW) {
    StatsCtx<T> ctx{x, shift};
    reduce_nchw<StatsAcc<T>>(ctx, N, C, HW, out, (double)(N * HW), work, counter);
}

// Same for channels-last rows: grid (ceil(C/32), splits), block (32, BN_ROWS); counter
// [ceil(C/32)] u32.
template <typename T>
__device__ void stats_nhwc(const T* x, const double* shift, double* out, double* work,
                           unsigned* counter, long long N, long long C, long long HW) {
    StatsCtx<T> ctx{x, shift};
    reduce_nhwc<StatsAcc<T>>(ctx, N * HW, C, out, (double)(N * HW), work, counter);
}

#define STATS_ENTRIES(suffix, T)                                                               \
    extern "C" __global__ void bn_stats_nchw_##suffix(const T* x, const double* shift,         \
                                                      double* out, double* work,               \
                                                      unsigned* counter, long long n,          \
                                                      long long c, long long hw) {             \
        stats_nchw<T>(x, shift, out, work, counter, n, c, hw);                                 \
    }                                                                                          \
    EMU_REGISTER(bn_stats_nchw_##suffix)                                                       \
    extern "C" __global__ void bn_stats_nhwc_##suffix(const T* x, const double* shift,         \
                                                      double* out, double* work,               \
                                                      unsigned* counter, long long n,          \
                                                      long long c, long long hw) {             \
        stats_nhwc<T>(x, shift, out, work, counter, n, c, hw);                                 \
    }                                                                                          \
    EMU_REGISTER(bn_stats_nhwc_##suffix)
STAMP(STATS_ENTRIES)

// Reduced sums [3, C] → per-channel rows of `out` [10, C] (f64), all on the device:
//   0 n, the global count;          1 mean = K + A/n (K when n = 0: the next step's shift);
//   2 invstd = 1/sqrt(M2/n + eps)   (NaN when n = 1, a batch that cannot be normalised;
//                                    1 when n = 0, an empty batch);
//   3 biased var M2/n;              4 unbiased var M2/(n − 1) (0 when n ≤ 1);
//   5 w, the running-statistics blend weight: `momentum` when n > 1, else 0;
//   6 the next step's shift and the running mean's target; 7 the running variance's target
//     (a channel whose batch holds NaN or Inf keeps its shift K, target 0 and weight 0);
//   8, 9 the running mean and variance before this step (0 without running statistics): what
//     a rollback restores.
// With running statistics (`run_mean`, `run_var` non-null, the layer's variables in their own
// dtype R), the same thread updates them in place, running ← running + w·(target − running),
// which leaves them bitwise untouched where w = 0; thread 0 adds 1 to `batches`
// (num_batches_tracked, when non-null). So a training step's whole per-channel bookkeeping is
// this one launch. The caller passes momentum (or 1/num_batches_tracked, known on the host):
// nothing is read back. Grid ceil(C/BN_THREADS), block BN_THREADS.

// old + (target − old)·w rounded step by step (no fused multiply-add), as the CPU does.
__device__ __forceinline__ double blend(double old, double target, double w) {
    return __dadd_rn(old, __dmul_rn(__dsub_rn(target, old), w));
}

template <typename R>
__device__ void finalize(const double* sums, const double* shift, double* out, R* run_mean,
                         R* run_var, long long* batches, double momentum, double eps,
                         long long C) {
    const long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (c == 0 && batches != nullptr) *batches += 1;
    if (c >= C) return;
    const double n = sums[c], a = sums[C + c], b = sums[2 * C + c];
    const double d = n > 0 ? a / n : 0.0;
    double m2 = b - a * d;
    m2 = m2 > 0 ? m2 : 0.0;
    const double var = n > 0 ? m2 / n : 0.0;
    out[c] = n;
    out[C + c] = shift[c] + d;
    out[2 * C + c] = n == 1 ? nan("") : (n > 0 ? rsqrt(var + eps) : 1.0);
    out[3 * C + c] = var;
    const double mean = shift[c] + d, unbiased = n > 1 ? m2 / (n - 1) : 0.0;
    // A channel whose batch holds NaN or Inf keeps its shift and running statistics
    // (v - v == 0 tests finiteness, as on the CPU).
    const bool ok = mean - mean == 0.0 && var - var == 0.0;
    const double w = ok && n > 1 ? momentum : 0.0;
    const double mean_target = ok ? mean : shift[c], var_target = ok ? unbiased : 0.0;
    out[4 * C + c] = unbiased;
    out[5 * C + c] = w;
    out[6 * C + c] = mean_target;
    out[7 * C + c] = var_target;
    double old_mean = 0.0, old_var = 0.0;
    if (run_mean != nullptr) {
        old_mean = (double)to_acc(run_mean[c]);
        old_var = (double)to_acc(run_var[c]);
        run_mean[c] = store_as<R>(blend(old_mean, mean_target, w));
        run_var[c] = store_as<R>(blend(old_var, var_target, w));
    }
    out[8 * C + c] = old_mean;
    out[9 * C + c] = old_var;
}

// `bn_finalize_<R>`: R is the running statistics' dtype; `bn_finalize_f64` with null running
// pointers is the plain finalize of the functional ops.
#define FINALIZE_ENTRY(suffix, R)                                                              \
    extern "C" __global__ void bn_finalize_##suffix(                                           \
        const double* sums, const double* shift, double* out, R* run_mean, R* run_var,        \
        long long* batches, double momentum, double eps, long long c) {                        \
        finalize<R>(sums, shift, out, run_mean, run_var, batches, momentum, eps, c);           \
    }                                                                                          \
    EMU_REGISTER(bn_finalize_##suffix)
STAMP(FINALIZE_ENTRY)
