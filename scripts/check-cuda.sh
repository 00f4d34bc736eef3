#!/usr/bin/env bash
# The `cuda` and `nccl` features without a GPU: lints every target, links every test and
# example binary against stub CUDA libraries (scripts/cuda-stubs.sh) and the ResNet example
# with `cudnn` too, runs the checks of the
# embedded kernel images (the library's fatbin unit tests, with the stubs loaded; and
# cuobjdump's list of each image), and lists the CUDA tests. nvcc 13.0 and cuobjdump come from
# PyPI (scripts/nvcc-env.sh). Builds in target/cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cuda-build-env.sh

echo "-- clippy --features $features --all-targets"
cargo clippy --features $features --all-targets -- -D warnings

echo "-- cargo doc --features $features, the library and the examples (warnings are errors)"
# With the examples, whose dev-dependencies unify features as clippy's --all-targets did: the
# dependencies checked for clippy serve here. The library alone is another feature set, and
# rebuilt every dependency down to candle's CUDA kernels (minutes).
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --lib --examples --features $features

echo "-- link every test and example binary"
# JSON on stdout (diagnostics rendered on stderr): the binaries, and the library's OUT_DIR with
# the kernel images (from this build: a separate `cargo build --lib` would rebuild every
# dependency with other features).
out_dir=$(cargo test --features $features --tests --examples --no-run \
    --message-format=json-render-diagnostics |
    python3 -c 'import sys, json
out = ""
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print("  built", m["executable"], file=sys.stderr)
    if m.get("reason") == "build-script-executed" and "candle-distributed" in m["package_id"]:
        out = m["out_dir"]
print(out)')
[ -d "$out_dir" ] || { echo "FAIL: no OUT_DIR of candle-distributed's build script"; exit 1; }

echo "-- the cudnn feature: the ResNet example links against libcudnn.so.9 (candle's cuDNN convolutions)"
# The simulated GPU has no cuDNN (gpu-sim/README.md): this build is linked, never run, here;
# scripts/test-gpu.sh runs it on a GPU.
cargo build --features $features,cudnn --example resnet \
    --message-format=json-render-diagnostics | python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' >"$CARGO_TARGET_DIR/resnet-cudnn.path"
resnet_cudnn=$(cat "$CARGO_TARGET_DIR/resnet-cudnn.path")
readelf -d "$resnet_cudnn" | grep -q 'NEEDED.*libcudnn\.so\.9' ||
    { echo "FAIL: $resnet_cudnn does not need libcudnn.so.9"; exit 1; }
echo "ok   $resnet_cudnn needs libcudnn.so.9"
# The plain build's binary back at target/cuda/debug/examples/resnet (cargo links the last
# build's there; nothing is recompiled).
cargo build --features $features --example resnet -q

echo "-- the embedded kernel images (library unit tests, stub libraries loaded)"
LD_LIBRARY_PATH="$CUDA_STUBS" cargo test --features $features --lib fatbin

echo "-- cuobjdump --list-elf --list-ptx on every image"
for k in kernels/*.cu; do
    img="$out_dir/$(basename "$k" .cu).fatbin"
    listing=$(cuobjdump --list-elf --list-ptx "$img")
    for want in 'sm_80\.cubin' 'sm_90\.cubin' 'sm_90\.ptx'; do
        grep -qE "$want" <<<"$listing" || { echo "FAIL $img lacks $want:"; echo "$listing"; exit 1; }
    done
    echo "ok   $(basename "$img"): $(grep -oE 'sm_[0-9]+\.(cubin|ptx)' <<<"$listing" | tr '\n' ' ')"
done

echo "-- the CUDA test binaries list their tests (they load against the stubs)"
for t in cuda max_pool; do
    LD_LIBRARY_PATH="$CUDA_STUBS" cargo test --features $features --test "$t" -- --list | tail -n 1
done
