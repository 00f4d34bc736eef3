"""PyTorch's side of the main job (`cargo run --release --example resnet`): the same ResNet-20
(16x16 inputs, f32, BatchNorm, AdamW with lr 4e-3 and weight decay 5e-4), global batch 128,
8000 training and 2000 validation images, 3 epochs, one process with the given thread count.
The images are random (the throughput does not depend on them) and not augmented.

    .venv-torch/bin/python scripts/torch_main.py [threads]

Prints one JSON line with the fields of the example's summary that `scripts/bench-main.sh`
compares: images trained per second of the whole run (training and validation), and seconds.
"""

import json
import sys
import time

import torch
import torch.nn.functional as F

from torch_step import SIDE, ResNet20

EPOCHS, BATCH, TRAIN, VAL = 3, 128, 8000, 2000


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    images, labels = torch.rand(TRAIN, 3, SIDE, SIDE), torch.randint(0, 10, (TRAIN,))
    val_images, val_labels = torch.rand(VAL, 3, SIDE, SIDE), torch.randint(0, 10, (VAL,))
    model = ResNet20()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=5e-4)
    start, seen = time.perf_counter(), 0
    for _ in range(EPOCHS):
        model.train()
        order = torch.randperm(TRAIN)
        for i in range(0, TRAIN, BATCH):
            idx = order[i:i + BATCH]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(images[idx]), labels[idx]).backward()
            opt.step()
            seen += len(idx)
        model.eval()
        with torch.no_grad():
            for i in range(0, VAL, BATCH):
                F.cross_entropy(model(val_images[i:i + BATCH]), val_labels[i:i + BATCH])
    seconds = time.perf_counter() - start
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "images_per_sec": round(seen / seconds, 1), "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
