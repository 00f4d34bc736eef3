# Sourced: the environment in which the `cuda,nccl` binaries are built without a GPU, shared by
# scripts/check-cuda.sh, scripts/test-gpu-sim.sh and scripts/plant-defects.sh so that they
# build them once: nvcc 13.0 from PyPI (scripts/nvcc-env.sh), the stub CUDA libraries to link
# against (scripts/cuda-stubs.sh), sm_80 and CUDA 13.0 unless set, target/cuda unless
# CARGO_TARGET_DIR is set; `features` names the feature set.
. scripts/nvcc-env.sh || return 1
. scripts/cuda-stubs.sh || return 1
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80} CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
features=cuda,nccl
