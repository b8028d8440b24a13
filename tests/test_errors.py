"""Errors and shutdown: failures surface in the main process, promptly, and nothing outlives its owner.

Every test that could hang carries a hang_limit (SIGALRM, see conftest) or runs its
loader in a subprocess with a timeout, so a regression fails instead of stalling.
"""

import collections
import contextlib
import functools
import gc
import os
import signal
import warnings

import pytest
import torch.utils.data as tud

import _candidate
import _datasets as ds
import _leaks
from _compare import assert_same, seed_all
from _load import Within

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def loader(dataset, **kwargs):
    """The candidate's DataLoader, with forked workers unless told otherwise."""
    if kwargs.get("num_workers", 0) > 0:
        kwargs.setdefault("multiprocessing_context", "fork")
    return _candidate.DataLoader(dataset, **kwargs)


def worker_pids(iterator, children_before):
    """Worker pids by worker id: from iterator._workers, else the new children in start order."""
    if hasattr(iterator, "_workers"):
        return [w.pid for w in iterator._workers]
    # Workers start in id order, so the order of creation gives the id.
    return sorted(_leaks.children() - children_before, key=lambda p: (_leaks.start_ticks(p), p))


def raised_by(action, expected):
    """Run action, which must raise `expected`; return the exception with its tracebacks dropped.

    A traceback holds the raising iterator's frames, so its workers would live on until
    the garbage collector found them (and torch's shutdown from inside gc takes ~10 s).
    """
    try:
        action()
    except expected as e:
        error = e
    else:
        pytest.fail(f"{expected.__name__} was not raised")
    return _leaks.drop_tracebacks(error)


def exhaust(iterable):
    for _ in iterable:
        pass


# --- exceptions raised by user code in a worker ---------------------------------------


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataset_exception_reraised_with_worker_traceback(context):
    """An exception in __getitem__ re-raises in the main process with its type and the worker's traceback."""
    data = loader(ds.RaisingDataset(16, bad=5), batch_size=2, num_workers=2, multiprocessing_context=context)
    message = str(raised_by(lambda: exhaust(data), ds.DatasetError))
    assert "in DataLoader worker process" in message
    assert "_explode_in_getitem" in message
    assert "item 5 is broken" in message


def test_collate_exception_reraised_with_worker_traceback():
    """An exception in collate_fn re-raises in the main process with its type and the worker's traceback."""
    data = loader(ds.PlainDataset(8), batch_size=2, num_workers=2, collate_fn=ds.raising_collate)
    message = str(raised_by(lambda: next(iter(data)), ds.CollateError))
    assert "in DataLoader worker process" in message
    assert "_explode_in_collate" in message
    assert "cannot collate a batch of 2" in message


# --- workers that die or stall ----------------------------------------------------------


def _kill_worker_mid_epoch(worker_id, timed=None):
    """Kill a worker while it sleeps in __getitem__; returns (its pid, the RuntimeError).

    Each worker's first batch has been received, so none is in flight when the kill
    lands (torch itself fails differently if killed mid-transfer). ``timed``: a context
    manager (a ``Within``) around the kill and the raise, none by default.
    """
    data = loader(ds.SlowDataset(400, delay=0.5), batch_size=1, num_workers=2)
    children_before = _leaks.children()
    it = iter(data)
    next(it), next(it)
    pid = worker_pids(it, children_before)[worker_id]

    def kill_and_continue():
        # torch raises from its SIGCHLD handler, which can fire anywhere after the
        # kill, so the kill belongs inside the guarded call.
        os.kill(pid, signal.SIGKILL)
        exhaust(it)

    with timed or contextlib.nullcontext():
        error = raised_by(kill_and_continue, RuntimeError)
    return pid, error


@pytest.mark.hang_limit(30)
def test_killed_worker_raises_promptly():
    """A worker SIGKILLed mid-epoch makes iteration raise RuntimeError naming its pid within 5 s."""
    pid, error = _kill_worker_mid_epoch(1, Within(5, "the killed worker's error"))
    assert str(pid) in str(error)


@pytest.mark.fastfeed_only
@pytest.mark.hang_limit(30)
def test_killed_worker_error_names_worker_pid_and_signal():
    """The RuntimeError for a SIGKILLed worker names the worker id, its pid and the signal."""
    pid, error = _kill_worker_mid_epoch(1)
    message = str(error)
    assert "worker 1" in message and str(pid) in message and "SIGKILL" in message, message


