#!/usr/bin/env bash
# Validates the crate on this machine's real NVIDIA GPUs and prints one summary table:
#   - tests/cuda.rs and tests/nccl.rs (NCCL with one rank per GPU present);
#   - every `cuda::` variant of the device tests, the torchvision models included;
#   - the ResNet example's --check over NCCL on every GPU (--world-size = the GPU count), in
#     f32 and bf16, with gradient accumulation and several buckets, and built with the `cudnn`
#     feature (candle's cuDNN convolutions; needs cuDNN 9);
#   - compute-sanitizer's memcheck, racecheck and synccheck over tests/cuda.rs, where it is
#     installed.
#
#   scripts/test-gpu.sh                    # on a GPU machine with Rust: builds, then runs
#   scripts/test-gpu.sh --build-only DIR   # on any machine (no GPU, no driver needed): builds
#                                          # the binaries into DIR/binaries.tar.zst (stripped;
#                                          # one zstd --long stream: ~58 MB for all of them)
#   scripts/test-gpu.sh --bin-dir DIR      # on a GPU machine without Rust: runs DIR's binaries
#                                          # (unpacks binaries.tar.zst with zstd, or *.xz)
#   scripts/test-gpu.sh --rehearse --bin-dir DIR
#                                          # on 2 simulated GPUs (scripts/gpu-sim-env.sh
#                                          # sourced, DIR built for them): every step, the test
#                                          # binaries listing their tests instead of running
#                                          # them (scripts/test-gpu-sim.sh runs them all), the
#                                          # example's checks at small sizes: the script end to
#                                          # end, not a GPU's verdict
#
# Building needs what scripts/check-cuda.sh needs (nvcc from PyPI through scripts/nvcc-env.sh,
# stub libraries for linking without a driver); binaries go to target/gpu. Running needs the
# NVIDIA driver, and NCCL 2.27 or newer, cuBLAS, cuRAND and the CUDA runtime 13 where the
# dynamic linker finds them (LD_LIBRARY_PATH, or PyPI's nvidia-* packages of this python3,
# which are appended to it). Exit status: 0 when every step passed, 1 when one failed, 2 when
# there is no GPU to test on. Steps' output goes to TEST_GPU_LOGS (default target/test-gpu-logs);
# each step is stopped after TEST_GPU_STEP_TIMEOUT seconds (default 300).
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
root=$PWD

