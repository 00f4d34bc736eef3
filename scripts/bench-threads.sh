#!/usr/bin/env bash
# The main job (`target/release/examples/resnet` at its defaults: 4 thread ranks) with candle's
# thread counts left to the communicator (nothing set: `collective::share_cores`), set by hand
# to one thread per rank, and set to the machine's cores per rank (candle's own default when
# nothing shares them), alternating, ROUNDS times.
#
#   scripts/bench-threads.sh [ROUNDS]      (default 3)
#
# Prints one markdown row per run and each setting's median images/s against the first's.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
cores="$(nproc)"
cargo build --release --example resnet >&2
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
settings=("nothing set" "1 thread per rank" "$cores threads per rank")
run() {
    case "$1" in
    0) env -u CANDLE_NUM_THREADS -u RAYON_NUM_THREADS target/release/examples/resnet --out-dir "$out" ;;
    1) CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS=1 target/release/examples/resnet --out-dir "$out" ;;
    2) CANDLE_NUM_THREADS=$cores RAYON_NUM_THREADS=$cores target/release/examples/resnet --out-dir "$out" ;;
    esac 2>/dev/null | tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['images_per_sec'])"
}
declare -a all=("" "" "")
echo "| round | ${settings[0]} | ${settings[1]} | ${settings[2]} | (images/s) |"
echo "|---|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
    row=()
    for s in 0 1 2; do
        v="$(run "$s")"
        row+=("$v")
        all[s]="${all[s]} $v"
    done
    echo "| $r | ${row[0]} | ${row[1]} | ${row[2]} | |"
done
python3 - "${all[0]}" "${all[1]}" "${all[2]}" "$cores" <<'PY'
import statistics, sys
m = [statistics.median(float(v) for v in a.split()) for a in sys.argv[1:4]]
print(f"\nmedians ({sys.argv[4]} cores): nothing set {m[0]:.0f}, one thread per rank {m[1]:.0f} "
      f"({m[0] / m[1]:.2f}x of it), {sys.argv[4]} per rank {m[2]:.0f} ({m[0] / m[2]:.2f}x of it) images/s")
PY
