#!/usr/bin/env bash
# What `cargo package` would publish, for the three published crates of the workspace: the
# library's sources, its kernels, its build script and its documents, and nothing of the test
# machinery; the collectives' and the start-up crate's sources, README and licences. Fails
# naming what is missing or extra; then packages all three and builds each packaged crate on
# its own (`cargo package`'s verification, default features: candle-distributed is built
# against the packaged candle-collective and candle-rendezvous, not the folders).
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
extra=$(grep -E '^(tests|benches|examples|gpu-sim|scripts|target|candle-rendezvous|candle-collective|\.ci)/' <<<"$list" || true)
[ -z "$extra" ] || { echo "FAIL: the package holds test machinery:"; echo "$extra"; fail=1; }
[ "$fail" = 0 ] && echo "ok   the package holds $(wc -l <<<"$list") files, none of the test machinery"
[ "$fail" = 0 ] || exit 1
for crate in candle-collective candle-rendezvous; do
    rlist=$(cargo package -p "$crate" --list --allow-dirty 2>/dev/null)
    for need in Cargo.toml README.md LICENSE-MIT LICENSE-APACHE src/lib.rs; do
        grep -qx "$need" <<<"$rlist" || { echo "FAIL: $crate's package lacks $need"; exit 1; }
    done
    for path in $(git ls-files "$crate/src"); do
        grep -qx "${path#"$crate"/}" <<<"$rlist" || { echo "FAIL: $crate's package lacks $path"; exit 1; }
    done
    echo "ok   $crate's package holds $(wc -l <<<"$rlist") files"
done
# cargo treats a registry's crate as immutable: it unpacks each packaged dependency under
# $CARGO_HOME/registry/src/<its temporary registry>/ and reuses that folder, and the build of
# it in the target folder, when the same name and version come again from a registry at the
# same path. A machine or target folder that ran this before would build against stale
# sources of candle-collective 0.1.0. Those unpacked copies (only the temporary registries',
# whose folders start with "-", never a real registry's) and the build fingerprints of the
# three crates go first: cargo rebuilds them.
cargo_home=${CARGO_HOME:-$HOME/.cargo}
target=${CARGO_TARGET_DIR:-target}
rm -rf "$cargo_home"/registry/src/-*/candle-{collective,rendezvous,distributed}-* \
    "$cargo_home"/registry/cache/-*/candle-{collective,rendezvous,distributed}-* \
    "$target"/debug/.fingerprint/candle-{collective,rendezvous,distributed}-*
cargo package -p candle-rendezvous -p candle-collective -p candle-distributed --allow-dirty --quiet
echo "ok   the three packaged crates build on their own"
