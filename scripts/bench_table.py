#!/usr/bin/env python3
"""Prints the benchmark tables of docs/benchmarks.md from one run of both benchmarks.

Reads criterion's results of `cargo bench --bench batch_norm`
(target/criterion/<shape>_<layout>/<bench>/new/estimates.json, median) and PyTorch's numbers from
`scripts/bench_torch.py` (target/bench_torch.json), both measured in the same run with the
same allocator setting and thread count. See `scripts/bench.sh`.
"""
import json
import pathlib

TARGET = pathlib.Path(__file__).resolve().parent.parent / "target"
SHAPES = ["32x64x32x32", "64x256x14x14", "8x32x112x112"]


def median_ms(group, bench):
    path = TARGET / "criterion" / group / bench / "new" / "estimates.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())["median"]["point_estimate"] / 1e6


def gbs(ms, shape, passes):
    n = 1
    for d in shape.split("x"):
        n *= int(d)
    return passes * n * 4 / (ms * 1e-3) / 1e9


def fmt(v):
    return "–" if v is None else f"{v:.2f}"


def ratio(a, b):
    return "–" if a is None or b is None else f"{a / b:.2f}×"


torch = json.loads((TARGET / "bench_torch.json").read_text())
print(
    "| shape | layout | forward ms (GB/s) | op backward ms (GB/s) | fwd + op bwd ms "
    "| autograd fwd+bwd ms | PyTorch fwd / fwd+bwd ms "
    "| ratio to PyTorch: fwd / fwd + op bwd / autograd fwd+bwd "
    "| candle-nn fwd / autograd fwd+bwd ms | speed-up over candle-nn: fwd / autograd fwd+bwd |"
)
print("|---|---|---|---|---|---|---|---|---|---|")
for shape in SHAPES:
    for layout in ["nchw", "nhwc"]:
        g = f"{shape}_{layout}"
        fwd = median_ms(g, "syncbn_forward")
        bwd = median_ms(g, "syncbn_backward_ops")
        auto = median_ms(g, "syncbn_forward_backward_autograd")
        cfwd = median_ms(g, "candle_nn_forward")
        cauto = median_ms(g, "candle_nn_forward_backward_autograd")
        tf, tfb = torch[g]["forward"], torch[g]["forward_backward"]
        both = fwd + bwd if fwd is not None and bwd is not None else None
        print(
            f"| {shape} | {layout.upper()} | {fmt(fwd)} ({gbs(fwd, shape, 3):.0f}) "
            f"| {fmt(bwd)} ({gbs(bwd, shape, 5):.0f}) | {fmt(both)} | {fmt(auto)} "
            f"| {tf:.2f} / {tfb:.2f} | {ratio(fwd, tf)} / {ratio(both, tfb)} / {ratio(auto, tfb)} "
            f"| {fmt(cfwd)} / {fmt(cauto)} | {ratio(cfwd, fwd)} / {ratio(cauto, auto)} |"
        )

print()
print(
    "| shape | layout | autograd fwd+bwd ms | candle's share alone ms | the rest ms "
    "| replay: layer + candle ms (sum) | PyTorch fwd+bwd / without accumulation ms "
    "| ratio: autograd fwd+bwd / the rest to PyTorch fwd+bwd | ratio: layer in the replay "
    "to PyTorch without accumulation |"
)
print("|---|---|---|---|---|---|---|---|---|")
for shape in SHAPES:
    for layout in ["nchw", "nhwc"]:
        g = f"{shape}_{layout}"
        auto = median_ms(g, "syncbn_forward_backward_autograd")
        share = median_ms(g, "candle_autograd_share")
        rest = auto - share if auto is not None and share is not None else None
        layer = median_ms(g, "autograd_replay_layer")
        candle = median_ms(g, "autograd_replay_candle")
        both = layer + candle if layer is not None and candle is not None else None
        tfb = torch[g]["forward_backward"]
        tgrad = torch[g].get("forward_backward_no_accumulation")
        print(
            f"| {shape} | {layout.upper()} | {fmt(auto)} | {fmt(share)} | {fmt(rest)} "
            f"| {fmt(layer)} + {fmt(candle)} ({fmt(both)}) | {tfb:.2f} / {fmt(tgrad)} "
            f"| {ratio(auto, tfb)} / {ratio(rest, tfb)} | {ratio(layer, tgrad)} |"
        )

print()
print(
    "| shape | layout | copy ms (GB/s) | statistics pass ms (GB/s) | forward ms "
    "| forward / 1.5 copies | statistics pass / 0.5 copy |"
)
print("|---|---|---|---|---|---|---|")
for shape in SHAPES:
    for layout in ["nchw", "nhwc"]:
        g = f"{shape}_{layout}"
        copy = median_ms(g, "copy_baseline")
        stats = median_ms(g, "syncbn_stats")
        fwd = median_ms(g, "syncbn_forward")
        if copy is None or stats is None or fwd is None:
            continue
        print(
            f"| {shape} | {layout.upper()} | {fmt(copy)} ({gbs(copy, shape, 2):.0f}) "
            f"| {fmt(stats)} ({gbs(stats, shape, 1):.0f}) | {fmt(fwd)} "
            f"| {fwd / (1.5 * copy):.2f}× | {stats / (0.5 * copy):.2f}× |"
        )
