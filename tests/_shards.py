"""Shard sets for the Shards tests, written by webdataset's own TarWriter (so every test also reads shards that
another writer made), and the module-level decode functions workers unpickle."""

from __future__ import annotations

import os

import pytest
import torch

UNEQUAL = (7, 3, 12, 5, 9, 1, 8, 6, 10, 4)  # samples per shard: 65, no two neighbours alike


def make(directory, counts=UNEQUAL, *, payload: int = 0, index: bool = True) -> list[str]:
    """Shards ``shard-000000.tar``... with ``counts[k]`` samples each; sample i is ``{"txt": str(i), "cls": i % 3}``
    (plus ``payload`` bytes in ``"bin"``). Returns their paths; ``index``: save fastfeed's index beside them."""
    import webdataset as wds

    os.makedirs(directory, exist_ok=True)
    paths, i = [], 0
    for k, n in enumerate(counts):
        path = os.path.join(directory, f"shard-{k:06d}.tar")
        with open(path, "wb") as f, wds.TarWriter(f) as w:
            for _ in range(n):
                sample = {"__key__": f"s{i:06d}", "txt": str(i).encode(), "cls": str(i % 3).encode()}
                if payload:
                    sample["bin"] = bytes([i % 251]) * payload
                w.write(sample)
                i += 1
        paths.append(path)
    if index:
        from fastfeed.io import index_shards

        index_shards(paths, dest=True)
    return paths


def number(sample) -> int:
    """A sample's number (its ``txt``)."""
    return int(sample["txt"])


def as_tensor(sample):
    return torch.tensor(int(sample["txt"]))


def flat(batches) -> list[int]:
    return [int(x) for b in batches for x in (b.tolist() if hasattr(b, "tolist") else b if isinstance(b, list) else [b])]


def interleave(per_rank: list[list[list[int]]]) -> list[int]:
    """The global sequence: batch j of rank 0, of rank 1, ..., then batch j+1."""
    batches = len(per_rank[0])
    assert all(len(r) == batches for r in per_rank), [len(r) for r in per_rank]
    return [x for j in range(batches) for r in per_rank for x in r[j]]


@pytest.fixture
def memfs():
    """fsspec's in-memory filesystem, emptied of what the test wrote (a module imports it by name to use it)."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    before = set(fs.store)
    yield fs
    for k in set(fs.store) - before:
        fs.store.pop(k, None)
    for d in list(fs.pseudo_dirs):
        if "fastfeed-test-" in d:
            fs.pseudo_dirs.remove(d)
