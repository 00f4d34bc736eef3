# Sourced: builds the simulated GPU (gpu-sim/build.sh; only what changed) and sets the
# environment so that any binary built with `--features cuda,nccl` runs on simulated GPUs:
# LD_LIBRARY_PATH puts the simulated libcuda.so.1, libcublas.so.13, libcurand.so.10, ...
# first; GPU_SIM_DEVICES (default 4) sets the number of devices; GPU_SIM_KERNELS names the
# kernel libraries. The simulator's rules and blind spots: gpu-sim/README.md.
_gpu_sim_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$_gpu_sim_root/gpu-sim/build.sh" || return 1
export GPU_SIM_OUT=${GPU_SIM_OUT:-$_gpu_sim_root/target/gpu-sim}
export GPU_SIM_DEVICES=${GPU_SIM_DEVICES:-4}
export GPU_SIM_KERNELS="$GPU_SIM_OUT/kernels"
export LD_LIBRARY_PATH="$GPU_SIM_OUT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset _gpu_sim_root
