// 2-D max pooling over channels-first planes, with PyTorch's semantics: windows of k×k at
// stride s over the input padded by p on every side (padding never wins), the output value is
// the window's first maximum in row-major order, and a NaN wins over any number (the last NaN
// of a window). The backward routes each output's gradient to that same element: one thread
// per input element sums, in increasing (oh, ow) order, the gradients of the windows whose
// maximum it is, so the result is deterministic (no atomics) and equals the CPU op's bitwise.
#include "compat.cuh"

// Geometry of one pooling: planes of h×w inputs and oh×ow outputs.
struct PoolGeom {
    long long planes, h, w, oh, ow;
    int k, s, p;
};

template <typename A> __device__ __forceinline__ bool is_nan(A v) { return v != v; }

// Index within its plane of the maximum of window (i, j) of `plane` (a pointer to h×w values).
template <typename T>
__device__ __forceinline__ long long window_argmax(const T* plane, const PoolGeom& g, long long i,
                                                   long long j) {
    using A = typename AccOf<T>::type;
    long long h0 = i * g.s - g.p, w0 = j * g.s - g.p;
    const long long h1 = h0 + g.k < g.h ? h0 + g.k : g.h;
    const long long w1 = w0 + g.k < g.w ? w0 + g.k : g.w;
    h0 = h0 > 0 ? h0 : 0;
    w0 = w0 > 0 ? w0 : 0;
    long long best_at = h0 * g.w + w0;
    A best = to_acc(plane[best_at]);
    for (long long a = h0; a < h1; a++) {
        for (long long b = w0; b < w1; b++) {
            const A v = to_acc(plane[a * g.w + b]);
            if (v > best || is_nan(v)) {
                best = v;
                best_at = a * g.w + b;
            }
        }
    }
    return best_at;
}

// x: [planes, h, w], y: [planes, oh, ow]. One thread per output element, grid-stride loop.
template <typename T> __device__ void max_pool_fwd(const T* x, T* y, PoolGeom g) {
    const long long total = g.planes * g.oh * g.ow;
    const long long step = (long long)blockDim.x * gridDim.x;
    for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < total; o += step) {
        const long long plane = o / (g.oh * g.ow), r = o % (g.oh * g.ow);
        const T* xp = x + plane * g.h * g.w;
        y[o] = xp[window_argmax(xp, g, r / g.ow, r % g.ow)];
    }
}

// x, dx: [planes, h, w], dy: [planes, oh, ow]. One thread per input element, grid-stride loop.
template <typename T> __device__ void max_pool_bwd(const T* x, const T* dy, T* dx, PoolGeom g) {
    using A = typename AccOf<T>::type;
    const long long total = g.planes * g.h * g.w;
    const long long step = (long long)blockDim.x * gridDim.x;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += step) {
        const long long plane = e / (g.h * g.w), at = e % (g.h * g.w);
        const long long a = at / g.w, b = at % g.w;
        // Windows i with i·s − p ≤ a < i·s − p + k, clamped to the output.
        const long long ilo = a + g.p - g.k + 1 > 0 ? (a + g.p - g.k + 1 + g.s - 1) / g.s : 0;
        const long long jlo = b + g.p - g.k + 1 > 0 ? (b + g.p - g.k + 1 + g.s - 1) / g.s : 0;
        const long long ihi = (a + g.p) / g.s < g.oh - 1 ? (a + g.p) / g.s : g.oh - 1;
        const long long jhi = (b + g.p) / g.s < g.ow - 1 ? (b + g.p) / g.s : g.ow - 1;
        const T* xp = x + plane * g.h * g.w;
        const T* dyp = dy + plane * g.oh * g.ow;
        A sum = (A)0;
        for (long long i = ilo; i <= ihi; i++)
            for (long long j = jlo; j <= jhi; j++)
                if (window_argmax(xp, g, i, j) == at) sum += to_acc(dyp[i * g.ow + j]);
        dx[e] = store_as<T>(sum);
    }
}

#define MAX_POOL_ENTRIES(suffix, T)                                                             \
    extern "C" __global__ void max_pool2d_fwd_##suffix(                                         \
        const T* x, T* y, long long planes, long long h, long long w, long long oh,              \
        long long ow, int k, int s, int p) {                                                    \
        max_pool_fwd<T>(x, y, PoolGeom{planes, h, w, oh, ow, k, s, p});                         \
    }                                                                                           \
    EMU_REGISTER(max_pool2d_fwd_##suffix)                                                       \
    extern "C" __global__ void max_pool2d_bwd_##suffix(                                         \
        const T* x, const T* dy, T* dx, long long planes, long long h, long long w,             \
        long long oh, long long ow, int k, int s, int p) {                                      \
        max_pool_bwd<T>(x, dy, dx, PoolGeom{planes, h, w, oh, ow, k, s, p});                    \
    }                                                                                           \
    EMU_REGISTER(max_pool2d_bwd_##suffix)
STAMP(MAX_POOL_ENTRIES)
