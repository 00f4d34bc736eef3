"""PyTorch's side of `cargo bench --bench step_breakdown`: the same ResNet-20 (16x16 inputs, f32,
BatchNorm, AdamW), one process, the same thread count, the same op families at the same shapes.

    .venv-torch/bin/python scripts/torch_step.py [threads]

Prints a table with the columns of the Rust bench. Needs PyTorch (scripts/test-torch.sh
installs it into .venv-torch).
"""

import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SIDE = 16
REPS = 7
# (cin, cout, kernel, stride, input side, count): ResNet-20's 21 convolutions.
CONVS = [
    (3, 16, 3, 1, 16, 1),
    (16, 16, 3, 1, 16, 6),
    (16, 32, 3, 2, 16, 1),
    (16, 32, 1, 2, 16, 1),
    (32, 32, 3, 1, 8, 5),
    (32, 64, 3, 2, 8, 1),
    (32, 64, 1, 2, 8, 1),
    (64, 64, 3, 1, 4, 5),
]
NORMS = [(16, 16, 7), (32, 8, 7), (64, 4, 7)]


class Block(nn.Module):
    def __init__(self, cin, c, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.down = None
        if stride != 1 or cin != c:
            self.down = nn.Sequential(nn.Conv2d(cin, c, 1, stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet20(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for i, w in enumerate([16, 32, 64]):
            for j in range(3):
                layers.append(Block(cin, w, 2 if j == 0 and i > 0 else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


def timed(f):
    f()
    ms = []
    for _ in range(REPS):
        t = time.perf_counter()
        f()
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms)


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    print(f"PyTorch {torch.__version__}, ResNet-20, f32, {SIDE}x{SIDE}, BatchNorm, AdamW; one process, "
          f"{torch.get_num_threads()} threads; medians of {REPS}")
    print()
    print("| batch | step ms | images/s | forward (whole model) ms | conv forward | conv backward | batch norm fwd+bwd | optimizer | the rest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (32, 128):
        model = ResNet20()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(n, 3, SIDE, SIDE)
        y = torch.arange(n) % 10

        def fwd():
            return F.cross_entropy(model(x), y)

        def step():
            opt.zero_grad(set_to_none=True)
            fwd().backward()
            opt.step()

        forward = timed(fwd)
        fwd().backward()
        optimizer = timed(opt.step)
        whole = timed(step)
        conv_f = conv_b = 0.0
        for cin, cout, k, stride, side, count in CONVS:
            xi = torch.randn(n, cin, side, side, requires_grad=True)
            w = (torch.randn(cout, cin, k, k) * 0.1).requires_grad_()
            f = timed(lambda: F.conv2d(xi, w, stride=stride, padding=k // 2))
            fb = timed(lambda: F.conv2d(xi, w, stride=stride, padding=k // 2).sum().backward())
            conv_f += f * count
            conv_b += max(fb - f, 0.0) * count
        bn_t = 0.0
        for c, side, count in NORMS:
            bn = nn.BatchNorm2d(c)
            xi = torch.randn(n, c, side, side, requires_grad=True)
            z = torch.randn(n, c, side, side, requires_grad=True)
            bn_t += timed(lambda: F.relu(bn(xi) + z).sum().backward()) * count
        rest = whole - conv_f - conv_b - bn_t - optimizer

        def pct(v):
            return f"{v:.0f} ms ({100 * v / whole:.0f} %)"

        print(f"| {n} | {whole:.0f} | {n / (whole / 1e3):.0f} | {forward:.0f} | {pct(conv_f)} | {pct(conv_b)} | "
              f"{pct(bn_t)} | {pct(optimizer)} | {pct(rest)} |")


if __name__ == "__main__":
    main()
