#!/usr/bin/env bash
# The crate's speed on this machine's NVIDIA GPUs, side by side with PyTorch on the same GPUs in
# the same run, printed as one set of tables with ratios (ours / PyTorch's; below 1 is faster
# for times, above 1 is faster for images/s):
#   - the layer: SyncBatchNorm's training forward and forward + backward against
#     torch.nn.functional.batch_norm, NCHW and channels-last, f32 and bf16, ResNet-50's
#     batch-norm sizes at batch 32 (examples/gpu_bench.rs; its kernels alone against a copy);
#   - the host time to issue one layer call, ResNet-20's sizes, against candle-nn's BatchNorm
#     and nn.BatchNorm2d (examples/host_cost.rs), and DataParallel::sync_gradients;
#   - training steps: the ResNet example's ResNet-20 (32x32, batch 128, f32; also built with
#     the `cudnn` feature where DIR has that build) and ResNet-50 (224x224, batch 64, f32 and
#     bf16) on one GPU, images/s of its second epoch, against the same models in PyTorch
#     (eager, cuDNN);
#   - the data-parallel step on every GPU present: the example over NCCL with the gradient
#     all-reduce overlapped with the backward (--overlap on) and after it (off), against
#     PyTorch's DistributedDataParallel; per-GPU batch 128.
# The PyTorch side is scripts/torch_gpu_bench.py, run with TORCH_PYTHON (default python3).
#
#   scripts/bench-gpu.sh                    # on a GPU machine with Rust: builds, then runs
#   scripts/bench-gpu.sh --build-only DIR   # on any machine (no GPU needed): builds the four
#                                           # binaries into DIR/binaries.tar.zst (~14 MB)
#   scripts/bench-gpu.sh --bin-dir DIR      # on a GPU machine without Rust: runs DIR's binaries
#                                           # (DIR from this script's --build-only, or from
#                                           # scripts/test-gpu.sh --build-only: a superset)
#   scripts/bench-gpu.sh --rehearse --bin-dir DIR
#                                           # on simulated GPUs (scripts/gpu-sim-env.sh sourced,
#                                           # DIR holding gpu_bench, host_cost and resnet built
#                                           # for them): every step at small sizes with the
#                                           # kernels skipped (GPU_SIM_SKIP_KERNELS=1: host
#                                           # time only), PyTorch on the CPU; the figures are
#                                           # marked as not a GPU's
#
# Building needs what scripts/test-gpu.sh needs (binaries in target/gpu). Running needs the
# NVIDIA driver, NCCL, cuBLAS, cuRAND and the CUDA runtime 13 where the dynamic linker finds
# them (LD_LIBRARY_PATH, or the nvidia-* packages PyTorch's python imports, appended), and
# PyTorch with CUDA for the PyTorch side. f32 is true f32 on both sides (TF32 off). Each step's
# output goes to BENCH_GPU_LOGS (default target/bench-gpu-logs): ours.jsonl and torch.jsonl
# hold every figure; each step is stopped after BENCH_GPU_STEP_TIMEOUT seconds (default 240).
# Exit status: 0 when every step ran, 1 when one failed (listed under the tables), 2 when there
# is no GPU.
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
root=$PWD

