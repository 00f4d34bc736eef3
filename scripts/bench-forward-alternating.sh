#!/usr/bin/env bash
# The layer's training forward against PyTorch's BatchNorm2d on one benchmark shape, timed in
# alternating rounds (ours, then PyTorch's, ROUNDS times) so that both see the same state of a
# shared machine; prints each round's medians and their ratio. Same allocator setting, thread
# count and PyTorch environment as scripts/bench.sh.
#
#   scripts/bench-forward-alternating.sh [SHAPE] [LAYOUT] [ROUNDS]    # 64x256x14x14 nhwc 6
set -euo pipefail
cd "$(dirname "$0")/.."
shape=${1:-64x256x14x14} layout=${2:-nhwc} rounds=${3:-6}
. scripts/bench-env.sh
cargo bench --bench batch_norm --no-run
estimate=target/criterion/${shape}_${layout}/syncbn_forward/new/estimates.json
for round in $(seq "$rounds"); do
    cargo bench -q --bench batch_norm -- "^$shape/$layout/syncbn_forward\$" \
        --warm-up-time 1 --measurement-time 3 --noplot > /dev/null 2>&1
    ours=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["median"]["point_estimate"] / 1e6)' "$estimate")
    torch=$(BENCH_ONLY=${shape}_$layout BENCH_REPEATS=300 "$venv/bin/python" scripts/bench_torch.py 2> /dev/null |
        python3 -c 'import json,sys; print(next(iter(json.load(sys.stdin).values()))["forward"])')
    python3 -c 'import sys; o, t = map(float, sys.argv[2:]); print(f"round {sys.argv[1]}: ours {o:.3f} ms, PyTorch {t:.3f} ms, ratio {o / t:.2f}x")' \
        "$round" "$ours" "$torch"
done
