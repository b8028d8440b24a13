"""Measuring one setting: a loader run for warm-up and then windows, with the user's step.

The objective is steady-state batches/s as the training loop sees it: each window times
``batches / seconds`` of ``next(it)`` plus the step, over whole rounds of the workers. The workers of one
setting serve all its windows (``persistent_workers=True``, so an epoch boundary costs no restart),
warm-up batches are discarded, and the median of at least ``MIN_WINDOWS`` windows is the figure; a
setting whose windows spread more than the tolerance gets more windows, up to ``MAX_WINDOWS``.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Callable

import torch

from .. import _memory, _procstat, transfer
from ..stats import quantile
from .noise import CpuMeter, usage
from .result import Setting, Trial

MIN_WINDOWS = 3
MAX_WINDOWS = 6
WINDOW_S = 0.5  # the shortest window...
WINDOW_BATCHES = 4  # ...and its fewest batches


class OutOfTime(Exception):
    """The tuning budget ran out in the middle of a trial (which is kept if it has windows)."""

    def __init__(self, trial: Trial | None):
        super().__init__("tuning budget spent")
        self.trial = trial


def step_fn(step) -> Callable[[Any], None] | None:
    """The training step to run with each batch: None, a synthetic one of ``step`` seconds, or the user's."""
    if step is None:
        return None
    if callable(step):
        return step
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step < 0:
        raise ValueError(f"step must be None, a number of seconds >= 0 or a callable(batch), got {step!r}")
    seconds = float(step)
    return lambda batch: time.sleep(seconds)  # waits, as the host does while a GPU step runs


def sync() -> None:
    """Wait for queued GPU work, so that a window's edges count the GPU time of its steps."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def load_seconds(rec) -> float | None:
    """A worker's seconds per batch (fetch and collate), from a loader's ``stats.Recorder``: read from the recorder
    itself, not ``Stats.of`` it, since a tuning epoch's trial iterators record their workers' times but not the
    consumer's (the epoch's own recorder times that), and ``Stats.of`` such a recorder is empty."""
    fetch = [x for series in rec.fetch for x in series] if rec is not None else []
    if not fetch:
        return None
    collate = [x for series in rec.collate for x in series]
    return statistics.fmean(fetch) + (statistics.fmean(collate) if collate else 0.0)


def load_tail(rec) -> float | None:
    """``Trial.load_tail`` from a loader's recorder (``stats.Recorder``): the 95th percentile of the workers' time
    per batch (fetch and collate), or of the loop's step when that is longer, over their median; None without
    workers' records."""
    if rec is None:
        return None
    times = [f + c for fetch, collate in zip(rec.fetch, rec.collate) for f, c in zip(fetch, collate)]
    typical = quantile(times, 0.5)
    if not typical:
        return None
    return max(quantile(times, 0.95), quantile(rec.steps(), 0.95) or 0.0) / typical


def batch_bytes(batch) -> int:
    return sum(t.numel() * t.element_size() for t in transfer.tensors(batch))


def probe_batch_bytes(loader_cls, dataset, base: dict) -> int:
    """The bytes of one batch, made in this process: what the memory budget needs before any trial."""
    loader = loader_cls(dataset, **loader_args(base, Setting("process", 0, None)))
    return batch_bytes(next(iter(loader)))


def private_bytes(pids) -> int:
    """The largest private memory (USS: resident and swapped) among ``pids``: what one more worker costs."""
    return _memory.largest_uss(pids)


def loader_args(base: dict, setting: Setting) -> dict:
    """The loader's arguments for ``setting`` on top of the user's ``base`` ones."""
    kwargs = dict(base, **setting.loader_kwargs())
    if setting.total == 0:  # what torch rejects without workers
        for key in ("multiprocessing_context", "timeout", "persistent_workers"):
            kwargs.pop(key, None)
    return kwargs


def close(loader) -> None:
    """Stop a trial loader's workers and free its ring now, not at garbage collection."""
    own = getattr(loader, "close", None)
    if own is not None:  # a loader that knows how (DALI's)
        own()
        return
    it = loader._iterator
    loader._iterator = None
    if it is not None:
        it._shutdown_workers()
    if loader._ff_ring is not None:
        loader._ff_ring.close()
        loader._ff_ring = None


