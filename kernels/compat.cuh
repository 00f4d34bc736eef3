// What the kernels need from CUDA, for nvcc and for the g++ emulator of tests/emu/ alike:
// fp16/bf16 types, a dynamic shared memory macro, the registration hook of entry points, and
// loads/stores between storage types and the accumulation type.
#pragma once

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define EMU_REGISTER(name)
#define DYNAMIC_SMEM(T, name)                     \
    extern __shared__ unsigned char name##_raw[]; \
    T* name = reinterpret_cast<T*>(name##_raw)
#else
#include "cuda_emu.h"
#define DYNAMIC_SMEM(T, name) T* name = static_cast<T*>(::emu::dynamic_smem())
#endif

// Full unrolling of a short fixed-count loop (register arrays stay in registers).
#ifdef __CUDACC__
#define BN_UNROLL _Pragma("unroll")
#else
#define BN_UNROLL _Pragma("GCC unroll 16")
#endif

// bf16 entry points exist where the hardware has bf16 arithmetic (and always under emulation).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define BN_HAS_BF16 1
#else
#define BN_HAS_BF16 0
#endif

// Accumulation type of a storage type: f32 for f32/f16/bf16, f64 for f64.
template <typename T> struct AccOf {
    using type = float;
};
template <> struct AccOf<double> {
    using type = double;
};

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}
template <typename T> __device__ __forceinline__ T store_as(typename AccOf<T>::type v) {
    return from_acc<T>(v);
}
template <> __device__ __forceinline__ double store_as<double>(double v) { return v; }

// Entry points `<root>_<dtype>` stamped from one templated body: STAMP(ROOT_MACRO) expands
// ROOT_MACRO(suffix, T) for every storage type.
#if BN_HAS_BF16
#define STAMP_BF16(M) M(bf16, __nv_bfloat16)
#else
#define STAMP_BF16(M)
#endif
#define STAMP(M) M(f32, float) M(f64, double) M(f16, __half) STAMP_BF16(M)
