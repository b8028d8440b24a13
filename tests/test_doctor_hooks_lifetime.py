"""The doctor's hooks and the lifetime of what they watch: a torch iterator the script drops, under a watch, stops
its workers at once (torch's ``__del__``, when its last reference goes), as it does unwatched, and not at some
later garbage collection, where torch's shutdown can stall the process for its 5 s join timeout."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader

from fastfeed import doctor
from fastfeed.doctor.demo import Decoded

pytestmark = pytest.mark.fastfeed_only

GONE_WITHIN_S = 0.5  # torch's own shutdown of an idle worker takes milliseconds


def _dropped(ref: weakref.ref, workers, within: float = GONE_WITHIN_S) -> tuple[bool, list[int]]:
    """Whether the iterator behind ``ref`` is freed, and the pids of its ``workers`` still running, after at most
    ``within`` seconds (the doctor's sampler thread may hold the iterator for a moment while it reads its pids)."""
    deadline = time.monotonic() + within
    while (ref() is not None or any(w.is_alive() for w in workers)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return ref() is None, [w.pid for w in workers if w.is_alive()]


def _expected(i: int, batch_size: int = 8):
    """Decoded's batch ``i``: images of value ``index % 251``, labels ``index % 10``."""
    idx = torch.arange(i * batch_size, (i + 1) * batch_size)
    return (idx % 251).float(), idx % 10


def test_a_dropped_torch_iterator_stops_its_workers_at_once_and_its_batches_stay_recorded():
    """With the garbage collector off, dropping a watched torch iterator frees it and stops its worker, and the
    batches it gave stay recorded."""
    gc.disable()
    try:
        with doctor.watch(interval=0.05) as report:
            loader = TorchLoader(Decoded(64, 0.0, 0.0), batch_size=8, num_workers=1)
            it = iter(loader)
            got = [next(it), next(it)]
            ref, workers = weakref.ref(it), list(it._workers)
            assert len(workers) == 1 and workers[0].is_alive()
            del it
            freed, alive = _dropped(ref, workers)
    finally:
        gc.enable()
        gc.collect()  # where the iterator was kept alive (a cycle), free it here, not in a later test
    assert freed, "the watched iterator outlived its last reference: something holds it in a reference cycle"
    assert not alive, f"worker {alive} still running {GONE_WITHIN_S} s after its iterator was dropped"

    for i, (images, labels) in enumerate(got):
        want_images, want_labels = _expected(i)
        assert torch.equal(images[:, 0, 0, 0], want_images) and torch.equal(labels, want_labels)
    rec = report.timeline.primary()
    assert rec.kind == "torch" and rec.made_at.startswith("test_doctor_hooks_lifetime.py:")
    assert rec.batches == 2 and len(rec.epochs) == 1
    epoch = rec.epochs[0]
    assert len(epoch.asks) == len(epoch.returns) == 2 and epoch.ready is None
    assert all(a <= r for a, r in zip(epoch.asks, epoch.returns)) and epoch.asks[1] >= epoch.returns[0]


def test_a_torch_iterator_ended_by_the_watchs_steps_is_freed_when_the_watch_ends():
    """watch(steps=N) ends a loop over torch's loader from inside its iterator; once the ``with`` block has
    swallowed that, nothing of the doctor's keeps the iterator or its worker alive."""
    loader = TorchLoader(Decoded(64, 0.0, 0.0), batch_size=8, num_workers=1)
    done = 0
    gc.disable()
    try:
        with doctor.watch(steps=3) as report:
            it = iter(loader)
            ref, workers = weakref.ref(it), list(it._workers)
            for _batch in it:
                done += 1
        del it
        freed, alive = _dropped(ref, workers)
    finally:
        gc.enable()
        gc.collect()
    assert done == 3
    assert freed, "the watched iterator outlived its last reference: something holds it in a reference cycle"
    assert not alive, f"worker {alive} still running {GONE_WITHIN_S} s after its iterator was dropped"
    rec = report.timeline.primary()
    assert rec.kind == "torch" and rec.batches == 3
