#!/usr/bin/env python3
"""The table of docs/benchmarks.md from the JSON files scripts/bench-collectives.sh writes.

Usage: python3 scripts/bench_collectives_table.py target/bench-collectives
Ratios are against baselines of the same run: the memcpy of the minimum traffic (its source
written long before, and written just before, as a gradient fresh from backward() is) and gloo
for thread ranks, MPI's own MPI_Allreduce for the MPI backend, and the f32 sync for the 16-bit wires.
"""
import json
import os
import sys


def load(d, name):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else None


def main():
    d = sys.argv[1]
    threads, gloo, mpi = load(d, "threads.json"), load(d, "gloo.json"), load(d, "mpi.json")
    print(f"{threads['ranks']} ranks, one bucket of {threads['mib']:g} MiB of f32, "
          f"median of {threads['iters']} rounds\n")
    print("| backend | what | ms | vs memcpy of the minimum traffic | vs the same, source fresh | vs gloo | vs raw MPI_Allreduce | vs f32 sync | max diff from the f32 sync |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = gloo["median_s"] if gloo else None
    for run, name in ((threads, "ThreadGroup"), (mpi, "MPI")):
        if run is None:
            continue
        rows = {r["name"]: r for r in run["rows"]}
        # The memcpy baselines are the thread ranks': MPI's run copies in 4 processes, not
        # beside the threads, and its memcpy rows are left out.
        threads_only = name == "ThreadGroup"
        memcpy = rows.get("memcpy of the minimum traffic", {}).get("median_s") if threads_only else None
        fresh = rows.get("memcpy of the minimum traffic, source fresh", {}).get("median_s") if threads_only else None
        raw = rows.get("raw MPI_Allreduce", {}).get("median_s")
        f32 = rows["sync_gradients, f32 wire"]["median_s"]
        for r in run["rows"]:
            if not threads_only and r["name"].startswith("memcpy"):
                continue
            t = r["median_s"]
            ratio = lambda base: f"{t / base:.2f}×" if base else "–"
            sync = r["name"].startswith("sync_gradients")
            diff = r.get("max_diff")
            print(f"| {name} | {r['name']} | {t * 1e3:.2f} | {ratio(memcpy)} | {ratio(fresh)} | "
                  f"{ratio(g) if name == 'ThreadGroup' else '–'} | {ratio(raw)} | "
                  f"{ratio(f32) if sync else '–'} | {'–' if diff is None else f'{diff:.1e}'} |")
    if gloo:
        print(f"| gloo (PyTorch {gloo.get('torch', '')}, {gloo['ranks']} processes) | all_reduce (sum, then / world) | {g * 1e3:.2f} | – | – | 1.00× | – | – | – |")


if __name__ == "__main__":
    main()
