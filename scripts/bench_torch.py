#!/usr/bin/env python3
"""PyTorch's training-mode BatchNorm2d on the benchmark's shapes, as the baseline of the README table.

Usage: python scripts/bench_torch.py > target/bench_torch.json
BENCH_ONLY=64x256x14x14_nhwc (a key as below) times that shape and layout alone; BENCH_REPEATS
sets the calls per median (30). Prints JSON
{"<N>x<C>x<H>x<W>_<nchw|nhwc>": {"forward": ms, "forward_backward": ms,
"forward_backward_no_accumulation": ms}} with median milliseconds, run with the same thread
count and allocator setting as the Rust benchmark. The backward is seeded with a dense gradient
of ones (what candle's `y.backward()` does), made once outside the timing. "forward_backward"
is `y.backward(ones)`, which also adds the gradients into `x.grad` and the parameters' `.grad`;
"forward_backward_no_accumulation" is `torch.autograd.grad` of the input and both parameters,
which returns the gradients without adding them anywhere.
"""
import json
import os
import statistics
import sys
import time

import torch

SHAPES = [(32, 64, 32, 32), (64, 256, 14, 14), (8, 32, 112, 112)]
REPEATS = int(os.environ.get("BENCH_REPEATS", "30"))
ONLY = os.environ.get("BENCH_ONLY")


def median_ms(fn):
    for _ in range(5):
        fn()
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main():
    torch.manual_seed(0)
    out = {}
    for n, c, h, w in SHAPES:
        for layout in ("nchw", "nhwc"):
            if ONLY and ONLY != f"{n}x{c}x{h}x{w}_{layout}":
                continue
            fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
            bn = torch.nn.BatchNorm2d(c).train().to(memory_format=fmt)
            x = (torch.randn(n, c, h, w) * 2 + 1).to(memory_format=fmt)
            xg = x.clone().requires_grad_(True)
            ones = torch.ones_like(x).to(memory_format=fmt)

            def fwd():
                with torch.no_grad():
                    bn(x)

            def fwd_bwd():
                y = bn(xg)
                y.backward(ones)

            def fwd_grad():
                torch.autograd.grad(bn(xg), (xg, bn.weight, bn.bias), ones)

            out[f"{n}x{c}x{h}x{w}_{layout}"] = {
                "forward": median_ms(fwd),
                "forward_backward": median_ms(fwd_bwd),
                "forward_backward_no_accumulation": median_ms(fwd_grad),
            }
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}",
        file=sys.stderr,
    )
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
