#!/usr/bin/env bash
# gpu-sim/build.sh [GOAL...]: builds the simulated device into ${GPU_SIM_OUT:-target/gpu-sim}: lib/ holds libgpusim.so under
# the sonames a `cuda,nccl` build loads (libcuda.so.1, libcublas.so.13, libcurand.so.10, ...),
# kernels/ the kernel libraries (candle-kernels' sources at the version in Cargo.lock, read from
# the cargo registry, and ours from kernels/), bin/ the entry-point tool. Needs g++, make, and
# nvcc from PyPI (scripts/nvcc-env.sh installs it) for the PTX that the kernels are checked
# against. Rebuilds only what changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
. scripts/nvcc-env.sh
out=${GPU_SIM_OUT:-$root/target/gpu-sim}
cargo fetch -q
registry_src() { # crate -> its source folder at the Cargo.lock version
    local ver dir
    ver=$(awk -v n="$1" '$0 == "name = \"" n "\"" {getline; print $3; exit}' Cargo.lock | tr -d '"')
    [ -n "$ver" ] || { echo "gpu-sim: $1 is not in Cargo.lock" >&2; return 1; }
    dir=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"$1-$ver" 2>/dev/null | head -1)
    [ -d "$dir" ] || { echo "gpu-sim: $1 $ver not in the cargo registry" >&2; return 1; }
    echo "$dir"
}
candle=$(registry_src candle-kernels)
cudarc=$(registry_src cudarc)
# Extra arguments are make goals (`selftest` builds the self-tests too).
make -C gpu-sim -j"$(nproc)" --no-print-directory OUT="$out" CANDLE_SRC="$candle/src" \
    CUDARC_SRC="$cudarc/src" NVCC="$(command -v nvcc)" all "$@"
# libcudart: linked by candle-kernels' static library (never called by the tests); the real
# one from the nvcc wheels, which never touches the driver at load.
ln -sf "$CUDA_PATH/lib/libcudart.so.13" "$out/lib/libcudart.so.13"
