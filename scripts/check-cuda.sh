#!/usr/bin/env bash
# Type-checks and lints the `cuda` and `nccl` features, all targets (library, tests/cuda.rs,
# examples/gpu_bench.rs), with nvcc 13.0 from PyPI: build.rs compiles kernels/*.cu to PTX on the
# way. Linking needs libcuda (a GPU driver), so nothing is linked or run here.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/nvcc-env.sh
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80} CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
cargo clippy --features cuda,nccl --all-targets -- -D warnings
