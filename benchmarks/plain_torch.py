"""A training script written for torch alone, for ``fastfeed run``: the demo runs it as it is, and under
``python -m fastfeed run``, and compares their epoch times.

torch's defaults (``persistent_workers=False``) and its usual shape: a map-style dataset of uint8 images drawn from
a pool larger than the CPU's cache, ``DataLoader(..., shuffle=True, num_workers=2)``, a few short epochs, and a
step that touches every batch. Prints one JSON line: the seconds of all epochs and the batches seen.

Run: python benchmarks/plain_torch.py [EPOCHS]   or   python -m fastfeed run benchmarks/plain_torch.py [EPOCHS]
"""

import json
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

POOL, LENGTH, BATCH = 512, 64 * 40, 64  # 512 images of 150 KB: 77 MB, beyond a CPU's last-level cache


class Images(Dataset):
    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.pool = [torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8, generator=generator)
                     for _ in range(POOL)]  # fmt: skip

    def __len__(self):
        return LENGTH

    def __getitem__(self, i):
        return self.pool[i % POOL], i % 10


def main(epochs: int) -> None:
    loader = DataLoader(Images(), batch_size=BATCH, shuffle=True, num_workers=2)
    batches, start = 0, time.perf_counter()
    for _ in range(epochs):
        for images, labels in loader:
            images.float().mean()  # the step: read every byte once
            batches += 1
    print(json.dumps({"seconds": time.perf_counter() - start, "batches": batches}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
