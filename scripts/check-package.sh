#!/usr/bin/env bash
# What `cargo package` would publish, for both crates of the workspace: the library's sources,
# its kernels, its build script and its documents, and nothing of the test machinery; the
# start-up crate's sources, README and licences. Fails naming what is missing or extra; then
# packages both and builds each packaged crate on its own (`cargo package`'s
# verification, default features: candle-distributed is built against the packaged
# candle-rendezvous, not the folder).
set -euo pipefail
cd "$(dirname "$0")/.."
list=$(cargo package -p candle-distributed --list --allow-dirty 2>/dev/null)
fail=0
for need in Cargo.toml build.rs README.md src/lib.rs kernels/stats.cu kernels/compat.cuh docs/faults.md LICENSE-MIT LICENSE-APACHE; do
    grep -qx "$need" <<<"$list" || { echo "FAIL: the package lacks $need"; fail=1; }
done
for path in $(git ls-files src kernels); do
    case "$path" in
    *.rs | *.cu | *.cuh) grep -qx "$path" <<<"$list" || { echo "FAIL: the package lacks $path"; fail=1; } ;;
    esac
done
extra=$(grep -E '^(tests|benches|examples|gpu-sim|scripts|target|candle-rendezvous|\.ci)/' <<<"$list" || true)
[ -z "$extra" ] || { echo "FAIL: the package holds test machinery:"; echo "$extra"; fail=1; }
[ "$fail" = 0 ] && echo "ok   the package holds $(wc -l <<<"$list") files, none of the test machinery"
[ "$fail" = 0 ] || exit 1
rlist=$(cargo package -p candle-rendezvous --list --allow-dirty 2>/dev/null)
for need in Cargo.toml README.md LICENSE-MIT LICENSE-APACHE src/lib.rs; do
    grep -qx "$need" <<<"$rlist" || { echo "FAIL: candle-rendezvous's package lacks $need"; exit 1; }
done
for path in $(git ls-files candle-rendezvous/src); do
    grep -qx "${path#candle-rendezvous/}" <<<"$rlist" || { echo "FAIL: candle-rendezvous's package lacks $path"; exit 1; }
done
echo "ok   candle-rendezvous's package holds $(wc -l <<<"$rlist") files"
cargo package -p candle-rendezvous -p candle-distributed --allow-dirty --quiet
echo "ok   both packaged crates build on their own"
