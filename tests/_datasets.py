"""Datasets, samplers and collate functions shared by the tests.

Everything here is module-level so that the spawn start method can pickle it by
reference. Samples draw from torch.rand, random.random and np.random, so any
difference in per-worker seeding shows up as different batches.
"""

import os
import random
import time
from collections import namedtuple

import numpy as np
import torch
import torch.utils.data as tud

import _candidate

Point = namedtuple("Point", ["x", "y"])


class DatasetError(Exception):
    """Raised on purpose by a dataset."""


class CollateError(Exception):
    """Raised on purpose by a collate function."""


class WorkerInfoMismatch(AssertionError):
    """The candidate's get_worker_info() disagrees with torch's inside a worker."""


def _describe(info):
    return None if info is None else (info.id, info.num_workers, info.seed)


def worker_identity(verify):
    """(worker id, worker seed) as torch reports them; (-1, 0) in the main process.

    With verify, first check that the candidate's get_worker_info() agrees with torch's.
    """
    theirs = tud.get_worker_info()
    if verify:
        ours = _candidate.get_worker_info()
        if _describe(ours) != _describe(theirs):
            raise WorkerInfoMismatch(
                f"{_candidate.NAME}.get_worker_info() gave {_describe(ours)}, "
                f"torch gave {_describe(theirs)} (id, num_workers, seed)"
            )
    return (-1, 0) if theirs is None else (theirs.id, theirs.seed)


def augmented_sample(index, width, verify):
    worker, seed = worker_identity(verify)
    return {
        "x": torch.arange(width, dtype=torch.float32) + index + torch.rand(width),
        "py": random.random(),
        "np": np.random.rand(2),
        "index": index,
        "worker": worker,
        "seed": seed,
    }


class AugmentedDataset(tud.Dataset):
    """Map-style: a dict of random augmentations, tagged with index and worker."""

    def __init__(self, n=24, width=3):
        self.n, self.width = n, width
        self.offset = 0  # worker_init_fn may change it inside a worker
        self.verify_worker_info = False

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return augmented_sample(index + self.offset, self.width, self.verify_worker_info)


class GetitemsDataset(AugmentedDataset):
    """Map-style with a batched __getitems__; its samples say how big the request was."""

    def __getitems__(self, indices):
        return [dict(self[i], request=len(indices)) for i in indices]


class ShardedIterable(tud.IterableDataset):
    """Iterable-style: worker k of n yields indices k, k+n, ... (uneven shards on purpose)."""

    def __init__(self, n=23, width=3):
        self.n, self.width = n, width
        self.offset = 0
        self.verify_worker_info = False

    def __len__(self):
        return self.n

    def __iter__(self):
        info = tud.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(first, self.n, step):
            yield augmented_sample(index + self.offset, self.width, self.verify_worker_info)


class NestedDataset(tud.Dataset):
    """Map-style with every container and leaf type that default_collate handles."""

    def __init__(self, n=10):
        self.n = n
        self.verify_worker_info = False

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        worker, _ = worker_identity(self.verify_worker_info)
        return {
            "tensor": torch.rand(2, 3),
            "array": np.random.randint(0, 100, size=(4,), dtype=np.int32),
            "int": i,
            "float": random.random(),
            "str": f"item-{i}",
            "list": [torch.tensor([i, worker]), i * 2],
            "tuple": (np.float32(i) / 3, f"t{i}"),
            "namedtuple": Point(x=i, y=torch.rand(1, dtype=torch.float64)),
            "bool": i % 2 == 0,
            "worker": worker,
        }


class PlainDataset(tud.Dataset):
    """Deterministic: item i is a float tensor full of i, so any batch can be checked by eye."""

    def __init__(self, n=16, width=4):
        self.n, self.width = n, width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((self.width,), float(i)), "index": i}


def expected_plain_batch(indices, width=4):
    """The batch that default_collate makes of PlainDataset items `indices`."""
    return {
        "x": torch.stack([torch.full((width,), float(i)) for i in indices]),
        "index": torch.tensor(indices),
    }


class SlowDataset(tud.Dataset):
    """Each item takes `delay` seconds."""

    def __init__(self, n=1000, delay=0.05):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.tensor([i])


def _explode_in_getitem(i):
    raise DatasetError(f"item {i} is broken")


class RaisingDataset(tud.Dataset):
    """Item `bad` raises DatasetError from _explode_in_getitem."""

    def __init__(self, n=16, bad=5):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            _explode_in_getitem(i)
        return torch.tensor([i])


def _explode_in_collate(batch):
    raise CollateError(f"cannot collate a batch of {len(batch)}")


def raising_collate(batch):
    """A collate_fn that always raises CollateError."""
    _explode_in_collate(batch)


