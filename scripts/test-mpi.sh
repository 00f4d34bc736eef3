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

# The fault runs: rank 1 never reaches a collective (then, never reaches the duplicate of
# MPI_COMM_WORLD that `world_with_timeout` makes); rank 0's 2 s timeout aborts the job. The job
# must fail, name the timeout, and end well before rank 1's 60 s sleep (the abort ends it).
for hang in all_reduce dup; do
    echo "fault run: a rank that never reaches the $hang aborts the job"
    start=$(date +%s)
    set +e
    out=$(timeout 120 mpirun "${extra[@]}" --oversubscribe -np 2 -x CANDLE_DISTRIBUTED_MPI_HANG=$hang "$bin" 2>&1)
    rc=$?
    set -e
    took=$(( $(date +%s) - start ))
    echo "$out" | tail -n 12
    if [ "$rc" = 0 ] || [ "$rc" = 124 ]; then
        echo "FAIL: the job's exit status is $rc (expected an aborted job)"; exit 1
    fi
    grep -q "timed out after 2s in $hang; aborting the MPI job" <<<"$out" ||
        { echo "FAIL: no timeout message"; exit 1; }
    # The flight recorder's lines follow the message: the stuck all-reduce, never agreed on.
    if [ "$hang" = all_reduce ]; then
        grep -q "mpi rank 0: the last 1 collectives" <<<"$out" &&
            grep -q "all_reduce #0 F32×2, enqueued, enqueued at" <<<"$out" ||
            { echo "FAIL: no flight record of the stuck call"; exit 1; }
    fi
    [ "$took" -lt 45 ] || { echo "FAIL: the job took ${took} s"; exit 1; }
    echo "ok   a rank that never reaches the $hang aborts the job (status $rc after ${took} s)"
done
