# Sourced by the CPU batch-norm benchmarks (scripts/bench.sh, scripts/bench-forward-alternating.sh):
# one allocator setting and thread count for every side, and `venv`, a virtual environment with
# PyTorch outside the repository (TORCH_VENV; created with pip when missing).
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2} OMP_NUM_THREADS=${RAYON_NUM_THREADS:-2}
venv=${TORCH_VENV:-$HOME/.cache/candle-distributed-bench-venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.15.0 numpy
fi
