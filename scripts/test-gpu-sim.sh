#!/usr/bin/env bash
# The GPU half on simulated GPUs (gpu-sim/README.md), no GPU needed: the simulator's
# self-tests, then every `cuda::` test variant (under three thread schedules, one with each
# launch's blocks on 4 OS threads; the ResNet example's under the first only), the suites of the
# layer, max-pool, convolution and data-parallel loop again on the composite path
# (CANDLE_DISTRIBUTED_COMPOSITE=1, with tests/nccl.rs on 4 GPUs), tests/cuda.rs (also on 4 block threads under two seeds),
# the launch counts of tests/gpu_counts.rs,
# tests/nccl.rs and tests/nccl_faults.rs (the simulated NCCL) on 4 GPUs with freed memory
# reused, tests/nccl.rs on 8 (but its ResNet test), under each damage an aborted collective can
# leave, and with one collective at a time per GPU, the cuda_startup example, the ResNet
# example on `--device cuda` (4 thread ranks on one simulated GPU) with its `--check`, and the
# README's NCCL commands at tiny sizes on 8 GPUs: `--backend nccl --world-size 8 --check` in
# f32 and bf16 with accumulation and several buckets, a stop and `--resume`, and
# `torchrun --nproc_per_node 8` (torchrun from TORCH_VENV), and scripts/test-gpu.sh and
# scripts/bench-gpu.sh rehearsed (`--rehearse`: every step at small sizes; the benchmarks with
# kernels skipped and PyTorch from TORCH_VENV on the CPU);
# a worker's crash under torchrun's restarts is rehearsed across two machines by
# scripts/test-two-nodes.sh.
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

echo "-- [$((SECONDS - started)) s] build the simulator and its self-tests"
gpu-sim/build.sh selftest
. scripts/gpu-sim-env.sh
out=$GPU_SIM_OUT

echo "-- [$((SECONDS - started)) s] the simulator's self-tests: planted defects and driver rules"
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
    echo "-- [$((SECONDS - started)) s] the same with blocks and threads in the order GPU_SIM_SCHEDULE=$schedule"
    GPU_SIM_SCHEDULE=$schedule GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" \
        quietly "selftest-$schedule" "$out/bin/selftest" "$out/ptx/test_defects.ptx"
done
echo "-- [$((SECONDS - started)) s] the same with the blocks of a launch on 4 OS threads (GPU_SIM_BLOCK_THREADS=4), in each order"
for schedule in forward reverse random:7; do
    GPU_SIM_BLOCK_THREADS=4 GPU_SIM_SCHEDULE=$schedule GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" \
        quietly "selftest-threads-$schedule" "$out/bin/selftest" "$out/ptx/test_defects.ptx"
done
echo "-- [$((SECONDS - started)) s] the same with freed stream-ordered memory reused (GPU_SIM_REUSE=1)"
GPU_SIM_REUSE=1 GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" \
    quietly selftest-reuse "$out/bin/selftest" "$out/ptx/test_defects.ptx"
echo "-- [$((SECONDS - started)) s] the same checks with kernels skipped (GPU_SIM_SKIP_KERNELS=1, for host-cost timing)"
GPU_SIM_SKIP_KERNELS=1 GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" "$out/bin/selftest" "$out/ptx/test_defects.ptx" skip
"$out/bin/half_math"
"$out/bin/blas_ref"
"$out/bin/rand_ref"
"$out/bin/blas_sim"
"$out/bin/nccl_selftest"
for damage in finite nan none; do
    echo "-- [$((SECONDS - started)) s] nccl_selftest with GPU_SIM_NCCL_ABORT_DAMAGE=$damage"
    GPU_SIM_NCCL_ABORT_DAMAGE=$damage quietly "nccl-$damage" "$out/bin/nccl_selftest"
done
echo "-- [$((SECONDS - started)) s] nccl_selftest with one collective at a time per device (GPU_SIM_NCCL_PROGRESS=device)"
GPU_SIM_NCCL_PROGRESS=device quietly nccl-device "$out/bin/nccl_selftest"

echo "-- [$((SECONDS - started)) s] the executor's rate on a barrier-free kernel (for the record, not a test)"
GPU_SIM_KERNELS="$GPU_SIM_KERNELS:$out/test-kernels" "$out/bin/selftest" "$out/ptx/test_defects.ptx" bench

echo "-- [$((SECONDS - started)) s] build the cuda,nccl test and example binaries"
cargo test --features $features --tests --examples --no-run -q

