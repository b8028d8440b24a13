"""The doctor's built-in scenario: a training loop with a known bottleneck, to diagnose.

``fastfeed doctor --demo [ARGS]`` runs it; ``python -m fastfeed.doctor.demo ARGS`` runs it alone. By default one
worker decodes 16-sample batches at 1 ms of CPU per sample while the step takes 8 ms, so on any machine with a
second core idle the loop waits on input and more workers help. The arguments make the other bottlenecks:

- ``--workers 2`` on 2 cores: every core busy decoding (input/cpu);
- ``--read-ms 1 --sample-ms 0``: samples that wait on slow reads rather than compute (input/io);
- ``--step-ms 30 --sample-ms 0.1``: a step slower than loading (compute);
- ``--torch --workers 0``: torch's own DataLoader, loading in the training loop.

The step stands in for a GPU step: the host sleeps, as it would while waiting on the device's kernels.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import Dataset


class Decoded(Dataset):
    """Images that cost ``sample_ms`` of CPU (decoding) and ``read_ms`` of waiting (a read) each."""

    def __init__(self, n: int, sample_ms: float, read_ms: float) -> None:
        self.n, self.sample_s, self.read_s = n, sample_ms / 1e3, read_ms / 1e3

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.read_s:
            time.sleep(self.read_s)
        img = torch.full((3, 32, 32), float(i % 251))
        end = time.perf_counter() + self.sample_s
        while time.perf_counter() < end:  # decoding: CPU-bound work of a known cost
            img.mul_(1.0001)
        return img, i % 10


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--samples", type=int, default=2048, help="dataset length")
    p.add_argument("--sample-ms", type=float, default=1.0, help="CPU per sample")
    p.add_argument("--read-ms", type=float, default=0.0, help="waiting per sample (a slow read)")
    p.add_argument("--step-ms", type=float, default=8.0, help="the training step")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--torch", action="store_true", help="torch.utils.data.DataLoader instead of fastfeed's")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    if args.torch:
        from torch.utils.data import DataLoader
    else:
        from fastfeed import DataLoader
    ds = Decoded(args.samples, args.sample_ms, args.read_ms)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    seen = 0
    for _ in range(args.epochs):
        for images, _labels in loader:
            seen += len(images)
            time.sleep(args.step_ms / 1e3)  # the device's step: the host waits
    print(f"trained on {seen} samples")


if __name__ == "__main__":
    main()
