"""The ring of slots seen from outside: torch's timing of sampler draws, slot counts, growth."""

from __future__ import annotations

import gc
import glob
import warnings

import pytest
import torch
import torch.utils.data as tud

import _datasets as ds
from _candidate import DataLoader

pytestmark = pytest.mark.fastfeed_only


def _run_keeping_batches(loader_cls):
    """Iterate while keeping every batch and drawing from the global RNG between steps."""
    torch.manual_seed(7)
    loader = loader_cls(ds.PlainDataset(24), batch_size=2, sampler=ds.LazyRandomSampler(24), num_workers=2)
    kept, draws = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in loader:
            kept.append(batch)
            draws.append(torch.rand(()).item())  # the training step's own randomness
    return [b["index"].tolist() for b in kept], draws


def test_sampler_is_consumed_when_torch_consumes_it():
    """With slots held by the user, indices are still drawn at torch's moments, so the loop's random stream matches torch's."""
    assert _run_keeping_batches(DataLoader) == _run_keeping_batches(tud.DataLoader)


@pytest.fixture
def slots_freed_in_time(monkeypatch):
    """Workers wait far longer than any scheduling delay for the slot the loop is about to free (forked workers
    inherit this), so that a loaded machine, which can hold the loop off the CPU past control.WAIT_S, cannot grow
    the ring: the slot-count tests below then count what the loop holds, not the scheduler's delays.

    Not longer still: a worker polls every WAIT_S/20, and a loop that holds its batch while it asks for the next
    one frees nothing, so once per ring the wait runs its full length before the slot the loop needs is made (at
    30 s, a 30 s stall for one worker and one batch in flight, and 1.5 s polls)."""
    from fastfeed._ring import control

    monkeypatch.setattr(control, "WAIT_S", 2.0)


@pytest.mark.usefixtures("slots_freed_in_time")
@pytest.mark.parametrize("num_workers,prefetch_factor", [(1, 1), (2, 2), (2, 3)])
def test_a_training_loop_uses_the_window_plus_two_slots_and_never_warns(num_workers, prefetch_factor):
    """A loop that holds only its current batch needs at most num_workers*prefetch_factor+2 slots (torch holds as many batches), silently."""
    loader = DataLoader(ds.PlainDataset(40), batch_size=2, num_workers=num_workers, prefetch_factor=prefetch_factor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        it = iter(loader)
        for batch in it:
            assert len(it._ring._slots) <= num_workers * prefetch_factor + 2
        del batch
    del it
    gc.collect()


@pytest.mark.usefixtures("slots_freed_in_time")
def test_a_consumer_that_drops_each_batch_uses_at_most_the_window_plus_one():
    """Dropping each batch before asking for the next keeps the ring within num_workers*prefetch_factor+1 slots."""
    it = iter(DataLoader(ds.PlainDataset(40), batch_size=2, num_workers=2, prefetch_factor=2))
    for _ in range(15):
        next(it)["x"].sum()
    assert 1 <= len(it._ring._slots) <= 5
    del it
    gc.collect()


def test_slow_workers_hold_one_slot_each_not_their_whole_window():
    """Slots are taken when a batch is written, so behind slow workers the ring stays far below the prefetch window."""
    loader = DataLoader(ds.SlowDataset(64, 0.02), batch_size=2, num_workers=2, prefetch_factor=8)
    it = iter(loader)
    for _ in range(20):
        next(it)
    assert len(it._ring._slots) <= 2 + 2  # one per worker, plus the two a loop holds
    del it, loader
    gc.collect()


@pytest.mark.usefixtures("slots_freed_in_time")
def test_the_next_epoch_writes_into_the_same_slots():
    """Without persistent workers, epoch 2's new workers reuse the ring epoch 1 made: no new segment."""
    loader = DataLoader(ds.PlainDataset(24), batch_size=2, num_workers=2)
    first = {slot.segment.name for slot in _ring_after_epoch(loader)._slots}
    second = {slot.segment.name for slot in _ring_after_epoch(loader)._slots}
    assert first and second <= first
    del loader
    gc.collect()


def _ring_after_epoch(loader):
    for batch in loader:
        batch["x"].sum()
    del batch
    return loader._ff_ring


def test_a_deleted_loader_unlinks_its_ring():
    """The ring kept between epochs goes with its loader: no segment is left under its name."""
    loader = DataLoader(ds.PlainDataset(24), batch_size=2, num_workers=2)
    prefix = _ring_after_epoch(loader).prefix
    assert glob.glob(f"/dev/shm{prefix}*")
    del loader
    gc.collect()
    assert not glob.glob(f"/dev/shm{prefix}*")


@pytest.mark.fastfeed_only
def test_a_forked_copy_of_a_live_iterator_leaves_the_parents_workers_and_segments_alone():
    """Dropping, in a forked child, its copy of an iterator (and of the loader's ring) neither stops the parent's
    workers nor unlinks the parent's segments: the parent's epoch goes on to the end."""
    import os

    loader = DataLoader(ds.PlainDataset(64), batch_size=4, num_workers=2)
    it = iter(loader)
    first = [next(it)["index"].tolist() for _ in range(2)]
    names = {slot.segment.name for slot in it._ring._slots}
    pid = os.fork()
    if pid == 0:  # the child: no pytest, nothing escapes
        code = 1
        try:
            del it
            loader._ff_ring = None
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert all(glob.glob("/dev/shm" + name) for name in names), "the child unlinked the parent's segments"
    rest = [b["index"].tolist() for b in it]
    assert first + rest == [list(range(4 * n, 4 * n + 4)) for n in range(16)]
