#!/usr/bin/env python3
"""Prints the README's benchmark table from criterion's results of `cargo bench --bench batch_norm`.

Reads target/criterion/<shape>_<layout>/<bench>/new/estimates.json (median, ms) and the same
run's candle-nn numbers; PyTorch's are the reference figures of DESIGN.md section 8, measured on
a machine of the same kind with the same allocator setting (not in this run).
"""
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "target" / "criterion"
SHAPES = ["32x64x32x32", "64x256x14x14", "8x32x112x112"]
# PyTorch 2.15, 2 threads: forward (NCHW, NHWC), forward + backward (NCHW, NHWC), ms.
TORCH = {
    "32x64x32x32": (2.3, 1.0, 4.7, 3.2),
    "64x256x14x14": (3.5, 1.4, 7.4, 4.6),
    "8x32x112x112": (3.5, 2.0, 6.7, 6.8),
}


def median_ms(group, bench):
    path = ROOT / group / bench / "new" / "estimates.json"
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


print("| shape | layout | forward ms (GB/s) | op backward ms (GB/s) | fwd + op bwd ms | vs PyTorch fwd / fwd+bwd | autograd fwd+bwd ms | candle-nn fwd / autograd fwd+bwd ms | speed-up vs candle-nn (autograd) |")
print("|---|---|---|---|---|---|---|---|---|")
for shape in SHAPES:
    for i, layout in enumerate(["nchw", "nhwc"]):
        g = f"{shape}_{layout}"
        fwd = median_ms(g, "syncbn_forward")
        bwd = median_ms(g, "syncbn_backward_ops")
        auto = median_ms(g, "syncbn_forward_backward_autograd")
        cfwd = median_ms(g, "candle_nn_forward")
        cauto = median_ms(g, "candle_nn_forward_backward_autograd")
        tf, tfb = TORCH[shape][i], TORCH[shape][2 + i]
        both = fwd + bwd if fwd and bwd else None
        ratio = f"{fwd / tf:.2f}× / {both / tfb:.2f}×" if both else "–"
        speed = f"{cauto / auto:.1f}×" if cauto and auto else "–"
        print(
            f"| {shape} | {layout.upper()} | {fmt(fwd)} ({gbs(fwd, shape, 3):.0f}) | {fmt(bwd)} ({gbs(bwd, shape, 5):.0f}) "
            f"| {fmt(both)} | {ratio} | {fmt(auto)} | {fmt(cfwd)} / {fmt(cauto)} | {speed} |"
        )
