// The simulated cuBLAS (libcublas.so.13): the entry points cudarc 0.19.10 and candle 0.11.1
// call, written from NVIDIA's cuBLAS reference (no NVIDIA code or header). The arithmetic is in
// gemm.h; the cublas_*.cpp files check the arguments as the reference describes, read the
// host-side scalars at the call, validate every matrix's full extent against the allocation table
// and enqueue the computation as stream work on the handle's stream.
//
// Handles: a handle belongs to the context current at cublasCreate (a later call from a thread
// with another current context still uses the handle's). Its stream (cublasSetStream, default
// the NULL stream, i.e. the legacy stream) is kept as the CUstream value and resolved at every
// call, so CU_STREAM_PER_THREAD means the calling thread's per-thread stream, as in CUDA.
//
// Each GEMM, GEMV or ASUM is one operation on the stream (Op kind "gemm" or "asum") and counts
// one Counts::host_tasks on it, counted when enqueued. A call that returns early (m, n or
// batchCount 0, or C left unchanged by the reference's quick-return rule) enqueues nothing.
//
// Errors (each one logged with the function, the argument and the value): a handle that is
// not live (never created, destroyed) gives CUBLAS_STATUS_NOT_INITIALIZED; a negative size,
// a too small leading dimension, a bad transpose code or a NULL scalar
// CUBLAS_STATUS_INVALID_VALUE; a type/compute-type combination or algo outside the simulated
// set CUBLAS_STATUS_NOT_SUPPORTED; a context with a sticky error, an unusable stream or a race
// found when enqueueing CUBLAS_STATUS_EXECUTION_FAILED. cublasDestroy synchronises the
// handle's context, as the reference says it does (cudaDeviceSynchronize).
//
// Deviations, all reported: an argument whose extent is not inside one live allocation of the
// handle's device is refused at the call with CUBLAS_STATUS_INVALID_VALUE (a GPU would fault
// later); with CUBLAS_POINTER_MODE_HOST, alpha/beta/result pointing into device memory are
// refused the same way (a real process would crash reading them).
//
// This header: the handle's object and the helpers those files share (namespace cublas_sim).
// cublas_handle.cpp holds the handles and their entry points, cublas_args.cpp the argument checks
// and the enqueueing, cublas_gemm.cpp the GEMMs, cublas_level2.cpp GEMV and ASUM.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "blas_types.h"
#include "sim.h"

struct cublasContext {
    sim::Context* ctx = nullptr;
    CUstream stream = nullptr;  // as given to cublasSetStream
    int pointer_mode = CUBLAS_POINTER_MODE_HOST;
    int math_mode = CUBLAS_DEFAULT_MATH;
    void* workspace = nullptr;  // cublasSetWorkspace (kept, not used: no kernel needs one)
    size_t workspace_size = 0;
};

namespace cublas_sim {

// A copy of a live handle's state, taken under the registry's lock.
struct HandleState {
    sim::Context* ctx;
    CUstream stream;
    int pointer_mode;
    int math_mode;
};

// ------------------------------------------------------------- handles (cublas_handle.cpp)
// Copies a live handle's state into *out; false (logged) if `h` is not a live handle.
bool lookup(const char* fn, cublasHandle_t h, HandleState* out);
// The handle's context must still be usable: alive, without a sticky error.
cublasStatus_t check_context(const char* fn, sim::Context* c);

// ------------------------------------------- argument checks, enqueueing (cublas_args.cpp)
// The scale type of alpha and beta.
enum class Scale { Half, Float, Double };
double read_scale(const void* p, Scale s);
// An op code must be CUBLAS_OP_N, _T or _C; false (logged) otherwise.
bool valid_op(const char* fn, const char* arg, int op);
// Logs the formatted message with ": CUBLAS_STATUS_INVALID_VALUE" and returns that status.
cublasStatus_t invalid(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Validates the bytes [ptr + lo, ptr + lo + len) as one live allocation of `device` and adds
// the use. `desc` describes the argument for the message.
bool check_range(const char* fn, const char* arg, const std::string& desc, uint64_t ptr, int64_t lo,
                 uint64_t len, int device, bool write, std::vector<sim::BufferUse>& uses);
// A column-major matrix argument (rows x cols, ld, batch matrices stride elements apart).
bool check_matrix(const char* fn, const char* arg, const void* p, int64_t rows, int64_t cols,
                  int64_t ld, int64_t stride, int64_t batch, size_t elem, int device, bool write,
                  std::vector<sim::BufferUse>& uses);
// A strided vector (n elements, inc apart; a negative inc walks from the far end, as BLAS).
bool check_vector(const char* fn, const char* arg, const void* p, int64_t n, int64_t inc,
                  size_t elem, int device, bool write, std::vector<sim::BufferUse>& uses);

// Host pointer mode: a scalar must be host memory, read now.
bool host_scalar(const char* fn, const char* arg, const void* p, Scale s, double* out);
// Device pointer mode: a scalar must be device memory of the handle's device, read when the
// operation runs.
bool device_scalar(const char* fn, const char* arg, const void* p, Scale s, int device,
                   std::vector<sim::BufferUse>& uses);

// Enqueues `run` on the handle's stream after the checks; counts it.
cublasStatus_t submit(const char* fn, const HandleState& hs, const char* kind,
                      std::function<void()> run, const std::vector<sim::BufferUse>& uses,
                      sim::Stream* s);
// The handle's stream, resolved now (CU_STREAM_PER_THREAD is the calling thread's); null
// (logged) if it cannot be used.
sim::Stream* stream_of(const char* fn, const HandleState& hs);

}  // namespace cublas_sim
