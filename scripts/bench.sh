#!/usr/bin/env bash
# The README's CPU benchmark table: SyncBatchNorm (world size 1), candle-nn's BatchNorm and
# PyTorch's BatchNorm2d, in one run, with one allocator setting and 2 threads for all.
# PyTorch comes from a virtual environment outside the repository (TORCH_VENV, created here with
# pip when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench-env.sh
"$venv/bin/python" scripts/bench_torch.py > target/bench_torch.json
cargo bench --bench batch_norm
"$venv/bin/python" scripts/bench_table.py
