// Backward element-wise: dx = γ·invstd·(g − S1/n − (x − mean)·invstd²·S2/n) and dz = g in one
// pass, g = dy masked by the fused ReLU (y > 0) when `y` is given. S = [S1, S2] are the
// all-reduced sums of bn_backward_reduce ([2, C] f64; zeros for running statistics, where
// dx = γ·invstd·g), n the global count per channel (`count` [C] f64: row 0 of the reduced
// forward sums, left on the device).
#include "reduce.cuh"

template <typename A> struct BwdCoef {
    SplitMean<A> mean;
    A w, k1, k2;
    __device__ __forceinline__ BwdCoef() : w(0), k1(0), k2(0) {}
    __device__ BwdCoef(const double* m, const double* invstd, const A* weight,
                       const double* sums, const double* count, long long C, long long c)
        : mean(m[c]) {
        const double is = invstd[c], n = count[c];
        w = (A)((weight ? (double)weight[c] : 1.0) * is);
        k1 = (A)(n > 0 ? sums[c] / n : 0.0);
        k2 = (A)(n > 0 ? is * is * sums[C + c] / n : 0.0);
    }
    // g = dy, zeroed where the fused ReLU's output y is not positive (when masked).
    template <typename T> __device__ __forceinline__ A grad(T dy, bool masked, T y) const {
        return masked && !(to_acc(y) > (A)0) ? (A)0 : to_acc(dy);
    }
    template <typename T> __device__ __forceinline__ T dx(A g, T x) const {
        return store_as<T>(w * (g - k1 - mean.centre(to_acc(x)) * k2));
    }
    template <typename T>
    __device__ __forceinline__ void run(const T* dy, const T* x, const T* y, T* dx_, T* dz,
                                        long long i) const {
        const A g = grad(dy[i], y != nullptr, y ? y[i] : dy[i]);
        dx_[i] = dx(g, x[i]);
        if (dz) dz[i] = store_as<T>(g);
    }
};

// Grid (N·C planes, chunks of HW), block BN_THREADS (as bn_apply_nchw, 16-byte packs likewise).
template <typename T>
__device__ void backward_elemt_nchw(const T* dy, const T* x, const T* y, const double* mean,
                                    const double* invstd, const typename AccOf<T>::type* weight,
                                    const double* sums, const double* count, T* dx, T* dz,
                                    long long C, long long HW) {
    const long long plane = blockIdx.x, c = plane % C;
    const BwdCoef<typename AccOf<T>::type> k(mean, invstd, weight, sums, count, C, c);
    const long long base = plane * HW;
    const long long first = blockIdx.y * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)blockDim.x * gridDim.y;
    constexpr int V = Pack<T>::N;
    if (HW % V == 0 && aligned16(dy) && aligned16(x) && aligned16(dx) && (!y || aligned16(y)) &&
        (!dz || aligned16(dz))) {
        for (long long p = first; p < HW / V; p += stride) {
            const long long i = base + p * V;
            const Pack<T> dyv = load_pack(dy + i), xv = load_pack(x + i);
            Pack<T> yv, dxv, dzv;
            if (y) yv = load_pack(y + i);
            for (int j = 0; j < V; j++) {
                const auto g = k.grad(dyv.v[j], y != nullptr, y ? yv.v[j] : dyv.v[j]);
                dxv.v[j] = k.dx(g, xv.v[j]);
                dzv.v[j] = store_as<T>(g);
            }
            store_pack(dx + i, dxv);
            if (dz) store_pack(dz + i, dzv);
        }
        return;
    }
    for (long long p = first; p < HW; p += stride) k.run(dy, x, y, dx, dz, base + p);
}

// Grid (ceil(C/32), row blocks), block (32, BN_ROWS) (as bn_apply_nhwc, packs likewise).
template <typename T>
__device__ void backward_elemt_nhwc(const T* dy, const T* x, const T* y, const double* mean,
                                    const double* invstd, const typename AccOf<T>::type* weight,
                                    const double* sums, const double* count, T* dx, T* dz,
                                    long long rows, long long C) {
    using A = typename AccOf<T>::type;
    constexpr int V = Pack<T>::N;
    const long long t = blockIdx.x * 32LL + threadIdx.x;
    const long long r0 = blockIdx.y * (long long)BN_ROWS + threadIdx.y;
    const long long rstep = (long long)BN_ROWS * gridDim.y;
    if (C % V == 0 && aligned16(dy) && aligned16(x) && aligned16(dx) && (!y || aligned16(y)) &&
        (!dz || aligned16(dz))) {
        const long long c0 = t * V;
        if (c0 >= C) return;
        BwdCoef<A> k[V];
BN_UNROLL
        for (int j = 0; j < V; j++) k[j] = BwdCoef<A>(mean, invstd, weight, sums, count, C, c0 + j);
        for (long long r = r0; r < rows; r += rstep) {
            const long long i = r * C + c0;
            const Pack<T> dyv = load_pack(dy + i), xv = load_pack(x + i);
            const Pack<T> yv = y ? load_pack(y + i) : dyv;
            Pack<T> dxv, dzv;
BN_UNROLL
            for (int j = 0; j < V; j++) {
                const A g = k[j].grad(dyv.v[j], y != nullptr, yv.v[j]);
                dxv.v[j] = k[j].dx(g, xv.v[j]);
                dzv.v[j] = store_as<T>(g);
            }
            store_pack(dx + i, dxv);
            if (dz) store_pack(dz + i, dzv);
        }
        return;
    }
    const long long c = t;
    if (c >= C) return;
    const BwdCoef<A> k(mean, invstd, weight, sums, count, C, c);
    for (long long r = r0; r < rows; r += rstep) k.run(dy, x, y, dx, dz, r * C + c);
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
