"""The ring of slots seen from outside: torch's timing of sampler draws, slot counts, growth."""

from __future__ import annotations

import gc
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


@pytest.mark.parametrize("num_workers,prefetch_factor", [(1, 1), (2, 2), (2, 3)])
def test_a_training_loop_uses_the_window_plus_one_slot_and_never_warns(num_workers, prefetch_factor):
    """A loop that holds only its current batch needs at most num_workers*prefetch_factor+1 slots, silently."""
    loader = DataLoader(ds.PlainDataset(40), batch_size=2, num_workers=num_workers, prefetch_factor=prefetch_factor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        it = iter(loader)
        for batch in it:
            assert len(it._ring._slots) <= num_workers * prefetch_factor + 1
        del batch
    del it
    gc.collect()


def test_a_consumer_that_drops_each_batch_uses_exactly_the_window():
    """Dropping each batch before asking for the next keeps the ring at num_workers*prefetch_factor slots, as many batches as torch keeps in flight."""
    it = iter(DataLoader(ds.PlainDataset(40), batch_size=2, num_workers=2, prefetch_factor=2))
    for _ in range(15):
        next(it)["x"].sum()
    assert len(it._ring._slots) == 4
    del it
    gc.collect()
