"""What tuning found: every setting tried, the choice, and a config file a loader accepts."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field

from .._atomic import write_atomic

CONFIG_FORMAT = 1


@dataclass(frozen=True, order=True)
class Setting:
    """One point of the search space.

    ``remote``: Ray actors beside the ``num_workers`` local ones (``worker_type=("process", "ray")``,
    ``num_workers=(local, remote)``); 0 for a loader of local workers alone.
    """

    worker_type: str
    num_workers: int
    prefetch_factor: int | None  # None with num_workers=0, as torch wants it
    remote: int = 0

    @property
    def total(self) -> int:
        """Every worker, local and remote: the batches in flight are ``total * prefetch_factor``."""
        return self.num_workers + self.remote

    def __str__(self) -> str:
        pf = "-" if self.prefetch_factor is None else self.prefetch_factor
        if self.remote:
            return f"nw={self.num_workers}+{self.remote} pf={pf} {self.worker_type}+ray"
        return f"nw={self.num_workers} pf={pf} {self.worker_type}"

    def loader_kwargs(self) -> dict:
        if self.remote and self.num_workers:
            return {"num_workers": (self.num_workers, self.remote), "prefetch_factor": self.prefetch_factor,
                    "worker_type": (self.worker_type, "ray")}  # fmt: skip
        if self.remote:
            return {"num_workers": self.remote, "prefetch_factor": self.prefetch_factor, "worker_type": "ray"}
        return {"num_workers": self.num_workers, "prefetch_factor": self.prefetch_factor,
                "worker_type": self.worker_type}  # fmt: skip


@dataclass
class Trial:
    """One setting, measured (or skipped).

    Attributes:
        windows: batches/s of each window, warm-up excluded.
        stall_fraction: over the windows: Σwait / (Σwait + Σstep) (near 1 with no step: the loop only loads); a
            wait is an ask that found no batch ready: taking a ready one is the loop's own time, a step's.
        skipped: why the setting was not measured (memory budget, CPU limit), or None.
        seconds: wall time the trial took, start-up and warm-up included.
        batch_bytes: bytes of tensor data in one batch.
        worker_bytes: private memory (USS) of one worker process at the trial's end (0 for threads or nw=0).
        worker_start_bytes: the same once the workers had made their first batches; ``worker_bytes`` less it is
            what a worker copied while it read (copy-on-read), which goes on past the trial.
        samples_per_worker: the samples each worker read between those two readings.
        load_s: seconds a worker spent on one batch (fetch and collate; None with nw=0): what
            loading it in the main process, as ``num_workers=0`` does, would take.
        others_cores: the mean cores other processes (not this one, not its descendants) kept busy on this rank's
            CPUs during the windows (``fastfeed.tuning.noise``): the noise; None when not measured.
        worker_cpu_s: the workers' CPU seconds per batch over the windows (process workers; None for threads,
            Ray actors and nw=0): near ``load_s`` for CPU-bound samples, far below it for samples that wait.
        loop_cpu_s: this process's own CPU seconds per batch over the windows (the training loop, the pin thread,
            and thread workers); None when not measured.
        repeated: how many times the setting was measured again because others held the cores.
        worker_wait_s: the workers' seconds per batch spent runnable but waiting in a run queue for a core, over the
            windows (``/proc``'s schedstat; process workers; None where the kernel keeps none): their time per batch
            less this is what it would be with a core each, which tells CPU-bound samples from sleeping ones
            however busy the machine.
        load_tail: the slowest batches' time (the 95th percentile of a worker's time per batch, or of the loop's
            step when that is longer) over a worker's median time per batch: how many typical batches a slow one
            lasts (near 1 for samples that cost the same each time); None without workers.
    """

    setting: Setting
    windows: list = field(default_factory=list)
    stall_fraction: float = 0.0
    skipped: str | None = None
    seconds: float = 0.0
    batch_bytes: int = 0
    worker_bytes: int = 0
    load_s: float | None = None
    worker_start_bytes: int = 0
    samples_per_worker: float = 0.0
    others_cores: float | None = None
    worker_cpu_s: float | None = None
    loop_cpu_s: float | None = None
    repeated: int = 0
    worker_wait_s: float | None = None
    load_tail: float | None = None

    @property
    def growth_bytes(self) -> int:
        """What one worker's private memory grew by over the trial (see ``worker_start_bytes``)."""
        return max(0, self.worker_bytes - self.worker_start_bytes) if self.worker_start_bytes else 0

    @property
    def median(self) -> float:
        return statistics.median(self.windows) if self.windows else 0.0

    @property
    def spread(self) -> float:
        """(max - min) / median of the windows: how much to trust the median."""
        if len(self.windows) < 2 or self.median <= 0:
            return 0.0
        return (max(self.windows) - min(self.windows)) / self.median

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(median=self.median, spread=self.spread)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Trial:
        return cls(Setting(**d["setting"]), list(d["windows"]), d["stall_fraction"], d["skipped"], d["seconds"],
                   d.get("batch_bytes", 0), d.get("worker_bytes", 0), d.get("load_s"), d.get("worker_start_bytes", 0),
                   d.get("samples_per_worker", 0.0), d.get("others_cores"), d.get("worker_cpu_s"), d.get("loop_cpu_s"),
                   d.get("repeated", 0), d.get("worker_wait_s"), d.get("load_tail"))  # fmt: skip


