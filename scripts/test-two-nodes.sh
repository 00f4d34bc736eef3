#!/usr/bin/env bash
# Two machines rehearsed on one: two torchrun agents (--nnodes 2, c10d rendezvous), each in a
# network namespace of its own joined by a veth pair (10.87.0.1 and 10.87.0.2) and with a host
# name of its own (a UTS namespace), on simulated GPUs (gpu-sim/: each "machine" has its own
# device 0, 1, ...). The agents' rendezvous and store, the ranks' addresses and NCCL's id
# exchange cross a real interface. Checked:
#   1. node-local groups from the launch's variables (groups_of with LOCAL_WORLD_SIZE), 4 + 4
#      ranks and 3 + 5 ranks: each rank's group is its machine's ranks;
#   2. the ResNet example's --check across the two machines (8 ranks against one process);
#   3. one machine's worker killed after step 3: both agents restart the group, which resumes
#      from step 2's checkpoint (--resume auto) and ends with the uninterrupted run's
#      checkpoint, bit for bit.
# Needs root (network namespaces; CI runs as root), iproute2, and torchrun from the PyTorch of
# scripts/test-torch.sh (TORCH_VENV). Builds in target/cuda, as scripts/test-gpu-sim.sh.
# KEEP_OUT=1 keeps the agents' logs (their folder is printed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
[ "$(id -u)" = 0 ] || { echo "FAIL: network namespaces need root"; exit 1; }
command -v ip >/dev/null || { echo "FAIL: no ip (iproute2)"; exit 1; }
torchrun="${TORCH_VENV:-.venv-torch}/bin/torchrun"
[ -x "$torchrun" ] || { echo "FAIL: no torchrun at $torchrun: run scripts/test-torch.sh first"; exit 1; }
torchrun=$(realpath "$torchrun")
. scripts/cuda-build-env.sh
gpu-sim/build.sh >/dev/null
. scripts/gpu-sim-env.sh
cargo build --features "$features" -q --example resnet --example node_groups
resnet=$(realpath "$CARGO_TARGET_DIR/debug/examples/resnet")
node_groups=$(realpath "$CARGO_TARGET_DIR/debug/examples/node_groups")

tag=$$
ns=("cdn0-$tag" "cdn1-$tag")
addr=(10.87.0.1 10.87.0.2)
out=$(mktemp -d)
cleanup() {
    for n in "${ns[@]}"; do
        ip netns del "$n" 2>/dev/null || true
        rm -rf "/etc/netns/$n"
    done
    if [ -n "${KEEP_OUT:-}" ]; then echo "the agents' logs are kept in $out"; else rm -rf "$out"; fi
}
trap cleanup EXIT
for i in 0 1; do
    ip netns add "${ns[i]}"
    # `ip netns exec` mounts /etc/netns/<name>/hosts over /etc/hosts: each machine resolves
    # both names (torchrun looks its own host name up).
    mkdir -p "/etc/netns/${ns[i]}"
    printf '127.0.0.1 localhost\n%s node0\n%s node1\n' "${addr[0]}" "${addr[1]}" \
        >"/etc/netns/${ns[i]}/hosts"
done
ip link add "cdv0-$tag" type veth peer name "cdv1-$tag"
for i in 0 1; do
    ip link set "cdv$i-$tag" netns "${ns[i]}"
    ip -n "${ns[i]}" addr add "${addr[i]}/24" dev "cdv$i-$tag"
    ip -n "${ns[i]}" link set "cdv$i-$tag" up
    ip -n "${ns[i]}" link set lo up
done