@pytest.mark.hang_limit(30)
def test_timeout_raises_when_worker_is_too_slow():
    """timeout=1 with a 10 s __getitem__ raises RuntimeError 'timed out after 1' within ~3 s."""
    it = iter(loader(ds.SlowDataset(4, delay=10), batch_size=1, num_workers=1, timeout=1))
    with Within(3, "the timeout's error"):
        error = raised_by(functools.partial(next, it), RuntimeError)  # not a lambda: pyflakes misreads the del below
    assert "timed out after 1" in str(error)
    del it


# --- shutdown in the test process -------------------------------------------------------


def _delete_iterator_mid_epoch(context="fork"):
    it = iter(loader(ds.PlainDataset(64), batch_size=2, num_workers=2, multiprocessing_context=context))
    next(it)
    seen = _leaks.children()
    del it
    return seen


def _delete_loader_with_persistent_workers():
    data = loader(ds.PlainDataset(64), batch_size=2, num_workers=2, persistent_workers=True)
    for _ in data:
        break
    seen = _leaks.children()
    del data
    return seen


def _break_out_of_loop():
    for i, _ in enumerate(loader(ds.PlainDataset(64), batch_size=2, num_workers=2)):
        if i == 1:
            seen = _leaks.children()
            break
    return seen


def _finish_epoch():
    # The loader stays alive: finishing the epoch alone must release workers and segments.
    data = loader(ds.PlainDataset(16), batch_size=2, num_workers=2)
    it = iter(data)
    next(it)
    seen = _leaks.children()
    assert sum(1 for _ in it) == 7
    del it
    return seen


SHUTDOWNS = {
    "delete the iterator mid-epoch": _delete_iterator_mid_epoch,
    "delete the iterator mid-epoch (spawn)": lambda: _delete_iterator_mid_epoch("spawn"),
    "delete the loader (persistent workers)": _delete_loader_with_persistent_workers,
    "break out of the loop": _break_out_of_loop,
    "finish the epoch": _finish_epoch,
}


@pytest.mark.parametrize("how", list(SHUTDOWNS))
def test_shutdown_leaves_no_processes_or_segments(how):
    """Deleting the iterator or loader, breaking out, or finishing an epoch ends every worker and segment."""
    before = _leaks.Snapshot.take()
    workers_seen = SHUTDOWNS[how]() - before.children
    assert len(workers_seen) == 2, "the scenario should have started 2 workers"
    assert _leaks.wait_for_no_leaks(before) == []
    # Only this process tree's (or a dead process's): another test run beside this one has live segments of its own.
    assert not {n for n in _leaks.shm_segments(("fastfeed-",)) - before.segments if _leaks.is_ours(n)}


# --- shutdown of a whole process --------------------------------------------------------

from _scripts import gone as _gone, finish as _finish, start_script as _start_script  # noqa: E402


@pytest.mark.hang_limit(40)
@pytest.mark.parametrize("target", ["process", "process group"])
def test_ctrl_c_raises_keyboard_interrupt_and_cleans_up(target):
    """SIGINT to a script iterating a slow loader raises KeyboardInterrupt; no workers or segments remain."""
    proc = _start_script(
        """
        data = _candidate.DataLoader(ds.SlowDataset(10_000, delay=0.2), batch_size=1,
                                     num_workers=2, multiprocessing_context="fork")
        it = iter(data)
        next(it)
        print("READY", flush=True)
        for _ in it:
            pass
        """
    )
    with proc:  # closes the pipes and reaps the script whatever happens
        try:
            assert proc.stdout.readline().strip() == "READY"
            family = _leaks.descendants(proc.pid)
            assert len(family) >= 2
            with Within(5, "the script's exit after SIGINT"):
                if target == "process":
                    os.kill(proc.pid, signal.SIGINT)
                else:
                    os.killpg(proc.pid, signal.SIGINT)
                _, err = _finish(proc, timeout=15)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    assert _gone(proc.pid, family) == []


@pytest.mark.hang_limit(40)
@pytest.mark.parametrize("persistent", [False, True])
def test_interpreter_exit_mid_epoch_cleans_up(persistent):
    """Exiting the interpreter with a live iterator (persistent or not) leaves no workers or segments."""
    proc = _start_script(
        f"""
        data = _candidate.DataLoader(ds.PlainDataset(64), batch_size=2, num_workers=2,
                                     persistent_workers={persistent}, multiprocessing_context="fork")
        # Module globals: only interpreter shutdown can clean these up.
        it = iter(data)
        batches = [next(it), next(it)]
        print(*_leaks.descendants(os.getpid()), flush=True)
        """
    )
    out, err = _finish(proc, timeout=20)
    family = {int(p) for p in out.split()}
    assert len(family) >= 2
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    assert _gone(proc.pid, family) == []


