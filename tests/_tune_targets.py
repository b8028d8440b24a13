"""What the ``fastfeed tune`` tests name as ``module:attr``, and a stand-in tuning result.

Module-level, since the CLI imports its target by name (``tests/`` is on sys.path).
"""

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

import fastfeed
from fastfeed.tuning import Setting, Trial, TuneResult


class Rows(Dataset):
    """``n`` samples; sample i is a float row of ``width`` copies of i."""

    def __init__(self, n=64, width=2):
        self.n, self.width = n, width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.full((self.width,), float(i))


class Broken(IterableDataset):
    """An iterable dataset whose iterator fails at once."""

    def __iter__(self):
        raise RuntimeError("broken on purpose")


def stack(batch):
    """A collate function that is not torch's default."""
    return torch.stack(batch)


def make_loader():
    """A fastfeed loader with non-default arguments, which ``fastfeed tune`` should carry over."""
    return fastfeed.DataLoader(rows, batch_size=8, shuffle=True, drop_last=True, collate_fn=stack,
                               worker_type="thread")  # fmt: skip


class Evens(Sampler):
    """A sampler of its own: the even indices."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return (self.n + 1) // 2


evens = Evens(64)


def make_sampled_loader():
    """A torch loader with a sampler of its own and a timeout."""
    return DataLoader(rows, batch_size=4, sampler=evens, timeout=30)


def needs_arguments(n):
    """A callable the CLI cannot call."""
    return Rows(n)


def returns_number():
    """A callable that returns neither a Dataset nor a DataLoader."""
    return 7


def step(batch):
    """A training step that does nothing."""


rows = Rows()
not_a_dataset = 42


def result(num_workers=2, prefetch_factor=3, worker_type="process", batch_size=8) -> TuneResult:
    """A TuneResult as tune() would return it, with two measured trials and one skipped."""
    chosen = Trial(Setting(worker_type, num_workers, prefetch_factor), windows=[100.0, 104.0, 98.0], seconds=1.5)
    trials = [
        Trial(Setting(worker_type, 0, None), windows=[40.0, 41.0, 39.0], seconds=1.0),
        chosen,
        Trial(Setting(worker_type, 16, 2), skipped="memory budget"),
    ]
    return TuneResult(num_workers, prefetch_factor, worker_type, throughput=chosen.median,
                      samples_per_s=chosen.median * batch_size, stall_fraction=0.0, input_bound=True,
                      trials=trials, elapsed_s=2.5, converged=True, batch_size=batch_size)  # fmt: skip
