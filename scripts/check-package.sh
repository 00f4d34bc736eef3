#!/usr/bin/env bash
# What `cargo package` would publish: the library's sources, its kernels, its build script and
# its documents, and nothing of the test machinery. Fails naming what is missing or extra; then
# builds the packaged crate on its own (`cargo package`'s verification, default features).
set -euo pipefail
cd "$(dirname "$0")/.."
list=$(cargo package --list --allow-dirty 2>/dev/null)
fail=0
for need in Cargo.toml build.rs README.md src/lib.rs kernels/stats.cu kernels/compat.cuh docs/faults.md LICENSE-MIT LICENSE-APACHE; do
    grep -qx "$need" <<<"$list" || { echo "FAIL: the package lacks $need"; fail=1; }
done
for path in $(git ls-files src kernels); do
    case "$path" in
    *.rs | *.cu | *.cuh) grep -qx "$path" <<<"$list" || { echo "FAIL: the package lacks $path"; fail=1; } ;;
    esac
done
extra=$(grep -E '^(tests|benches|examples|gpu-sim|scripts|target|\.ci)/' <<<"$list" || true)
[ -z "$extra" ] || { echo "FAIL: the package holds test machinery:"; echo "$extra"; fail=1; }
[ "$fail" = 0 ] && echo "ok   the package holds $(wc -l <<<"$list") files, none of the test machinery"
[ "$fail" = 0 ] || exit 1
cargo package --allow-dirty --quiet
echo "ok   the packaged crate builds on its own"
