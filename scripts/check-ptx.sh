#!/usr/bin/env bash
# Compiles every kernels/*.cu to PTX with nvcc 13.0 for sm_80 and sm_90 and runs `ptxas -v` on
# it; fails on a compile error, a register spill or local memory. nvcc comes from PyPI (five
# pinned wheels) into an ignored virtual environment (NVCC_VENV, default .venv-nvcc); no GPU
# and no CUDA driver are needed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/nvcc-env.sh
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
for f in kernels/*.cu; do
    for arch in 80 90; do
        ptx="$out/$(basename "$f" .cu)_sm$arch.ptx"
        nvcc --ptx -std=c++17 -O3 -arch="sm_$arch" -I kernels -o "$ptx" "$f"
        report=$(ptxas -v -arch="sm_$arch" -o /dev/null "$ptx" 2>&1)
        entries=$(grep -c "Compiling entry function" <<<"$report")
        bad=$(grep -E "bytes spill|bytes lmem|bytes stack frame" <<<"$report" |
            grep -vE "^\s*0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads$" || true)
        if [ -n "$bad" ]; then
            echo "FAIL $f sm_$arch: spills or local memory:" && echo "$bad"
            status=1
        else
            echo "ok   $f sm_$arch: $entries entry points, no spills, no local memory"
        fi
    done
done
exit $status