@dataclass
class TuneResult:
    """What ``fastfeed.tune()`` (or ``num_workers="auto"``) chose, and the evidence.

    Attributes:
        num_workers, prefetch_factor, worker_type: the choice (the local workers, with ``remote``).
        throughput: batches/s of the choice, as measured; ``samples_per_s`` the same in samples.
        stall_fraction: of the choice (the share of the step spent waiting for input).
        input_bound: False when loading was not the bottleneck at a small setting: the cheapest
            setting within tolerance was chosen without a search.
        trials: every setting tried, in order, with its windows, or why it was skipped.
        elapsed_s: the tuning's wall time.
        converged: False when the budget ran out first (the choice is the best so far).
        batch_size: samples per batch (None when the loader does not batch).
        remote: Ray actors beside the local workers (``fastfeed.tune(remote=...)``); ``loader_kwargs()`` then has
            ``worker_type=("process", "ray"), num_workers=(local, remote)``.
        decided_by: under ``torch.distributed``, the rank whose measurements (``trials``) decided: the slowest
            (``fastfeed.tuning.agree``); None for a tuning on one process, and in results saved before it existed.
        limited_by: "memory" when the memory budget, not the CPUs, set the limit: a setting with more workers was
            skipped as over the budget while the choice is the most workers that fit; None otherwise.
        memory: the memory estimate behind the budget, or None before any worker was measured:
            ``worker_bytes`` (one worker's predicted cost, copy-on-read growth included), ``start_bytes`` and
            ``growth_bytes`` (measured on the first trial), ``projected_growth_bytes`` (the growth expected by the
            time a worker has read the dataset), ``containers`` (the dataset's large Python containers, as
            ``[name, kind, count, est_bytes]``), ``budget_bytes`` and ``max_workers`` (the most that fit).
        duels: the settings measured in turn before the choice (``fastfeed.tuning.duel.Duel.as_dict()``).
        noise: what other processes took of this rank's CPUs during the trials: ``mean_cores``, ``max_cores``, and
            ``repeated`` (trials measured again because others held the cores); None when not read.
        model: the model of what the cores can run (``Search.model()``): ``cores``, ``cpu_bound``,
            ``max_useful_workers``, and ``decided`` (True when it moved the choice); None without CPU readings.
        notes: one line for each thing the duels and the model decided.
    """

    num_workers: int
    prefetch_factor: int | None
    worker_type: str
    throughput: float
    samples_per_s: float | None
    stall_fraction: float
    input_bound: bool
    trials: list
    elapsed_s: float
    converged: bool
    batch_size: int | None = None
    remote: int = 0
    decided_by: int | None = None
    limited_by: str | None = None
    memory: dict | None = None
    duels: list = field(default_factory=list)
    noise: dict | None = None
    model: dict | None = None
    notes: list = field(default_factory=list)

    @property
    def setting(self) -> Setting:
        return Setting(self.worker_type, self.num_workers, self.prefetch_factor, self.remote)

    def loader_kwargs(self) -> dict:
        """``DataLoader(dataset, **result.loader_kwargs())`` uses the choice."""
        return self.setting.loader_kwargs()

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "trials"}
        d["trials"] = [t.as_dict() for t in self.trials]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TuneResult:
        """A saved result; the fields added since (``duels``, ``noise``, ...) take their defaults when absent."""
        fields = {k: v for k, v in d.items() if k != "trials"}
        return cls(**fields, trials=[Trial.from_dict(t) for t in d["trials"]])

    def save(self, path) -> None:
        """Write a JSON config: ``DataLoader(ds, **fastfeed.load_config(path))`` uses the choice."""
        write_json_atomic(path, {"fastfeed_config": CONFIG_FORMAT, "loader_kwargs": self.loader_kwargs(),
                                 "result": self.as_dict()})  # fmt: skip

    def __str__(self) -> str:
        head = (
            f"fastfeed tune: {self.setting}  {self.throughput:,.1f} batches/s"
            + (f" ({self.samples_per_s:,.0f} samples/s)" if self.samples_per_s else "")
            + f", stall {self.stall_fraction:.1%}"
            + ("" if self.input_bound else ", not input-bound")
            + ("" if self.decided_by is None else f", decided by rank {self.decided_by}")
            + f"  [{'converged' if self.converged else 'NOT converged (budget)'}, {len(self.trials)} trials,"
            f" {self.elapsed_s:.1f} s]"
        )
        memory = self.memory_line()
        if memory:
            head += "\n" + memory
        remote = any(t.setting.remote for t in self.trials)  # a column for the Ray actors, when any were tried
        rows = [f"{'':2}{'nw':>3} " + (f"{'ray':>3} " if remote else "")
                + f"{'pf':>3} {'type':<8} {'batches/s':>10} {'spread':>7} {'noise':>6} {'stall':>6} {'windows':>7}"]
        chosen = self.setting
        for t in sorted(self.trials, key=lambda t: t.setting):
            s = t.setting
            mark = "*" if s == chosen else " "
            pf = "-" if s.prefetch_factor is None else s.prefetch_factor
            actors = f"{s.remote:>3} " if remote else ""
            cells = f"{mark:2}{s.num_workers:>3} {actors}{pf:>3} {s.worker_type:<8}"
            if t.skipped:
                rows.append(f"{cells} skipped: {t.skipped}")
            else:
                rows.append(f"{cells} {t.median:>10,.1f} {t.spread:>7.1%} {_noise_cell(t):>6} "
                            f"{t.stall_fraction:>6.1%} {len(t.windows):>7}")  # fmt: skip
        return "\n".join([head, *rows, *self.evidence_lines()])

    def evidence_lines(self) -> list[str]:
        """Below the table: the noise seen (others' cores; the table's ``noise`` column is each trial's), each duel,
        and what the duels and the model decided."""
        lines = []
        if self.noise:
            n = self.noise
            lines.append(f"noise: other processes held {n['mean_cores']:.2f} cores on average, {n['max_cores']:.2f} "
                         f"at most; {n['repeated']} trial(s) measured again as noisy")  # fmt: skip
        lines += [f"duel: {duel_line(d)}" for d in self.duels]
        lines += [f"note: {n}" for n in self.notes]
        return lines

    def memory_line(self) -> str | None:
        """One line on the memory estimate, led by "memory, not CPU, set the limit" when it did; None without one."""
        m = self.memory
        if not m or not m.get("worker_bytes"):
            return None
        line = (f"{_mb(m['worker_bytes'])} per worker predicted ({_mb(m['start_bytes'])} at start"
                + (f" + {_mb(m['projected_growth_bytes'])} copied while reading" if m.get("projected_growth_bytes")
                   else "") + ")")  # fmt: skip
        if m.get("budget_bytes") is not None:
            line += f", budget {_mb(m['budget_bytes'])}: at most {m['max_workers']} workers fit"
        if self.limited_by != "memory":
            return "memory: " + line
        line = "memory, not CPU, set the limit: " + line
        if m.get("containers"):
            name, kind, count, est = m["containers"][0]
            line += (f"; the workers copy dataset.{name} ({kind} of {count:,} objects, ~{_mb(est)}) as they read"
                     " it: dataset = fastfeed.share(dataset) holds it once and lets more workers fit")
        return line


