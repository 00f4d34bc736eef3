// Backward reduce: local [Σg, Σg·(x − mean)] per channel (f64, the payload of the backward
// all-reduce), g = dy masked by the fused ReLU (y > 0) when `y` is given.
#include "reduce.cuh"

template <typename T> struct BwdCtx {
    const T* dy;        // [N, C, HW] or [N·HW, C]
    const T* x;         // same shape
    const T* y;         // same shape, or null without a fused ReLU
    const double* mean; // [C]
};

template <typename T> struct BwdAcc {
    using A = typename AccOf<T>::type;
    SplitMean<A> mean;
    A a = 0, b = 0;
    __device__ BwdAcc(const BwdCtx<T>& ctx, long long c) : mean(ctx.mean[c]) {}
    __device__ __forceinline__ void add(const BwdCtx<T>& ctx, long long i) {
        A g = to_acc(ctx.dy[i]);
        if (ctx.y && !(to_acc(ctx.y[i]) > (A)0)) g = (A)0;
        a += g;
        b += g * mean.centre(to_acc(ctx.x[i]));
    }
    __device__ __forceinline__ void result(const BwdCtx<T>&, long long, double& A_,
                                           double& B_) const {
        A_ = (double)a;
        B_ = (double)b;
    }
};

// out: [2, C] f64; work: [splits, 2, C] f64; counter as for the statistics. Launch
// configurations: those of bn_stats_nchw / bn_stats_nhwc.
#define BACKWARD_REDUCE_ENTRIES(suffix, T)                                                     \
    extern "C" __global__ void bn_backward_reduce_nchw_##suffix(                               \
        const T* dy, const T* x, const T* y, const double* mean, double* out, double* work,    \
        unsigned* counter, long long n, long long c, long long hw) {                           \
        BwdCtx<T> ctx{dy, x, y, mean};                                                         \
        reduce_nchw<BwdAcc<T>>(ctx, n, c, hw, out, -1.0, work, counter);                       \
    }                                                                                          \
    EMU_REGISTER(bn_backward_reduce_nchw_##suffix)                                             \
    extern "C" __global__ void bn_backward_reduce_nhwc_##suffix(                               \
        const T* dy, const T* x, const T* y, const double* mean, double* out, double* work,    \
        unsigned* counter, long long n, long long c, long long hw) {                           \
        BwdCtx<T> ctx{dy, x, y, mean};                                                         \
        reduce_nhwc<BwdAcc<T>>(ctx, n * hw, c, out, -1.0, work, counter);                      \
    }                                                                                          \
    EMU_REGISTER(bn_backward_reduce_nhwc_##suffix)
STAMP(BACKWARD_REDUCE_ENTRIES)