# agent NODE NPROC RUN_ID OUT_FILE PROGRAM ARGS...: torchrun's agent of machine NODE in its
# namespace, named node<NODE>, with NPROC ranks, each a process on simulated GPU LOCAL_RANK;
# torchrun itself without the simulated libraries (PyTorch's CUDA build would load them).
agent() {
    local node=$1 nproc=$2 run=$3 log=$4
    shift 4
    ip netns exec "${ns[node]}" unshare --uts sh -c 'hostname "$0" && exec "$@"' "node$node" \
        env LD_LIBRARY_PATH= "$torchrun" --nnodes 2 --nproc_per_node "$nproc" --node_rank "$node" \
        --rdzv_backend c10d --rdzv_endpoint "${addr[0]}:29400" --rdzv_id "$run" \
        --max-restarts "${RESTARTS:-0}" --no-python \
        env LD_LIBRARY_PATH="$LD_LIBRARY_PATH" GPU_SIM_DEVICES="$nproc" "$@" >"$log" 2>&1
}
# two NPROC0 NPROC1 NAME PROGRAM ARGS...: both agents at once; their logs in $out/NAME-<node>.
two() {
    local n0=$1 n1=$2 name=$3
    shift 3
    local run="$name-$tag"
    agent 0 "$n0" "$run" "$out/$name-0" "$@" &
    local a0=$!
    agent 1 "$n1" "$run" "$out/$name-1" "$@" &
    local a1=$!
    local s0=0 s1=0
    wait $a0 || s0=$?
    wait $a1 || s1=$?
    if [ $s0 -ne 0 ] || [ $s1 -ne 0 ]; then
        echo "FAIL: $name: agents exited with $s0 and $s1"
        tail -n 30 "$out/$name-0" "$out/$name-1"
        exit 1
    fi
}

for split in "4 4" "3 5"; do
    read -r n0 n1 <<<"$split"
    echo "-- [$((SECONDS - started)) s] node-local groups on two machines of $n0 and $n1 ranks"
    two "$n0" "$n1" "groups-$n0-$n1" "$node_groups"
    cat "$out/groups-$n0-$n1-0" "$out/groups-$n0-$n1-1" | python3 -c '
import json, sys
n0, n1 = (int(a) for a in sys.argv[1:])
rows = sorted((json.loads(l) for l in sys.stdin if l.startswith("{")), key=lambda r: r["rank"])
world = n0 + n1
ranks = [r["rank"] for r in rows]
assert ranks == list(range(world)), f"ranks reported: {ranks}"
for r in rows:
    node = 0 if r["rank"] < n0 else 1
    want = list(range(n0)) if node == 0 else list(range(n0, world))
    assert r["host"] == f"node{node}", r
    assert r["local_world_size"] == len(want), r
    assert r["node_ranks"] == want, r
    assert r["world_size"] == world and r["world_sum"] == world, r
print(f"ok   {world} ranks: node0 holds ranks 0..{n0 - 1}, node1 ranks {n0}..{world - 1}, each rank in its machine'"'"'s group")
' "$n0" "$n1"
done

small=(--backend nccl --image-size 8 --train-size 64 --val-size 32 --batch-size 16)
echo "-- [$((SECONDS - started)) s] the ResNet example's --check on two machines of 4 ranks: 8 ranks against one process"
two 4 4 check "$resnet" "${small[@]}" --check --check-steps 2 --out-dir "$out/check"
grep -h "^check: " "$out/check-0" "$out/check-1" | sort -u
grep -q "^check: 8 ranks SyncBatchNorm" "$out/check-0" ||
    { echo "FAIL: the check did not run 8 ranks"; tail -n 30 "$out/check-0"; exit 1; }

echo "-- [$((SECONDS - started)) s] a worker of machine 0 exits after step 3 of 4: both agents restart the group (--max-restarts 2), which resumes from step 2's checkpoint and ends with the uninterrupted run's checkpoint, bit for bit"
restart=("${small[@]}" --epochs 1 --save-every 2 --resume auto)
two 4 4 straight "$resnet" "${restart[@]}" --out-dir "$out/straight"
RESTARTS=2 two 4 4 killed "$resnet" "${restart[@]}" --out-dir "$out/killed" --exit-at-step 3
grep -q "rank 1: exiting after step 3" "$out/killed-0" ||
    { echo "FAIL: rank 1 did not exit"; tail -n 30 "$out/killed-0"; exit 1; }
# (Files, not a pipe: `grep -q` stops reading at its match, and under pipefail the writer's
# SIGPIPE would fail the check.)
grep -q "resuming from .*: epoch 0, step 2" "$out/killed-0" "$out/killed-1" ||
    { echo "FAIL: the restarted group did not resume from step 2's checkpoint"; tail -n 30 "$out/killed-0" "$out/killed-1"; exit 1; }
python3 scripts/same_checkpoint.py "$out/straight" "$out/killed" "the restarted two-machine run"
echo "-- two machines rehearsed in $((SECONDS - started)) s"
