"""worker_type="thread": the same batches, order, worker info and errors as torch's worker processes.

Thread workers share the process's RNGs, so parity is checked on datasets that draw
none; what each worker is (id, num_workers, seed) is part of every sample instead.
"""

import gc
import os
import threading

import pytest
import torch
import torch.utils.data as tud

import _datasets as ds
import _leaks
from _compare import assert_same, copy_batch, seed_all
from _load import Within
from _scripts import read_stderr_until, start_script

pytestmark = pytest.mark.fastfeed_only

import fastfeed  # noqa: E402 (after the marker: the whole module is fastfeed's)


def threads(**kwargs):
    return fastfeed.DataLoader(worker_type="thread", **kwargs)


def _who():
    info = tud.get_worker_info()
    return (-1, -1, 0) if info is None else (info.id, info.num_workers, info.seed)


class WhoMap(tud.Dataset):
    """Item i says which worker made it: no random draws, so threads and processes agree."""

    def __init__(self, n=23):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        wid, nw, seed = _who()
        return {"x": torch.full((3, 2), float(i)), "index": i, "worker": wid, "num_workers": nw, "seed": seed}


class WhoIterable(tud.IterableDataset):
    """Worker k of n yields k, k+n, ...: sharded by get_worker_info(), as users write it."""

    def __init__(self, n=23):
        self.n = n

    def __iter__(self):
        wid, nw, seed = _who()
        first, step = (0, 1) if wid < 0 else (wid, nw)
        for i in range(first, self.n, step):
            yield {"x": torch.full((2,), float(i)), "index": i, "worker": wid, "seed": seed}


def both(make, kwargs, epochs=1, limits=None, seed=99):
    """Copied batches of torch (forked workers) and of fastfeed's threads, from the same seeds."""
    runs = []
    for build in (lambda d: tud.DataLoader(d, multiprocessing_context="fork", **kwargs),
                  lambda d: threads(dataset=d, **kwargs)):  # fmt: skip
        seed_all(seed)
        loader = build(make())
        runs.append([[copy_batch(b) for _, b in zip(range(limit or 10**9), loader)]
                     for limit in (limits or [None] * epochs)])  # fmt: skip
        del loader
    return runs


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_map_style_batches_and_workers_match_torch_processes(num_workers, shuffle):
    """Thread workers make torch's batches, in torch's order, each by the worker torch's would use, with its seed."""
    ref, got = both(lambda: WhoMap(23), dict(batch_size=4, shuffle=shuffle, num_workers=num_workers))
    assert_same(got, ref)
    assert {int(w) for batch in ref[0] for w in batch["worker"]} == set(range(num_workers))


@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_sharded_by_worker_info_matches_torch(drop_last):
    """An IterableDataset sharded with get_worker_info() sees per-thread worker info and yields torch's batches."""
    ref, got = both(lambda: WhoIterable(23), dict(batch_size=4, num_workers=2, drop_last=drop_last))
    assert_same(got, ref)
    assert sorted(int(i) for b in got[0] for i in b["index"]) == (sorted(int(i) for b in ref[0] for i in b["index"]))


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_persistent_threads_epochs_and_abandoned_epoch_match_torch(kind):
    """Persistent thread workers: an abandoned epoch, then whole epochs, match torch's."""
    make = (lambda: WhoMap(17)) if kind == "map" else (lambda: WhoIterable(17))
    opts = dict(batch_size=2, num_workers=2, persistent_workers=True, shuffle=kind == "map" or None)
    opts = {k: v for k, v in opts.items() if v is not None}
    ref, got = both(make, opts, limits=[2, None, None])
    assert_same(got, ref)


def test_out_of_order_yields_every_batch():
    """in_order=False with threads yields the same batches as in order, in some order."""
    seed_all(0)
    got = [copy_batch(b) for b in threads(dataset=WhoMap(21), batch_size=3, num_workers=2, in_order=False)]
    assert sorted(int(i) for b in got for i in b["index"]) == list(range(21))


