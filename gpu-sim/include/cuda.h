// Stand-in for NVIDIA's cuda.h in the simulated GPU: only the toolkit version (13.0), which
// kernels test to pick code paths; no driver API.
#pragma once
#ifndef CUDA_VERSION
#define CUDA_VERSION 13000
#endif
