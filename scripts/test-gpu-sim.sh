#!/usr/bin/env bash
# The GPU half on simulated GPUs (gpu-sim/README.md), no GPU needed: the simulator's
# self-tests, then every `cuda::` test variant (under three thread schedules, one with each
# launch's blocks on 4 OS threads), tests/cuda.rs (also on 4 block threads under two seeds),
# the launch counts of tests/gpu_counts.rs,
# tests/nccl.rs and tests/nccl_faults.rs (the simulated NCCL) on 4 GPUs, tests/nccl.rs on 8
# and with one collective at a time per GPU, the cuda_startup example, the ResNet
# example on `--device cuda` (4 thread ranks on one simulated GPU) with its `--check`, and the
# README's NCCL commands at tiny sizes on 8 GPUs: `--backend nccl --world-size 8 --check` in
# f32 and bf16 with accumulation and several buckets, a stop and `--resume`, and
# `torchrun --nproc_per_node 8` (torchrun from TORCH_VENV).
# Builds the simulator and the cuda,nccl binaries in target/cuda with the flags of
# scripts/check-cuda.sh (so that CI builds them once). GPU_SIM_DEVICES sets the number of
# simulated GPUs (default 4); the 8-GPU steps set 8.
#
# 8 simulated GPUs in one process hold tens of thousands of simulated allocations, each two or
# three host memory mappings: the kernel's per-process limit (vm.max_map_count, 65530 by
# default) must be at least 262144 (`sysctl -w vm.max_map_count=262144` as root; CI sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
maps=$(cat /proc/sys/vm/max_map_count)
if [ "$maps" -lt 262144 ]; then
    echo "FAIL: vm.max_map_count is $maps; 8 simulated GPUs need 262144 (sysctl -w vm.max_map_count=262144, as root)"
    exit 1
fi
. scripts/cuda-build-env.sh

echo "-- build the simulator and its self-tests"
gpu-sim/build.sh selftest
. scripts/gpu-sim-env.sh
out=$GPU_SIM_OUT

echo "-- the simulator's self-tests: planted defects and driver rules"
GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" "$out/bin/selftest" "$out/ptx/test_defects.ptx"
# quietly LOG CMD...: runs a self-test with its output in $out/LOG.log; prints its last line,
# or all of it when it fails.
quietly() {
    local log="$out/$1.log"
    shift
    "$@" >"$log" 2>&1 || { cat "$log"; exit 1; }
    tail -1 "$log"
}
for schedule in reverse random:7; do
    echo "-- the same with blocks and threads in the order GPU_SIM_SCHEDULE=$schedule"
    GPU_SIM_SCHEDULE=$schedule GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" \
        quietly "selftest-$schedule" "$out/bin/selftest" "$out/ptx/test_defects.ptx"
done
echo "-- the same with the blocks of a launch on 4 OS threads (GPU_SIM_BLOCK_THREADS=4), in each order"
for schedule in forward reverse random:7; do
    GPU_SIM_BLOCK_THREADS=4 GPU_SIM_SCHEDULE=$schedule GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" \
        quietly "selftest-threads-$schedule" "$out/bin/selftest" "$out/ptx/test_defects.ptx"
done
echo "-- the same with freed stream-ordered memory reused (GPU_SIM_REUSE=1)"
GPU_SIM_REUSE=1 GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" \
    quietly selftest-reuse "$out/bin/selftest" "$out/ptx/test_defects.ptx"
echo "-- the same checks with kernels skipped (GPU_SIM_SKIP_KERNELS=1, for host-cost timing)"
GPU_SIM_SKIP_KERNELS=1 GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" "$out/bin/selftest" "$out/ptx/test_defects.ptx" skip
"$out/bin/half_math"
"$out/bin/blas_ref"
"$out/bin/rand_ref"
"$out/bin/blas_sim"
"$out/bin/nccl_selftest"
for damage in finite nan none; do
    echo "-- nccl_selftest with GPU_SIM_NCCL_ABORT_DAMAGE=$damage"
    GPU_SIM_NCCL_ABORT_DAMAGE=$damage quietly "nccl-$damage" "$out/bin/nccl_selftest"
done
echo "-- nccl_selftest with one collective at a time per device (GPU_SIM_NCCL_PROGRESS=device)"
GPU_SIM_NCCL_PROGRESS=device quietly nccl-device "$out/bin/nccl_selftest"

echo "-- the executor's rate on a barrier-free kernel (for the record, not a test)"
GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" "$out/bin/selftest" "$out/ptx/test_defects.ptx" bench