class GrowingDataset(tud.Dataset):
    """Item i is arange(length(i)) + i; the first batch is tiny, later ones alternate huge/small."""

    def __init__(self, n=16, batch_size=4):
        self.n, self.batch_size = n, batch_size

    def __len__(self):
        return self.n

    def length(self, i):
        batch = i // self.batch_size
        return 2 if batch == 0 else (100_000 + 1000 * i if batch % 2 else 3)

    def __getitem__(self, i):
        return torch.arange(self.length(i), dtype=torch.float32) + i


def pad_collate(batch):
    """Right-pad variable-length 1-D tensors with -1; returns (padded, lengths)."""
    lengths = torch.tensor([len(t) for t in batch])
    padded = torch.full((len(batch), int(lengths.max())), -1.0)
    for row, t in enumerate(batch):
        padded[row, : len(t)] = t
    return padded, lengths


def tuple_collate(batch):
    """A custom collate_fn returning (doubled stacked x, list of python indices, a str, a numpy scalar)."""
    return (
        torch.stack([s["x"] for s in batch]) * 2,
        [s["index"] for s in batch],
        f"custom-{len(batch)}",
        np.stack([s["np"] for s in batch]).sum(),
    )


class EveryOtherSampler(tud.Sampler):
    """Yields the odd indices, then the even ones, in reverse."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(list(range(1, self.n, 2))[::-1] + list(range(0, self.n, 2))[::-1])


class IrregularBatchSampler(tud.Sampler):
    """Batches of growing size: [0], [1, 2], [3, 4, 5], ... with the last one short."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return sum(1 for _ in self)

    def __iter__(self):
        start, size = 0, 1
        while start < self.n:
            yield list(range(start, min(start + size, self.n)))
            start, size = start + size, size + 1


def offset_worker_init(worker_id):
    """A worker_init_fn whose effects show in the samples: offsets indices and reseeds RNGs."""
    info = tud.get_worker_info()
    info.dataset.offset = 1000 * (worker_id + 1)
    random.seed(worker_id + 11)
    np.random.seed(worker_id + 13)


class LazyRandomSampler(tud.Sampler):
    """Draws each index from the global torch RNG only when asked, so *when* the loader
    consumes the sampler shows in the random stream the training loop sees."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            yield int(torch.randint(0, self.n, ()).item())


class SegfaultDataset(tud.Dataset):
    """Item 3 kills its worker with SIGSEGV inside native code (a NULL read through ctypes)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 3:
            import ctypes

            ctypes.string_at(0)
        return torch.tensor([i])


class InitError(Exception):
    pass


def raising_worker_init(worker_id):
    raise InitError(f"worker {worker_id} cannot start")


class BigItemDataset(tud.Dataset):
    """Items of `nbytes` bytes each, so a batch needs more shared memory than a small limit allows."""

    def __init__(self, n=8, nbytes=1 << 20):
        self.n, self.nbytes = n, nbytes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.nbytes,), i % 256, dtype=torch.uint8)


