"""A worker's memory stays flat over an epoch.

A forked worker shares its parent's pages until one side writes to them. The epoch's sampler builds its whole
order at its first draw (RandomSampler: a list of len(dataset) Python ints, ~40 bytes each), and the main process
then writes every int's reference count as it hands the indices out. A worker forked after that first draw
therefore ends up holding its own copy of the whole order, page by page, growing as the epoch goes (8-10 KB per
batch of 256): memory nothing in the worker uses. Workers forked before the first draw share none of it.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import warnings

import pytest
import torch
import torch.utils.data as tud

import _candidate

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods(),
    reason="forked workers and /proc/PID/smaps_rollup are Linux's",
)

ITEMS = 1_000_000  # the order of a shuffled epoch: ~40 MB of ints in the main process
BATCH = 1024
# What a worker forked after the first draw gains over the epoch: ~30 MB (32 bytes an int, less the first and last
# batches left out of the measure). A worker that shares none of it moves by some hundreds of KB at most.
MAX_GROWTH_KB = 4 * 1024


class _IndexAndPid(tud.Dataset):
    """A small tensor per index, the worker's pid riding along so the test knows whose memory to read."""

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        return torch.tensor([i, os.getpid()])


def _uss_kb(pid: int) -> int:
    """A process's unique set size (its pages no other process maps), in KB."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total


# fastfeed's own: torch forks its workers with this process's objects unfrozen, so under pytest (many objects) each
# of its workers copies ~40 MB of them as its collector walks them (pytorch/pytorch#13246), which fastfeed's
# gc.freeze() around the forks avoids.
@pytest.mark.fastfeed_only
@pytest.mark.hang_limit(60)
def test_no_worker_grows_over_a_shuffled_epoch():
    """Each of two forked workers' unique memory grows by under MAX_GROWTH_KB over a shuffled epoch of ~1000
    batches (the main process's order of 1M indices, copied into a worker forked after its first draw: ~30 MB)."""
    loader = _candidate.DataLoader(_IndexAndPid(), batch_size=BATCH, shuffle=True, num_workers=2,
                                   generator=torch.Generator().manual_seed(0), multiprocessing_context="fork")
    n_batches = len(loader)
    first_at, last_at = 50, n_batches - 20  # past the workers' start-up; none has exited yet
    start: dict[int, int] = {}  # by worker pid, from the first batch of its seen at or after first_at
    growth: dict[int, int] = {}
    for n, batch in enumerate(loader):
        pid = batch[0, 1].item()  # a batch is one worker's
        if n >= first_at and pid not in start:
            start[pid] = _uss_kb(pid)
        if n == last_at:
            growth = {pid: _uss_kb(pid) - kb for pid, kb in start.items()}
    assert len(growth) == 2, f"expected both workers among the batches, saw pids {sorted(start)}"
    assert max(growth.values()) < MAX_GROWTH_KB, (
        f"worker unique memory grew by {growth} KB over {last_at - first_at} batches (limit {MAX_GROWTH_KB} KB)"
    )


# Set in the main process by the sampler's first draw; a forked worker sees the value it had when it was forked.
_drawn = [0]


class _NotingSampler(tud.Sampler):
    """A shuffled order that notes its first draw."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        _drawn[0] = 1
        yield from torch.randperm(self.n, generator=torch.Generator().manual_seed(1)).tolist()


class _DrawnAtFork(tud.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return _drawn[0]


def test_every_worker_is_forked_before_the_sampler_first_draws():
    """No worker inherits the epoch's drawn order: with three workers (where a copy shared by two late workers
    is not in either's unique memory), every worker was forked before the sampler's first draw."""
    _drawn[0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's, when there are more workers than CPUs
        loader = _candidate.DataLoader(_DrawnAtFork(), batch_size=4, sampler=_NotingSampler(64), num_workers=3,
                                       multiprocessing_context="fork")
        seen = [flag for batch in loader for flag in batch.tolist()]
    assert len(seen) == 64
    assert _drawn[0] == 1  # the sampler was drawn from, in this process
    assert not any(seen), "a worker was forked after the epoch's sampler made its first draw"