def _noise_cell(t: Trial) -> str:
    """Others' cores during a trial, with ``r`` when it was measured again (``-`` when not read)."""
    if t.others_cores is None:
        return "-"
    return f"{t.others_cores:.2f}" + ("r" if t.repeated else "")


def duel_line(d: dict) -> str:
    """A duel from its ``as_dict()``, as ``str(Duel)`` says it: the ratios dear / cheap round by round, the verdict."""
    rounds = ", ".join(f"{dear / cheap:.2f}x" if cheap > 0 else "inf" for cheap, dear in d.get("rounds", []))
    said = {"dear": f"{d['dear']} clearly better", "cheap": f"{d['cheap']} as good",
            "tie": f"no clear winner, {d['cheap']} (cheaper) taken"}.get(d.get("outcome"), "undecided")  # fmt: skip
    return f"{d['dear']} vs {d['cheap']} ({d.get('reason', '')}), measured in turn: {rounds or '-'}; {said}"


def _mb(n) -> str:
    return f"{n / 2**20:,.0f} MB"


def write_json_atomic(path, data) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename: readers never see half."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True), "\n")


def load_config(path) -> dict:
    """The loader arguments saved by ``TuneResult.save`` or ``fastfeed tune --out``: ``DataLoader(ds, **them)``.

    Raises:
        ValueError: the file is not a fastfeed config.
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a fastfeed config (invalid JSON: {e})") from None
    if not isinstance(data, dict) or data.get("fastfeed_config") != CONFIG_FORMAT:
        raise ValueError(f"{path}: not a fastfeed config (written by `fastfeed tune --out` or TuneResult.save)")
    kwargs = data.get("loader_kwargs")
    if not isinstance(kwargs, dict):
        raise ValueError(f"{path}: its loader_kwargs are missing or malformed")
    kwargs = dict(kwargs)
    nw = kwargs.get("num_workers")
    if isinstance(nw, list) and len(nw) == 2 and all(isinstance(n, int) for n in nw):  # (local, remote): JSON's list
        kwargs["num_workers"] = tuple(nw)
    elif not isinstance(nw, int):
        raise ValueError(f"{path}: its loader_kwargs are missing or malformed")
    if isinstance(kwargs.get("worker_type"), list):  # ("process", "ray")
        kwargs["worker_type"] = tuple(kwargs["worker_type"])
    return kwargs
