"""The doctor's timeline as a Chrome trace (``trace.json``): open it in https://ui.perfetto.dev or chrome://tracing.

The PNG shows the whole run at once; the trace lets the user zoom into each batch: which wait lined up with
which worker's fetch or collate, how long each step and host-to-device copy took, next to the CPU, disk and
GPU counters, and, loaded beside torch's profiler trace, next to the kernels.

Layout: the main process is pid 1, with per loader a track of its waits, one of its steps and one of its H2D
copies, and the system samples as counters. Each worker process is a process of its own (its real pid where
known), with its fetch and collate spells. Times are microseconds since the watch started.
"""

from __future__ import annotations

import json
from pathlib import Path

from .timeline import EpochRecord, LoaderRecord, Timeline

MAIN_PID = 1
SYNTHETIC_PID = 1 << 23  # above Linux's largest pid (4194304), so never a real worker's
# (counter name, ((sample key, scale), ...)): each counter drawn when a sample has any of its keys
COUNTERS = (
    ("cpu %", (("cpu_busy", 100), ("iowait", 100))),
    ("gpu %", (("gpu_util", 100), ("gpu_mem_util", 100))),
    ("disk MB/s", (("disk_read_mbps", 1),)),
    ("pcie MB/s", (("pcie_rx_mbps", 1), ("pcie_tx_mbps", 1))),
)


def chrome_trace(timeline: Timeline) -> dict:
    """The timeline in Chrome's Trace Event Format: complete events, counters and track names, sorted by time."""
    events = _name(MAIN_PID, None, "main process", sort=0)
    for index, rec in enumerate(timeline.loaders):
        events += _loader_events(timeline.start, index, rec)
        events += _worker_events(timeline.start, index, rec)
    events += _counter_events(timeline)
    events.sort(key=lambda ev: ev["ts"])  # stable: the names, at 0, stay ahead of what they name
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timeline: Timeline, path) -> Path:
    """Write ``chrome_trace(timeline)`` to ``path`` as compact JSON."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timeline), separators=(",", ":")))
    return path


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3) + 0.0  # + 0.0: no "-0.0" in the file


def _span(name: str, pid: int, tid: int, start: float, end: float, **args) -> dict:
    """A complete event from ``start`` to ``end`` (seconds since the watch started)."""
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


def _loader_events(start: float, index: int, rec: LoaderRecord) -> list[dict]:
    """On the main process: this loader's waits, steps and H2D copies, each on a track of its own."""
    wait_tid, step_tid, h2d_tid = 3 * index + 1, 3 * index + 2, 3 * index + 3
    label = f"loader {rec.id} ({rec.kind}, made at {rec.made_at})"
    tracks = [(wait_tid, "wait"), (step_tid, "step")]
    if any(ep.h2d for ep in rec.epochs):
        tracks.append((h2d_tid, "h2d"))
    events = [ev for tid, what in tracks for ev in _name(MAIN_PID, tid, f"{label}: {what}", sort=tid)]
    for e, ep in enumerate(rec.epochs):
        asks = [a - start for a in ep.asks]
        returns = [r - start for r in ep.returns]
        events += [_span("wait", MAIN_PID, wait_tid, a, r, batch=i, epoch=e, **_ready(ep, i))
                   for i, (a, r) in enumerate(zip(asks, returns))]  # fmt: skip
        events += [_span("step", MAIN_PID, step_tid, r, a, batch=i, epoch=e)
                   for i, (r, a) in enumerate(zip(returns, asks[1:]))]  # fmt: skip
        # only durations are recorded: each copy is placed to end when its batch was returned (an approximation)
        events += [_span("h2d", MAIN_PID, h2d_tid, r - d, r, batch=i, epoch=e)
                   for i, (d, r) in enumerate(zip(ep.h2d, returns))]  # fmt: skip
    return events


def _ready(ep: EpochRecord, i: int) -> dict:
    """How many batches were already made when batch ``i`` was asked for, where the loader says."""
    return {"ready": ep.ready[i]} if ep.ready is not None and i < len(ep.ready) else {}


def _worker_events(start: float, index: int, rec: LoaderRecord) -> list[dict]:
    """Each worker process of this loader as a process of its own, with its fetch and collate spells."""
    events, named = [], set()
    for e, ep in enumerate(rec.epochs):
        for w, worker in enumerate(ep.workers):
            real = w < len(ep.pids)
            pid = ep.pids[w] if real else SYNTHETIC_PID + 1000 * index + w
            if pid not in named:
                named.add(pid)
                who = f"loader {rec.id} worker {w} (pid {pid if real else 'unknown'})"
                events += _name(pid, None, who, sort=pid) + _name(pid, pid, who, sort=0)
            for j, (f, c, end) in enumerate(zip(worker.fetch, worker.collate, worker.ends)):
                if end:  # 0: the end is unknown, so is when it ran
                    end -= start
                    events.append(_span("fetch", pid, pid, end - c - f, end - c, batch=j, epoch=e))
                    events.append(_span("collate", pid, pid, end - c, end, batch=j, epoch=e))
    return events


def _counter_events(timeline: Timeline) -> list[dict]:
    """The system samples as counters on the main process, each value from the start of its interval."""
    events = []
    for s in timeline.samples:
        ts = _us(s["t"] - (s.get("dt") or 0.0) - timeline.start)
        for name, keys in COUNTERS:
            args = {key: s[key] * scale for key, scale in keys if s.get(key) is not None}
            if args:
                events.append({"name": name, "ph": "C", "pid": MAIN_PID, "tid": 0, "ts": ts, "args": args})
    return events
