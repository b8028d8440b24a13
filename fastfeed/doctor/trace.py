"""The doctor's timeline as a Chrome trace (``trace.json``): open it in https://ui.perfetto.dev or chrome://tracing.

The PNG shows the whole run at once; the trace lets the user zoom into each batch: which wait lined up with
which worker's fetch or collate, how long each step and host-to-device copy took, next to the CPU, disk and
GPU counters, and, loaded beside torch's profiler trace, next to the kernels.

Layout: the main process is pid 1, with per loader a track of its waits, one of its steps and one of its H2D
copies, and the system samples as counters. Each worker process is a process of its own (its real pid where
known), with its fetch and collate spells. Times are microseconds since the watch started.

A job's trace (``job_trace``, the ranks of one ``torchrun``) holds that layout once per rank, ranks in order:
rank ``r``'s main process, named "rank r (host, local rank l)", with its loaders' tracks, its counters and a
"sync" track splitting each step of its training loader into compute and then sync; then that rank's worker
processes, named "rank r loader i worker w (pid p)". Two ranks' workers may have the same pid (two machines),
so the trace numbers every process afresh, 1, 2, 3, ... in that order, the real pid kept in its name. Times are
on rank 0's clock, microseconds since the job started.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

from .ranks import RankRecord, RankSplit
from .timeline import EpochRecord, LoaderRecord, Timeline

MAIN_PID = 1
SYNTHETIC_PID = 1 << 23  # above Linux's largest pid (4194304), so never a real worker's
# (counter name, ((sample key, scale), ...)): each counter drawn when a sample has any of its keys
COUNTERS = (
    ("cpu %", (("cpu_busy", 100), ("iowait", 100))),
    ("gpu %", (("gpu_util", 100), ("gpu_mem_util", 100))),
    ("disk MB/s", (("disk_read_mbps", 1),)),
    ("pcie MB/s", (("pcie_rx_mbps", 1), ("pcie_tx_mbps", 1))),
    ("memory available MB", (("mem_available", 1 / 2**20),)),  # read every few ticks: a counter holds its value
)


def chrome_trace(timeline: Timeline) -> dict:
    """The timeline in Chrome's Trace Event Format: complete events, counters and track names, sorted by time."""
    events = _name(MAIN_PID, None, "main process", sort=0)
    for index, rec in enumerate(timeline.loaders):
        events += _loader_events(timeline.start, index, rec)
        events += _worker_events(timeline.start, index, rec)
    events += _counter_events(timeline.samples, timeline.start)
    events.sort(key=lambda ev: ev["ts"])  # stable: the names, at 0, stay ahead of what they name
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timeline: Timeline, path) -> Path:
    """Write ``chrome_trace(timeline)`` to ``path`` as compact JSON."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timeline), separators=(",", ":")))
    return path


def job_trace(ranks: list[RankRecord], splits: list[RankSplit], start: float) -> dict:
    """One job's ranks in one trace, laid out as the module's doc says, sorted by time.

    ``splits``: ``ranks.split(ranks)``, matched to ``ranks`` by rank. ``start``: the job's start on rank 0's clock,
    no later than any rank's first record; every rank's records are shifted by its ``offset`` onto that clock.

    The "sync" track draws, per step of the rank's training loader, ``compute`` then ``sync``: the split says how
    long the rank waited for the others during the step, not when, so the wait is drawn at the end of the step and
    the compute before it; where in the step the rank really waited (in ``backward()``'s all-reduce, at the next
    synchronisation with the GPU) is not known. Each ``sync`` carries ``waiting_for_others_ms``, the part of it
    the ranks' alignment explains (``RankSplit.aligned``).
    """
    by_rank = {sp.rank: sp for sp in splits}
    numbers = itertools.count(1)  # the trace's pids, in the order the processes are named (see the module's doc)
    events = []
    for r in sorted(ranks, key=lambda r: r.rank):
        tl = r.timeline
        main = next(numbers)
        where = f"{r.host}, local rank {r.local_rank}" if r.host else f"local rank {r.local_rank}"
        events += _name(main, None, f"rank {r.rank} ({where})", sort=main)
        workers = defaultdict(numbers.__next__).__getitem__  # a worker's pid -> its pid in the trace, on first sight
        for index, rec in enumerate(tl.loaders):
            events += _loader_events(start, index, rec, pid=main, offset=r.offset)
            events += _worker_events(start, index, rec, offset=r.offset, pids=workers, prefix=f"rank {r.rank} ")
        rec = tl.primary()  # the loader ranks.split splits
        if rec is not None and r.rank in by_rank:
            events += _sync_events(start, main, 3 * len(tl.loaders) + 1, rec, by_rank[r.rank])
        events += _counter_events(tl.samples, start, pid=main, offset=r.offset)
    events.sort(key=lambda ev: ev["ts"])  # stable: the names, at 0, stay ahead of what they name
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_job_trace(ranks: list[RankRecord], splits: list[RankSplit], start: float, path) -> Path:
    """Write ``job_trace(ranks, splits, start)`` to ``path`` as compact JSON."""
    path = Path(path)
    path.write_text(json.dumps(job_trace(ranks, splits, start), separators=(",", ":")))
    return path


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3) + 0.0  # + 0.0: no "-0.0" in the file


def _span(name: str, pid: int, tid: int, start: float, end: float, **args) -> dict:
    """A complete event from ``start`` to ``end`` (seconds since the trace's start)."""
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": _us(start), "dur": _us(max(end - start, 0.0)),
            "args": args}  # fmt: skip


