# Sourced by the CUDA scripts after scripts/nvcc-env.sh: generates stub shared libraries
# (libcuda.so.1, libnccl.so.2, libcublas.so.13, libcudnn.so.9 for the `cudnn` feature, ...)
# from the function names in cudarc's source, with the real libraries' sonames, so that CUDA test and example binaries link on a machine
# without a GPU driver; on a GPU machine the same binaries load the real libraries. Exports
# CUDA_STUBS (the folder) and RUSTFLAGS with it as a native search path. Needs gcc.
root=$(pwd)
cargo fetch -q
ver=$(awk '/^name = "cudarc"/{getline; print $3}' Cargo.lock | tr -d '"' | head -1)
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-"$ver" | head -1)
[ -d "$src" ] || { echo "cuda-stubs: cudarc $ver sources not found" >&2; return 1; }
CUDA_STUBS="$root/target/cuda-stubs"
mkdir -p "$CUDA_STUBS"
grep -rohE '^\s*(pub )?(unsafe )?fn (cu|nccl|nvrtc|curand|cublas)[A-Za-z0-9_]*' "$src/src" |
    grep -oE '(cu|nccl|nvrtc|curand|cublas)[A-Za-z0-9_]*$' | sort -u >"$CUDA_STUBS/syms.txt"
stub() { # name soname regex [exclude-regex]
    local f="$CUDA_STUBS/$1.c"
    grep -E "$3" "$CUDA_STUBS/syms.txt" | { if [ -n "${4:-}" ]; then grep -vE "$4"; else cat; fi; } |
        awk '{print "void " $1 "(void) {}"}' >"$f"
    gcc -shared -fPIC -o "$CUDA_STUBS/lib$1.so" -Wl,-soname,"$2" "$f"
    ln -sf "lib$1.so" "$CUDA_STUBS/$2"
}
stub cuda libcuda.so.1 '^cu[A-Z]'
stub nccl libnccl.so.2 '^nccl'
stub nvrtc libnvrtc.so.13 '^nvrtc'
stub curand libcurand.so.10 '^curand'
stub cublas libcublas.so.13 '^cublas' '^cublasLt'
stub cublasLt libcublasLt.so.13 '^cublasLt'
stub cudnn libcudnn.so.9 '^cudnn'
ln -sf "$CUDA_PATH/lib/libcudart.so.13" "$CUDA_STUBS/libcudart.so"
ln -sf "$CUDA_PATH/lib/libcudart.so.13" "$CUDA_STUBS/libcudart.so.13"
export CUDA_STUBS RUSTFLAGS="${RUSTFLAGS:-} -L native=$CUDA_STUBS"
