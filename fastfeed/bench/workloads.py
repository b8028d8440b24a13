"""The standard CPU workloads, defined once: a dataset factory plus the loader kwargs.

benchmarks/README.md says which question each workload answers. Datasets are
module-level classes built from a seeded generator, so they pickle under spawn and every
trial (candidate or torch) sees the same bytes.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from .images import (  # noqa: F401  (the jpeg workload's data, also reached as workloads.X)
    JPEG_CACHE, JPEG_CROP, JPEG_FILES, JPEG_GENERATOR, JPEG_QUALITY, JpegDataset, dali_jpeg_loader, jpeg_files,
    make_jpegs,
)

BATCH_SIZE = 64
IMAGE_SHAPE = (3, 224, 224)
IMAGE_BYTES = math.prod(IMAGE_SHAPE)  # uint8: 150,528 bytes
# The transport pool must exceed the last-level cache 8 times over, and 300 MB: a pool the cache
# holds measures cache bandwidth and flatters a loader that rewrites the same few buffers.
POOL_LLC_FACTOR = 8
POOL_MIN_BYTES = 300_000_000
CACHE_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
# startup.py measures time to first batch and memory, not bandwidth: it keeps the old 256-image
# pool (38.5 MB), so its absolute peak is not a 400 MB pool every loader holds alike.
STARTUP_POOL_ITEMS = 256
# The prefetch workload: a latency-bound dataset (time.sleep in __getitem__), small batches.
PREFETCH_SLEEP_S = 0.002
PREFETCH_BATCH_SIZE = 16


def _cache_size(text: str) -> int:
    """Bytes of a sysfs cache ``size`` such as ``"32768K"``, ``"48M"`` or ``"512"``."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def last_level_cache(sysfs: Path = CACHE_SYSFS) -> tuple[int | None, str]:
    """Size of CPU 0's last-level cache in bytes, and where it was read.

    From sysfs, the ``index*`` entry with the highest ``level`` (instruction caches left out,
    the largest if a level has several); else glibc's sysconf for L3, then L2, through
    ``getconf``; else ``(None, "unknown")``. On CPUs whose L3 is split between core complexes (AMD), this is one
    complex's L3, the cache one process can fill.

    Args:
        sysfs: The cache directory of one CPU.

    Returns:
        ``(bytes or None, "sysfs L3" / "getconf L3" / "unknown")``.
    """
    best: tuple[int, int] | None = None  # (level, bytes)
    for index in sorted(sysfs.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
        except OSError:
            kind = "Unified"
        if kind == "Instruction":
            continue
        try:
            entry = (int((index / "level").read_text()), _cache_size((index / "size").read_text()))
        except (OSError, ValueError):
            continue  # a missing or odd file: this entry says nothing
        if entry[1] > 0 and (best is None or entry > best):
            best = entry
    if best:
        return best[1], f"sysfs L{best[0]}"
    for level in (3, 2):  # glibc's sysconf, which Python's os.sysconf does not name: ask getconf
        try:
            out = subprocess.run(["getconf", f"LEVEL{level}_CACHE_SIZE"], capture_output=True, text=True,
                                 timeout=5).stdout
            size = int(out.strip() or 0)
        except (OSError, ValueError, subprocess.SubprocessError):
            continue
        if size > 0:
            return size, f"getconf L{level}"
    return None, "unknown"


def transport_pool_items(llc_bytes: int | None = None) -> int:
    """Images in the transport pool: at least 8x the last-level cache and at least 300 MB.

    Args:
        llc_bytes: The last-level cache in bytes (default: :func:`last_level_cache`); ``None``
            when unknown, which leaves the 300 MB floor (enough for caches up to 37.5 MB).

    Returns:
        The number of 3x224x224 uint8 images (150,528 bytes each), rounded up.
    """
    if llc_bytes is None:
        llc_bytes = last_level_cache()[0]
    return math.ceil(max(POOL_LLC_FACTOR * (llc_bytes or 0), POOL_MIN_BYTES) / IMAGE_BYTES)


# The last pool made, by its spec: a trial's fresh dataset reuses it rather than making 400 MB again.
_POOL_CACHE: dict[tuple, list[torch.Tensor]] = {}


def make_pool(shape: tuple[int, ...], dtype: str, pool_items: int, seed: int = 0) -> list[torch.Tensor]:
    """``pool_items`` seeded tensors of ``shape``, made on the first call for this spec, then reused.

    Making the transport pool (403 MB) took ~0.3-1.5 s and ~100,000 page faults per trial; the
    items are never written, so every trial of a run, either loader's, reads the same pool. Only
    the last spec's pool is kept.

    Args:
        shape: Shape of every item.
        dtype: NumPy dtype name (``"uint8"``: uniform bytes, floats: normal, others: integers 0-255).
        pool_items: Number of items.
        seed: Seed of the generator.

    Returns:
        The items, one tensor each (as a real dataset returns them, not views of one block).
    """
    key = (tuple(shape), dtype, pool_items, seed)
    if key not in _POOL_CACHE:
        _POOL_CACHE.clear()  # drop the previous spec's pool before making this one
        rng = np.random.default_rng(seed)
        if np.dtype(dtype).kind == "f":
            make = partial(rng.standard_normal, size=shape, dtype=dtype)
        elif np.dtype(dtype) == np.uint8:
            size = math.prod(shape)  # uniform bytes: 4x faster than integers(0, 256)
            make = lambda: np.frombuffer(bytearray(rng.bytes(size)), np.uint8).reshape(shape)  # noqa: E731
        else:
            make = partial(rng.integers, 0, 256, size=shape, dtype=dtype)
        _POOL_CACHE[key] = [torch.from_numpy(make()) for _ in range(pool_items)]
    return _POOL_CACHE[key]


class PoolDataset(Dataset):
    """Map-style dataset whose item ``i`` is ``pool[i % len(pool)]``, a pre-made tensor.

    Items are made before the loader exists (:func:`make_pool`, once per process and spec), so
    ``__getitem__`` costs almost nothing and a benchmark measures the loader, not the dataset.

    Args:
        length: Number of items the dataset reports.
        shape: Shape of every item.
        dtype: NumPy dtype name of the items (``"uint8"``: uniform bytes, floats: normal).
        pool_items: Number of distinct pre-made items.
        seed: Seed of the generator, so every trial sees the same data.
    """

    def __init__(self, length: int, shape: tuple[int, ...], dtype: str, pool_items: int, seed: int = 0):
        self.pool = make_pool(shape, dtype, pool_items, seed)
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


def transport(pool_items: int | None = None) -> Workload:
    """64 uint8 images of 3x224x224 per batch (9.6 MB): how fast do bytes reach the consumer?

    Args:
        pool_items: Number of distinct images; default :func:`transport_pool_items`, at least
            8x the last-level cache and 300 MB.

    Returns:
        The transport workload; ``describe`` gives the pool in MB and the cache it was sized against.
    """
    llc, source = last_level_cache()
    sized = pool_items is None
    if sized:
        pool_items = transport_pool_items(llc)
    spec = dict(shape=IMAGE_SHAPE, dtype="uint8", pool_items=pool_items)
    return Workload(
        name="transport",
        make_dataset=partial(PoolDataset, **spec),
        loader_kwargs=dict(batch_size=BATCH_SIZE),
        unit="GB/s",
        describe=dict(spec, pool_mb=round(pool_items * IMAGE_BYTES / 1e6, 1), batch_size=BATCH_SIZE,
                      llc_mb=None if llc is None else round(llc / 2**20, 1), llc_source=source,
                      pool_llc_ratio=None if not llc else round(pool_items * IMAGE_BYTES / llc, 1),
                      pool_sizing="8x LLC, >= 300 MB" if sized else "--pool-items"),
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


def startup(pool_items: int = STARTUP_POOL_ITEMS) -> Workload:
    """The transport dataset, measured for time to first batch and peak memory of a short run.

    Args:
        pool_items: Number of distinct images (default 256, 38.5 MB: startup does not measure bandwidth).

    Returns:
        The startup workload.
    """
    base = transport(pool_items)
    describe = {k: v for k, v in base.describe.items() if not k.startswith(("llc", "pool_llc", "pool_sizing"))}
    return Workload("startup", base.make_dataset, base.loader_kwargs, base.unit, describe)


# --- prefetch: a latency-bound dataset ------------------------------------------------------


class SleepDataset(Dataset):
    """Map-style dataset whose ``__getitem__`` sleeps ``sleep_s`` (``time.sleep``) and returns a tiny tensor.

    The sleep releases the GIL and uses no CPU, as a read from remote storage would: a loader
    can hide it only by having enough items in flight, which is what ``num_workers`` and
    ``prefetch_factor`` decide.

    Args:
        length: Number of items the dataset reports.
        sleep_s: Seconds each ``__getitem__`` sleeps.
        shape: Shape of the float32 item returned, filled with its index.
    """

    def __init__(self, length: int, sleep_s: float = PREFETCH_SLEEP_S, shape: tuple[int, ...] = (16,)):
        self.length, self.sleep_s, self.shape = length, sleep_s, shape

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return torch.full(self.shape, float(index))


def prefetch(sleep_s: float = PREFETCH_SLEEP_S) -> Workload:
    """16 items per batch, each taking ``sleep_s`` of sleep and no CPU: a latency-bound dataset.

    A worker fetches a batch's items one after another, so a batch takes ~16 x 2 ms = 32 ms
    of one worker, and the throughput is set by how many batches are in flight at once.

    Args:
        sleep_s: Seconds each item sleeps.

    Returns:
        The prefetch workload (``persistent_workers=True``, as its question asks of a steady state).
    """
    return Workload(
        name="prefetch",
        make_dataset=partial(SleepDataset, sleep_s=sleep_s),
        loader_kwargs=dict(batch_size=PREFETCH_BATCH_SIZE, persistent_workers=True),
        unit="batch/s",
        describe=dict(sleep_ms=sleep_s * 1e3, item_shape=[16], dtype="float32", batch_size=PREFETCH_BATCH_SIZE,
                      persistent_workers=True, sleep="time.sleep in __getitem__ (no CPU)"),
    )


def jpeg(files: int = JPEG_FILES, seed: int = 0) -> Workload:
    """JPEGs on disk, decoded, randomly cropped to 224x224 and flipped, 64 per batch: CPU-bound decode.

    Makes the files on first use (a few seconds), so building this workload needs Pillow;
    importing this module does not.

    Args:
        files: Number of distinct JPEG files.
        seed: Seed of the files' generator.

    Returns:
        The jpeg workload.
    """
    paths = jpeg_files(files, seed)
    mean_kb = sum(os.path.getsize(p) for p in paths) / len(paths) / 1e3
    return Workload(
        name="jpeg",
        make_dataset=partial(JpegDataset, paths=paths, crop=JPEG_CROP),
        loader_kwargs={"batch_size": BATCH_SIZE},
        unit="batch/s",
        describe={
            "files": files, "seed": seed, "quality": JPEG_QUALITY, "mean_file_kb": round(mean_kb, 1),
            "directory": str(Path(paths[0]).parent), "item_shape": [3, JPEG_CROP, JPEG_CROP],
            "dtype": "uint8", "batch_size": BATCH_SIZE, "decoder": "PIL",
        },
    )


# --- text: sentences tokenized in __getitem__ ----------------------------------------------

TEXT_WORDS = 4096  # the vocabulary the sentences are drawn from
TEXT_LENGTH = 128  # tokens per sample, padded or cut
TEXT_BATCH = 64


class TextDataset(Dataset):
    """Sentence ``i`` (40-200 words, drawn from a seeded vocabulary), tokenized in ``__getitem__``.

    The tokenizer is plain Python, as a pure-Python or a per-sample call into a tokenizer is: split on
    spaces, look each word up, add begin and end tokens, pad or cut to ``TEXT_LENGTH``. It returns
    ``(ids, mask)``: int64 and bool, so a batch is two small tensors and most of its cost is Python.
    """

    def __init__(self, length: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        self.words = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(TEXT_WORDS)]
        self.vocab = {w: i + 3 for i, w in enumerate(dict.fromkeys(self.words))}  # 0 pad, 1 begin, 2 end
        self.length, self.seed = length, seed

    def __len__(self) -> int:
        return self.length

    def sentence(self, index: int) -> str:
        rng = np.random.default_rng((self.seed, index))
        picks = rng.integers(0, TEXT_WORDS, rng.integers(40, 200))
        return " ".join(self.words[p] for p in picks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [1] + [self.vocab.get(w, 0) for w in self.sentence(index).split(" ")] + [2]
        ids = ids[:TEXT_LENGTH] + [0] * max(0, TEXT_LENGTH - len(ids))
        tokens = torch.tensor(ids, dtype=torch.int64)
        return tokens, tokens != 0


def text() -> Workload:
    """Sentences tokenized in ``__getitem__``, 64 per batch: Python per sample, small batches."""
    return Workload(
        name="text",
        make_dataset=TextDataset,
        loader_kwargs=dict(batch_size=TEXT_BATCH),
        unit="batch/s",
        describe=dict(words=TEXT_WORDS, tokens=TEXT_LENGTH, batch_size=TEXT_BATCH,
                      tokenizer="split, vocabulary lookup, pad (Python)"),
    )
