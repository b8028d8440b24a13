"""The measurement layer: what every fastfeed iterator records about each batch, and its summary.

Always on (``FASTFEED_STATS=0`` turns it off) and cheap: two clock reads per batch in the
consumer, two per batch in the worker, appended to flat arrays. The tuner and the doctor
read the raw records; ``DataLoader.stats()`` summarises them.

Per batch, in the order the consumer received them (``step`` has one fewer: ``step[i]`` precedes
batch ``i + 1``):

- ``wait``: seconds the consumer spent inside ``__next__`` (blocked on input);
- ``step``: seconds from the previous batch's return to this request (the training step);
- ``ready``: batches already made and waiting when the consumer asked.

Per worker, in the order it made them: ``fetch`` (``__getitem__`` / the iterable) and
``collate`` (collate function and the write into the ring slot) seconds, measured in the
worker. ``h2d``: seconds of each host-to-device copy, read from CUDA events once they completed.
"""

from __future__ import annotations

import statistics
import time
from array import array
from dataclasses import asdict, dataclass

from . import config

MAX_RECORDS = 1 << 20  # per series: past this only the sums grow (8 MB per series at most)


class Recorder:
    """The records of one iterator (one epoch): written by the loader, read by the tuner and doctor."""

    __slots__ = ("num_workers", "prefetch_factor", "started", "wait", "step", "ready", "h2d", "fetch",
                 "collate", "sum_wait", "sum_step", "batches", "busy", "first_ask", "last_return",
                 "_returned", "_asked", "_ready")  # fmt: skip

    def __init__(self, num_workers: int, prefetch_factor: int | None) -> None:
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.started = time.perf_counter()
        self.wait, self.step, self.ready, self.h2d = array("d"), array("d"), array("l"), array("d")
        self.fetch = [array("d") for _ in range(num_workers)]
        self.collate = [array("d") for _ in range(num_workers)]
        self.busy = [0.0] * num_workers  # each worker's fetch + collate seconds
        self.sum_wait = self.sum_step = 0.0
        self.batches = 0
        self.first_ask = self.last_return = None
        self._returned = None  # when the last batch was returned
        self._asked = 0.0
        self._ready = 0

    def asked(self, ready: int) -> None:
        """The consumer asks for a batch; ``ready`` of them are made and waiting."""
        self._asked = time.perf_counter()
        self._ready = ready

    def returned(self) -> None:
        """The batch asked for is returned (a request that ends the epoch records nothing)."""
        now = self.last_return = time.perf_counter()
        room = self.batches < MAX_RECORDS
        if self._returned is None:
            self.first_ask = self._asked
        else:
            step = self._asked - self._returned
            self.sum_step += step
            if room:
                self.step.append(step)
        wait = now - self._asked
        self.sum_wait += wait
        self.batches += 1
        self._returned = now
        if room:
            self.wait.append(wait)
            self.ready.append(self._ready)

    def worker(self, worker_id: int, fetch_s: float, collate_s: float) -> None:
        if worker_id >= self.num_workers:
            return
        self.busy[worker_id] += fetch_s + collate_s
        if len(self.fetch[worker_id]) < MAX_RECORDS:
            self.fetch[worker_id].append(fetch_s)
            self.collate[worker_id].append(collate_s)

    def copied(self, seconds: float | None) -> None:
        if seconds is not None and len(self.h2d) < MAX_RECORDS:
            self.h2d.append(seconds)

    def window(self, start: int, stop: int) -> tuple[float, float]:
        """Sums of ``wait`` and ``step`` over batches ``start..stop-1`` (for a tuner's window)."""
        wait = sum(self.wait[start:stop])
        step = sum(self.step[max(0, start - 1):max(0, stop - 1)])  # step i precedes batch i + 1
        return wait, step

    def summary(self) -> Stats:
        return Stats.of(self)


