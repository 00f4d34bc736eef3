#!/usr/bin/env python3
"""PyTorch's gloo all-reduce on CPU processes: the baseline of examples/sync_bench.rs's thread ranks.

Usage: python scripts/bench_gloo.py --ranks 4 --mib 25 --iters 10 --json target/bench_gloo.json
Each of the --ranks processes (one per rank, spawned here, rendezvous over a local TCP port)
all-reduces one f32 tensor of --mib MiB with dist.all_reduce(SUM) followed by a division by the
world size (what ReduceOp.AVG means; gloo has no AVG). Every round is timed on rank 0 from a
barrier to a barrier, as the Rust side times its variants; the median of --iters rounds after two
of warm-up is written as JSON {"ranks", "mib", "iters", "torch", "median_s"}.
"""
import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, args, port, queue):
    # One thread per process: the ranks share the machine's cores, as the thread ranks do.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks
    )
    n = int(args.mib * 1048576 / 4)
    g = torch.Generator().manual_seed(rank)
    grad = (torch.rand(n, generator=g) * 2 - 1) * (rank + 1)
    times = []
    for i in range(args.iters + 2):
        t = grad.clone()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t.div_(args.ranks)
        dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(statistics.median(times))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=float, default=25.0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", help="write the result here as JSON")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(rank_main, args=(args, free_port(), queue), nprocs=args.ranks, join=True)
    median = queue.get()
    print(f"gloo all_reduce (sum, then / world): {args.ranks} processes, "
          f"{args.mib} MiB of f32, median of {args.iters}: {median * 1e3:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "mib": args.mib, "iters": args.iters,
                       "torch": torch.__version__, "median_s": median}, f, indent=1)


if __name__ == "__main__":
    main()
