"""Shutdown from the garbage collector: a loader freed in a reference cycle stops its workers at once, and never
touches a descriptor, segment or process it no longer owns.

The cycle is the one every kept exception makes: a frame holds the exception (``saved = e``, or Jupyter's
``sys.last_value``), whose traceback holds the frame, which holds the iterator. When gc frees it, the objects'
``__del__`` methods run in an order nobody chooses; multiprocessing's ``Connection.__del__`` closes a pipe's
descriptor and leaves its number set, so a later stop that still uses it writes into, and closes, whatever file
reused the number meanwhile.
"""

import errno
import gc
import os
import sys
import threading
import time
import weakref

import psutil
import pytest
import torch.utils.data as tud

import _candidate
import _datasets as ds
import _leaks

pytestmark = pytest.mark.fastfeed_only  # the segments and the ring checked are fastfeed's

FORK_TRIALS = 5


class _StuckAfterError(ds.RaisingDataset):
    """Item ``bad`` raises; item ``stuck`` does not return for a minute (a worker blocked in user code)."""

    def __init__(self, n, bad, stuck):
        super().__init__(n, bad)
        self.stuck = stuck

    def __getitem__(self, i):
        if i == self.stuck:
            time.sleep(60)
        return super().__getitem__(i)


class _Writer(threading.Thread):
    """A user thread that writes, closes and rereads files without pause, so that every descriptor number freed
    meanwhile is soon one of its files."""

    FILES = 8

    def __init__(self, folder):
        super().__init__(name="user_chunk_writer", daemon=True)
        self.folder = folder
        self.errors: list[str] = []
        self.rounds = 0
        self.done = threading.Event()

    def _attempt(self, what, call, *args):
        try:
            return call(*args)
        except OSError as e:
            self.errors.append(f"{what}: {errno.errorcode.get(e.errno, e.errno)} {e}")
            return None

    def run(self):
        while not self.done.is_set():
            payload = b"%08d" % self.rounds * 256
            paths = [os.path.join(self.folder, f"chunk{k}.bin") for k in range(self.FILES)]
            fds = [self._attempt("open", os.open, p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for p in paths]
            for fd in fds:
                if fd is not None and self._attempt("write", os.write, fd, payload) != len(payload):
                    self.errors.append(f"write to descriptor {fd} did not complete")
            for fd in fds:
                if fd is not None:
                    self._attempt("close", os.close, fd)
            for p in paths:
                with open(p, "rb") as f:
                    if f.read() != payload:
                        self.errors.append(f"{os.path.basename(p)} holds bytes this thread did not write")
            self.rounds += 1


class _AgingBatches(tud.Sampler):
    """Batches of two in order, whose first iteration runs a young collection and then holds off automatic ones.

    torch's iterator asks for its batch sampler's iterator in ``__init__``, after the iterator object exists and
    before its workers' pipes do. A young collection then moves the iterator to generation 1, and the pipes'
    ``Connection`` objects are made in generation 0. A full collection lists generation 0 before generation 1,
    so their ``__del__`` runs first: the order a busy process reaches by chance, here every time.
    """

    def __init__(self, n):
        self.n = n
        self.aged = False

    def __len__(self):
        return (self.n + 1) // 2

    def __iter__(self):
        if not self.aged:
            self.aged = True
            gc.collect(0)
            gc.disable()  # the test enables it again after its own collection
        return iter([list(range(i, min(i + 2, self.n))) for i in range(0, self.n, 2)])


def _loader(dataset, start_method, aged):
    """``aged``: the pipes' ``Connection`` objects are finalized before the iterator (``_AgingBatches``)."""
    batches = dict(batch_sampler=_AgingBatches(len(dataset))) if aged else dict(batch_size=2)
    return _candidate.DataLoader(dataset, num_workers=2, multiprocessing_context=start_method, **batches)


def _fail_and_keep(loader):
    """Iterate a loader to its dataset's error and keep the error in a local, as user code does.

    Returns a weak reference to the iterator. This frame is left in a cycle: the local ``saved`` holds the error,
    whose traceback holds this frame, which holds the iterator.
    """
    it = iter(loader)
    try:
        for _ in it:
            pass
    except ds.DatasetError as e:
        saved = e  # noqa: F841 (kept on purpose: it makes the cycle)
    return weakref.ref(it)


def _workers_of_this_process(before):
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


def _own_segments():
    return sorted(name for name in _leaks.shm_segments() if name.startswith(f"fastfeed-{os.getpid()}-"))


def _collect_in_a_cycle(tmp_path, dataset, start_method, aged, monkeypatch):
    """Free a failed loader's cycle with gc while a user thread writes files; returns what went wrong.

    The stall being fixed (5.3 s per collection) was the finalizer giving the workers the status-check grace to
    exit inside gc. What the collection waits for is checked as the grace it gives (every ``Pool.stop`` made inside
    it), not as its wall time, which a loaded machine stretches past any bound by the kill and the reaping alone.
    """
    from fastfeed import _iterator
    from fastfeed._workers import pool as pools

    stops = []
    real_stop = pools.Pool.stop

    def recorded_stop(self, grace=pools.STATUS_CHECK_S, idle=False):
        stops.append((grace, getattr(_iterator._collecting, "on", False)))
        return real_stop(self, grace, idle)

    monkeypatch.setattr(pools.Pool, "stop", recorded_stop)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    segments_before = set(_own_segments())
    unraisable = []
    previous_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}")
    writer = _Writer(str(tmp_path))
    try:
        loader = _loader(dataset, start_method, aged)
        it_ref, loader_ref = _fail_and_keep(loader), weakref.ref(loader)
        del loader
        gc.disable()  # the collection below is the one that frees the cycle, not one the writer happens to trigger
        assert it_ref() is not None, "the iterator was freed without gc: the test made no cycle"
        assert _workers_of_this_process(before), "the failed iterator's workers should still be running"
        writer.start()
        while writer.rounds < 3:
            time.sleep(0.001)
        for _ in range(2):  # the second finds nothing left, and must not stop anything again
            gc.collect()
        rounds = writer.rounds
        while writer.rounds < rounds + 3:  # the writer ran after the collection too: a closed file shows
            time.sleep(0.001)
    finally:
        writer.done.set()
        writer.join()
        gc.enable()
        sys.unraisablehook = previous_hook
    assert it_ref() is None, "gc did not free the iterator"
    left = _workers_of_this_process(before)
    problems = {
        "user file operations that failed": writer.errors,
        "unraisable errors in finalizers": unraisable,
        "stops inside gc given more than COLLECTED_GRACE_S": [g for g, in_gc in stops if in_gc
                                                               and g > _iterator.COLLECTED_GRACE_S],
        "workers stopped other than once, from gc": [] if [in_gc for _, in_gc in stops] == [True] else stops,
        "worker processes left": [f"{p.pid}: {' '.join(p.cmdline())}" for p in left],
        "segments left": sorted(set(_own_segments()) - segments_before),
    }
    assert loader_ref() is None, "gc did not free the loader"
    return {what: found for what, found in problems.items() if found}


