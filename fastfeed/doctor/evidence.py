"""The numbers a verdict rests on, taken from a timeline: the loop's waits and steps, the workers' load, and the
system's state while the training loader ran. Every figure here is measured; none comes from the settings.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from ..stats import quantile
from .timeline import LoaderRecord, Timeline


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def ms(seconds) -> str:
    """Seconds as text in milliseconds, for reports ("-" when unknown)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def cv(values) -> float | None:
    """Coefficient of variation: how uneven a series is (0: perfectly even)."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else None


def pearson(xs, ys) -> float | None:
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pairs) < 3:
        return None
    xs, ys = zip(*pairs)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


@dataclass
class Evidence:
    """What was measured about the training loader (the one that yielded the most batches) and the machine."""

    loader: LoaderRecord | None
    batches: int = 0
    epochs: int = 0
    span_s: float = 0.0  # Σ over epochs of first request to last return
    wait_s: float = 0.0
    step_s: float = 0.0
    first_wait_s: float = 0.0  # Σ of each epoch's first wait: starting workers, first fetch
    waits: list = field(default_factory=list)  # per batch, epochs concatenated
    steps: list = field(default_factory=list)
    ends: list = field(default_factory=list)  # (ask, return) per batch
    steady: list = field(default_factory=list)  # whether batch i is not its epoch's first
    worker_batch_s: float | None = None  # fetch + collate per batch, mean over workers
    fetch: list = field(default_factory=list)
    worker_busy: list = field(default_factory=list)  # per worker: (fetch + collate) / span
    worker_cpu: float | None = None  # mean CPU (cores) of one local worker process
    h2d_p50_s: float | None = None
    ready_mean: float | None = None
    system: dict = field(default_factory=dict)  # means of the sampler's figures over the span
    cpus: int = 1
    gpu: bool = False
    distributed_s: float = 0.0
    world: int = 1
    warm_batches_per_s: float | None = None  # with each epoch's first round (a batch from every worker) left out
    sync_s: float | None = None  # of step_s, seconds waiting for other ranks (a job's rank; None: not measured)

    @property
    def loop_s(self) -> float:
        return self.wait_s + self.step_s

    @property
    def stall_fraction(self) -> float:
        return self.wait_s / self.loop_s if self.loop_s > 0 else 0.0

    @property
    def steady_stall_fraction(self) -> float:
        steady_wait = self.wait_s - self.first_wait_s
        total = steady_wait + self.step_s
        return steady_wait / total if total > 0 else 0.0

    @property
    def sync_fraction(self) -> float:
        return (self.sync_s or 0.0) / self.loop_s if self.loop_s > 0 else 0.0

    @property
    def compute_s(self) -> float:
        """The steps less their sync: what the loop itself spends."""
        return self.step_s - (self.sync_s or 0.0)

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.loop_s if self.loop_s > 0 else 0.0

    @property
    def batch_size(self) -> int:
        return (self.loader.batch_size if self.loader else None) or 1

    @property
    def samples_per_s(self) -> float:
        return self.batches_per_s * self.batch_size

    @property
    def free_cores(self) -> float | None:
        busy = self.system.get("cpu_busy")
        return None if busy is None else self.cpus * (1.0 - busy)

    def summary(self) -> dict:
        d = asdict(self)
        for key in ("loader", "waits", "steps", "ends", "steady", "fetch"):
            d.pop(key)
        d.update(stall_fraction=self.stall_fraction, steady_stall_fraction=self.steady_stall_fraction,
                 sync_fraction=None if self.sync_s is None else self.sync_fraction,
                 samples_per_s=self.samples_per_s, batches_per_s=self.batches_per_s, free_cores=self.free_cores,
                 wait_p50_s=quantile(self.waits, 0.5), wait_p95_s=quantile(self.waits, 0.95),
                 step_p50_s=quantile(self.steps, 0.5), step_p95_s=quantile(self.steps, 0.95))  # fmt: skip
        return d


def _in_span(samples: list[dict], spans: list[tuple[float, float]]) -> list[dict]:
    return [s for s in samples if any(a <= s["t"] - s.get("dt", 0) / 2 <= b for a, b in spans)]


def gather(tl: Timeline) -> Evidence:
    """The evidence of a timeline: its training loader's batches and workers, and the samples taken meanwhile."""
    rec = tl.primary()
    ev = Evidence(loader=rec, cpus=tl.cpus, gpu=tl.gpu is not None, distributed_s=tl.distributed_s,
                  world=tl.world)
    if rec is None or rec.batches == 0:
        return ev
    spans, busy, worker_time, pids, ready, h2d = [], [], [], set(), [], []
    first_round = max(1, rec.num_workers)  # round robin: batch k of an epoch carries worker k's start-up
    warm_n, warm_s = 0, 0.0
    for epoch in rec.epochs:
        if not epoch.asks:
            continue
        if len(epoch.asks) > first_round + 1:  # one batch per interval from ask to ask
            warm_n += len(epoch.asks) - 1 - first_round
            warm_s += epoch.asks[-1] - epoch.asks[first_round]
        waits, steps = epoch.waits(), epoch.steps()
        ev.epochs += 1
        ev.first_wait_s += waits[0]
        ev.waits += waits
        ev.steps += steps
        ev.steady += [False] + [True] * (len(waits) - 1)
        ev.ends += list(zip(epoch.asks, epoch.returns))
        spans.append((epoch.asks[0], epoch.returns[-1]))
        ready += epoch.ready or []
        h2d += epoch.h2d
        pids.update(epoch.pids)
        for wid, w in enumerate(epoch.workers):
            while len(busy) <= wid:
                busy.append(0.0)
            busy[wid] += sum(w.fetch) + sum(w.collate)
            worker_time += [f + c for f, c in zip(w.fetch, w.collate)]
            ev.fetch += w.fetch
    ev.batches = len(ev.waits)
    ev.warm_batches_per_s = warm_n / warm_s if warm_n and warm_s > 0 else None
    ev.wait_s, ev.step_s = sum(ev.waits), sum(ev.steps)
    ev.span_s = sum(b - a for a, b in spans)
    ev.worker_busy = [min(1.0, b / ev.span_s) for b in busy] if ev.span_s > 0 else []
    ev.worker_batch_s = _mean(worker_time)
    ev.ready_mean = _mean(ready)
    ev.h2d_p50_s = quantile(h2d, 0.5)
    inside = _in_span(tl.samples, spans)
    ev.system = {key: _mean(s.get(key) for s in inside)
                 for key in ("cpu_busy", "iowait", "psi_cpu", "psi_io", "disk_read_mbps", "disk_read_ms", "main_cpu",
                             "gpu_util", "gpu_mem_util", "pcie_rx_mbps", "pcie_tx_mbps")}  # fmt: skip
    ev.system["disk_read_mbps_cv"] = cv([s.get("disk_read_mbps") for s in inside])
    per_sample = [sum(v for p, v in (s.get("proc_cpu") or {}).items() if int(p) in pids) for s in inside]
    if pids and per_sample and rec.local_workers:  # Ray actors are no processes of ours: the local ones share it
        ev.worker_cpu = statistics.fmean(per_sample) / rec.local_workers
    return ev