def _quantile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class Stats:
    """What ``DataLoader.stats()`` reports about the latest iterator.

    Attributes:
        batches: batches returned to the consumer.
        elapsed_s: from the first request to the last batch returned.
        batches_per_s: ``batches / elapsed_s``.
        stall_fraction: Σwait / (Σwait + Σstep): the share of the consumer's time spent waiting for input.
        wait_p50_s, wait_p95_s, step_p50_s, step_p95_s: quantiles of the two.
        ready_mean: batches made and waiting when the consumer asked, on average.
        worker_busy: each worker's fetch + collate time over the iterator's lifetime.
        fetch_mean_s, collate_mean_s: per batch, in the workers (None with ``num_workers=0``).
        h2d_p50_s: the host-to-device copy's median (None without a CUDA device stage).
    """

    num_workers: int
    prefetch_factor: int | None
    batches: int
    elapsed_s: float
    batches_per_s: float
    stall_fraction: float
    wait_p50_s: float | None
    wait_p95_s: float | None
    step_p50_s: float | None
    step_p95_s: float | None
    ready_mean: float | None
    worker_busy: tuple
    fetch_mean_s: float | None
    collate_mean_s: float | None
    h2d_p50_s: float | None

    @classmethod
    def of(cls, rec: Recorder | None) -> Stats:
        if rec is None or rec.first_ask is None or rec.last_return is None:
            nw, pf = (0, None) if rec is None else (rec.num_workers, rec.prefetch_factor)
            return cls(nw, pf, 0, 0.0, 0.0, 0.0, None, None, None, None, None, (0.0,) * nw, None, None, None)
        elapsed = rec.last_return - rec.first_ask
        lifetime = max(rec.last_return - rec.started, 1e-9)
        total = rec.sum_wait + rec.sum_step
        fetch = [x for series in rec.fetch for x in series]
        collate = [x for series in rec.collate for x in series]
        return cls(
            num_workers=rec.num_workers,
            prefetch_factor=rec.prefetch_factor,
            batches=rec.batches,
            elapsed_s=elapsed,
            batches_per_s=rec.batches / elapsed if elapsed > 0 else 0.0,
            stall_fraction=rec.sum_wait / total if total > 0 else 0.0,
            wait_p50_s=_quantile(rec.wait, 0.5),
            wait_p95_s=_quantile(rec.wait, 0.95),
            step_p50_s=_quantile(rec.step, 0.5),
            step_p95_s=_quantile(rec.step, 0.95),
            ready_mean=statistics.fmean(rec.ready) if rec.ready else None,
            worker_busy=tuple(min(1.0, b / lifetime) for b in rec.busy),
            fetch_mean_s=statistics.fmean(fetch) if fetch else None,
            collate_mean_s=statistics.fmean(collate) if collate else None,
            h2d_p50_s=_quantile(rec.h2d, 0.5),
        )

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        def ms(x):
            return "-" if x is None else f"{x * 1e3:.2f} ms"

        busy = " ".join(f"{b:.0%}" for b in self.worker_busy) or "-"
        return (
            f"{self.batches} batches in {self.elapsed_s:.2f} s ({self.batches_per_s:.1f}/s), "
            f"num_workers={self.num_workers}, prefetch_factor={self.prefetch_factor}\n"
            f"stall {self.stall_fraction:.1%}  wait p50 {ms(self.wait_p50_s)} p95 {ms(self.wait_p95_s)}  "
            f"step p50 {ms(self.step_p50_s)} p95 {ms(self.step_p95_s)}\n"
            f"workers busy {busy}  fetch {ms(self.fetch_mean_s)}  collate {ms(self.collate_mean_s)}  "
            f"h2d p50 {ms(self.h2d_p50_s)}  ready {'-' if self.ready_mean is None else f'{self.ready_mean:.1f}'}"
        )


def recorder(num_workers: int, prefetch_factor: int | None) -> Recorder | None:
    """A recorder for a new iterator, or None when ``FASTFEED_STATS=0``."""
    return Recorder(num_workers, prefetch_factor) if config.stats_enabled() else None


class Measured:
    """Mixed into the loader's iterators: times each ``__next__`` into ``self._stats``.

    ``_timed`` is False when a device stage wraps the iterator: the consumer then asks the
    stage, which does the timing (see ``transfer.DeviceIter``).
    """

    _stats: Recorder | None = None
    _timed = True

    def _ready_count(self) -> int:
        return 0

    def __next__(self):
        rec = self._stats
        if rec is None or not self._timed:
            return super().__next__()
        rec.asked(self._ready_count())
        data = super().__next__()
        rec.returned()
        return data