@pytest.mark.hang_limit(60)
@pytest.mark.parametrize("aged", [True, False], ids=["pipes_finalized_first", "iterator_finalized_first"])
@pytest.mark.parametrize("trial", range(FORK_TRIALS))
def test_a_failed_loader_freed_by_gc_stops_its_forked_workers_and_touches_no_user_file(tmp_path, trial, aged,
                                                                                      monkeypatch):
    """gc freeing a kept error's cycle stops the forked workers at once and leaves every user file intact."""
    problems = _collect_in_a_cycle(tmp_path, ds.RaisingDataset(n=40, bad=5), "fork", aged, monkeypatch)
    assert not problems


@pytest.mark.hang_limit(90)
def test_a_failed_loader_freed_by_gc_stops_its_spawned_workers_and_touches_no_user_file(tmp_path, monkeypatch):
    """gc freeing a kept error's cycle stops spawned workers at once and leaves every user file intact."""
    problems = _collect_in_a_cycle(tmp_path, ds.RaisingDataset(n=40, bad=5), "spawn", aged=True,
                                   monkeypatch=monkeypatch)
    assert not problems


@pytest.mark.hang_limit(60)
def test_a_worker_blocked_in_user_code_is_killed_when_gc_frees_its_failed_loader(tmp_path, monkeypatch):
    """A worker still inside ``__getitem__`` when gc frees the failed loader is killed, not waited for."""
    # Batch 1 (worker 1) raises; batch 2 (worker 0, prefetched) sleeps in the dataset meanwhile.
    problems = _collect_in_a_cycle(tmp_path, _StuckAfterError(n=40, bad=2, stuck=4), "fork", aged=True,
                                   monkeypatch=monkeypatch)
    assert not problems


