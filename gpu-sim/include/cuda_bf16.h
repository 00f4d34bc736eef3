// Stand-in for NVIDIA's cuda_bf16.h in the simulated GPU: __nv_bfloat16 and its intrinsics come
// from the emulator's headers (tests/emu/emu_half.h, through cuda_emu.h).
#pragma once
#include "cuda_emu.h"