def _name(pid: int, tid: int | None, name: str, sort: int) -> list[dict]:
    """Metadata naming a process (``tid`` None) or a thread, and its place in the list of tracks."""
    what = "process" if tid is None else "thread"
    tid = 0 if tid is None else tid
    return [
        {"name": f"{what}_name", "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}},
        {"name": f"{what}_sort_index", "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": {"sort_index": sort}},
    ]


def _label(rec: LoaderRecord) -> str:
    return f"loader {rec.id} ({rec.kind}, made at {rec.made_at})"


def _loader_events(start: float, index: int, rec: LoaderRecord, pid: int = MAIN_PID, offset: float = 0.0) -> list[dict]:
    """On the main process ``pid``: this loader's waits, steps and H2D copies, each on a track of its own.

    ``offset``: seconds from the record's clock to the one ``start`` is on (a rank's, to rank 0's).
    """
    wait_tid, step_tid, h2d_tid = 3 * index + 1, 3 * index + 2, 3 * index + 3
    label = _label(rec)
    tracks = [(wait_tid, "wait"), (step_tid, "step")]
    if any(ep.h2d for ep in rec.epochs):
        tracks.append((h2d_tid, "h2d"))
    events = [ev for tid, what in tracks for ev in _name(pid, tid, f"{label}: {what}", sort=tid)]
    for e, ep in enumerate(rec.epochs):
        asks = [a + offset - start for a in ep.asks]
        returns = [r + offset - start for r in ep.returns]
        events += [_span("wait", pid, wait_tid, a, r, batch=i, epoch=e, **_ready(ep, i))
                   for i, (a, r) in enumerate(zip(asks, returns))]  # fmt: skip
        events += [_span("step", pid, step_tid, r, a, batch=i, epoch=e)
                   for i, (r, a) in enumerate(zip(returns, asks[1:]))]  # fmt: skip
        # only durations are recorded: each copy is placed to end when its batch was returned (an approximation)
        events += [_span("h2d", pid, h2d_tid, r - d, r, batch=i, epoch=e)
                   for i, (d, r) in enumerate(zip(ep.h2d, returns))]  # fmt: skip
    return events


def _sync_events(start: float, pid: int, tid: int, rec: LoaderRecord, sp: RankSplit) -> list[dict]:
    """On a rank's main process ``pid``: each step of ``sp`` (its loader ``rec``, split) as compute, then sync."""
    events = _name(pid, tid, f"{_label(rec)}: sync", sort=tid)
    # the split counts only the epochs with batches, the wait track all of them: number the steps as the waits
    numbered = [e for e, ep in enumerate(rec.epochs) if ep.asks and ep.returns]
    first = 0
    for e, last in zip(numbered, sp.epoch_ends):
        for i in range(first, last):  # the epoch's last batch has no step
            ran = sp.returns[i] - start + sp.computes[i]
            # a part under the trace's precision is left out: ranks in step arrive apart by float rounding only
            if _us(sp.computes[i]) > 0:
                events.append(_span("compute", pid, tid, sp.returns[i] - start, ran, batch=i - first, epoch=e))
            if _us(sp.syncs[i]) > 0:
                events.append(_span("sync", pid, tid, ran, ran + sp.syncs[i], batch=i - first, epoch=e,
                                    waiting_for_others_ms=round(sp.aligned[i] * 1e3, 3)))  # fmt: skip
        first = last + 1
    return events


def _ready(ep: EpochRecord, i: int) -> dict:
    """How many batches were already made when batch ``i`` was asked for, where the loader says."""
    return {"ready": ep.ready[i]} if ep.ready is not None and i < len(ep.ready) else {}


def _worker_events(start: float, index: int, rec: LoaderRecord, offset: float = 0.0, pids=None,
                   prefix: str = "") -> list[dict]:  # fmt: skip
    """Each worker process of this loader as a process of its own, with its fetch and collate spells.

    ``offset``: as ``_loader_events``'. ``pids``: maps a worker's pid (or its stand-in where unknown) to its pid in
    the trace, the same where None. ``prefix``: what the process names begin with (a rank's "rank 1 ").
    """
    events, named = [], set()
    for e, ep in enumerate(rec.epochs):
        for w, worker in enumerate(ep.workers):
            real = w < len(ep.pids)
            pid = ep.pids[w] if real else SYNTHETIC_PID + 1000 * index + w
            track = pids(pid) if pids else pid
            if pid not in named:
                named.add(pid)
                who = f"{prefix}loader {rec.id} worker {w} (pid {pid if real else 'unknown'})"
                events += _name(track, None, who, sort=track) + _name(track, track, who, sort=0)
            for j, (f, c, end) in enumerate(zip(worker.fetch, worker.collate, worker.ends)):
                if end:  # 0: the end is unknown, so is when it ran
                    end = end + offset - start  # as _loader_events shifts, to the same rounding
                    events.append(_span("fetch", track, track, end - c - f, end - c, batch=j, epoch=e))
                    events.append(_span("collate", track, track, end - c, end, batch=j, epoch=e))
    return events


def _counter_events(samples: list[dict], start: float, pid: int = MAIN_PID, offset: float = 0.0) -> list[dict]:
    """The system samples as counters on the main process ``pid``, each value from the start of its interval.

    ``offset``: as ``_loader_events``'.
    """
    events = []
    for s in samples:
        ts = _us(s["t"] - (s.get("dt") or 0.0) + offset - start)
        for name, keys in COUNTERS:
            args = {key: s[key] * scale for key, scale in keys if s.get(key) is not None}
            if args:
                events.append({"name": name, "ph": "C", "pid": pid, "tid": 0, "ts": ts, "args": args})
    return events
