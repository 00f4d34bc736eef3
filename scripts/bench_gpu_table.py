"""The tables of `scripts/bench-gpu.sh`: the crate's figures (OURS, JSON lines from
examples/gpu_bench.rs, examples/host_cost.rs and the ResNet example) beside PyTorch's (THEIRS,
from scripts/torch_gpu_bench.py), joined case by case, with ratios.

    python3 scripts/bench_gpu_table.py [--title TEXT] [--strict] OURS.jsonl THEIRS.jsonl

A case one side lacks shows "–"; a failed step is listed under the tables. Exits 1 when a
table has no row at all (nothing was measured), and with --strict (the rehearsal) also when a
ratio is missing: a case one side did not measure, or a step that failed.
"""

import argparse
import json


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                rows.append(json.loads(line))
    return rows


def fmt(v):
    """One decimal, or three significant digits below 10 (a rehearsal's tiny rates)."""
    if v is None:
        return "–"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


# Ratios that could not be formed (a case one side lacks): what --strict refuses.
MISSING = []


def ratio(a, b):
    if a is None or b is None or b == 0:
        MISSING.append((a, b))
        return "–"
    return f"{a / b:.2f}"


def by(rows, bench):
    return [r for r in rows if r.get("bench") == bench]


def layer_table(ours, theirs):
    torch = {(r["layout"], r["dtype"], r["c"], r["hw"]): r for r in by(theirs, "layer")}
    out = ["| layout | dtype | N × C × H·W | fwd µs | PyTorch | ratio | fwd+bwd µs | PyTorch | ratio "
           "| copy µs | kernels fwd, of copy | kernels bwd, of copy |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = by(ours, "layer")
    seen = {(r["layout"], r["dtype"], r["c"], r["hw"]) for r in rows}
    rows += [dict(t, fwd_us=None, fwd_bwd_us=None, copy_us=None, kernels_fwd_us=None,
                  kernels_bwd_us=None) for k, t in torch.items() if k not in seen]
    for r in rows:
        t = torch.get((r["layout"], r["dtype"], r["c"], r["hw"]), {})
        # The kernels' element accesses over the copy's 2: 3 forward, 5 backward.
        have = r["copy_us"] is not None
        fwd_of_copy = 3 * r["copy_us"] / 2 / r["kernels_fwd_us"] if have and r["kernels_fwd_us"] else None
        bwd_of_copy = 5 * r["copy_us"] / 2 / r["kernels_bwd_us"] if have and r["kernels_bwd_us"] else None
        out.append(
            f"| {r['layout']} | {r['dtype']} | {r['batch']} × {r['c']} × {r['hw']} "
            f"| {fmt(r['fwd_us'])} | {fmt(t.get('fwd_us'))} | {ratio(r['fwd_us'], t.get('fwd_us'))} "
            f"| {fmt(r['fwd_bwd_us'])} | {fmt(t.get('fwd_bwd_us'))} "
            f"| {ratio(r['fwd_bwd_us'], t.get('fwd_bwd_us'))} | {fmt(r['copy_us'])} "
            f"| {'–' if fwd_of_copy is None else f'{100 * fwd_of_copy:.0f} %'} "
            f"| {'–' if bwd_of_copy is None else f'{100 * bwd_of_copy:.0f} %'} |")
    return out


def host_table(ours, theirs):
    torch = {(tuple(r["shape"][1:]), r["what"]): r for r in by(theirs, "host_layer")}
    out = ["| shape | what | SyncBatchNorm µs | candle-nn BatchNorm µs | PyTorch nn.BatchNorm2d µs "
           "| ours / PyTorch |",
           "|---|---|---|---|---|---|"]
    rows = by(ours, "host_layer")
    seen = {(tuple(r["shape"][1:]), r["what"]) for r in rows}
    rows += [dict(t, sync_batch_norm_us=None, candle_nn_us=None)
             for k, t in torch.items() if k not in seen]
    for r in rows:
        t = torch.get((tuple(r["shape"][1:]), r["what"]), {})
        shape = "×".join(str(d) for d in r["shape"])
        out.append(f"| {shape} | {r['what']} | {fmt(r['sync_batch_norm_us'])} "
                   f"| {fmt(r['candle_nn_us'])} | {fmt(t.get('torch_us'))} "
                   f"| {ratio(r['sync_batch_norm_us'], t.get('torch_us'))} |")
    for r in by(ours, "host_sync"):
        out.append(f"| ResNet-20's {r['variables']} gradients ({r['values']} values) "
                   f"| sync_gradients against one all_reduce | {fmt(r['sync_gradients_us'])} "
                   f"| {fmt(r['all_reduce_us'])} (the all_reduce) | – | – |")
    return out


def step_table(ours, theirs):
    torch = {(r["model"], r["precision"]): r for r in by(theirs, "step")}
    out = ["| model | precision | batch, side | ours images/s | PyTorch images/s | ours / PyTorch |",
           "|---|---|---|---|---|---|"]
    rows = by(ours, "step")
    # PyTorch's cases that ours has no row for (its step failed) still show, ours as "–".
    seen = {(r["model"], r["precision"]) for r in rows}
    rows += [{"model": m, "precision": p, "batch": t["batch"], "side": t["side"],
              "images_per_sec": None} for (m, p), t in torch.items() if (m, p) not in seen]
    for r in rows:
        t = torch.get((r["model"], r["precision"]), {})
        size = f"{r['batch']}, {r['side']}×{r['side']}"
        if t and (t["batch"], t["side"]) != (r["batch"], r["side"]):
            size += f" (PyTorch: {t['batch']}, {t['side']}×{t['side']})"
        model = r["model"] + (f", {r['conv']} convolutions" if "conv" in r else "")
        out.append(f"| {model} | {r['precision']} | {size} | {fmt(r['images_per_sec'])} "
                   f"| {fmt(t.get('images_per_sec'))} "
                   f"| {ratio(r['images_per_sec'], t.get('images_per_sec'))} |")
    return out


def ddp_table(ours, theirs):
    torch = next(iter(by(theirs, "ddp")), {})
    rate = {r["overlap"]: r for r in by(ours, "ddp")}
    on, off = rate.get("on", {}), rate.get("off", {})
    world = on.get("world") or off.get("world") or torch.get("world")
    out = ["| GPUs | batch per GPU | ours, overlapped images/s | ours, after the backward | overlapped / after "
           "| PyTorch DDP images/s | overlapped / PyTorch |",
           "|---|---|---|---|---|---|---|"]
    if on or off or torch:
        a, b, t = on.get("images_per_sec"), off.get("images_per_sec"), torch.get("images_per_sec")
        batch = on.get("batch") or off.get("batch") or torch.get("batch")
        out.append(f"| {world} | {batch} | {fmt(a)} | {fmt(b)} | {ratio(a, b)} | {fmt(t)} | {ratio(a, t)} |")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--title", default="")
    p.add_argument("--strict", action="store_true")
    p.add_argument("ours")
    p.add_argument("theirs")
    args = p.parse_args()
    ours, theirs = load(args.ours), load(args.theirs)
    versions = sorted({r["torch"] for r in theirs if "torch" in r})
    devices = sorted({r["device"] for r in theirs if "device" in r})
    if args.title:
        print(f"## {args.title}\n")
    print(f"PyTorch {', '.join(versions) or '–'} on {', '.join(devices) or '–'}. "
          "Ratios: ours / PyTorch's (times: below 1 is faster; images/s: above 1 is faster).")
    empty = False
    for name, table in [
        ("The layer, training mode (ResNet-50's batch-norm sizes)", layer_table),
        ("Host time to issue one layer call (ResNet-20's batch-norm sizes)", host_table),
        ("Training step on one GPU (the ResNet example against the same model in PyTorch)",
         step_table),
        ("Data-parallel ResNet-20 step on every GPU", ddp_table),
    ]:
        rows = table(ours, theirs)
        print(f"\n### {name}\n")
        print("\n".join(rows))
        empty |= len(rows) == 2
    failed = [r for r in ours + theirs if r.get("bench") == "failed"]
    if failed:
        print("\nFailed steps: " + ", ".join(f"{r['step']} (exit {r['status']})" for r in failed))
    if empty:
        print("\nbench_gpu_table: a table has no row (nothing measured there)")
    if args.strict and (MISSING or failed):
        print("\nbench_gpu_table: --strict: a ratio is missing (a case one side lacks, or a failed step)")
        return 1
    return 1 if empty else 0


if __name__ == "__main__":
    raise SystemExit(main())