echo "-- [$((SECONDS - started)) s] every cuda:: test variant, on simulated GPUs (one gated: see gpu-sim/README.md), with blocks and threads in index order, reversed and in a seeded random order"
# Gated: ResNet-18/34/50 at 32x32 for several steps, tens of millions of parameters through
# element-wise kernels one emulated thread each (minutes per model here).
# The random order also with each launch's blocks on 4 OS threads at once.
# The ResNet example's two cuda:: tests (4 thread ranks on one GPU against one process) in index
# order only: three quarters of each run, and their kernels are the ones the other tests run
# under every order.
resnet_tests=(--skip equivalence::cuda::check_passes_for_a_tiny_model
    --skip equivalence::cuda::uneven_last_batch_and_accumulation_match_one_process)
for schedule in forward reverse random:7; do
    threads=1 skip=()
    [ "$schedule" = random:7 ] && threads=4
    [ "$schedule" = forward ] || skip=("${resnet_tests[@]}")
    echo "   [$((SECONDS - started)) s] GPU_SIM_SCHEDULE=$schedule GPU_SIM_BLOCK_THREADS=$threads"
    GPU_SIM_SCHEDULE=$schedule GPU_SIM_BLOCK_THREADS=$threads cargo test --features $features \
        --tests -q -- cuda:: --skip cuda::torchvision_models_train "${skip[@]}"
done

echo "-- [$((SECONDS - started)) s] tests/cuda.rs and tests/gpu_counts.rs, on simulated GPUs"
cargo test --features $features --test cuda --test gpu_counts -q
# The split reductions' "last block sums the partials" protocol in every dtype and both
# layouts, with the blocks of each launch on 4 OS threads meeting at preemption points.
for seed in 7 11; do
    echo "-- [$((SECONDS - started)) s] tests/cuda.rs with each launch's blocks on 4 OS threads, GPU_SIM_SCHEDULE=random:$seed"
    GPU_SIM_BLOCK_THREADS=4 GPU_SIM_SCHEDULE=random:$seed cargo test --features $features \
        --test cuda -q
done

# The composite path (candle's CUDA ops in place of the crate's kernels, as on a device without
# them): the same test bodies and tolerances. Not tests/cuda.rs or tests/gpu_counts.rs, which
# test the kernels themselves.
echo "-- [$((SECONDS - started)) s] the composite path forced (CANDLE_DISTRIBUTED_COMPOSITE=1): the cuda:: variants of the layer's, max-pool's, convolution's and data-parallel suites, then tests/nccl.rs on 4 simulated GPUs"
CANDLE_DISTRIBUTED_COMPOSITE=1 cargo test --features $features -q --test equivalence \
    --test finite_differences --test precision --test non_finite --test errors --test max_pool \
    --test conv --test overlap --test data_parallel --test async_failure --test async_writes \
    --test parallel --test contrastive -- cuda::
GPU_SIM_DEVICES=4 CANDLE_DISTRIBUTED_COMPOSITE=1 cargo test --features $features --test nccl -q -- \
    --skip resnet_example_checks_and_trains_over_nccl

# With freed stream-ordered memory reused with its contents (GPU_SIM_REUSE=1): the runs below
# that do not set it (8 GPUs, every damage, one collective at a time) cover the fresh memory.
echo "-- [$((SECONDS - started)) s] tests/nccl.rs and tests/nccl_faults.rs on 4 simulated GPUs and the simulated NCCL, with freed stream-ordered memory reused (GPU_SIM_REUSE=1)"
GPU_SIM_DEVICES=4 GPU_SIM_REUSE=1 cargo test --features $features --test nccl --test nccl_faults -q
# The ResNet example over NCCL at 8 GPUs runs below, as the README's commands.
echo "-- [$((SECONDS - started)) s] tests/nccl.rs on 8 simulated GPUs (an 8-GPU node's world size; the ResNet test: the README's commands below)"
GPU_SIM_DEVICES=8 cargo test --features $features --test nccl -q -- \
    --skip resnet_example_checks_and_trains_over_nccl
# The rollback and recovery tests again, under every damage an aborted collective can leave
# (the runs above: the default, `partial`) and with freed memory reused with its contents.
for damage in finite nan none; do
    echo "-- [$((SECONDS - started)) s] the recovery tests with GPU_SIM_NCCL_ABORT_DAMAGE=$damage"
    GPU_SIM_DEVICES=4 GPU_SIM_NCCL_ABORT_DAMAGE=$damage cargo test --features $features \
        --test nccl -q -- abort rolls_back drop_with missing outlives
    GPU_SIM_DEVICES=4 GPU_SIM_NCCL_ABORT_DAMAGE=$damage cargo test --features $features \
        --test nccl_faults -q
