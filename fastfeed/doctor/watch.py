"""``fastfeed.doctor.watch()``: record a training loop (its loaders, their workers, the machine) into a report.

```python
with fastfeed.doctor.watch() as report:
    for batch in loader:
        train_step(batch)
print(report.verdict())
report.save("doctor-report")  # html=True adds report.html: one self-contained page, zoomable timeline
```

``steps=N`` ends the loop after N batches (the ``with`` block swallows the ``StopWatch`` that does it).
``alert_stall=0.2, alert_after_s=300`` logs a warning on the ``fastfeed`` logger when 20% of the loop has
been spent waiting for input over the last 300 s, or, with ``alert_gpu_util``, when the GPU was that idle; the
warning carries the verdict so far.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import time

from .. import topology
from .hooks import Hooks, StopWatch
from .report import Report
from .sampler import Sampler
from .timeline import Timeline
from .verdict import diagnose

log = logging.getLogger("fastfeed")
_active: list[Watch] = []


class Watch:
    """A context manager that records everything the doctor needs; ``watch()`` makes one.

    Args:
        steps: end the loop (``StopWatch``) after this many batches; None: record until the block ends.
        seconds: end the loop at the first batch after this many seconds.
        interval: seconds between system samples (NVML, /proc).
        alert_stall, alert_after_s, alert_gpu_util: the live alert (see the module docstring).
        overrides, to_fastfeed, cached: what-if runs (``fastfeed.doctor.hooks.Hooks``).
        job: this process is one rank of a job (``fastfeed.doctor.jobrun``): read the loop's sleep at each batch
            (the sync inside its steps), and keep the script's process group's store once it has one, to hand the
            records to rank 0 through it where no launcher's store exists.
    """

    def __init__(self, steps: int | None = None, seconds: float | None = None, interval: float = 0.1,
                 alert_stall: float | None = None, alert_after_s: float = 300.0, alert_gpu_util: float | None = None,
                 overrides: dict | None = None, to_fastfeed: bool = False, cached: bool = False,
                 job: bool = False) -> None:  # fmt: skip
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be a positive number of batches, got {steps}")
        self.steps, self.seconds = steps, seconds
        self.batches = 0
        self._job = job
        self._deadline = None
        self.hooks = Hooks(self._tick, overrides, to_fastfeed, cached, sleep=job)
        self.sampler = Sampler(interval, pids=self.hooks.pids, on_tick=self._on_sample)
        self.report = Report(self)
        self.start = self.end = None
        self.alert_stall, self.alert_after_s, self.alert_gpu_util = alert_stall, alert_after_s, alert_gpu_util
        self._recent: collections.deque = collections.deque()  # (t, Σwait, Σloop) of each sample, for alerts
        self._seen_batches: dict[int, int] = {}
        self._alerted = False
        self._topology = None

    def _tick(self) -> None:
        self.batches += 1
        if self._job:
            from . import jobstore

            jobstore.capture()
        if self.steps is not None and self.batches > self.steps:
            raise StopWatch(f"the doctor recorded {self.steps} batches")
        if self._deadline is not None and time.perf_counter() > self._deadline:
            raise StopWatch(f"the doctor recorded {self.seconds} s")

    def __enter__(self) -> Report:
        if _active:
            raise RuntimeError("fastfeed.doctor.watch() is already recording in this process; nest no second one")
        _active.append(self)
        self.start = time.perf_counter()
        if self.seconds is not None:
            self._deadline = self.start + self.seconds
        self.hooks.install()
        try:
            self.sampler.start()
        except BaseException:
            self.hooks.close()
            _active.remove(self)
            raise
        return self.report

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.end = time.perf_counter()
        try:
            self.sampler.stop()
        finally:
            self.hooks.close()
            _active.remove(self)
        self.report.freeze(self.timeline())
        return exc_type is not None and issubclass(exc_type, StopWatch)

    def timeline(self) -> Timeline:
        """The records so far (or all of them, once the watch ended)."""
        loaders = self.hooks.records()
        return Timeline(start=self.start, end=self.end or time.perf_counter(), loaders=loaders,
                        samples=list(self.sampler.samples), cpus=len(os.sched_getaffinity(0)),
                        gpu=self.sampler.gpu, distributed_s=self.hooks.distributed_s, world=_world(),
                        placement=self._placement(), mem_total=topology.meminfo_bytes("MemTotal"))  # fmt: skip

    def _placement(self) -> dict | None:
        """Where the workers ran against the watched GPU's NUMA node; None without a GPU or with one node."""
        gpu = self.sampler.gpu
        if gpu is None:
            return None
        if self._topology is None:
            self._topology = topology.discover()
        return placement(self._topology, gpu["index"], self.hooks.affinity.values())

    # -- the live alert -----------------------------------------------------------------------

    def _loop_totals(self) -> tuple[float, float]:
        """Σwait and Σ(wait + step) of every recorded batch so far, read incrementally."""
        wait = loop = 0.0
        for seen in self.hooks.seen.values():
            for epoch in seen.epochs:
                rec = epoch.rec
                n = len(rec.asks)
                done = self._seen_batches.get(id(rec), 0)
                if n > done:
                    w, s = rec.window(done, n)
                    wait, loop = wait + w, loop + w + s
                    self._seen_batches[id(rec)] = n
        return wait, loop

    def _on_sample(self, sample: dict) -> None:
        if self.alert_stall is None and self.alert_gpu_util is None:
            return
        wait, loop = self._loop_totals()
        now = sample["t"]
        self._recent.append((now, wait, loop, sample.get("gpu_util")))
        while self._recent and self._recent[0][0] < now - self.alert_after_s:
            self._recent.popleft()
        if now - self.start < self.alert_after_s:
            return
        total_loop = sum(r[2] for r in self._recent)
        stall = sum(r[1] for r in self._recent) / total_loop if total_loop > 0 else 0.0
        utils = [r[3] for r in self._recent if r[3] is not None]
        util = sum(utils) / len(utils) if utils else None
        stalled = self.alert_stall is not None and total_loop > 0 and stall >= self.alert_stall
        idle = self.alert_gpu_util is not None and util is not None and util < self.alert_gpu_util
        if not (stalled or idle):
            self._alerted = False  # re-arm once it clears
            return
        if self._alerted:
            return
        self._alerted = True
        what = f"{stall:.0%} of the loop waiting for input" if stalled else f"GPU utilisation {util:.0%}"
        log.warning("fastfeed doctor: %s over the last %.0f s. %s", what, self.alert_after_s,
                    diagnose(self.timeline()).line)


def _world() -> int:
    """The ranks of the script's process group, 1 when it has none (torch.distributed is only asked if imported)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def placement(topo: topology.Topology, gpu_index: int, affinities) -> dict | None:
    """How many worker processes (``affinities``: each one's allowed CPUs) may run only on the GPU's node, only
    off it (remote memory and a remote path to the GPU: the ``numa`` cause), or across nodes. ``gpu_index``:
    NVML's, which is PCI bus order, as ``topo.gpus`` is."""
    if len(topo.nodes) < 2 or not 0 <= gpu_index < len(topo.gpus):
        return None
    node = topo.gpus[gpu_index].numa_node
    if node is None or node not in topo.nodes:
        return None
    local = topo.nodes[node].cpus
    on = off = across = 0
    for cpus in affinities:
        if cpus <= local:
            on += 1
        elif cpus.isdisjoint(local):
            off += 1
        else:
            across += 1
    return {"gpu_node": node, "on_node": on, "off_node": off, "across_nodes": across}


def watch(**kwargs) -> Watch:
    """Record a training loop for the doctor: ``with fastfeed.doctor.watch() as report: ...``. See ``Watch``."""
    return Watch(**kwargs)