# --- memory that batches point into ---------------------------------------------------

RETENTION = dict(batch_size=2, num_workers=2, prefetch_factor=2, multiprocessing_context="fork")
RING_SLOTS = RETENTION["num_workers"] * RETENTION["prefetch_factor"] + 2


def _retained_epoch(loader_cls):
    """Every batch of an epoch 10x longer than the ring, kept alive, and the warnings it raised."""
    seed_all(99)
    data = loader_cls(ds.AugmentedDataset(RETENTION["batch_size"] * 10 * RING_SLOTS), **RETENTION)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(data)
    return batches, caught


@pytest.mark.hang_limit(30)
def test_retaining_every_batch_keeps_them_correct():
    """list(loader) over 10x the ring's slots completes and every retained batch stays equal to torch's."""
    expected, _ = _retained_epoch(tud.DataLoader)
    batches, _ = _retained_epoch(_candidate.DataLoader)
    assert len(batches) == 10 * RING_SLOTS
    assert_same(batches, expected)
    # Another epoch may reuse whatever memory the first one released.
    for _ in loader(ds.PlainDataset(64), batch_size=2, num_workers=2):
        pass
    assert_same(batches, expected)


@pytest.mark.fastfeed_only
@pytest.mark.hang_limit(30)
def test_retaining_every_batch_warns_once_about_ring_growth():
    """Retaining every batch makes the ring grow, announced by exactly one fastfeed.RingGrowthWarning."""
    growth_warning = _candidate.RingGrowthWarning
    assert growth_warning is not None, "fastfeed does not export RingGrowthWarning"
    assert issubclass(growth_warning, UserWarning)
    _, caught = _retained_epoch(_candidate.DataLoader)
    growth = [w for w in caught if issubclass(w.category, growth_warning)]
    assert len(growth) == 1, [str(w.message) for w in growth]


def test_batch_larger_than_its_slot_is_correct():
    """A batch that outgrows its slot (items grow after the first batch) arrives intact, as do later ones."""
    dataset = ds.GrowingDataset(24, batch_size=4)
    data = loader(dataset, batch_size=4, num_workers=2, collate_fn=ds.pad_collate)
    expected = [ds.pad_collate([dataset[i] for i in range(b, b + 4)]) for b in range(0, 24, 4)]
    assert expected[1][0].numel() > 100 * expected[0][0].numel(), "the second batch should be far bigger"
    batches = []
    for number, batch in enumerate(data):
        assert_same(batch, expected[number], f"batch {number} on arrival")
        batches.append(batch)
    assert_same(batches, expected, "retained batches")


def test_batches_outlive_iterator_and_loader():
    """Tensors from the loader keep their values after the iterator and loader are deleted."""
    data = loader(ds.PlainDataset(16), batch_size=4, num_workers=2)
    it = iter(data)
    first, second = next(it), next(it)
    del it, data
    gc.collect()
    for _ in loader(ds.PlainDataset(64, width=4), batch_size=4, num_workers=2, shuffle=True):
        pass
    assert_same(first, ds.expected_plain_batch([0, 1, 2, 3]))
    assert_same(second, ds.expected_plain_batch([4, 5, 6, 7]))


def test_batches_can_be_modified_in_place():
    """In-place edits to a batch stick while it is held, and never reach the batches that follow."""

    def edited(number):
        expected = ds.expected_plain_batch([2 * number, 2 * number + 1])
        return {"x": -expected["x"], "index": expected["index"] + 1000}

    held = collections.deque(maxlen=2)  # a short window, so the ring need not grow
    for number, batch in enumerate(loader(ds.PlainDataset(40), batch_size=2, num_workers=2)):
        assert_same(batch, ds.expected_plain_batch([2 * number, 2 * number + 1]), f"batch {number}")
        batch["x"].mul_(-1)
        batch["index"].add_(1000)
        held.append((number, batch))
        for n, kept in held:
            assert_same(kept, edited(n), f"batch {n}, held at batch {number}")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_run_when_stderr_is_not_a_file(context):
    """With sys.stderr replaced by an object without a descriptor (a notebook, pytest's capsys), workers still run."""
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()):
        got = [b["index"].tolist() for b in loader(ds.PlainDataset(8), batch_size=2, num_workers=2,
                                                      multiprocessing_context=context)]  # fmt: skip
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]
