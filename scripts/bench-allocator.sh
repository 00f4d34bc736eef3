#!/usr/bin/env bash
# The layer against PyTorch at the user's default allocator and with glibc's trimming turned
# off (the setting of scripts/bench.sh), side by side in one run: SyncBatchNorm's forward and
# its forward + backward through candle's autograd (`cargo bench --bench batch_norm`), and
# PyTorch's BatchNorm2d (`scripts/bench_torch.py`), 2 threads each.
#
#   scripts/bench-allocator.sh        (needs .venv-torch, or TORCH_PY=path/to/python)
#
# Prints a markdown table of medians in milliseconds and the ratios to PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${TORCH_PY:-.venv-torch/bin/python}"
export RAYON_NUM_THREADS=2 OMP_NUM_THREADS=2
cargo bench --bench batch_norm --no-run >&2
bin="$(ls -t target/release/deps/batch_norm-* | grep -v '\.d$' | head -1)"
off=(env MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296)
median() { python3 -c "import json; print(json.load(open('target/criterion/$1/$2/new/estimates.json'))['median']['point_estimate'] / 1e6)"; }
for mode in default off; do
  run=(); [ "$mode" = off ] && run=("${off[@]}")
  "${run[@]}" "$py" scripts/bench_torch.py > "target/bench_torch_$mode.json"
  for shape in 32x64x32x32 64x256x14x14 8x32x112x112; do
    for layout in nchw nhwc; do
      for b in syncbn_forward syncbn_forward_backward_autograd; do
        "${run[@]}" "$bin" --bench "^$shape/$layout/$b\$" >/dev/null 2>&1
        echo "$mode $shape $layout $b $(median "${shape}_$layout" "$b")"
      done
    done
  done
done > target/bench_allocator.txt
python3 - <<'PY'
import json
rows = [l.split() for l in open("target/bench_allocator.txt")]
ours = {(m, s, l, b): float(v) for m, s, l, b, v in rows}
print("| shape | layout | allocator | forward ms: ours / PyTorch (ratio) | autograd fwd+bwd ms: ours / PyTorch (ratio) |")
print("|---|---|---|---|---|")
for mode, name in (("default", "default"), ("off", "trim off")):
    torch = json.load(open(f"target/bench_torch_{mode}.json"))
    for s in ("32x64x32x32", "64x256x14x14", "8x32x112x112"):
        for l in ("nchw", "nhwc"):
            t = torch[f"{s}_{l}"]
            f, fb = ours[(mode, s, l, "syncbn_forward")], ours[(mode, s, l, "syncbn_forward_backward_autograd")]
            print(f"| {s} | {l.upper()} | {name} | {f:.2f} / {t['forward']:.2f} ({f / t['forward']:.2f}×) | "
                  f"{fb:.2f} / {t['forward_backward']:.2f} ({fb / t['forward_backward']:.2f}×) |")
PY
