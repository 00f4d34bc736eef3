#!/usr/bin/env bash
# scripts/plant-defects.sh [NAME...]: the planted-defect suite. Each patch in tests/plants/ is a
# small mistake in the crate or its kernels, of a kind real GPU and collective code makes; its
# header says which (Models:) and which test must catch it (Catch:). For each patch (or the
# ones named): apply it, rebuild what it touches, run that test, require that it FAILS, revert.
# A patch whose test passes is a gap in the tests or the simulator: the script fails. Prints a
# table: patch, caught by, result, seconds.
#
# Catch: lines name a runner and its arguments:
#   cpu TEST [FILTER...]      cargo test --test TEST on the CPU (thread ranks)
#   sim TEST [FILTER...]      the same on simulated GPUs (gpu-sim/), blocks on one thread
#   sim4 TEST [FILTER...]     the same with each launch's blocks on 4 OS threads (random:7)
#   nccl TEST [FILTER...]     the same on 4 simulated GPUs with the simulated NCCL
# All build with --features cuda,nccl into target/cuda, as scripts/test-gpu-sim.sh does (run
# after it, only the crate and the named test rebuild). A test that runs longer than
# PLANT_LIMIT seconds (300) is ended, and the plant counts as caught (it hung). The working tree must be clean where a
# patch applies; a patch is reverted even when the script is interrupted.
#
# Not in CI (about 5 minutes after scripts/test-gpu-sim.sh, which would take CI past its 80):
# run it before a change to gpu-sim/, kernels/, tests/emu/ or candle-collective/src/, and after
# adding a test meant to catch one of these.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cuda-build-env.sh
# Seconds a Catch: command may run.
limit=${PLANT_LIMIT:-300}

# cargo test's arguments for a Catch: line's test and filters.
test_args() {
    local t=$1
    shift
    echo "--features $features -q --test $t -- $*"
}
run_catch() { # RUNNER TEST [FILTER...]
    local runner=$1
    shift
    case $runner in
        cpu) cargo test $(test_args "$@") ;;
        sim) GPU_SIM_BLOCK_THREADS=1 cargo test $(test_args "$@") ;;
        sim4) GPU_SIM_BLOCK_THREADS=4 GPU_SIM_SCHEDULE=random:7 cargo test $(test_args "$@") ;;
        nccl) GPU_SIM_DEVICES=4 cargo test $(test_args "$@") ;;
        *) echo "unknown runner '$runner'" >&2; return 2 ;;
    esac
}

plants=()
if [ $# -gt 0 ]; then
    for n in "$@"; do plants+=("tests/plants/$n.patch"); done
else
    plants=(tests/plants/*.patch)
fi

applied=""
kernels=""
catch_pid=""
# Puts the tree back (and, for a patch to the kernels or the simulator, their libraries).
revert() {
    if [ -n "$applied" ]; then
        git apply -R "$applied"
        applied=""
        if [ -n "$kernels" ]; then
            gpu-sim/build.sh >/dev/null 2>&1 || echo "warning: gpu-sim/build.sh failed after the revert"
            kernels=""
        fi
    fi
}
# An interrupt ends the running test too (timeout runs it in a process group of its own).
interrupted() {
    [ -n "$catch_pid" ] && kill -TERM -- "-$catch_pid" 2>/dev/null
    revert
    exit 130
}
trap revert EXIT
trap interrupted INT TERM
export -f run_catch test_args
export features

. scripts/gpu-sim-env.sh >/dev/null
log=$(mktemp -d)
rows=()
missed=0
for p in "${plants[@]}"; do
    name=$(basename "$p" .patch)
    models=$(sed -n 's/^Models: //p' "$p" | head -1)
    catch=$(sed -n 's/^Catch: //p' "$p" | head -1)
    [ -n "$models" ] && [ -n "$catch" ] || { echo "FAIL: $p has no Models: or Catch: line"; exit 1; }
    echo "== $name: $models"
    echo "   caught by: $catch"
    git apply --check "$p" || { echo "FAIL: $p does not apply to this tree"; exit 1; }
    git apply "$p"
    applied=$p
    start=$SECONDS
    # Rebuild what the patch touches; a patch that does not build is a broken plant, not a catch.
    read -r -a words <<<"$catch"
    touched=$(git apply --numstat "$p")
    if grep -qE '(kernels|gpu-sim|tests/emu)/' <<<"$touched"; then
        kernels=yes
        gpu-sim/build.sh >"$log/$name.build" 2>&1 || { cat "$log/$name.build"; echo "FAIL: $name does not build"; exit 1; }
    fi
    if ! cargo test --features $features -q --no-run --test "${words[1]}" >>"$log/$name.build" 2>&1; then
        cat "$log/$name.build"
        echo "FAIL: $name does not build"
        exit 1
    fi
    # A plant that hangs its test counts as caught when the limit ends it.
    rc=0
    timeout "$limit" bash -c 'run_catch "$@"' _ "${words[@]}" >"$log/$name.log" 2>&1 &
    catch_pid=$!
    wait "$catch_pid" || rc=$?
    catch_pid=""
    if [ "$rc" -eq 0 ]; then
        result="MISSED"
        missed=$((missed + 1))
        tail -20 "$log/$name.log"
    elif [ "$rc" -eq 124 ]; then
        result="caught (hung; ended after $limit s)"
    else
        result="caught"
        grep -m3 -E "panicked|FAILED|race|error" "$log/$name.log" | cut -c1-160 | sed 's/^/   /' || true
    fi
    revert
    secs=$((SECONDS - start))
    echo "   $result in $secs s"
    rows+=("| \`$name\` | $models | \`$catch\` | $result | $secs |")
done

echo
echo "| patch | models | caught by | result | seconds |"
echo "|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
rm -rf "$log"
if [ "$missed" -gt 0 ]; then
    echo "FAIL: $missed planted defect(s) not caught"
    exit 1
fi
echo "ok   every planted defect caught"