usage() { sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

. scripts/gpu-bins.sh
gpu_args test-gpu "$caller" "$@"

if [ "$mode" = build ]; then
    command -v zstd >/dev/null || { echo "test-gpu: --build-only needs zstd (apt-get install zstd)" >&2; exit 1; }
    gpu_build_into "$bin_dir.raw" --tests --examples && gpu_build_cudnn "$bin_dir.raw" ||
        { echo "test-gpu: FAIL: the build" >&2; exit 1; }
    gpu_pack "$bin_dir.raw" "$bin_dir" || { echo "test-gpu: FAIL: packing the binaries" >&2; exit 1; }
    rm -rf "$bin_dir.raw"
    echo "test-gpu: binaries in $bin_dir; on the GPU machine: scripts/test-gpu.sh --bin-dir $bin_dir"
    exit 0
fi

# ------------------------------------------------------------------------------ the GPUs
gpus=0
if [ $rehearse = 1 ]; then
    export GPU_SIM_DEVICES=2
    gpus=2
elif command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
if [ "$gpus" -eq 0 ]; then
    cat >&2 <<'EOF'
test-gpu: no NVIDIA GPU found (nvidia-smi is missing or lists no GPU), so there is nothing to
validate here. This script runs the crate's GPU suites on real GPUs. Without one:
  scripts/test-gpu-sim.sh                 runs every CUDA and NCCL path on simulated GPUs
  scripts/test-gpu.sh --build-only DIR    builds binaries here to run on a GPU machine with
                                          scripts/test-gpu.sh --bin-dir DIR
EOF
    exit 2
fi
[ $rehearse = 1 ] ||
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader |
    sed 's/^/test-gpu: GPU /'

if [ "$mode" = source ]; then
    bin_dir="$root/target/gpu/named"
    echo "test-gpu: building (target/gpu)"
    gpu_build_into "$bin_dir" --tests --examples && gpu_build_cudnn "$bin_dir" ||
        { echo "test-gpu: FAIL: the build" >&2; exit 1; }
else
    bin_dir=$(cd "$bin_dir" && pwd)
    gpu_unpack "$bin_dir" cuda || { echo "test-gpu: FAIL: unpacking the binaries" >&2; exit 1; }
fi

# PyPI's NVIDIA libraries of this python3 (NCCL, cuBLAS, cuRAND, cudart), after the user's own.
[ $rehearse = 1 ] || gpu_libraries
sanitizer=$(command -v compute-sanitizer 2>/dev/null ||
    ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)

# ------------------------------------------------------------------------------ the steps
logs=${TEST_GPU_LOGS:-$root/target/test-gpu-logs}
mkdir -p "$logs"
results=()
failed=0
# step NAME COMMAND...: runs it, its output into $logs/NAME.log (and its last lines on failure),
# for at most TEST_GPU_STEP_TIMEOUT seconds (default 300: a hang costs one row, not the run;
# a step stopped there shows exit 124).
step() {
    local name=$1
    shift
    local t0=$SECONDS status
    echo "test-gpu: $name"
    timeout -k 10 "${TEST_GPU_STEP_TIMEOUT:-300}" "$@" >"$logs/$name.log" 2>&1
    status=$?
    local took=$((SECONDS - t0))
    if [ $status -eq 0 ]; then
        results+=("$(printf '%-34s %-6s %6s s  %s' "$name" pass "$took" "$(summary "$logs/$name.log")")")
    else
        failed=1
        results+=("$(printf '%-34s %-6s %6s s  exit %s, log %s' "$name" FAIL "$took" "$status" "$logs/$name.log")")
        tail -20 "$logs/$name.log" | sed 's/^/    /'
    fi
}
# The last "test result" line of a libtest run, or the last line of a program's output.
summary() {
    local r
    r=$(grep -E '^test result:' "$1" | tail -1 | sed 's/^test result: //; s/; finished in.*//')
    [ -n "$r" ] || r=$(tail -1 "$1" | cut -c1-80)
    echo "$r"
}
bin() { echo "$bin_dir/$1"; }
# What a test binary is asked: run its tests (one at a time), or in the rehearsal list them.
run=(--test-threads=1) sizes=()
if [ $rehearse = 1 ]; then
    run=(--list)
    sizes=(--image-size 8 --train-size 64 --val-size 32 --batch-size 16)
fi

step cuda "$(bin cuda)" "${run[@]}"
step nccl "$(bin nccl)" "${run[@]}"
# The cuda:: variants of the device tests (device_tests! in tests/), the torchvision models
# included. Test binaries are named after tests/NAME.rs and tests/NAME/main.rs.
for src in tests/*.rs tests/*/main.rs; do
    name=$(basename "${src%/main.rs}" .rs)
    case "$name" in cuda | nccl | nccl_faults | gpu_counts) continue ;; esac # run above, or simulator-only
    t=$(bin "$name")
    [ -x "$t" ] || continue
    # (Read whole first: `grep -q` in a pipe under pipefail fails when it stops reading early.)
    tests=$("$t" --list 2>/dev/null) || true
    grep -q 'cuda::.*: test$' <<<"$tests" || continue # cuda::x or mod::cuda::x
    step "cuda::-$name" "$t" cuda:: "${run[@]}"
done
out=$(mktemp -d)
for precision in f32 bf16; do
    step "resnet-check-$precision-x$gpus" "$(bin resnet)" --backend nccl --world-size "$gpus" \
        --precision "$precision" --accumulate 2 --bucket-mb 0.1 --check --check-steps 3 \
        "${sizes[@]}" --out-dir "$out/check-$precision"
done
# candle's cuDNN convolutions (the `cudnn` feature; needs libcudnn.so.9): the same check.
if [ -x "$(bin resnet-cudnn)" ]; then
    step "resnet-check-cudnn-x$gpus" "$(bin resnet-cudnn)" --backend nccl --world-size "$gpus" \
        --check --check-steps 3 "${sizes[@]}" --out-dir "$out/check-cudnn"
fi
if [ $rehearse = 1 ]; then
    results+=("$(printf '%-34s %-6s %6s    %s' compute-sanitizer skip - "rehearsal")")
elif [ -n "$sanitizer" ]; then
    for tool in memcheck racecheck synccheck; do
        step "sanitizer-$tool" "$sanitizer" --tool "$tool" --error-exitcode 1 \
            "$(bin cuda)" --test-threads=1
    done
else
    results+=("$(printf '%-34s %-6s %6s    %s' compute-sanitizer skip - "not installed")")
fi
rm -rf "$out"

echo
if [ $rehearse = 1 ]; then
    echo "test-gpu: REHEARSAL on $gpus simulated GPUs: the test binaries listed their tests, the checks ran at small sizes"
else
    echo "test-gpu: $gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | sed 's/^ *//' | paste -sd,)"
fi
printf '%-34s %-6s %8s  %s\n' step result time detail
printf '%s\n' "${results[@]}"
exit $failed
