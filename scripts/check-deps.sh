#!/usr/bin/env bash
# What a CPU-only build of the library compiles: none of the shared key's cryptography, which
# only the NCCL start-up uses (candle-rendezvous's `keys` feature, turned on by `nccl`). Reads
# `cargo tree` of the library's normal dependencies with default features, then with `nccl`
# (where the crypto crates must appear: the check itself is shown to see them).
set -euo pipefail
cd "$(dirname "$0")/.."
crypto="hmac sha2 hkdf digest chacha20poly1305 chacha20 poly1305 aead cipher zeroize subtle"
tree() { cargo tree -p candle-distributed -e normal --prefix none --format '{p}' "$@" | awk '{print $1}' | sort -u; }
cpu=$(tree)
nccl=$(tree --features nccl)
fail=0
for c in $crypto; do
    if grep -qx "$c" <<<"$cpu"; then
        echo "FAIL: a CPU-only build compiles $c:"
        cargo tree -p candle-distributed -e normal -i "$c" | head -20
        fail=1
    fi
    grep -qx "$c" <<<"$nccl" || { echo "FAIL: the check does not see $c in the nccl build either"; fail=1; }
done
[ "$fail" = 0 ] || exit 1
echo "ok   a CPU-only build compiles $(wc -l <<<"$cpu") crates, none of: $crypto"
echo "ok   with nccl: $(wc -l <<<"$nccl") crates, the shared key's cryptography among them"
