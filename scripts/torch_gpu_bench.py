"""PyTorch's side of `scripts/bench-gpu.sh`: the same measurements as the crate's GPU benchmarks,
on the same GPU, one JSON object per line on stdout.

    python3 scripts/torch_gpu_bench.py layer [--quick] [--device cuda|cpu]
        torch.nn.functional.batch_norm (training) at ResNet-50's batch-norm sizes, batch 32,
        NCHW and channels_last, f32 and bf16: forward, forward + backward (seeded with ones, as
        candle seeds `y.backward()`), and a copy of the same tensor; median of 7 rounds of 50
        calls, the device synchronised around each round (examples/gpu_bench.rs).
    python3 scripts/torch_gpu_bench.py host [--quick] [--device cuda|cpu]
        nn.BatchNorm2d at ResNet-20's sizes (batch 128): the host time to issue a training
        forward, and a forward + backward, without waiting for the device; median of 15 batches
        of 20 calls, the device drained after each batch (examples/host_cost.rs).
    python3 scripts/torch_gpu_bench.py step --model resnet20|resnet50 --batch B --side S
                                            --precision f32|bf16 [--steps N] [--device cuda|cpu]
        Training steps of the ResNet example's architectures (scripts/torch_step.py's ResNet-20;
        torchvision's ResNet-50, written out here), BatchNorm, AdamW (lr 4e-3, weight decay
        5e-4), random images, NCHW; bf16 through autocast. Images/s over N steps after 5.
    python3 scripts/torch_gpu_bench.py ddp --world W --batch B --side S [--steps N] [--device ...]
        The same ResNet-20 step under DistributedDataParallel on W processes (NCCL on GPUs, one
        per rank, SyncBatchNorm; gloo on the CPU), per-rank batch B: global images/s.

`--quick` shrinks the sizes for a rehearsal; `--device cpu` runs where there is no GPU (the
figures are then the CPU's, and say so). f32 is true f32: TF32 is turned off (PyTorch lets
cuDNN use it by default). The DistributedDataParallel model's batch norms are SyncBatchNorm on
GPUs (as the example's default), plain on the CPU (gloo's SyncBatchNorm needs CUDA).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_step import ResNet20  # noqa: E402

# (C, H*W) of ResNet-50's batch-norm layers: stem, then one per stage (H = W).
SIZES = [(64, 112 * 112), (256, 56 * 56), (512, 28 * 28), (1024, 14 * 14), (2048, 7 * 7)]
# ResNet-20's batch-norm inputs at batch 128 (examples/host_cost.rs).
HOST_SHAPES = [(128, 16, 32, 32), (128, 32, 16, 16), (128, 64, 8, 8)]


def emit(**fields):
    fields["torch"] = torch.__version__
    fields["tf32"] = torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
    print(json.dumps(fields), flush=True)


def exact_f32():
    """f32 is f32: no TF32 tensor-core arithmetic in PyTorch's convolutions and products (its
    default for cuDNN), as in candle's plain build. bf16 runs through autocast."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev, f, rounds, iters, wait=True):
    """Median seconds per call over `rounds` rounds of `iters` calls, after 3 warm-up calls; the
    device drained before each round, and before its clock stops when `wait` (else after: the
    time to issue the calls)."""
    for _ in range(3):
        f()
    ts = []
    for _ in range(rounds):
        sync(dev)
        t = time.perf_counter()
        for _ in range(iters):
            f()
        if wait:
            sync(dev)
        ts.append((time.perf_counter() - t) / iters)
        sync(dev)
    return statistics.median(ts)


def us(s):
    return round(s * 1e6, 1)


def layer(args, dev):
    batch, rounds, iters = (2, 2, 3) if args.quick else (32, 7, 50)
    for cl in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            for c, hw in SIZES:
                side = math.isqrt(hw)
                x = (torch.randn(batch, c, side, side, device=dev) * 2 + 3).to(dtype)
                if cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                x.requires_grad_(True)
                w = torch.ones(c, device=dev, requires_grad=True)
                b = torch.zeros(c, device=dev, requires_grad=True)
                rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)

                def fwd():
                    return F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)

                def fwd_bwd():
                    # The gradients returned, not accumulated into .grad (candle's backward()
                    # returns fresh ones): no extra pass over x's gradient per call.
                    y = fwd()
                    torch.autograd.grad(y, (x, w, b), torch.ones_like(y))

                copy = timed(dev, lambda: x.detach().clone(), rounds, iters)
                f = timed(dev, fwd, rounds, iters)
                fb = timed(dev, fwd_bwd, rounds, iters)
                emit(bench="layer", layout="NHWC" if cl else "NCHW",
                     dtype="f32" if dtype == torch.float32 else "bf16", batch=batch, c=c, hw=hw,
                     copy_us=us(copy), fwd_us=us(f), fwd_bwd_us=us(fb), device=dev.type)