def test_get_worker_info_is_none_in_the_main_thread_while_threads_work():
    """While thread workers run, get_worker_info() in the main thread (and any other) is still None."""
    seen = []
    loader = threads(dataset=WhoMap(12), batch_size=2, num_workers=2)
    for _ in loader:
        seen.append(tud.get_worker_info())
        t = threading.Thread(target=lambda: seen.append(tud.get_worker_info()))
        t.start()
        t.join()
    assert seen and all(info is None for info in seen)


def test_worker_threads_leave_the_main_rngs_alone():
    """Iterating with thread workers changes the main RNGs exactly as torch's worker processes do."""
    states = []
    for make in (lambda: tud.DataLoader(WhoMap(12), batch_size=2, num_workers=2, shuffle=True),
                 lambda: threads(dataset=WhoMap(12), batch_size=2, num_workers=2, shuffle=True)):  # fmt: skip
        seed_all(5)
        for _ in make():
            pass
        states.append((torch.get_rng_state(), torch.randn(3)))
    assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])


def test_batches_are_views_of_ring_slots():
    """Thread workers write into the ring: a batch held while the next arrives is not overwritten."""
    loader = threads(dataset=ds.PlainDataset(40), batch_size=4, num_workers=2)
    prev = None
    for n, batch in enumerate(loader):
        if prev is not None:
            assert_same(prev, ds.expected_plain_batch(list(range(4 * (n - 1), 4 * n))))
        prev = batch


def test_retaining_every_batch_completes():
    """list(loader) with ten times the ring's slots completes and every batch is right."""
    with pytest.warns(fastfeed.RingGrowthWarning):
        kept = list(threads(dataset=ds.PlainDataset(160), batch_size=2, num_workers=2))
    assert len(kept) == 80
    for n, batch in enumerate(kept):
        assert_same(batch, ds.expected_plain_batch([2 * n, 2 * n + 1]))


# --- errors -------------------------------------------------------------------------------


def test_dataset_exception_reraised_with_its_type_and_the_threads_traceback():
    """An exception in __getitem__ re-raises with its type, naming the worker thread and the failing frame."""
    with pytest.raises(ds.DatasetError) as info:
        for _ in threads(dataset=ds.RaisingDataset(16, bad=5), batch_size=2, num_workers=2):
            pass
    text = str(info.value)
    assert "in DataLoader worker thread" in text and "_explode_in_getitem" in text and "item 5" in text, text


def test_collate_and_worker_init_exceptions_reraised():
    """Exceptions in collate_fn and in worker_init_fn re-raise with their types and traceback."""
    with pytest.raises(ds.CollateError) as info:
        next(iter(threads(dataset=ds.PlainDataset(8), batch_size=2, num_workers=2, collate_fn=ds.raising_collate)))
    assert "_explode_in_collate" in str(info.value)
    with pytest.raises(ds.InitError) as info:
        next(iter(threads(dataset=ds.PlainDataset(8), batch_size=2, num_workers=2,
                          worker_init_fn=ds.raising_worker_init)))  # fmt: skip
    assert "in DataLoader worker thread 0" in str(info.value) and "raising_worker_init" in str(info.value)


