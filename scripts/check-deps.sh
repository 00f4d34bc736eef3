#!/usr/bin/env bash
# What a CPU-only build compiles: none of the shared key's cryptography, which only the NCCL
# start-up uses (candle-rendezvous's `keys` feature, turned on by `nccl`). Reads `cargo tree` of
# the normal dependencies, with default features, of the library and of the collectives crate
# it builds on (which a program may use alone), then with `nccl` (where the crypto crates must
# appear: the check itself is shown to see them).
set -euo pipefail
cd "$(dirname "$0")/.."
crypto="hmac sha2 hkdf digest chacha20poly1305 chacha20 poly1305 aead cipher zeroize subtle"
fail=0
for pkg in candle-distributed candle-collective; do
    tree() { cargo tree -p "$pkg" -e normal --prefix none --format '{p}' "$@" | awk '{print $1}' | sort -u; }
    cpu=$(tree)
    nccl=$(tree --features nccl)
    bad=0
    for c in $crypto; do
        if grep -qx "$c" <<<"$cpu"; then
            echo "FAIL: a CPU-only build of $pkg compiles $c:"
            cargo tree -p "$pkg" -e normal -i "$c" | head -20
            bad=1
        fi
        grep -qx "$c" <<<"$nccl" || { echo "FAIL: the check does not see $c in $pkg's nccl build either"; bad=1; }
    done
    if [ "$bad" = 0 ]; then
        echo "ok   a CPU-only build of $pkg compiles $(wc -l <<<"$cpu") crates, none of: $crypto"
        echo "ok   with nccl: $(wc -l <<<"$nccl") crates, the shared key's cryptography among them"
    fi
    fail=$((fail | bad))
done
[ "$fail" = 0 ]
