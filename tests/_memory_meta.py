"""A training script whose map-style dataset keeps its metadata as Python objects: one dict per sample.

This is pytorch/pytorch#13246's dataset: forked workers copy the pages of the dicts they read (reading an object
writes its reference count), so each worker's private memory grows with the samples it reads. The doctor's
memory tests run it (``fastfeed doctor tests/_memory_meta.py --items 200000``), and ``dataset()`` is the same
dataset for the tuner's.

    python tests/_memory_meta.py [--items N] [--workers N] [--batch-size N] [--epochs N] [--fastfeed] [--columns]
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset


class Meta(Dataset):
    """``items`` dicts of a file name, a label and a size, as an ImageNet index holds them; a sample is made from
    its dict alone (no file is read), so the run is quick and all its memory growth is the dicts'."""

    def __init__(self, n: int, sleep_s: float = 0.0) -> None:
        self.items = [{"path": f"train/n{i % 1000:08d}/img_{i:09d}.JPEG", "label": i % 1000, "size": 100_000 + i}
                      for i in range(n)]  # fmt: skip
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        item = self.items[i]
        if self.sleep_s:
            import time

            time.sleep(self.sleep_s)  # a read's wait: more workers overlap it, whatever the cores
        return torch.tensor([item["label"], item["size"], len(item["path"])], dtype=torch.int64)


class Columns(Dataset):
    """The same metadata as numpy columns: one buffer each, which reading never writes, so nothing is copied."""

    def __init__(self, n: int) -> None:
        import numpy as np

        self.label = np.arange(n, dtype=np.int64) % 1000
        self.size = 100_000 + np.arange(n, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, i: int):
        return torch.tensor([self.label[i], self.size[i], 33], dtype=torch.int64)


def dataset(items: int = 200_000, sleep_s: float = 0.0) -> Meta:
    return Meta(items, sleep_s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--fastfeed", action="store_true", help="fastfeed's DataLoader instead of torch's")
    p.add_argument("--columns", action="store_true", help="the metadata as numpy columns (no copy-on-read)")
    args = p.parse_args()
    if args.fastfeed:
        from fastfeed import DataLoader
    else:
        from torch.utils.data import DataLoader
    data = Columns(args.items) if args.columns else Meta(args.items)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    total = 0
    for _ in range(args.epochs):
        for batch in loader:
            total += int(batch[:, 0].sum())  # a step that reads the batch
    print(f"sum of labels {total}")


if __name__ == "__main__":
    main()
