// Kernels for the simulator's self-tests (gpu-sim/tests/selftest.cpp): each plants one defect
// class, or is a correct kernel the tests misuse.
#include <cstdint>

#ifndef __CUDACC__
// The emulator refuses what sm_70 tolerates (a barrier that exited threads skip), as for our
// own kernels.
extern "C" {
int gpusim_strict_barriers = 1;
}
#endif

// out[i] = in[i] + 1 for i < n.
extern "C" __global__ void sim_add_one(const float* in, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] + 1.0f;
}

// Writes out[n + past] once: `past` elements beyond the end of an n-element buffer.
extern "C" __global__ void sim_write_past(float* out, int n, int past) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[n + past] = 1.0f;
}

// Reads through a pointer stored in device memory (a pointer the launch check cannot see).
extern "C" __global__ void sim_read_indirect(const uint64_t* where, float* out) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = *reinterpret_cast<const float*>(where[0]);
}

// A barrier that some threads never reach (they exit first): undefined behaviour before sm_70,
// refused by the strict emulator.
extern "C" __global__ void sim_divergent_barrier(float* out) {
    if (threadIdx.x >= 16) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// Assumes that block 0 runs before the others (no GPU promises an order between blocks):
// block 0 writes *flag; every other block b copies it to out[b]. Correct only in index order.
extern "C" __global__ void sim_block_zero_first(int* flag, int* out) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) *flag = 1;
    else out[blockIdx.x] = *reinterpret_cast<volatile int*>(flag);
}

// "The last block to arrive sums the partials", as a split reduction writes it: each block of
// 64 threads sums its 1024 values of `in` (shared memory, barriers), then its thread 0
// publishes the block's partial and announces its arrival on *counter; the block whose
// announcement is the last sums the partials into *out (the sum of `in`) and resets the counter.
// `ANNOUNCE_FIRST` plants the defect: the announcement before the write, a window of two
// instructions in which the last block can read a partial not yet written. Blocks run one
// after another never show it (each block ends before the next starts); blocks running at
// once show it when the pause after an atomic (a preemption point) keeps a block inside its
// window while the last one reads.
template <bool ANNOUNCE_FIRST>
__device__ void last_block_sums(const float* in, float* partials, unsigned* counter, float* out) {
    __shared__ float s[64];
    const unsigned t = threadIdx.x, b = blockIdx.x;
    float acc = 0.0f;
    for (unsigned i = t; i < 1024; i += 64) acc += in[b * 1024 + i];
    s[t] = acc;
    __syncthreads();
    for (unsigned w = 32; w > 0; w >>= 1) {
        if (t < w) s[t] += s[t + w];
        __syncthreads();
    }
    if (t != 0) return;
    unsigned arrived;
    if (ANNOUNCE_FIRST) {
        arrived = atomicAdd(counter, 1u);
        partials[b] = s[0];
    } else {
        partials[b] = s[0];
        __threadfence();
        arrived = atomicAdd(counter, 1u);
    }
    if (arrived == gridDim.x - 1) {
        __threadfence();
        float sum = 0.0f;
        for (unsigned k = 0; k < gridDim.x; k++) sum += *(volatile float*)&partials[k];
        *out = sum;
        *counter = 0;
    }
}
extern "C" __global__ void sim_announce_before_writing(const float* in, float* partials,
                                                       unsigned* counter, float* out) {
    last_block_sums<true>(in, partials, counter, out);
}
extern "C" __global__ void sim_announce_after_writing(const float* in, float* partials,
                                                      unsigned* counter, float* out) {
    last_block_sums<false>(in, partials, counter, out);
}

// Reads a static shared variable before any thread of its block wrote it, then writes it:
// undefined on a GPU (shared memory holds anything at a block's start). out[b] gets what block
// b read: on one OS thread, blocks one after another, the previous block's 7 unless the
// emulator poisons static shared memory at every block start.
extern "C" __global__ void sim_static_shared_read_first(int* out) {
    __shared__ int s;
    if (threadIdx.x == 0) {
        out[blockIdx.x] = s;
        s = 7;
    }
}

// Reads a float4 at in + 1, 4 bytes past a 16-byte boundary: a misaligned vector load, which
// faults on a GPU (and which x86 would perform).
extern "C" __global__ void sim_misaligned_vector_load(const float* in, float* out) {
    if (threadIdx.x != 0) return;
    float4 v = *reinterpret_cast<const float4*>(in + 1);
    out[0] = v.x + v.y + v.z + v.w;
}