def run(loader_cls, dataset, base: dict, setting: Setting, step, *, tolerance: float, deadline: float,
        window_s: float = WINDOW_S, first: bool = False, windows: int | None = None) -> Trial:  # fmt: skip
    """Measure ``setting``: warm-up, then windows until their median is trustworthy.

    ``first``: the tuning's first trial, which gets one window whatever the deadline (a
    budget too small still yields an answer).
    ``windows``: exactly this many windows, whatever their spread (a duel's round: short, its noise
    answered by the rounds), instead of ``MIN_WINDOWS`` to ``MAX_WINDOWS``.

    Raises:
        OutOfTime: ``deadline`` (``time.monotonic()``) passed; its ``trial`` has the windows
            measured so far, or is None.
        Whatever the loader or ``step`` raise, after the loader's workers are stopped.
    """
    kwargs = loader_args(base, setting)
    if setting.total > 0:
        kwargs["persistent_workers"] = True  # windows reuse the workers, across epoch ends too
    return run_made(lambda: loader_cls(dataset, **kwargs), setting, step, tolerance=tolerance, deadline=deadline,
                    window_s=window_s, first=first, windows=windows)  # fmt: skip


def run_made(make: Callable[[], Any], setting: Setting, step, *, tolerance: float, deadline: float,
             window_s: float = WINDOW_S, first: bool = False, windows: int | None = None) -> Trial:  # fmt: skip
    """``run`` for a loader that ``make()`` builds for ``setting`` (a DALI pipeline's, say)."""
    started = time.monotonic()
    trial = Trial(setting)
    with warnings.catch_warnings():
        # Settings above the cores are tried on purpose: torch's warning about them is noise here.
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        loader = make()
        return _run(loader, trial, step, tolerance, deadline, window_s, first, started, windows)


def _run(loader, trial, step, tolerance, deadline, window_s, first, started, windows=None) -> Trial:
    try:
        _windows(loader, trial, step_fn(step), tolerance, deadline, window_s, 1 if first else 0, windows)
    except OutOfTime:
        trial.seconds = time.monotonic() - started
        raise OutOfTime(trial if trial.windows else None) from None
    finally:
        close(loader)
    trial.seconds = time.monotonic() - started
    return trial


def _windows(loader, trial: Trial, step, tolerance: float, deadline: float, window_s: float, least: int,
             count: int | None = None) -> None:
    it = iter(loader)
    try:
        first = next(it)
    except StopIteration:
        raise ValueError("the loader yields no batches: nothing to tune") from None
    trial.batch_bytes = batch_bytes(first)
    del first
    pids = _worker_pids(loader)
    # Each worker's private memory once it has made its first batches, and again at the end: what it grows by
    # in between is what it copied of the parent's memory while reading (copy-on-read), which goes on growing
    # past the trial, toward the size of the dataset's Python objects (see offline.Budget).
    start_bytes = private_bytes(pids) if pids else 0
    warm = (loader.num_workers * (loader.prefetch_factor or 0)) + 1
    # The workers' run-queue waits are read for local process workers only: a Ray actor's are another machine's.
    feed = _Feed(loader, it, step, warm, per_round=trial.setting.total, pids=() if trial.setting.remote else pids)
    waits, steps = 0.0, 0.0
    fewest, most = (count, count) if count else (MIN_WINDOWS, MAX_WINDOWS)
    while len(trial.windows) < fewest or (trial.spread > tolerance and len(trial.windows) < most):
        if time.monotonic() > deadline and len(trial.windows) >= least:
            feed.cpu.settle(trial, workers=bool(pids) and not trial.setting.remote)  # a trial kept has its noise
            raise OutOfTime(trial)
        rate, wait, stepped = feed.window(window_s)
        trial.windows.append(rate)
        waits, steps = waits + wait, steps + stepped
    trial.stall_fraction = waits / (waits + steps) if waits + steps > 0 else 0.0
    rec = loader._ff_stats  # fastfeed's loaders, DALI's too, keep their recorder there
    trial.load_s, trial.load_tail = load_seconds(rec), load_tail(rec)
    pids = _worker_pids(loader) or pids
    feed.cpu.settle(trial, workers=bool(pids) and not trial.setting.remote)
    if pids:
        trial.worker_bytes = private_bytes(pids)
        trial.worker_start_bytes = min(start_bytes, trial.worker_bytes) if start_bytes else trial.worker_bytes
        # The samples each worker read between the two readings: the batches taken since, shared out (a batch
        # in flight at either end is within a worker's prefetch of it).
        trial.samples_per_worker = feed.batches * (loader.batch_size or 1) / max(1, len(pids))


def _worker_pids(loader) -> list[int]:
    """The loader's local worker processes now (none for threads, Ray actors or ``num_workers=0``)."""
    it = getattr(loader, "_iterator", None)
    pids = getattr(getattr(it, "_pool", None), "pids", None)
    if it is None or getattr(it, "_threads", True) or not pids:
        return []
    return list(pids)


