"""The standard CPU workloads, defined once: a dataset factory plus the loader kwargs.

See /work/shared/BENCHMARKS.md for the questions each workload answers. Datasets are
module-level classes built from a seeded generator, so they pickle under spawn and every
trial (candidate or torch) sees the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

BATCH_SIZE = 64
IMAGE_SHAPE = (3, 224, 224)
# 256 images of 3x224x224 uint8 are ~38.5 MB: more than this machine's 32 MiB L3, so the
# transport figure measures memory bandwidth, not cache bandwidth. Raise it on bigger caches.
TRANSPORT_POOL_ITEMS = 256


class PoolDataset(Dataset):
    """Map-style dataset whose item ``i`` is ``pool[i % len(pool)]``, a pre-made tensor.

    Items are made once, up front, so ``__getitem__`` costs almost nothing and a benchmark
    measures the loader, not the dataset.

    Args:
        length: Number of items the dataset reports.
        shape: Shape of every item.
        dtype: NumPy dtype name of the items (``"uint8"``: uniform bytes, floats: normal).
        pool_items: Number of distinct pre-made items.
        seed: Seed of the generator, so every trial sees the same data.
    """

    def __init__(self, length: int, shape: tuple[int, ...], dtype: str, pool_items: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        if np.dtype(dtype).kind == "f":
            make = partial(rng.standard_normal, size=shape, dtype=dtype)
        else:
            make = partial(rng.integers, 0, 256, size=shape, dtype=dtype)
        # One tensor per item, as a real dataset would return, rather than views of one block.
        self.pool = [torch.from_numpy(make()) for _ in range(pool_items)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.pool[index % len(self.pool)]


@dataclass(frozen=True)
class Workload:
    """A standard workload: how to build a fresh dataset and how to load it.

    Attributes:
        name: Workload id, as in BENCHMARKS.md.
        make_dataset: Called with the number of items a trial needs; returns a fresh dataset.
        loader_kwargs: Keyword arguments shared by candidate and torch loaders.
        unit: Throughput unit to report, ``"GB/s"`` or ``"batch/s"``.
        describe: JSON-able description, written to the results.
    """

    name: str
    make_dataset: Callable[[int], Dataset]
    loader_kwargs: dict[str, Any]
    unit: str
    describe: dict[str, Any] = field(default_factory=dict)


def transport(pool_items: int = TRANSPORT_POOL_ITEMS) -> Workload:
    """64 uint8 images of 3x224x224 per batch (9.6 MB): how fast do bytes reach the consumer?

    Args:
        pool_items: Number of distinct images; keep their total above the L3 cache size.

    Returns:
        The transport workload.
    """
    spec = dict(shape=IMAGE_SHAPE, dtype="uint8", pool_items=pool_items)
    return Workload(
        name="transport",
        make_dataset=partial(PoolDataset, **spec),
        loader_kwargs=dict(batch_size=BATCH_SIZE),
        unit="GB/s",
        describe=dict(spec, pool_mb=round(pool_items * np.prod(IMAGE_SHAPE) / 1e6, 1), batch_size=BATCH_SIZE),
    )


def overhead(pool_items: int = 1024) -> Workload:
    """16 float32 per item, 64 per batch: what does one batch cost, besides its bytes?

    Args:
        pool_items: Number of distinct pre-made items.

    Returns:
        The overhead workload.
    """
    spec = dict(shape=(16,), dtype="float32", pool_items=pool_items)
    return Workload(
        name="overhead",
        make_dataset=partial(PoolDataset, **spec),
        loader_kwargs=dict(batch_size=BATCH_SIZE),
        unit="batch/s",
        describe=dict(spec, batch_size=BATCH_SIZE),
    )


def startup(pool_items: int = TRANSPORT_POOL_ITEMS) -> Workload:
    """The transport dataset, measured for time to first batch and peak memory of a short run.

    Args:
        pool_items: Number of distinct images.

    Returns:
        The startup workload.
    """
    base = transport(pool_items)
    return Workload("startup", base.make_dataset, base.loader_kwargs, base.unit, base.describe)
