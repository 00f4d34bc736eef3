#!/usr/bin/env bash
# Builds tests/mpi.rs with the `mpi` feature and runs it on 4 MPI processes (mpirun from Open
# MPI; as root it needs --allow-run-as-root, and --oversubscribe lets 4 ranks share fewer
# cores). Exits non-zero when any rank fails. Needs: apt-get install libopenmpi-dev openmpi-bin
# libclang-dev.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(cargo test --features mpi --test mpi --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "mpi":
        print(m["executable"])')
[ -n "$bin" ] || { cargo test --features mpi --test mpi --no-run; exit 1; }
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-run-as-root)
mpirun "${extra[@]}" --oversubscribe -np 4 "$bin"