@pytest.mark.hang_limit(60)
def test_gc_freeing_a_failed_iterator_mid_way_through_its_loaders_next_epoch_leaves_that_epoch_whole():
    """gc stopping a failed iterator's workers while its loader's next epoch runs leaves that epoch's workers and
    batches alone, and unlinks the old iterator's ring (the notebook: a fixed cell rerun, the error kept)."""
    dataset = ds.RaisingDataset(n=40, bad=5)
    loader = _loader(dataset, "fork", aged=True)
    try:
        old_ref = _fail_and_keep(loader)
        old_prefix = loader._ff_ring.prefix
        dataset.bad = -1  # the next epoch's workers get a copy that no longer raises
        it = iter(loader)  # the loader lets go of the last iterator: only the cycle holds it now
        assert loader._ff_ring.prefix != old_prefix, "the old workers still run: a new ring is expected"
        got = [next(it).tolist() for _ in range(5)]
        gc.collect()
        assert old_ref() is None, "gc did not free the failed iterator"
        assert not [name for name in _own_segments() if ("/" + name).startswith(old_prefix)]
    finally:
        gc.enable()
    got += [b.tolist() for b in it]
    assert got == [[[i], [i + 1]] for i in range(0, 40, 2)]


class _Held:
    """Stands for a pipe the finalizer needs: its ``__del__`` closes it."""

    def __init__(self, order):
        self.order = order
        self.open = True

    def __del__(self):
        self.open = False
        self.order.append("held.__del__")


class _Node:
    def __init__(self, name, order):
        self.name, self.order = name, order

    def __del__(self):
        self.order.append(f"{self.name}.__del__")


@pytest.mark.parametrize("older", ["owner", "peer"])
def test_a_cycles_finalizer_runs_before_any_del_of_it_and_finds_what_it_holds_intact(older):
    """gc calls a weakref.finalize of an object in a garbage cycle before any ``__del__`` of that cycle, whichever
    generation each object is in, and what the finalizer holds has not been finalized when it runs."""
    order = []
    gc.disable()
    try:
        first = _Node(older, order)
        gc.collect(0)  # the first object goes to generation 1, the second is made in generation 0
        second = _Node("peer" if older == "owner" else "owner", order)
        owner, peer = (first, second) if older == "owner" else (second, first)
        held = _Held(order)
        owner.peer, peer.owner, owner.held, peer.held = peer, owner, held, held

        def stop(held):
            order.append("finalizer, held open" if held.open else "finalizer, held closed")

        weakref.finalize(owner, stop, held)
        del first, second, owner, peer, held
        gc.collect()
    finally:
        gc.enable()
    assert order[0] == "finalizer, held open"
    assert sorted(order[1:3]) == ["owner.__del__", "peer.__del__"]
    assert order[3:] == ["held.__del__"]


class _OwnThreadPool:
    """A pool whose finalizer-time stop finds itself on one of the pool's own threads (a Ray link's reader)."""

    all_gone = True

    def __init__(self):
        self.stopped_on = []
        self.done = threading.Event()

    def on_own_thread(self):
        return threading.current_thread().name == "pool-own"

    def stop(self, grace, idle):
        self.stopped_on.append((threading.current_thread().name, grace))
        self.done.set()


class _Ring:
    in_use = True

    def recover(self):
        pass


def test_a_finalizer_run_on_the_pools_own_thread_stops_the_workers_from_another_thread():
    """Collected on one of the pool's own threads (which may hold the lock the stop needs), the iterator's finalizer
    hands the stop to a thread of its own and returns at once; anywhere else it stops the workers itself."""
    from fastfeed import _iterator

    pool = _OwnThreadPool()
    own = threading.Thread(target=_iterator._stop, args=(os.getpid(), pool, _Ring()), name="pool-own")
    own.start()
    own.join(5)
    assert pool.done.wait(5)
    assert pool.stopped_on == [("ff_collected_stop", _iterator.COLLECTED_GRACE_S)]
    other = _OwnThreadPool()
    _iterator._stop(os.getpid(), other, _Ring())
    assert other.stopped_on == [(threading.current_thread().name, _iterator.STATUS_CHECK_S)]
