"""Checks that two runs of the ResNet example ended at the same place with the same weights:
both final checkpoints (`<dir>/checkpoint.json`) at the start of epoch 1 after 4 steps, with equal
tensor CRC-32s.

    python3 scripts/same_checkpoint.py STRAIGHT_DIR RESTARTED_DIR "what was restarted"
"""
import json
import sys

straight, restarted, what = sys.argv[1:4]
a, b = (json.load(open(f"{d}/checkpoint.json")) for d in (straight, restarted))
for m in (a, b):
    meta = m["metadata"]
    assert meta["position"] == {"epoch": 1, "step": 0} and meta["user"]["step"] == 4, meta
assert a["tensors_crc32"] == b["tensors_crc32"], (
    f"the restarted run's final checkpoint differs: CRC-32 {b['tensors_crc32']:08x} "
    f"against {a['tensors_crc32']:08x}")
print(f"ok   {what}'s final checkpoint equals the uninterrupted one (CRC-32 {a['tensors_crc32']:08x})")
