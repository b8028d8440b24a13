"""The doctor's records, as one timeline: every observed iterator's batches, its workers' batches, and the
system samples, on one clock (``time.perf_counter``, which is CLOCK_MONOTONIC and so shared by the workers).

Plain data, JSON-able both ways (``to_dict`` / ``from_dict``): the verdict, the plots and the trace read it,
and tests build fake ones (a GPU's timeline on a machine without one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class WorkerRecord:
    """One worker's batches, in the order it made them: seconds in the dataset, seconds collating into the
    slot, and the clock when it finished (0 where unknown)."""

    fetch: list[float] = field(default_factory=list)
    collate: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)


@dataclass
class EpochRecord:
    """One iterator: when the consumer asked for each batch and when it got it.

    ``ready``: batches already made when asked (None where the loader does not say: torch's).
    ``h2d``: seconds of each host-to-device copy (fastfeed's device stage).
    ``pids``: the worker processes (empty for thread workers and ``num_workers=0``).
    ``blocked``: at each return, the seconds the consuming thread had so far spent blocked, neither on a CPU nor
    waiting for one (``fastfeed.doctor.blocked``): differences between returns tell how long a step slept, as
    it does inside a collective on a CPU backend. Empty where not read.
    """

    asks: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    ready: list[int] | None = None
    h2d: list[float] = field(default_factory=list)
    workers: list[WorkerRecord] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)

    def waits(self) -> list[float]:
        return [r - a for a, r in zip(self.asks, self.returns)]

    def steps(self) -> list[float]:
        """``steps()[i]``: from batch ``i``'s return to the request for batch ``i + 1``."""
        return [a - r for a, r in zip(self.asks[1:], self.returns)]


@dataclass
class LoaderRecord:
    """A loader the script iterated: what it was and where it was made, and one record per epoch.

    ``num_workers`` counts every worker, local and remote; ``worker_split`` is ``[local, remote]`` for a loader
    with Ray actors among its workers (``worker_type`` "ray" or "process+ray"), None otherwise.
    """

    id: int
    kind: str  # "fastfeed", "torch" or "dali"
    made_at: str  # file:line of the DataLoader(...) call
    num_workers: int
    prefetch_factor: int | None
    batch_size: int | None
    worker_type: str = "process"  # "process", "thread", "ray", "process+ray" (fastfeed's mixed form) or "dali"
    persistent_workers: bool = False
    pin_memory: bool = False
    prefetch: bool = False  # the dataset reads ahead (defines prefetch(indices), as fastfeed.io.Files does)
    epochs: list[EpochRecord] = field(default_factory=list)
    worker_split: list[int] | None = None
    # The dataset's large Python containers, ``[name, kind, count, est_bytes]`` each, largest first
    # (``fastfeed.sharing.large_containers``): what forked workers copy as they read it. None: not looked for.
    containers: list | None = None

    @property
    def batches(self) -> int:
        return sum(len(e.asks) for e in self.epochs)

    @property
    def local_workers(self) -> int:
        """Workers on this machine (processes or threads)."""
        return self.worker_split[0] if self.worker_split else self.num_workers

    @property
    def remote_workers(self) -> int:
        """Workers that are Ray actors, wherever Ray placed them."""
        return self.worker_split[1] if self.worker_split else 0


@dataclass
class Timeline:
    """Everything one watch recorded.

    ``samples``: the system sampler's readings (``fastfeed.doctor.sampler``), each a dict with ``t``
    and the figures of the interval that ended then. ``cpus``: this process's allowed CPUs.
    ``gpu``: the GPU watched (``{"index", "name"}``) or None. ``distributed_s``: seconds the main
    thread spent in ``torch.distributed`` collectives called from Python; ``world``: the ranks of its process group. ``placement``: where the
    workers ran against the GPU's NUMA node, when there is one to compare with. ``mem_total``: the machine's memory,
    against which the samples' ``mem_available`` is its headroom.
    """

    start: float
    end: float
    loaders: list[LoaderRecord] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    cpus: int = 1
    gpu: dict | None = None
    distributed_s: float = 0.0
    world: int = 1  # ranks in the process group the script had made by the watch's end (1: none)
    placement: dict | None = None
    mem_total: int | None = None  # the machine's memory in bytes (MemTotal)

    def primary(self) -> LoaderRecord | None:
        """The loader that yielded the most batches: the training loader."""
        return max(self.loaders, key=lambda rec: rec.batches, default=None)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Timeline:
        loaders = []
        for ld in d.get("loaders", []):
            epochs = [EpochRecord(**{**e, "workers": [WorkerRecord(**w) for w in e.get("workers", [])]})
                      for e in ld.get("epochs", [])]  # fmt: skip
            loaders.append(LoaderRecord(**{**ld, "epochs": epochs}))
        return cls(**{**d, "loaders": loaders})