echo "-- build the cuda,nccl test and example binaries"
cargo test --features $features --tests --examples --no-run -q

echo "-- every cuda:: test variant, on simulated GPUs (one gated: see gpu-sim/README.md), with blocks and threads in index order, reversed and in a seeded random order"
# Gated: ResNet-18/34/50 at 32x32 for several steps, tens of millions of parameters through
# element-wise kernels one emulated thread each (minutes per model here).
# The random order also with each launch's blocks on 4 OS threads at once.
for schedule in forward reverse random:7; do
    threads=1
    [ "$schedule" = random:7 ] && threads=4
    echo "   GPU_SIM_SCHEDULE=$schedule GPU_SIM_BLOCK_THREADS=$threads"
    GPU_SIM_SCHEDULE=$schedule GPU_SIM_BLOCK_THREADS=$threads cargo test --features $features \
        --tests -q -- cuda:: --skip cuda::torchvision_models_train
done

echo "-- tests/cuda.rs and tests/gpu_counts.rs, on simulated GPUs"
cargo test --features $features --test cuda --test gpu_counts -q
# The split reductions' "last block sums the partials" protocol in every dtype and both
# layouts, with the blocks of each launch on 4 OS threads meeting at preemption points.
for seed in 7 11; do
    echo "-- tests/cuda.rs with each launch's blocks on 4 OS threads, GPU_SIM_SCHEDULE=random:$seed"
    GPU_SIM_BLOCK_THREADS=4 GPU_SIM_SCHEDULE=random:$seed cargo test --features $features \
        --test cuda -q
done

echo "-- tests/nccl.rs and tests/nccl_faults.rs on 4 simulated GPUs and the simulated NCCL"
GPU_SIM_DEVICES=4 cargo test --features $features --test nccl --test nccl_faults -q
echo "-- tests/nccl.rs on 8 simulated GPUs (an 8-GPU node's world size)"
GPU_SIM_DEVICES=8 cargo test --features $features --test nccl -q
# The rollback and recovery tests again, under every damage an aborted collective can leave
# (the runs above: the default, `partial`) and with freed memory reused with its contents.
for damage in finite nan none; do
    echo "-- the recovery tests with GPU_SIM_NCCL_ABORT_DAMAGE=$damage"
    GPU_SIM_DEVICES=4 GPU_SIM_NCCL_ABORT_DAMAGE=$damage cargo test --features $features \
        --test nccl -q -- abort rolls_back drop_with missing outlives
    GPU_SIM_DEVICES=4 GPU_SIM_NCCL_ABORT_DAMAGE=$damage cargo test --features $features \
        --test nccl_faults -q
done
# One collective at a time per GPU in issue order: what NCCL's kernels may do when they occupy
# the GPU. Tests one at a time (cargo's parallel tests share the GPUs, and their communicators'
# collectives would interleave). Covers the parallel layers beside DataParallel, and the
# example's --check over NCCL.
echo "-- tests/nccl.rs with one collective at a time per GPU (GPU_SIM_NCCL_PROGRESS=device), one test at a time"
GPU_SIM_DEVICES=4 GPU_SIM_NCCL_PROGRESS=device cargo test --features $features --test nccl -q \
    -- --test-threads=1
echo "-- the NCCL suites with freed stream-ordered memory reused (GPU_SIM_REUSE=1)"
GPU_SIM_DEVICES=4 GPU_SIM_REUSE=1 cargo test --features $features --test nccl --test nccl_faults -q

echo "-- examples/cuda_startup, on a simulated GPU"
cargo run --features $features -q --example cuda_startup

echo "-- examples/resnet --device cuda --world-size 4 (tiny), then its --check"
resnet_out=$(mktemp -d)
trap 'rm -rf "$resnet_out"' EXIT
tiny=(--device cuda --world-size 4 --image-size 8 --train-size 64 --val-size 32 --batch-size 16)
cargo run --features $features -q --example resnet -- "${tiny[@]}" --epochs 1 --out-dir "$resnet_out"
cargo run --features $features -q --example resnet -- "${tiny[@]}" --check --check-steps 2 \
    --out-dir "$resnet_out/check"

