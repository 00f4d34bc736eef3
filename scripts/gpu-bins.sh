# Sourced by scripts/test-gpu.sh and scripts/bench-gpu.sh: building the `cuda,nccl` binaries
# on a machine without a GPU, carrying them as one zstd stream, and running them on a GPU
# machine without Rust.
#
#   gpu_args TOOL CALLER ARGS...          the command line the two scripts share: sets mode
#                                         (source, build or bin), bin_dir (a relative one taken
#                                         from the folder CALLER) and rehearse (0 or 1); exits 2
#                                         on an unknown argument, and on --rehearse without
#                                         --bin-dir or without scripts/gpu-sim-env.sh sourced
#   gpu_build_into DEST [CARGO ARGS...]   builds (release, --features cuda,nccl, target/gpu) the
#                                         targets the arguments name, copies the executables
#                                         into DEST under plain names (tests/cuda.rs -> cuda),
#                                         stripped. For the rehearsal on simulated GPUs:
#                                         GPU_BINS_PROFILE (a cargo profile, e.g. dev) and
#                                         GPU_BINS_TARGET (a target folder) build where the
#                                         simulated-GPU suites built, in the environment they
#                                         set (scripts/cuda-build-env.sh), and GPU_BINS_LINK=1
#                                         links the executables instead of copying them
#   gpu_build_cudnn DEST                  the ResNet example with the `cudnn` feature (candle's
#                                         cuDNN convolutions) as DEST/resnet-cudnn
#   gpu_pack SRC DIR                      SRC's files into DIR/binaries.tar.zst
#   gpu_unpack DIR WANT                   unpacks DIR/binaries.tar.zst (or DIR/*.xz) unless DIR
#                                         already holds the binary WANT
#   gpu_libraries [PYTHON]                appends the folders of PyPI's NVIDIA libraries that
#                                         PYTHON (default python3) imports to LD_LIBRARY_PATH
#                                         (NCCL, cuBLAS, cuRAND, cudart, cuDNN)

_gpu_bins_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

gpu_args() {
    local tool=$1 caller=$2
    shift 2
    mode=source bin_dir= rehearse=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --build-only) mode=build bin_dir=${2:?--build-only needs a folder}; shift ;;
            --bin-dir) mode=bin bin_dir=${2:?--bin-dir needs a folder}; shift ;;
            --rehearse) rehearse=1 ;;
            -h | --help) usage; exit 0 ;;
            *) echo "$tool: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
        esac
        shift
    done
    case "$bin_dir" in "" | /*) ;; *) bin_dir=$caller/$bin_dir ;; esac
    if [ $rehearse = 1 ] && { [ "$mode" != bin ] || [ -z "${GPU_SIM_OUT:-}" ]; }; then
        echo "$tool: --rehearse runs DIR's binaries on simulated GPUs: --bin-dir DIR, with scripts/gpu-sim-env.sh sourced" >&2
        exit 2
    fi
}

gpu_build_into() {
    local dest=$1
    shift
    (
        cd "$_gpu_bins_root" || exit 1
        # (Once: sourcing the stubs again would change RUSTFLAGS, and cargo would rebuild all.)
        if [ -z "${CUDA_STUBS:-}" ]; then
            . scripts/nvcc-env.sh || exit 1
            . scripts/cuda-stubs.sh || exit 1
        fi
        # Machine code for the GPUs present (nvidia-smi), else for sm_90; PTX for newer ones.
        if [ -z "${CUDA_COMPUTE_CAP:-}" ]; then
            CUDA_COMPUTE_CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
                head -1 | tr -d '.') || true
            export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
        fi
        export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
        export CARGO_TARGET_DIR=${GPU_BINS_TARGET:-$_gpu_bins_root/target/gpu}
        exes=$(cargo build --profile "${GPU_BINS_PROFILE:-release}" --features cuda,nccl "$@" \
            --message-format=json-render-diagnostics | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])') || exit 1
        rm -rf "$dest"
        mkdir -p "$dest"
        for e in $exes; do
            name=$(basename "$e")
            name=${name%-*[0-9a-f]} # a test binary's hash suffix
            if [ "${GPU_BINS_LINK:-0}" = 1 ]; then
                ln -s "$e" "$dest/$name" || exit 1
            else
                cp "$e" "$dest/$name" && strip "$dest/$name" || exit 1
            fi
        done
    )
}

gpu_build_cudnn() {
    local dest=$1
    gpu_build_into "$dest.cudnn" --features cudnn --example resnet &&
        mv "$dest.cudnn/resnet" "$dest/resnet-cudnn" && rm -rf "$dest.cudnn"
}

gpu_pack() {
    local src=$1 dir=$2
    # Every binary carries candle's kernel images: one stream with a long window stores them
    # once (1.7 GB of binaries in ~44 MB; separate files would take ~245 MB).
    mkdir -p "$dir"
    tar cf - -C "$src" . | zstd -q -f --long=31 -12 -T0 -o "$dir/binaries.tar.zst" || return 1
    du -sh "$dir/binaries.tar.zst"
}

gpu_unpack() {
    local dir=$1 want=$2 f
    if [ -f "$dir/binaries.tar.zst" ] && [ ! -e "$dir/$want" ]; then
        command -v zstd >/dev/null ||
            { echo "unpacking $dir/binaries.tar.zst needs zstd" >&2; return 1; }
        zstd -q -d --long=31 -c "$dir/binaries.tar.zst" | tar xf - -C "$dir" || return 1
    fi
    for f in "$dir"/*.xz; do
        [ -e "$f" ] || continue
        [ -e "${f%.xz}" ] || xz -dk -T0 "$f" || return 1
    done
    find "$dir" -maxdepth 1 -type f ! -name '*.zst' ! -name '*.xz' -exec chmod +x {} +
}

gpu_libraries() {
    local py=${1:-python3} extra
    # Every folder of PyPI's nvidia-* packages (a namespace package: one or several paths).
    extra=$("$py" - 2>/dev/null <<'PY'
import os
try:
    import nvidia
except ImportError:
    raise SystemExit
dirs = set()
for base in nvidia.__path__:
    for root, _, files in os.walk(base):
        if any(f.startswith("lib") and ".so" in f for f in files):
            dirs.add(root)
print(":".join(sorted(dirs)))
PY
    )
    if [ -n "$extra" ]; then
        export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$extra"
    fi
}
