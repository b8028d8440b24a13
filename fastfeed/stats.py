"""The measurement layer: what every fastfeed iterator records about each batch, and its summary.

Always on (``FASTFEED_STATS=0`` turns it off) and cheap: two clock reads and a poll per batch
in the consumer, a few clock reads per batch in the worker, appended to flat arrays. The tuner and the doctor
read the raw records; ``DataLoader.stats()`` summarises them.

Per batch, in the order the consumer received them (``step`` has one fewer: ``step[i]`` precedes
batch ``i + 1``):

- ``wait``: seconds the consumer spent inside ``__next__`` (blocked on input);
- ``step``: seconds from the previous batch's return to this request (the training step);
- ``ready``: batches already made and waiting when the consumer asked.

Per worker, in the order it made them: ``fetch`` (``__getitem__`` / the iterable) and
``collate`` (collate function and the write into the ring slot) seconds, measured in the
worker, and ``ends``: the worker's clock when it finished each (``perf_counter`` is CLOCK_MONOTONIC, one clock
for every process, so the doctor can place worker batches on the consumer's timeline). ``h2d``: seconds of each
host-to-device copy, read from CUDA events once they completed.
"""

from __future__ import annotations

import statistics
import time
from array import array
from dataclasses import asdict, dataclass

from . import config

MAX_RECORDS = 1 << 18  # batches (and worker batches) kept in full (~20 MB); past this only totals grow


class Recorder:
    """The records of one iterator (one epoch): written by the loader, read by the tuner and doctor.

    Raw clock readings are kept (three list appends per batch: lists take the float objects
    the clock returned, where an array would convert them, which costs the loop measurably);
    waits, steps and sums are derived when read.
    """

    __slots__ = ("num_workers", "prefetch_factor", "started", "asks", "returns", "ready", "h2d", "fetch",
                 "collate", "ends", "_extra", "add", "paths")  # fmt: skip

    def __init__(self, num_workers: int, prefetch_factor: int | None) -> None:
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.started = time.perf_counter()
        self.asks: list[float] = []
        self.returns: list[float] = []
        self.ready: list[int] = []
        self.h2d = array("d")
        self.fetch = [array("d") for _ in range(num_workers)]
        self.collate = [array("d") for _ in range(num_workers)]
        self.ends = [array("d") for _ in range(num_workers)]
        self._extra = None  # past MAX_RECORDS: [batches, Σwait, Σstep, last return]
        self.paths: dict[int, str] = {}  # worker id -> how its batches reach the ring (Stats.worker_paths)
        self.add = self._adder()

    def _adder(self):
        """``add(asked, ready, returned)``: a batch asked for at ``asked`` (``ready`` were made and
        waiting) was returned at ``returned``. A closure over bound appends: it runs for every batch."""
        asks, ask, ret, rdy, overflow = self.asks, self.asks.append, self.returns.append, self.ready.append, self._more

        def add(asked: float, ready: int, returned: float) -> None:
            if len(asks) < MAX_RECORDS:
                ask(asked)
                ret(returned)
                rdy(ready)
            else:
                overflow(asked, returned)

        return add

    def _more(self, asked: float, returned: float) -> None:
        extra = self._extra
        if extra is None:
            extra = self._extra = [0, 0.0, 0.0, self.returns[-1]]
        extra[0] += 1
        extra[1] += returned - asked
        extra[2] += asked - extra[3]
        extra[3] = returned

    def worker(self, worker_id: int, fetch_s: float, collate_s: float, done_at: float = 0.0) -> None:
        if worker_id < self.num_workers and len(self.fetch[worker_id]) < MAX_RECORDS:
            self.fetch[worker_id].append(fetch_s)
            self.collate[worker_id].append(collate_s)
            self.ends[worker_id].append(done_at)

    def copied(self, seconds: float | None) -> None:
        if seconds is not None and len(self.h2d) < MAX_RECORDS:
            self.h2d.append(seconds)

    @property
    def batches(self) -> int:
        return len(self.asks) + (self._extra[0] if self._extra else 0)

    @property
    def first_ask(self) -> float | None:
        return self.asks[0] if self.asks else None

    @property
    def last_return(self) -> float | None:
        if self._extra:
            return self._extra[3]
        return self.returns[-1] if self.returns else None

    def waits(self) -> list[float]:
        return [r - a for a, r in zip(self.asks, self.returns)]

    def steps(self) -> list[float]:
        """``steps()[i]``: from batch ``i``'s return to the request for batch ``i + 1``."""
        return [a - r for a, r in zip(self.asks[1:], self.returns)]

    def window(self, start: int, stop: int) -> tuple[float, float]:
        """Sums of the waits of batches ``start..stop-1`` and of the steps before them (for a tuner's window)."""
        asks, returns = self.asks, self.returns
        wait = sum(returns[start:stop]) - sum(asks[start:stop])
        a = max(start, 1)
        step = sum(asks[a:stop]) - sum(returns[a - 1:stop - 1]) if stop > a else 0.0
        return wait, step

    def totals(self) -> tuple[float, float]:
        """Σwait and Σstep over every batch."""
        wait, step = self.window(0, len(self.asks))
        if self._extra:
            wait, step = wait + self._extra[1], step + self._extra[2]
        return wait, step