done
# One collective at a time per GPU in issue order: what NCCL's kernels may do when they occupy
# the GPU. Tests one at a time (cargo's parallel tests share the GPUs, and their communicators'
# collectives would interleave). Covers the parallel layers beside DataParallel, and the
# example's --check over NCCL.
echo "-- [$((SECONDS - started)) s] tests/nccl.rs with one collective at a time per GPU (GPU_SIM_NCCL_PROGRESS=device), one test at a time"
GPU_SIM_DEVICES=4 GPU_SIM_NCCL_PROGRESS=device cargo test --features $features --test nccl -q \
    -- --test-threads=1

echo "-- [$((SECONDS - started)) s] examples/cuda_startup, on a simulated GPU"
cargo run --features $features -q --example cuda_startup

echo "-- [$((SECONDS - started)) s] examples/resnet --device cuda --world-size 4 (tiny), then its --check"
resnet_out=$(mktemp -d)
trap 'rm -rf "$resnet_out"' EXIT
tiny=(--device cuda --world-size 4 --image-size 8 --train-size 64 --val-size 32 --batch-size 16)
cargo run --features $features -q --example resnet -- "${tiny[@]}" --epochs 1 --out-dir "$resnet_out"
cargo run --features $features -q --example resnet -- "${tiny[@]}" --check --check-steps 2 \
    --out-dir "$resnet_out/check"

echo "-- [$((SECONDS - started)) s] the README's NCCL commands, tiny, on 8 simulated GPUs: --check in f32 and bf16 with --accumulate 2 and 0.1 MiB buckets, a run stopped after its first epoch and resumed, then torchrun with 8 processes"
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
    echo "-- [$((SECONDS - started)) s] a hang across processes under PyTorch's TCPStore: the timed-out rank names the rank behind from its progress reports"
    # The venv's python by its own path (resolving its link would leave the venv).
    TORCH_PYTHON="$(cd "${TORCH_VENV:-.venv-torch}" && pwd)/bin/python" GPU_SIM_DEVICES=4 cargo test \
        --features $features --test nccl_faults -q -- --ignored --exact \
        a_hang_report_across_processes_names_the_rank_behind
    echo "-- [$((SECONDS - started)) s] scripts/test-gpu.sh and scripts/bench-gpu.sh rehearsed on 2 simulated GPUs: every step, the test binaries listing their tests, the example's checks and the benchmarks at small sizes (kernels skipped in the benchmarks, PyTorch on the CPU: the figures are not a GPU's)"
    # The folder the scripts take from --build-only, of this build's binaries (links).
    gpu_bins="$resnet_out/gpu-bins"
    (. scripts/gpu-bins.sh && GPU_BINS_PROFILE=dev GPU_BINS_TARGET="$CARGO_TARGET_DIR" GPU_BINS_LINK=1 \
        gpu_build_into "$gpu_bins" --tests --example resnet --example gpu_bench --example host_cost -q)
    TEST_GPU_LOGS="$resnet_out/test-gpu-logs" scripts/test-gpu.sh --rehearse --bin-dir "$gpu_bins"
    TORCH_PYTHON="$(cd "${TORCH_VENV:-.venv-torch}" && pwd)/bin/python" \
        BENCH_GPU_LOGS="$resnet_out/bench-gpu-logs" scripts/bench-gpu.sh --rehearse --bin-dir "$gpu_bins"
    # The rehearsal's strictness, planted: a case PyTorch's side lacks must fail the table.
    sed '1d' "$resnet_out/bench-gpu-logs/torch.jsonl" >"$resnet_out/torch-less.jsonl"
    if python3 scripts/bench_gpu_table.py --strict "$resnet_out/bench-gpu-logs/ours.jsonl" \
        "$resnet_out/torch-less.jsonl" >/dev/null; then
        echo "FAIL: bench_gpu_table.py --strict accepted a case measured on one side only"
        exit 1
    fi
elif [ -n "${GPU_SIM_SKIP_TORCHRUN:-}" ]; then
    echo "torchrun: skipped (GPU_SIM_SKIP_TORCHRUN set)"
else
    echo "FAIL: no torchrun at $torchrun: run scripts/test-torch.sh first (or set GPU_SIM_SKIP_TORCHRUN=1)"
    exit 1
fi

echo "-- the simulated GPU suites took $((SECONDS - started)) s"
