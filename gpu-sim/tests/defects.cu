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

// "The last block to arrive adds the partials", with the defect that a block announces its
// arrival (counter[0]) before writing its partial, so the last block can read one not yet
// written. Blocks run one after another never show it (each block ends before the next
// starts); blocks running at once do, whatever their order: a block that is not the last
// lingers between announcing and writing until the last block has read (counter[1]), or for a
// bounded time (alone on its thread, it writes then). Thread 0 of each block only; `out` gets
// the sum of partials b + 1, that is n(n + 1)/2 for n blocks when correct.
extern "C" __global__ void sim_announce_before_writing(float* partials, unsigned* counter,
                                                       float* out) {
    if (threadIdx.x != 0) return;
    unsigned arrived = atomicAdd(&counter[0], 1u);
    if (arrived != gridDim.x - 1)
        for (long i = 0; i < 200000000L && *(volatile unsigned*)&counter[1] == 0; i++) {
        }
    partials[blockIdx.x] = float(blockIdx.x + 1);
    if (arrived == gridDim.x - 1) {
        float s = 0.0f;
        for (unsigned b = 0; b < gridDim.x; b++) s += *(volatile float*)&partials[b];
        *out = s;
        atomicExch(&counter[1], 1u);
    }
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
