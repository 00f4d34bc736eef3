// Normalisation: y = act((x − mean)·γ·invstd + β [+ z]), act = ReLU when `relu`, with the mean
// split as hi + lo so that f32 arithmetic stays accurate when |mean| ≫ std. Per-channel
// coefficients are computed once per thread from f64 statistics and A-typed parameters
// (A = f32, or f64 for f64 inputs; `weight` γ and `bias` β, each [C], or null for γ = 1 and
// β = 0; two views of one [2, C] buffer serve too).
#include "reduce.cuh"

template <typename A> struct Coef {
    SplitMean<A> mean;
    A scale, shift;
    __device__ __forceinline__ Coef() : scale(0), shift(0) {}
    __device__ Coef(const double* m, const double* invstd, const A* weight, const A* bias,
                    long long c)
        : mean(m[c]) {
        const double g = weight ? (double)weight[c] : 1.0;
        scale = (A)(g * invstd[c]);
        shift = bias ? bias[c] : (A)0;
    }
    // act((x − mean)·scale + shift [+ zv]); zv is read only when `has_z`.
    template <typename T>
    __device__ __forceinline__ T apply(T x, bool has_z, T zv, int relu) const {
        A y = mean.centre(to_acc(x)) * scale + shift;
        if (has_z) y += to_acc(zv);
        if (relu && !(y > (A)0)) y = (A)0;
        return store_as<T>(y);
    }
};

// x, z?, y: [N, C, HW]. Grid (N·C planes, chunks of HW), block BN_THREADS; 16-byte loads and
// stores where the buffers are aligned and HW is a multiple of the pack length.
template <typename T>
__device__ void apply_nchw(const T* x, const T* z, const double* mean, const double* invstd,
                           const typename AccOf<T>::type* weight,
                           const typename AccOf<T>::type* bias, T* y, long long C, long long HW,
                           int relu) {
    const long long plane = blockIdx.x, c = plane % C;
    const Coef<typename AccOf<T>::type> k(mean, invstd, weight, bias, c);
    const long long base = plane * HW;
    const long long first = blockIdx.y * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)blockDim.x * gridDim.y;
    constexpr int V = Pack<T>::N;
    // Whole planes of 16-byte packs when every plane starts aligned (HW a multiple of V).
    if (HW % V == 0 && aligned16(x) && aligned16(y) && (!z || aligned16(z))) {
        for (long long p = first; p < HW / V; p += stride) {
            const long long i = base + p * V;
            const Pack<T> xv = load_pack(x + i);
            const Pack<T> zv = z ? load_pack(z + i) : xv;
            Pack<T> yv;
            for (int j = 0; j < V; j++) yv.v[j] = k.apply(xv.v[j], z != nullptr, zv.v[j], relu);
            store_pack(y + i, yv);
        }
        return;
    }
    for (long long p = first; p < HW; p += stride)
        y[base + p] = k.apply(x[base + p], z != nullptr, z ? z[base + p] : x[base + p], relu);
}

// x, z?, y: [rows, C]. Grid (ceil(C/32), row blocks), block (32, BN_ROWS); 16-byte packs of
// channels where aligned and C is a multiple of the pack length.
template <typename T>
__device__ void apply_nhwc(const T* x, const T* z, const double* mean, const double* invstd,
                           const typename AccOf<T>::type* weight,
                           const typename AccOf<T>::type* bias, T* y, long long rows,
                           long long C, int relu) {
    using A = typename AccOf<T>::type;
    constexpr int V = Pack<T>::N;
    const long long t = blockIdx.x * 32LL + threadIdx.x;
    const long long r0 = blockIdx.y * (long long)BN_ROWS + threadIdx.y;
    const long long rstep = (long long)BN_ROWS * gridDim.y;
    // 16-byte packs of V consecutive channels when C is a multiple of V and the buffers are
    // aligned: thread t then covers channels [V·t, V·t + V) (blocks past C/(32·V) exit).
    if (C % V == 0 && aligned16(x) && aligned16(y) && (!z || aligned16(z))) {
        const long long c0 = t * V;
        if (c0 >= C) return;
        Coef<A> k[V];
BN_UNROLL
        for (int j = 0; j < V; j++) k[j] = Coef<A>(mean, invstd, weight, bias, c0 + j);
        for (long long r = r0; r < rows; r += rstep) {
            const long long i = r * C + c0;
            const Pack<T> xv = load_pack(x + i);
            const Pack<T> zv = z ? load_pack(z + i) : xv;
            Pack<T> yv;
BN_UNROLL
            for (int j = 0; j < V; j++) yv.v[j] = k[j].apply(xv.v[j], z != nullptr, zv.v[j], relu);
            store_pack(y + i, yv);
        }
        return;
    }
    const long long c = t;
    if (c >= C) return;
    const Coef<A> k(mean, invstd, weight, bias, c);
    for (long long r = r0; r < rows; r += rstep)
        y[r * C + c] = k.apply(x[r * C + c], z != nullptr, z ? z[r * C + c] : x[r * C + c], relu);
}

#define APPLY_ENTRIES(suffix, T)                                                                \
    extern "C" __global__ void bn_apply_nchw_##suffix(                                          \
        const T* x, const T* z, const double* mean, const double* invstd,                       \
        const typename AccOf<T>::type* weight, const typename AccOf<T>::type* bias, T* y,       \
        long long n, long long c, long long hw, int relu) {                                     \
        (void)n;                                                                                \
        apply_nchw<T>(x, z, mean, invstd, weight, bias, y, c, hw, relu);                        \
    }                                                                                           \
    EMU_REGISTER(bn_apply_nchw_##suffix)                                                        \
    extern "C" __global__ void bn_apply_nhwc_##suffix(                                          \
        const T* x, const T* z, const double* mean, const double* invstd,                       \
        const typename AccOf<T>::type* weight, const typename AccOf<T>::type* bias, T* y,       \
        long long n, long long c, long long hw, int relu) {                                     \
        apply_nhwc<T>(x, z, mean, invstd, weight, bias, y, n * hw, c, relu);                    \
    }                                                                                           \
    EMU_REGISTER(bn_apply_nhwc_##suffix)
STAMP(APPLY_ENTRIES)
