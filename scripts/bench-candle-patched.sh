#!/usr/bin/env bash
# What candle's autograd costs the layer's training step: the forward + backward through
# `Tensor::backward` (`cargo bench --bench batch_norm`, syncbn_forward_backward_autograd) with
# the candle-core of Cargo.lock and with a copy of it changed so that a custom op's first
# gradient for a tensor is stored as it is, instead of being added to a fresh zero tensor
# (`GradStore::or_insert` then `add`, which candle does for every op), each at the default
# allocator and with glibc's trimming off, beside PyTorch's BatchNorm2d (scripts/bench_torch.py).
#
#   scripts/bench-candle-patched.sh      (needs .venv-torch, or TORCH_PY=path/to/python)
#
# The copy is made from the cargo registry into target/candle-core-patched and built into
# target/patched (a release build of the benchmark, a few minutes on 2 cores). Prints one
# line per shape, layout, candle and allocator setting with the median in milliseconds.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${TORCH_PY:-.venv-torch/bin/python}"
export RAYON_NUM_THREADS=2 OMP_NUM_THREADS=2
version=$(cargo metadata --format-version 1 | python3 -c "import json,sys; print(next(p['version'] for p in json.load(sys.stdin)['packages'] if p['name'] == 'candle-core'))")
src=$(dirname "$(cargo metadata --format-version 1 | python3 -c "import json,sys; print(next(p['manifest_path'] for p in json.load(sys.stdin)['packages'] if p['name'] == 'candle-core'))")")
copy=target/candle-core-patched
rm -rf "$copy" && cp -r "$src" "$copy" && chmod -R u+w "$copy"
python3 - "$copy/src/backprop.rs" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
# In the custom ops' arms: `let sum_grad = grads.or_insert(ARG)?; *sum_grad = sum_grad.add(&GRAD)?`
# becomes "add into the stored gradient if there is one, else store GRAD itself".
pattern = re.compile(
    r"let sum_grad = grads\.or_insert\((arg\d?)\)\?;\s*\*sum_grad = sum_grad\.add\(&(arg_grad\d?)\)\?"
)
start = text.index("c.bwd(arg, node, &grad)")
end = text.index("Op::Unary(", start)
arms, n = pattern.subn(
    lambda m: (
        f"match grads.0.get_mut(&{m[1]}.id()) {{ Some(sum_grad) => *sum_grad = "
        f"sum_grad.add(&{m[2]})?, None => {{ grads.0.insert({m[1]}.id(), {m[2]}); }} }}"
    ),
    text[start:end],
)
assert n == 6, f"expected the six gradients of CustomOp1..3, changed {n}"
open(path, "w").write(text[:start] + arms + text[end:])
PY
echo "candle-core $version, patched copy in $copy" >&2
CARGO_TARGET_DIR=target/patched cargo bench --bench batch_norm --no-run \
    --config "patch.crates-io.candle-core.path=\"$copy\"" >&2
cargo bench --bench batch_norm --no-run >&2
stock="$(ls -t target/release/deps/batch_norm-* | grep -v '\.d$' | head -1)"
patched="$(ls -t target/patched/release/deps/batch_norm-* | grep -v '\.d$' | head -1)"
off=(env MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296)
for mode in default off; do
  run=(); [ "$mode" = off ] && run=("${off[@]}")
  "${run[@]}" "$py" scripts/bench_torch.py > "target/bench_torch_patched_$mode.json"
  for shape in 32x64x32x32 64x256x14x14 8x32x112x112; do
    for layout in nchw nhwc; do
      for which in stock patched; do
        bin=$stock; [ "$which" = patched ] && bin=$patched
        # The first "time:" line's median (awk reads to the end: no broken pipe).
        ms=$("${run[@]}" env CRITERION_HOME="target/criterion-$which" "$bin" \
          --bench "^$shape/$layout/syncbn_forward_backward_autograd\$" 2>&1 |
          awk '/time:/ && !seen { print $4, $5; seen = 1 }')
        echo "$shape $layout candle-$which $mode $ms"
      done
      "$py" -c "import json; print('$shape $layout pytorch $mode', round(json.load(open('target/bench_torch_patched_$mode.json'))['${shape}_$layout']['forward_backward'], 3), 'ms')"
    done
  done
done
