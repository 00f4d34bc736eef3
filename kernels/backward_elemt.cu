// Backward element-wise: dx = γ·invstd·(g − S1/n − (x − mean)·invstd²·S2/n) and dz = g in one
// pass, g = dy masked by the fused ReLU (y > 0) when `y` is given. S = [S1, S2] are the
// all-reduced sums of bn_backward_reduce ([2, C] f64; zeros for running statistics, where
// dx = γ·invstd·g), n the global count per channel (`count` [C] f64: row 0 of the reduced
// forward sums, left on the device).
#include "reduce.cuh"

template <typename A> struct BwdCoef {
    SplitMean<A> mean;
    A w, k1, k2;
    __device__ BwdCoef(const double* m, const double* invstd, const A* weight,
                       const double* sums, const double* count, long long C, long long c)
        : mean(m[c]) {
        const double is = invstd[c], n = count[c];
        w = (A)((weight ? (double)weight[c] : 1.0) * is);
        k1 = (A)(n > 0 ? sums[c] / n : 0.0);
        k2 = (A)(n > 0 ? is * is * sums[C + c] / n : 0.0);
    }
    template <typename T>
    __device__ __forceinline__ void run(const T* dy, const T* x, const T* y, T* dx, T* dz,
                                        long long i) const {
        A g = to_acc(dy[i]);
        if (y && !(to_acc(y[i]) > (A)0)) g = (A)0;
        dx[i] = store_as<T>(w * (g - k1 - mean.centre(to_acc(x[i])) * k2));
        if (dz) dz[i] = store_as<T>(g);
    }
};

// Grid (N·C planes, chunks of HW), block BN_THREADS (as bn_apply_nchw).
template <typename T>
__device__ void backward_elemt_nchw(const T* dy, const T* x, const T* y, const double* mean,
                                    const double* invstd, const typename AccOf<T>::type* weight,
                                    const double* sums, const double* count, T* dx, T* dz,
                                    long long C, long long HW) {
    const long long plane = blockIdx.x, c = plane % C;
    const BwdCoef<typename AccOf<T>::type> k(mean, invstd, weight, sums, count, C, c);
    const long long base = plane * HW;
    for (long long p = blockIdx.y * (long long)blockDim.x + threadIdx.x; p < HW;
         p += (long long)blockDim.x * gridDim.y)
        k.run(dy, x, y, dx, dz, base + p);
}

// Grid (ceil(C/32), row blocks), block (32, BN_ROWS) (as bn_apply_nhwc).
template <typename T>
__device__ void backward_elemt_nhwc(const T* dy, const T* x, const T* y, const double* mean,
                                    const double* invstd, const typename AccOf<T>::type* weight,
                                    const double* sums, const double* count, T* dx, T* dz,
                                    long long rows, long long C) {
    const long long c = blockIdx.x * 32LL + threadIdx.x;
    if (c >= C) return;
    const BwdCoef<typename AccOf<T>::type> k(mean, invstd, weight, sums, count, C, c);
    for (long long r = blockIdx.y * (long long)BN_ROWS + threadIdx.y; r < rows;
         r += (long long)BN_ROWS * gridDim.y)
        k.run(dy, x, y, dx, dz, r * C + c);
}

#define BACKWARD_ELEMT_ENTRIES(suffix, T)                                                      \
    extern "C" __global__ void bn_backward_elemt_nchw_##suffix(                                \
        const T* dy, const T* x, const T* y, const double* mean, const double* invstd,         \
        const typename AccOf<T>::type* weight, const double* sums, const double* count, T* dx, \
        T* dz, long long n, long long c, long long hw) {                                       \
        (void)n;                                                                               \
        backward_elemt_nchw<T>(dy, x, y, mean, invstd, weight, sums, count, dx, dz, c, hw);    \
    }                                                                                          \
    EMU_REGISTER(bn_backward_elemt_nchw_##suffix)                                              \
    extern "C" __global__ void bn_backward_elemt_nhwc_##suffix(                                \
        const T* dy, const T* x, const T* y, const double* mean, const double* invstd,         \
        const typename AccOf<T>::type* weight, const double* sums, const double* count, T* dx, \
        T* dz, long long n, long long c, long long hw) {                                       \
        backward_elemt_nhwc<T>(dy, x, y, mean, invstd, weight, sums, count, dx, dz, n * hw,    \
                               c);                                                             \
    }                                                                                          \
    EMU_REGISTER(bn_backward_elemt_nhwc_##suffix)
STAMP(BACKWARD_ELEMT_ENTRIES)