class _Feed:
    """Batches from ``loader`` with the step run on each, epoch after epoch, timed as the stats time them.

    A window may span an epoch's end: an epoch shorter than a window is what the loop runs,
    and ``persistent_workers`` keeps the workers, so the restart is part of the figure.
    """

    def __init__(self, loader, it, step, warm: int, per_round: int = 1, pids=()):
        self.loader, self.it, self.step = loader, it, step
        # A window ends after whole rounds of the workers (a batch from each, as they deliver in turn): n workers
        # finishing together hand over n batches at once, and a window cut inside such a burst reads up to a batch
        # too many or too few. At 32 batches/s (latency-bound samples beside busy loops) that moved a window's rate
        # by 5-10%, past the tolerance, so the trial ran 6 windows instead of 3 (`fastfeed bench tune`'s (b)).
        self.per_round = max(1, per_round)
        self.wait = self.stepped = 0.0  # seconds in next() and in the step (and the loop)
        self.batches = 0  # taken after the first
        self.cpu = WindowsCpu(pids)
        for _ in range(warm - 1):  # the first batch was taken already
            self._next()

    def _next(self) -> None:
        # Taking a batch that is ready already (the workers kept ahead) is the loop's own time, not a wait for input:
        # on a loaded 2-core machine that hand-over read 1-2% of a 50 ms step, at the edge of NOT_INPUT_BOUND.
        ready = getattr(self.it, "_batch_ready", None)
        handed = ready is not None and ready()
        t0 = time.perf_counter()
        try:
            batch = next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            try:
                batch = next(self.it)
            except StopIteration:
                raise ValueError("the loader yields no batches: nothing to tune") from None
        t1 = time.perf_counter()
        self.batches += 1
        if self.step is not None:
            self.step(batch)
        if handed:
            self.stepped += time.perf_counter() - t0
        else:
            self.wait += t1 - t0
            self.stepped += time.perf_counter() - t1

    def window(self, seconds: float) -> tuple[float, float, float]:
        """(batches/s, Σwait, Σstep) over one window."""
        wait0 = self.wait
        sync()
        self.cpu.open()  # outside the timed span: the reading's own cost is no part of the window
        t0 = time.perf_counter()
        n = 0
        while n < WINDOW_BATCHES or time.perf_counter() - t0 < seconds or n % self.per_round:
            self._next()
            n += 1
        sync()
        elapsed = time.perf_counter() - t0
        self.cpu.close(n)
        return n / elapsed, self.wait - wait0, elapsed - (self.wait - wait0)


class WindowsCpu:
    """The CPU readings of a trial's windows, summed: a meter reading at each window's edges (``noise``).

    Only the windows count, not the warm-up nor the time between windows, as for the batches/s.

    ``pids``: the workers' processes, whose run-queue waits (``_procstat.run_delay_ns``) are read at the same
    edges; none (threads, Ray actors, ``num_workers=0``, a loader whose workers are not known): not read.
    """

    def __init__(self, pids=()) -> None:
        self.meter = CpuMeter()
        self.pids = list(pids)
        self._start = None
        self._delay: int | None = None  # the workers' run-queue nanoseconds at the window's start
        self.seconds = self.others_s = self.own_s = self.children_s = 0.0  # others_s: core-seconds
        self.wait_s: float | None = 0.0 if self.pids else None
        self.batches = 0

    def open(self) -> None:
        """A window begins."""
        self._start = self.meter.read()
        if self.wait_s is not None:
            self._delay = _procstat.run_delay_ns(self.pids)

    def close(self, batches: int) -> None:
        """The window begun at ``open()`` has ended, after ``batches`` batches; the next one may begin here."""
        end = self.meter.read()
        u = usage(self._start, end)
        self._start = end
        if self.wait_s is not None:
            delay = _procstat.run_delay_ns(self.pids)
            if delay is None or self._delay is None:
                self.wait_s = None  # the kernel keeps none
            else:
                self.wait_s += max(0, delay - self._delay) / 1e9
                self._delay = delay
        self.seconds += u.seconds
        self.others_s += u.others_cores * u.seconds
        self.own_s += u.own_cpu_s
        self.children_s += u.children_cpu_s
        self.batches += batches

    def settle(self, trial: Trial, workers: bool) -> None:
        """Set ``trial``'s ``others_cores`` (over the windows' time), ``loop_cpu_s`` and, with ``workers`` (the
        loader's local worker processes, none remote: the descendants' CPU is theirs), ``worker_cpu_s`` and, where
        read, ``worker_wait_s``."""
        if self.seconds > 0:
            trial.others_cores = self.others_s / self.seconds
        if self.batches:
            trial.loop_cpu_s = self.own_s / self.batches
            trial.worker_cpu_s = self.children_s / self.batches if workers else None
            if workers and self.wait_s is not None:
                trial.worker_wait_s = self.wait_s / self.batches
