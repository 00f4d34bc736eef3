#!/usr/bin/env bash
# The main job against PyTorch on this machine, side by side: `target/release/examples/resnet`
# at its defaults (ResNet-20, 4 thread ranks, global batch 128, 3 epochs of 8000 images) and
# `scripts/torch_main.py` (the same model, batch, epochs and images in one PyTorch process with
# as many threads as the example's ranks share: the machine's cores), alternating, ROUNDS times.
#
#   scripts/bench-main.sh [ROUNDS]       (default 2; needs .venv-torch: scripts/test-torch.sh)
#
# Prints one markdown row per run and the ratio of the medians.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
threads="$(nproc)"
cargo build --release --example resnet >&2
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
field() { python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['$1'])"; }
ours=() torch=()
echo "| run | candle-distributed images/s | seconds | PyTorch images/s | seconds |"
echo "|---|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
  a="$(target/release/examples/resnet --out-dir "$out" 2>/dev/null | tail -1)"
  b="$(.venv-torch/bin/python scripts/torch_main.py "$threads" | tail -1)"
  ours+=("$(field images_per_sec <<<"$a")") torch+=("$(field images_per_sec <<<"$b")")
  echo "| $r | ${ours[-1]} | $(field seconds <<<"$a") | ${torch[-1]} | $(field seconds <<<"$b") |"
done
python3 - "${ours[*]}" "${torch[*]}" "$(.venv-torch/bin/python -c 'import torch; print(torch.__version__)')" "$threads" <<'PY'
import statistics, sys
ours, torch = ([float(v) for v in a.split()] for a in sys.argv[1:3])
a, b = statistics.median(ours), statistics.median(torch)
print(f"\nmedians: {a:.0f} against PyTorch {sys.argv[3]}'s {b:.0f} images/s ({sys.argv[4]} threads): {a / b:.2f}x")
PY
