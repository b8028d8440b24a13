"""Datasets for the Ray worker tests: importable by name in the actors (tests/ is on their PYTHONPATH)."""

import os
import time

import torch
import torch.utils.data as tud

from _datasets import augmented_sample

class SlowAugmented(tud.Dataset):
    """Random augmentations from the worker RNGs, ``delay`` seconds per sample (so an epoch can be interrupted)."""

    def __init__(self, n=48, width=3, delay=0.0):
        self.n, self.width, self.delay = n, width, delay

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if self.delay:
            time.sleep(self.delay)
        return augmented_sample(index, self.width, False)


class WhereAmI(tud.Dataset):
    """Each sample says which worker made it and in which process (the actors' pids and worker info)."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        info = tud.get_worker_info()
        return {"index": index, "pid": os.getpid(), "worker": info.id, "num_workers": info.num_workers,
                "seed": info.seed, "offset": getattr(info.dataset, "offset", 0)}  # fmt: skip


def set_offset(worker_id):
    """worker_init_fn: the dataset copy of worker k gets offset 100 * (k + 1)."""
    tud.get_worker_info().dataset.offset = 100 * (worker_id + 1)


class Failing(tud.Dataset):
    """Item 5 raises a dataset error (not a fault of the node)."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        if index == 5:
            raise KeyError(f"no sample {index} in this dataset")
        return torch.tensor([index])


class Sleepy(tud.Dataset):
    """Item 2 takes 30 s: past any timeout a test sets."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 2:
            time.sleep(30)
        return torch.tensor([index])


class KillsItsActor(tud.Dataset):
    """Item 6 ends its process at once (os._exit), every time: a batch that keeps killing its worker.

    With batches of 2 it is in batch 3, worker 1's second: the actor dies with the answer to batch 1 possibly still
    on its way, so the first loss may be charged to batch 1, and only redoing owed batches one at a time names
    batch 3 as the one that kills."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        if index == 6:
            os._exit(1)
        return torch.tensor([index])


class PositionInSelf(tud.IterableDataset):
    """An IterableDataset that is its own iterator and keeps counting across epochs (no state_dict): its
    position lives only in the worker's copy."""

    def __init__(self, per_epoch=6):
        self.per_epoch = per_epoch
        self.count = 0
        self.left = 0

    def __iter__(self):
        self.left = self.per_epoch
        return self

    def __next__(self):
        if self.left == 0:
            raise StopIteration
        self.left -= 1
        self.count += 1
        time.sleep(0.05)
        return torch.tensor([tud.get_worker_info().id, self.count])


class CountsPickles(tud.Dataset):
    """Counts, in the process that pickles it, how often it was pickled."""

    pickled = 0

    def __init__(self, n=24):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.tensor([index])

    def __getstate__(self):
        type(self).pickled += 1
        return self.__dict__


class Gated(tud.Dataset):
    """Items from ``first_held`` on wait until the file ``gate`` exists (at most ``limit_s``, so a failed test
    cannot hang an actor for ever): a test holds the epoch open at a point it knows, for as long as it needs."""

    def __init__(self, gate: str, n=8, first_held=2, limit_s=60.0):
        self.gate, self.n, self.first_held, self.limit_s = gate, n, first_held, limit_s

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if index >= self.first_held:
            deadline = time.monotonic() + self.limit_s
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        return torch.tensor([index])


def init_then_hang(marker: str, worker_id: int) -> None:
    """worker_init_fn (bound to ``marker`` with functools.partial): creates the file ``marker`` (the actor was placed
    and runs), then does not return for 60 s: a start that outlasts any start timeout a test sets."""
    open(marker, "w").close()
    time.sleep(60)


class ToldAhead(tud.Dataset):
    """A map-style dataset with a read-ahead hook (``prefetch``): each sample is ``[index, told]``, where ``told``
    counts the indices its worker's copy had been told of and not yet asked for when the sample was asked for (a
    later task's samples, since a task's own are told just before they are asked for). ``delay`` seconds per
    sample give the loader's next tasks time to reach the worker."""

    def __init__(self, n=12, delay=0.05):
        self.n, self.delay = n, delay
        self.told: set = set()
        self.asked: set = set()

    def __len__(self):
        return self.n

    def prefetch(self, indices):
        self.told.update(indices)

    def __getitem__(self, index):
        time.sleep(self.delay)
        self.asked.add(index)
        return torch.tensor([index, len(self.told - self.asked)])
