#!/usr/bin/env bash
# The GPU half on simulated GPUs (gpu-sim/README.md), no GPU needed: the simulator's
# self-tests, then every `cuda::` test variant, tests/cuda.rs, the launch counts of
# tests/gpu_counts.rs, tests/nccl.rs and tests/nccl_faults.rs (the simulated NCCL), the
# cuda_startup example, the ResNet example on `--device cuda` (4 thread ranks on one simulated
# GPU) with its `--check`, and the README's NCCL commands at tiny sizes: `--backend nccl
# --world-size 4 --check` and `torchrun --nproc_per_node 2` (torchrun from TORCH_VENV).
# Builds the simulator and the cuda,nccl binaries in target/cuda with the flags of
# scripts/check-cuda.sh (so that CI builds them once). GPU_SIM_DEVICES sets the number of
# simulated GPUs (default 4).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
. scripts/nvcc-env.sh
. scripts/cuda-stubs.sh
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80} CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
features=cuda,nccl

echo "-- build the simulator and its self-tests"
gpu-sim/build.sh selftest
. scripts/gpu-sim-env.sh
out=$GPU_SIM_OUT

echo "-- the simulator's self-tests: planted defects and driver rules"
GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" "$out/bin/selftest" "$out/ptx/test_defects.ptx"
echo "-- the same checks with kernels skipped (GPU_SIM_SKIP_KERNELS=1, for host-cost timing)"
GPU_SIM_SKIP_KERNELS=1 GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" "$out/bin/selftest" "$out/ptx/test_defects.ptx" skip
"$out/bin/half_math"
"$out/bin/blas_ref"
"$out/bin/rand_ref"
"$out/bin/blas_sim"
"$out/bin/nccl_selftest"

echo "-- the executor's rate on a barrier-free kernel (for the record, not a test)"
GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" "$out/bin/selftest" "$out/ptx/test_defects.ptx" bench

echo "-- build the cuda,nccl test and example binaries"
cargo test --features $features --tests --examples --no-run -q

echo "-- every cuda:: test variant, on simulated GPUs (one gated: see gpu-sim/README.md)"
# Gated: ResNet-18/34/50 at 32x32 for several steps, tens of millions of parameters through
# element-wise kernels one emulated thread each (minutes per model here).
cargo test --features $features --tests -q -- cuda:: --skip cuda::torchvision_models_train

echo "-- tests/cuda.rs and tests/gpu_counts.rs, on simulated GPUs"
cargo test --features $features --test cuda --test gpu_counts -q

echo "-- tests/nccl.rs and tests/nccl_faults.rs on 4 simulated GPUs and the simulated NCCL"
GPU_SIM_DEVICES=4 cargo test --features $features --test nccl --test nccl_faults -q

echo "-- examples/cuda_startup, on a simulated GPU"
cargo run --features $features -q --example cuda_startup

echo "-- examples/resnet --device cuda --world-size 4 (tiny), then its --check"
resnet_out=$(mktemp -d)
trap 'rm -rf "$resnet_out"' EXIT
tiny=(--device cuda --world-size 4 --image-size 8 --train-size 64 --val-size 32 --batch-size 16)
cargo run --features $features -q --example resnet -- "${tiny[@]}" --epochs 1 --out-dir "$resnet_out"
cargo run --features $features -q --example resnet -- "${tiny[@]}" --check --check-steps 2 \
    --out-dir "$resnet_out/check"

echo "-- the README's NCCL commands, tiny: --backend nccl --world-size 4 --check, then torchrun"
small=(--image-size 8 --train-size 64 --val-size 32 --batch-size 16)
GPU_SIM_DEVICES=4 cargo run --features $features -q --example resnet -- --backend nccl \
    --world-size 4 "${small[@]}" --check --check-steps 2 --out-dir "$resnet_out/nccl-check"
# torchrun from the PyTorch that scripts/test-torch.sh installs (TORCH_VENV); only the ranks
# get the simulated libraries (PyTorch's own CUDA build would otherwise load them).
torchrun="${TORCH_VENV:-.venv-torch}/bin/torchrun"
if [ -x "$torchrun" ]; then
    torchrun=$(realpath "$torchrun")
    resnet=$(realpath "$CARGO_TARGET_DIR/debug/examples/resnet")
    summary=$(cd "$resnet_out" && LD_LIBRARY_PATH= "$torchrun" --nproc_per_node 2 --no-python \
        env LD_LIBRARY_PATH="$LD_LIBRARY_PATH" "$resnet" --backend nccl "${small[@]}" \
        --epochs 1 --out-dir "$resnet_out/torchrun" | tail -1)
    echo "$summary"
    grep -q '"world_size":2' <<<"$summary" || { echo "FAIL: torchrun's run did not report 2 ranks"; exit 1; }
elif [ -n "${GPU_SIM_SKIP_TORCHRUN:-}" ]; then
    echo "torchrun: skipped (GPU_SIM_SKIP_TORCHRUN set)"
else
    echo "FAIL: no torchrun at $torchrun: run scripts/test-torch.sh first (or set GPU_SIM_SKIP_TORCHRUN=1)"
    exit 1
fi

echo "-- the simulated GPU suites took $((SECONDS - started)) s"
