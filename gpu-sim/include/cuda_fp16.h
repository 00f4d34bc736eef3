// Stand-in for NVIDIA's cuda_fp16.h in the simulated GPU: __half and its intrinsics come from
// the emulator's headers (tests/emu/emu_half.h, through cuda_emu.h).
#pragma once
#include "cuda_emu.h"
