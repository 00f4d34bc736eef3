#!/usr/bin/env bash
# Gradient synchronisation on the CPU backends against three baselines, all in one run:
# examples/sync_bench.rs on 4 thread ranks (with a memcpy of the all-reduce's minimum traffic),
# PyTorch's gloo all-reduce on 4 processes (scripts/bench_gloo.py, same size), and, when Open
# MPI is installed, sync_bench under `mpirun -np 4` (with MPI's own MPI_Allreduce of the same
# buffer). Prints the table of docs/benchmarks.md (scripts/bench_collectives_table.py).
#
#   scripts/bench-collectives.sh            # 25 MiB, 100 rounds; MIB=… ITERS=… to change
#
# Installs PyTorch 2.15.0 into TORCH_VENV (default ~/.cache/candle-distributed-bench-venv) when
# missing. Every side runs with the allocator setting of scripts/bench.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mib=${MIB:-25}
iters=${ITERS:-100}
venv=${TORCH_VENV:-$HOME/.cache/candle-distributed-bench-venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.15.0 numpy
fi
# Fresh multi-megabyte buffers otherwise cost page faults that dwarf the copies on these VMs.
# MALLOC_ARENA_MAX=1 puts the thread ranks' allocations on the main heap, which keeps what is
# freed (the per-thread heaps glibc would use hand emptied heaps back to the system whatever
# the thresholds, and refilling them doubled sync_gradients' time).
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_ARENA_MAX=1
out=target/bench-collectives
mkdir -p "$out"
rm -f "$out"/*.json

cargo build --release --example sync_bench
target/release/examples/sync_bench --ranks 4 --mib "$mib" --iters "$iters" --json "$out/threads.json"
"$venv/bin/python" scripts/bench_gloo.py --ranks 4 --mib "$mib" --iters "$iters" --json "$out/gloo.json"
if command -v mpirun > /dev/null && command -v mpicc > /dev/null; then
    CARGO_TARGET_DIR=target/mpi-release cargo build --release --features mpi --example sync_bench
    extra=()
    [ "$(id -u)" = 0 ] && extra+=(--allow-run-as-root)
    mpirun "${extra[@]}" --oversubscribe -np 4 \
        -x MALLOC_MMAP_THRESHOLD_ -x MALLOC_TRIM_THRESHOLD_ -x MALLOC_ARENA_MAX \
        target/mpi-release/release/examples/sync_bench --backend mpi --mib "$mib" --iters "$iters" \
        --json "$out/mpi.json"
else
    echo "no Open MPI (apt-get install openmpi-bin libopenmpi-dev libclang-dev): MPI rows skipped"
fi
python3 scripts/bench_collectives_table.py "$out"
