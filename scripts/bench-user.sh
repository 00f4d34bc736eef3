#!/usr/bin/env bash
# A user's own program against the main job, on this machine: `examples/user_resnet.rs` (a
# ResNet-20 written with candle-nn's layers, this crate's `conv2d_no_bias` and
# `sync_batch_norm`, candle-nn's AdamW, 4 thread ranks, nothing set in the environment), the
# same with its ReLUs inside the batch norms (`--fused`), and `target/release/examples/resnet`
# at its defaults (the same model size, data, batch and epochs), alternating, ROUNDS times.
#
#   scripts/bench-user.sh [ROUNDS]      (default 3)
#
# Prints one markdown row per round and the ratios of the medians.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
cargo build --release --example resnet --example user_resnet >&2
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
ips() { python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['images_per_sec'])"; }
unset CANDLE_NUM_THREADS RAYON_NUM_THREADS
main=() user=() fused=()
echo "| round | main job images/s | user program images/s | user program, --fused |"
echo "|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
    main+=("$(target/release/examples/resnet --out-dir "$out" 2>/dev/null | ips)")
    user+=("$(target/release/examples/user_resnet 2>/dev/null | ips)")
    fused+=("$(target/release/examples/user_resnet --fused 2>/dev/null | ips)")
    echo "| $r | ${main[-1]} | ${user[-1]} | ${fused[-1]} |"
done
python3 - "${main[*]}" "${user[*]}" "${fused[*]}" <<'PY'
import statistics, sys
a, b, c = (statistics.median(float(v) for v in s.split()) for s in sys.argv[1:4])
print(f"\nmedians: main job {a:.0f}, user program {b:.0f} ({b / a:.2f}x), "
      f"with --fused {c:.0f} images/s ({c / a:.2f}x)")
PY
