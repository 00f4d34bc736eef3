// Stand-in for NVIDIA's cuda_fp8.h in the simulated GPU: __nv_fp8_e4m3, __nv_fp8_e5m2 and the
// __nv_cvt_* conversions come from the emulator's tests/emu/emu_fp8.h.
#pragma once
#include "cuda_emu.h"
#include "emu_fp8.h"
