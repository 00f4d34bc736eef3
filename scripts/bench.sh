#!/usr/bin/env bash
# The README's CPU benchmark table: SyncBatchNorm (world size 1), candle-nn's BatchNorm and
# PyTorch's BatchNorm2d, in one run, with one allocator setting and 2 threads for all.
# PyTorch comes from a virtual environment outside the repository (TORCH_VENV, created here with
# pip when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2} OMP_NUM_THREADS=${RAYON_NUM_THREADS:-2}
venv=${TORCH_VENV:-$HOME/.cache/candle-distributed-bench-venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.15.0 numpy
fi
"$venv/bin/python" scripts/bench_torch.py > target/bench_torch.json
cargo bench --bench batch_norm
"$venv/bin/python" scripts/bench_table.py