class RaggedDataset(tud.Dataset):
    """Odd items are one element longer, so every default-collated batch fails to stack."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.zeros(5000 + i % 2)


class StatefulIterable(tud.IterableDataset):
    """ShardedIterable that saves and restores its position with state_dict()/load_state_dict().

    Each sample says how many samples this iterator had read before it (`read`), so a
    resumed worker that replayed its shard instead of loading its state shows.
    """

    def __init__(self, n=23, width=3):
        self.n, self.width = n, width
        self.pos = None  # the next index this replica yields
        self.read = 0
        self._start = None

    def state_dict(self):
        return {"pos": self.pos, "read": self.read}

    def load_state_dict(self, state):
        self._start = state

    def __iter__(self):
        info = tud.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        start, self._start = self._start, None
        self.pos, self.read = (first, 0) if start is None else (start["pos"], start["read"])
        while self.pos < self.n:
            index = self.pos
            self.pos += step
            self.read += 1
            yield dict(augmented_sample(index, self.width, False), read=self.read)


class UnevenIterable(ShardedIterable):
    """ShardedIterable whose worker 1 (of 2 or more) stops after 3 samples, long before the others."""

    def __iter__(self):
        info = tud.get_worker_info()
        for count, sample in enumerate(super().__iter__()):
            if info is not None and info.id == 1 and count == 3:
                return
            yield sample


class StragglerMap(tud.Dataset):
    """Item i is (worker id, i); item `slow` takes `delay` seconds: its worker straggles.

    With ``gate`` (a path no file has yet), the delay starts only once item ``slow + 1`` (the other worker's first)
    has been fetched: spawned workers beside other load start seconds apart, and a straggler's delay that ran out
    before the other worker had even started would make no straggler at all."""

    def __init__(self, n=10, slow=0, delay=1.0, gate=None):
        self.n, self.slow, self.delay, self.gate = n, slow, delay, gate

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.gate is not None and i == self.slow + 1:
            open(self.gate, "a").close()
        if i == self.slow:
            deadline = time.monotonic() + 120  # a guard: the other worker never started
            while self.gate is not None and not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(self.delay)
        return (tud.get_worker_info().id, i)


class StragglerIterable(tud.IterableDataset):
    """Worker w yields w*per .. w*per+per-1; item `slow` takes `delay` seconds."""

    def __init__(self, per=5, slow=5, delay=1.0):
        self.per, self.slow, self.delay = per, slow, delay

    def __iter__(self):
        wid = tud.get_worker_info().id
        for i in range(wid * self.per, (wid + 1) * self.per):
            if i == self.slow:
                time.sleep(self.delay)
            yield i


def slow_on_zero_collate(batch):
    """torch's default collate, after a 1 s pause for the batch holding item 0 (a straggling collate)."""
    if any(index == 0 for _, index in batch):
        time.sleep(1.0)
    return tud.default_collate(batch)


class StartLog(tud.Dataset):
    """Fetching item i creates the file `i` in `directory` first, then takes `delay` seconds."""

    def __init__(self, directory, n=16, delay=0.05):
        self.directory, self.n, self.delay = directory, n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        open(os.path.join(self.directory, str(i)), "w").close()
        time.sleep(self.delay)
        return torch.tensor([i])


# -- resume cases (tests/test_resume_cases.py): plain ints, so torchdata's StatefulDataLoader and the candidate can
# be compared sample for sample (torchdata does not restore the workers' RNGs, so nothing here draws from them).


def _shard():
    info = tud.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class IndexMap(tud.Dataset):
    """Map-style: item i is i."""

    def __init__(self, n=100):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class CountingMap(IndexMap):
    """Map-style and stateful: item i is 1000 * (items this copy had read before) + i; the count is its state."""

    def __init__(self, n=100):
        super().__init__(n)
        self.reads = 0

    def state_dict(self):
        return {"reads": self.reads}

    def load_state_dict(self, state):
        self.reads = state["reads"]

    def __getitem__(self, i):
        self.reads += 1
        return 1000 * (self.reads - 1) + i


class IndexIterable(tud.IterableDataset):
    """Iterable: worker k of n yields k, k+n, ... below `n`."""

    def __init__(self, n=100):
        self.n = n

    def __iter__(self):
        first, step = _shard()
        return iter(range(first, self.n, step))


class EpochIterable(tud.IterableDataset):
    """Stateful iterable: each fresh ``__iter__`` starts epoch e+1 and yields 1000 * e + its shard's indices.

    Its state is the epoch and position; a state loaded before ``__iter__`` continues there.
    """

    def __init__(self, n=100):
        self.n, self.epoch, self.pos = n, 0, None
        self._loaded = None

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self._loaded = dict(state)

    def __iter__(self):
        first, step = _shard()
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            self.epoch, self.pos = loaded["epoch"], loaded["pos"]
            if self.pos is None or self.pos >= self.n:  # saved after an epoch's end: the next epoch
                self.epoch, self.pos = self.epoch + 1, first
        else:
            self.epoch, self.pos = self.epoch + 1, first
        while self.pos < self.n:
            index = self.pos
            self.pos += step
            yield 1000 * self.epoch + index


class PoppingIterable(EpochIterable):
    """EpochIterable whose ``load_state_dict`` takes its argument apart (pops its keys), as some datasets do."""

    def load_state_dict(self, state):
        self._loaded = {"epoch": state.pop("epoch"), "pos": state.pop("pos")}


class SelfIterable(tud.IterableDataset):
    """Stateful iterable whose ``__iter__`` returns itself, starting its shard over; its state is its position."""

    def __init__(self, n=100):
        self.n, self.pos, self.step = n, 0, 1

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]

    def __iter__(self):
        self.pos, self.step = _shard()
        return self

    def __next__(self):
        if self.pos >= self.n:
            raise StopIteration
        index = self.pos
        self.pos += self.step
        return index


class FixedOrderSampler(tud.Sampler):
    """Stateless: the same shuffled order of range(n) every epoch (fixed at construction)."""

    def __init__(self, n, seed=0):
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()

    def __len__(self):
        return len(self.order)

    def __iter__(self):
        return iter(self.order)


class StatefulSampler(tud.Sampler):
    """Stateful, as torchdata's samplers are: epoch e is a permutation seeded by e; the state is (epoch, position).

    A state loaded before ``__iter__`` continues that epoch from that position (or starts the next one, if it
    was saved at its end).
    """

    def __init__(self, n, seed=0):
        self.n, self.seed, self.epoch, self.pos = n, seed, -1, 0
        self._loaded = None

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self._loaded = dict(state)

    def __iter__(self):
        loaded, self._loaded = self._loaded, None
        if loaded is not None and 0 <= loaded["epoch"] and loaded["pos"] < self.n:
            self.epoch, self.pos = loaded["epoch"], loaded["pos"]
        else:
            self.epoch, self.pos = (self.epoch if loaded is None else loaded["epoch"]) + 1, 0
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        while self.pos < self.n:
            index = order[self.pos]
            self.pos += 1
            yield index