def host(args, dev):
    calls, batches = (4, 3) if args.quick else (20, 15)
    for n, c, h, w in HOST_SHAPES:
        if args.quick:
            n = 2
        bn = nn.BatchNorm2d(c).to(dev).train()
        x = torch.randn(n, c, h, w, device=dev, requires_grad=True)
        for what in ("forward", "forward + backward"):
            def call():
                y = bn(x)
                if what != "forward":
                    torch.autograd.grad(y, (x, bn.weight, bn.bias), torch.ones_like(y))
            t = timed(dev, call, batches, calls, wait=False)
            emit(bench="host_layer", shape=[n, c, h, w], what=what, torch_us=us(t),
                 device=dev.type)


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 block (stride on the 3x3 convolution), as examples/resnet."""

    def __init__(self, cin, c, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, c, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, stride, 1, bias=False), nn.BatchNorm2d(c)
        self.conv3, self.bn3 = nn.Conv2d(c, 4 * c, 1, bias=False), nn.BatchNorm2d(4 * c)
        self.down = None
        if stride != 1 or cin != 4 * c:
            self.down = nn.Sequential(nn.Conv2d(cin, 4 * c, 1, stride, bias=False),
                                      nn.BatchNorm2d(4 * c))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        layers, cin = [], 64
        for i, (c, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
            for j in range(blocks):
                layers.append(Bottleneck(cin, c, 2 if j == 0 and i > 0 else 1))
                cin = 4 * c
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(self.layers(x).mean((2, 3)))


def make_step(model_name, batch, side, precision, dev):
    torch.manual_seed(0)
    model = (ResNet20() if model_name == "resnet20" else ResNet50()).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=5e-4)
    x = torch.rand(batch, 3, side, side, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    amp = precision == "bf16"

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model, step


def run_steps(step, steps, dev):
    for _ in range(5):
        step()
    sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync(dev)
    return time.perf_counter() - t


def train_step(args, dev):
    _, step = make_step(args.model, args.batch, args.side, args.precision, dev)
    seconds = run_steps(step, args.steps, dev)
    emit(bench="step", model=args.model, batch=args.batch, side=args.side,
         precision=args.precision, world=1,
         images_per_sec=round(args.steps * args.batch / seconds, 1), device=dev.type)


def ddp_rank(rank, args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    exact_f32()  # (a spawned process starts from the defaults)
    cuda = args.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world)
    model, _ = make_step("resnet20", args.batch, args.side, "f32", dev)
    # Batch statistics of the global batch, as the example's default --norm syncbn.
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if cuda else model
    ddp = DDP(model, device_ids=[rank] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=4e-3, weight_decay=5e-4)
    x = torch.rand(args.batch, 3, args.side, args.side, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)

    def step():
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds = run_steps(step, args.steps, dev)
    if rank == 0:
        emit(bench="ddp", model="resnet20", batch=args.batch, side=args.side, world=args.world,
             images_per_sec=round(args.world * args.steps * args.batch / seconds, 1),
             device=dev.type)
    dist.destroy_process_group()


def ddp(args, dev):
    import torch.multiprocessing as mp
    import socket
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:  # a port free now (the ranks bind it a moment later)
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    mp.spawn(ddp_rank, args=(args,), nprocs=args.world)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["layer", "host", "step", "ddp"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", choices=["resnet20", "resnet50"], default="resnet20")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--side", type=int, default=32)
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--world", type=int, default=1)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_gpu_bench: PyTorch sees no CUDA device (use --device cpu to rehearse)")
    exact_f32()
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, args.world)))
    dev = torch.device(args.device)
    {"layer": layer, "host": host, "step": train_step, "ddp": ddp}[args.what](args, dev)


if __name__ == "__main__":
    main()