def quantile(values, q: float) -> float | None:
    """The ``q`` quantile of ``values`` (the nearest rank below), or None for none."""
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
        worker_busy: each worker's fetch + collate time over the iterator's lifetime (its first
            ``MAX_RECORDS`` batches).
        fetch_mean_s, collate_mean_s: per batch, in the workers (None with ``num_workers=0``).
        h2d_p50_s: the host-to-device copy's median (None without a CUDA device stage).
        worker_paths: how each worker's batches reach the ring: ``"process"`` and ``"thread"`` write into it;
            a Ray actor's take ``"shm"`` (an actor on this node writes into it), ``"stream"`` (another node's,
            read into it from a TCP stream) or ``"object store"`` (through Ray's object store, then copied in).
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
    worker_paths: tuple = ()

    @classmethod
    def of(cls, rec: Recorder | None) -> Stats:
        if rec is None or rec.first_ask is None:
            nw, pf = (0, None) if rec is None else (rec.num_workers, rec.prefetch_factor)
            return cls(nw, pf, 0, 0.0, 0.0, 0.0, None, None, None, None, None, (0.0,) * nw, None, None, None)
        batches = rec.batches
        elapsed = rec.last_return - rec.first_ask
        lifetime = max(rec.last_return - rec.started, 1e-9)
        sum_wait, sum_step = rec.totals()
        total = sum_wait + sum_step
        waits, steps = rec.waits(), rec.steps()
        fetch = [x for series in rec.fetch for x in series]
        collate = [x for series in rec.collate for x in series]
        busy = [sum(f) + sum(c) for f, c in zip(rec.fetch, rec.collate)]
        return cls(
            num_workers=rec.num_workers,
            prefetch_factor=rec.prefetch_factor,
            batches=batches,
            elapsed_s=elapsed,
            batches_per_s=batches / elapsed if elapsed > 0 else 0.0,
            stall_fraction=sum_wait / total if total > 0 else 0.0,
            wait_p50_s=quantile(waits, 0.5),
            wait_p95_s=quantile(waits, 0.95),
            step_p50_s=quantile(steps, 0.5),
            step_p95_s=quantile(steps, 0.95),
            ready_mean=statistics.fmean(rec.ready) if rec.ready else None,
            worker_busy=tuple(min(1.0, b / lifetime) for b in busy),
            fetch_mean_s=statistics.fmean(fetch) if fetch else None,
            collate_mean_s=statistics.fmean(collate) if collate else None,
            h2d_p50_s=quantile(rec.h2d, 0.5),
            worker_paths=tuple(rec.paths.get(w, "") for w in range(rec.num_workers)),
        )

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        def ms(x):
            return "-" if x is None else f"{x * 1e3:.2f} ms"

        # Without per-batch worker records (DALI's threads, torch's loaders under the doctor) there is no busy figure.
        busy = " ".join(f"{b:.0%}" for b in self.worker_busy) if self.fetch_mean_s is not None else ""
        busy = busy or "-"
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