usage() { sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

. scripts/gpu-bins.sh
gpu_args bench-gpu "$caller" "$@"
bins=(--example gpu_bench --example host_cost --example resnet)

if [ "$mode" = build ]; then
    command -v zstd >/dev/null || { echo "bench-gpu: --build-only needs zstd (apt-get install zstd)" >&2; exit 1; }
    gpu_build_into "$bin_dir.raw" "${bins[@]}" && gpu_build_cudnn "$bin_dir.raw" ||
        { echo "bench-gpu: FAIL: the build" >&2; exit 1; }
    gpu_pack "$bin_dir.raw" "$bin_dir" || { echo "bench-gpu: FAIL: packing the binaries" >&2; exit 1; }
    rm -rf "$bin_dir.raw"
    echo "bench-gpu: binaries in $bin_dir; on the GPU machine: scripts/bench-gpu.sh --bin-dir $bin_dir"
    exit 0
fi

# ------------------------------------------------------------------------------ the GPUs
if [ $rehearse = 1 ]; then
    export GPU_SIM_DEVICES=2
    gpus=2
    gpu_names="2 simulated GPUs (gpu-sim)"
else
    gpus=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    fi
    # The ranks see the devices CUDA_VISIBLE_DEVICES leaves them, where it is set.
    if [ "$gpus" -gt 0 ] && [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
        visible=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
        [ "$visible" -lt "$gpus" ] && gpus=$visible
    fi
    if [ "$gpus" -eq 0 ]; then
        cat >&2 <<'EOF'
bench-gpu: no NVIDIA GPU found (nvidia-smi is missing or lists no GPU). Without one:
  scripts/bench-gpu.sh --build-only DIR    builds binaries here for a GPU machine
  scripts/test-gpu-sim.sh                  rehearses this script on simulated GPUs
EOF
        exit 2
    fi
    gpu_names=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sort | uniq -c |
        sed 's/^ *//' | paste -sd,)
fi

if [ "$mode" = source ]; then
    bin_dir="$root/target/gpu/bench"
    echo "bench-gpu: building (target/gpu)"
    gpu_build_into "$bin_dir" "${bins[@]}" && gpu_build_cudnn "$bin_dir" ||
        { echo "bench-gpu: FAIL: the build" >&2; exit 1; }
else
    bin_dir=$(cd "$bin_dir" && pwd)
    gpu_unpack "$bin_dir" gpu_bench || { echo "bench-gpu: FAIL: unpacking the binaries" >&2; exit 1; }
fi
python=${TORCH_PYTHON:-python3}
if [ $rehearse = 0 ]; then
    gpu_libraries "$python"
    # A missing library (or a CUDA 12 PyTorch's, where the binaries want CUDA 13's) shows here,
    # once, rather than as every step of ours failing.
    missing=$(ldd "$bin_dir/gpu_bench" 2>/dev/null | grep 'not found' | sed 's/^[[:space:]]*//' | paste -sd,)
    [ -z "$missing" ] || echo "bench-gpu: WARNING: the binaries lack $missing (PyTorch's CUDA: $("$python" -c 'import torch; print(torch.version.cuda)' 2>&1 | tail -1))" >&2
fi

# ------------------------------------------------------------------------------ the steps
logs=${BENCH_GPU_LOGS:-$root/target/bench-gpu-logs}
mkdir -p "$logs"
# (This run's files only: the folder may be the caller's.)
rm -rf "$logs"/*.log "$logs"/step-* "$logs"/ddp-*
ours="$logs/ours.jsonl" theirs="$logs/torch.jsonl"
: >"$ours"
: >"$theirs"
# f32 is f32 on both sides: no TF32 in cuBLAS or cuDNN (PyTorch's script also turns it off;
# candle's cuDNN build would otherwise be free to use it).
export NVIDIA_TF32_OVERRIDE=0
# Each step ends within this many seconds (a hang costs one row, not the run).
limit=${BENCH_GPU_STEP_TIMEOUT:-240}
failed=0
# step NAME SINK COMMAND...: runs it (for at most $limit s), its stdout's JSON lines appended to
# SINK, everything in $logs/NAME.log; a failure is recorded in ours.jsonl (the tables list it)
# and its log's end printed; returns the command's status.
step() {
    local name=$1 sink=$2
    shift 2
    local t0=$SECONDS status
    echo "bench-gpu: $name"
    timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
    status=$?
    grep '^{' "$logs/$name.log" >>"$sink"
    if [ $status -ne 0 ]; then
        failed=1
        echo "{\"bench\": \"failed\", \"step\": \"$name\", \"status\": $status}" >>"$ours"
        tail -15 "$logs/$name.log" | sed 's/^/    /'
    fi
    echo "bench-gpu: $name took $((SECONDS - t0)) s (exit $status)"
    return $status
}
bin() { echo "$bin_dir/$1"; }

if [ $rehearse = 1 ]; then
    quick=(--quick)
    torch_dev=(--device cpu)
    skip=(env GPU_SIM_SKIP_KERNELS=1)
    r20=(--image-size 8 --batch-size 8 --val-size 8) train20=16
    r50=(--image-size 32 --batch-size 2 --val-size 2) train50=4
    t20=(--batch 8 --side 8 --steps 2)
    t50=(--batch 2 --side 32 --steps 2)
    per_gpu=4
else
    quick=() torch_dev=() skip=()
    r20=(--image-size 32 --batch-size 128 --val-size 128) train20=2560
    r50=(--image-size 224 --batch-size 64 --val-size 64) train50=640
    t20=(--batch 128 --side 32 --steps 30)
    t50=(--batch 64 --side 224 --steps 20)
    per_gpu=128
fi

# The example's second epoch (the first pays module loads and allocator growth) as a JSON line:
# its images/s. With the kernels skipped (the rehearsal) the example's sample count, a sum on
# the device, is 0: the epoch's images (TRAIN) over its time on the host instead.
resnet_rate() {
    local dir=$1 tag=$2 train=$3
    python3 - "$dir/metrics.csv" "$tag" "$train" <<'PY'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1])))
fields = json.loads(sys.argv[2])
if len(rows) != 2:
    sys.exit(f"bench-gpu: {sys.argv[1]} has {len(rows)} epochs, not the 2 asked for")
rate = float(rows[-1]["images_per_sec"])
if rate == 0:
    rate = int(sys.argv[3]) / (float(rows[-1]["seconds"]) - float(rows[-2]["seconds"]))
fields["images_per_sec"] = round(rate, 1)
fields["epoch"] = int(rows[-1]["epoch"])
print(json.dumps(fields))
PY
}
# step_resnet NAME TAG TRAIN BINARY ARGS...: the example (BINARY: resnet, or resnet-cudnn) for 2
# epochs of TRAIN images, then its rate into ours.jsonl.
step_resnet() {
    local name=$1 tag=$2 train=$3 binary=$4
    shift 4
    local dir="$logs/$name"
    step "$name" /dev/null "${skip[@]}" "$(bin "$binary")" --backend nccl --epochs 2 \
        --out-dir "$dir" --train-size "$train" "$@" || return 0 # (its failure is recorded)
    resnet_rate "$dir" "$tag" "$train" >>"$ours" || {
        failed=1
        echo "{\"bench\": \"failed\", \"step\": \"$name (its rate)\", \"status\": 1}" >>"$ours"
    }
}

step layer-ours "$ours" "${skip[@]}" "$(bin gpu_bench)" --json "${quick[@]}"
step layer-torch "$theirs" "$python" scripts/torch_gpu_bench.py layer "${quick[@]}" "${torch_dev[@]}"
step host-ours "$ours" "${skip[@]}" "$(bin host_cost)" --json
step host-torch "$theirs" "$python" scripts/torch_gpu_bench.py host "${quick[@]}" "${torch_dev[@]}"

# (r20 and r50: --image-size S --batch-size B --val-size V)
step_resnet step-resnet20-f32 "{\"bench\": \"step\", \"model\": \"resnet20\", \"precision\": \"f32\", \"world\": 1, \"batch\": ${r20[3]}, \"side\": ${r20[1]}}" \
    $train20 resnet --world-size 1 --model resnet20 --precision f32 "${r20[@]}"
step step-torch-resnet20-f32 "$theirs" "$python" scripts/torch_gpu_bench.py step --model resnet20 \
    --precision f32 "${t20[@]}" "${torch_dev[@]}"
# candle's cuDNN convolutions (the `cudnn` feature), where that build is in the folder: the
# simulated GPU has no cuDNN, so the rehearsal's folder has none.
if [ -x "$(bin resnet-cudnn)" ]; then
    step_resnet step-resnet20-f32-cudnn "{\"bench\": \"step\", \"model\": \"resnet20\", \"conv\": \"cuDNN\", \"precision\": \"f32\", \"world\": 1, \"batch\": ${r20[3]}, \"side\": ${r20[1]}}" \
        $train20 resnet-cudnn --world-size 1 --model resnet20 --precision f32 "${r20[@]}"
fi
for precision in f32 bf16; do
    step_resnet "step-resnet50-$precision" "{\"bench\": \"step\", \"model\": \"resnet50\", \"precision\": \"$precision\", \"world\": 1, \"batch\": ${r50[3]}, \"side\": ${r50[1]}}" \
        $train50 resnet --world-size 1 --model resnet50 --precision $precision "${r50[@]}"
    step "step-torch-resnet50-$precision" "$theirs" "$python" scripts/torch_gpu_bench.py step \
        --model resnet50 --precision $precision "${t50[@]}" "${torch_dev[@]}"
done

ddp_r20=("${r20[@]}")
ddp_r20[3]=$((per_gpu * gpus)) # --batch-size: the global batch
for overlap in on off; do
    step_resnet "ddp-overlap-$overlap" "{\"bench\": \"ddp\", \"overlap\": \"$overlap\", \"world\": $gpus, \"batch\": $per_gpu}" \
        $((train20 * gpus)) resnet --world-size "$gpus" --model resnet20 --overlap $overlap "${ddp_r20[@]}"
done
step ddp-torch "$theirs" "$python" scripts/torch_gpu_bench.py ddp --world "$gpus" --batch "$per_gpu" \
    "${t20[@]:2}" "${torch_dev[@]}"

echo
title="$gpu_names"
[ $rehearse = 1 ] && title="REHEARSAL on $gpu_names with their kernels skipped (host time only), PyTorch on the CPU, small sizes: none of these figures is a GPU's speed"
strict=()
[ $rehearse = 1 ] && strict=(--strict) # every case measured on both sides, or the rehearsal fails
python3 scripts/bench_gpu_table.py --title "$title" "${strict[@]}" "$ours" "$theirs" || failed=1
exit $failed