class ExitingDataset(tud.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        raise SystemExit(3)


def test_a_thread_ended_by_system_exit_is_named():
    """A worker thread that SystemExit ends raises a RuntimeError naming the worker and the cause."""
    with pytest.raises(RuntimeError, match=r"DataLoader worker [01] \(thread\) stopped: SystemExit: 3"):
        next(iter(threads(dataset=ExitingDataset(), batch_size=1, num_workers=2)))


class GatedDataset(tud.Dataset):
    """Items wait for ``gate`` (so a test can release a 'hung' thread when it is done)."""

    def __init__(self):
        self.gate = threading.Event()

    def __len__(self):
        return 8

    def __getitem__(self, i):
        self.gate.wait(30)
        return torch.tensor([i])


@pytest.mark.hang_limit(30)
def test_timeout_raises_when_a_thread_is_too_slow():
    """With timeout=, a hung __getitem__ in a worker thread gives torch's RuntimeError after the timeout."""
    dataset = GatedDataset()
    try:
        with Within(5, "the timeout's error"):
            with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.5 seconds"):
                next(iter(threads(dataset=dataset, batch_size=1, num_workers=2, timeout=0.5)))
    finally:
        dataset.gate.set()  # the hung threads end, whatever the verdict


@pytest.mark.hang_limit(40)
def test_a_hung_thread_loader_dumps_the_worker_stacks():
    """With FASTFEED_HANG_DUMP_S, a thread loader stuck in __getitem__ prints each worker thread's stack."""
    proc = start_script(
        """
        it = iter(_candidate.DataLoader(ds.SlowDataset(8, delay=60), batch_size=1, num_workers=2,
                                        worker_type="thread"))
        next(it)
        """,
        FASTFEED_HANG_DUMP_S="1",
    )
    with proc:
        err = read_stderr_until(proc, "in __getitem__", 2)
        proc.kill()
        proc.communicate()
    assert "fastfeed: no batch for 1 s" in err, err
    assert "ff_data_worker_0" in err and "ff_data_worker_1" in err, err
    assert err.count("in __getitem__") >= 2, err
    from fastfeed import cli

    assert cli.main(["cleanup"]) == 0  # the ring of a SIGKILLed process: what any later fastfeed process reclaims


@pytest.mark.hang_limit(120)
@pytest.mark.parametrize("persistent", [False, True])
def test_restarts_keep_threads_fds_and_segments_flat(persistent):
    """300 iterator restarts with thread workers leave the thread, fd and segment counts flat."""
    loader = threads(dataset=ds.PlainDataset(4), batch_size=2, num_workers=2, persistent_workers=persistent)

    def state():
        gc.collect()
        return (
            threading.active_count(),
            len(os.listdir("/proc/self/fd")),
            len(_leaks.shm_segments((f"fastfeed-{os.getpid()}-",))),
        )

    for _ in range(10):
        list(loader)
    before = state()
    for _ in range(300):
        for batch in loader:
            pass
    after = state()
    del loader, batch
    gc.collect()
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)
    assert after[2] <= 4, (before, after)


# --- arguments and state ----------------------------------------------------------------


def test_bad_worker_type_and_conflicting_arguments_are_clear_errors():
    """An unknown worker_type, a multiprocessing_context or a DataPipe with threads raise ValueErrors that say why."""
    with pytest.raises(ValueError, match=r"worker_type must be one of \('process', 'thread', 'ray'\) or \('process', 'ray'\), got 'threads'"):
        fastfeed.DataLoader(WhoMap(4), worker_type="threads")
    with pytest.raises(ValueError, match="multiprocessing_context applies to worker processes"):
        threads(dataset=WhoMap(4), num_workers=2, multiprocessing_context="fork")
    from torch.utils.data.datapipes.iter import IterableWrapper

    with pytest.raises(ValueError, match="does not support DataPipes"):
        threads(dataset=IterableWrapper(range(4)), num_workers=2)


def test_state_dict_resumes_a_map_style_epoch_with_threads():
    """state_dict() after batch k with threads, loaded into a new loader, yields batches k+1.. of the same order."""

    def make():
        return threads(dataset=WhoMap(30), batch_size=3, num_workers=2, shuffle=True,
                       generator=torch.Generator().manual_seed(4))  # fmt: skip

    full = [copy_batch(b) for b in make()]
    loader = make()
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert_same([copy_batch(b) for b in resumed], full[4:])


def test_state_dict_of_an_iterable_mid_epoch_with_threads_says_what_to_do():
    """Mid-epoch state of an IterableDataset with threads is refused with a message naming the fix."""
    loader = threads(dataset=WhoIterable(20), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="needs worker_type='process'"):
        loader.state_dict()
    del it