echo "-- the README's NCCL commands, tiny, on 8 simulated GPUs: --check in f32 and bf16 with --accumulate 2 and 0.1 MiB buckets, a run stopped after its first epoch and resumed, then torchrun with 8 processes"
small=(--image-size 8 --train-size 64 --val-size 32 --batch-size 16)
for precision in f32 bf16; do
    GPU_SIM_DEVICES=8 cargo run --features $features -q --example resnet -- --backend nccl \
        --world-size 8 "${small[@]}" --precision $precision --accumulate 2 --bucket-mb 0.1 \
        --check --check-steps 2 --out-dir "$resnet_out/nccl-check-$precision"
done
resume=(--backend nccl --world-size 8 "${small[@]}" --epochs 2 --bucket-mb 0.1
    --out-dir "$resnet_out/nccl-resume")
GPU_SIM_DEVICES=8 cargo run --features $features -q --example resnet -- "${resume[@]}" \
    --stop-after-epoch 1 >/dev/null
summary=$(GPU_SIM_DEVICES=8 cargo run --features $features -q --example resnet -- \
    "${resume[@]}" --resume "$resnet_out/nccl-resume" | tail -1)
echo "$summary"
python3 - "$summary" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
assert s["world_size"] == 8 and s["epochs"] == 2, f"the resumed run did not end after 2 epochs on 8 ranks: {s}"
PY
# torchrun from the PyTorch that scripts/test-torch.sh installs (TORCH_VENV); only the ranks
# get the simulated libraries (PyTorch's own CUDA build would otherwise load them).
torchrun="${TORCH_VENV:-.venv-torch}/bin/torchrun"
if [ -x "$torchrun" ]; then
    torchrun=$(realpath "$torchrun")
    resnet=$(realpath "$CARGO_TARGET_DIR/debug/examples/resnet")
    summary=$(cd "$resnet_out" && LD_LIBRARY_PATH= "$torchrun" --nproc_per_node 8 --no-python \
        env LD_LIBRARY_PATH="$LD_LIBRARY_PATH" GPU_SIM_DEVICES=8 "$resnet" --backend nccl "${small[@]}" \
        --epochs 1 --out-dir "$resnet_out/torchrun" | tail -1)
    echo "$summary"
    grep -q '"world_size":8' <<<"$summary" || { echo "FAIL: torchrun's run did not report 8 ranks"; exit 1; }
    echo "-- a hang across processes under PyTorch's TCPStore: the timed-out rank names the rank behind from its progress reports"
    # The venv's python by its own path (resolving its link would leave the venv).
    TORCH_PYTHON="$(cd "${TORCH_VENV:-.venv-torch}" && pwd)/bin/python" GPU_SIM_DEVICES=4 cargo test \
        --features $features --test nccl_faults -q -- --ignored --exact \
        a_hang_report_across_processes_names_the_rank_behind
    echo "-- torchrun --max-restarts 2 with --resume auto: rank 1 exits after step 3 of 4, torchrun restarts the group, which resumes from step 2's checkpoint and ends with the uninterrupted run's checkpoint, bit for bit"
    restart=(--backend nccl "${small[@]}" --epochs 1 --save-every 2 --resume auto)
    launch() { # out-dir, extra arguments
        (cd "$resnet_out" && LD_LIBRARY_PATH= "$torchrun" --nproc_per_node 8 --max-restarts 2 \
            --no-python env LD_LIBRARY_PATH="$LD_LIBRARY_PATH" GPU_SIM_DEVICES=8 "$resnet" \
            "${restart[@]}" --out-dir "$1" "${@:2}")
    }
    launch "$resnet_out/restart-straight" | tail -1
    log=$(launch "$resnet_out/restart-killed" --exit-at-step 3 2>&1)
    echo "$log" | grep -E "exiting after step|resuming from|world_size" | tail -n 5
    grep -q "rank 1: exiting after step 3" <<<"$log" || { echo "FAIL: rank 1 did not exit"; exit 1; }
    grep -q "resuming from .*: epoch 0, step 2" <<<"$log" ||
        { echo "FAIL: the restarted group did not resume from step 2's checkpoint"; exit 1; }
    python3 scripts/same_checkpoint.py "$resnet_out/restart-straight" "$resnet_out/restart-killed" \
        "the restarted run"
elif [ -n "${GPU_SIM_SKIP_TORCHRUN:-}" ]; then
    echo "torchrun: skipped (GPU_SIM_SKIP_TORCHRUN set)"
else
    echo "FAIL: no torchrun at $torchrun: run scripts/test-torch.sh first (or set GPU_SIM_SKIP_TORCHRUN=1)"
    exit 1
fi

echo "-- the simulated GPU suites took $((SECONDS - started)) s"
