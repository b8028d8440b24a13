"""``fastfeed.tune()``: find the cheapest loader setting within tolerance of the best, by measuring."""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Callable

from .. import config, topology
from .._workers import WORKER_TYPES
from . import agree, measure
from .result import Setting, Trial, TuneResult
from .search import Search

SHM_SHARE = 0.8  # of the free space where batch segments live
RAM_SHARE = 0.5  # of the available memory: the default memory budget
TIGHT = 0.1  # batches in flight above this share of the budget make memory a concern

# The class tune() measures fresh instances of: fastfeed.DataLoader, handed over by fastfeed/__init__.py. The
# loader imports tuning/ (for num_workers="auto"), so tuning/ never imports the loader.
_loader_class: type | None = None


def use_loader(cls: type) -> None:
    """Make ``cls`` (``fastfeed.DataLoader``) the loader class :func:`tune` builds and measures."""
    global _loader_class
    _loader_class = cls


def loader_class() -> type:
    """The loader class :func:`tune` measures (set by ``fastfeed/__init__.py`` when fastfeed is imported)."""
    if _loader_class is None:
        raise RuntimeError("fastfeed.tuning.offline has no loader class to measure: import fastfeed first")
    return _loader_class


def rank_cpus(base: dict | None = None) -> int:
    """CPUs this rank may use: its affinity and cgroup (cpuset and quota), split between local ranks.

    With a CUDA target, the NUMA plan's share for this rank (its workers' CPUs and the
    training loop's) is the limit.
    """
    base = base or {}
    from .. import affinity, transfer

    stage = transfer.plan(base.get("device"), None, 1) if base.get("device") is not None else None
    device = stage.device if stage is not None else None
    plan = affinity.plan_for(base.get("numa", "auto"), device, 1)
    if plan is not None and plan.worker_cpus:
        return len(plan.worker_cpus | plan.main_cpus)
    allowed = len(topology.discover().allowed_cpus) or os.cpu_count() or 1
    quota = _cgroup_quota_cpus()
    if quota is not None:
        allowed = min(allowed, quota)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, allowed // max(1, local))


def _cgroup_quota_cpus(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """The cgroup v2 CPU quota in CPUs (rounded up), or None when unlimited or unreadable."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def free_shm() -> int | None:
    try:
        st = os.statvfs(config.shm_dir())
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Budget:
    """Whether a setting fits in memory, from what earlier trials measured.

    A setting needs ``num_workers * prefetch_factor`` batches in shared memory (the ring)
    plus each worker's private memory. The first trial (few workers) measures both; until
    then every setting fits.
    """

    def __init__(self, memory_budget: int | None):
        if memory_budget is not None and (isinstance(memory_budget, bool) or memory_budget <= 0):
            raise ValueError(f"memory_budget must be a number of bytes > 0, or None, got {memory_budget!r}")
        ram = topology.meminfo_bytes("MemAvailable")
        self.memory = memory_budget if memory_budget is not None else (int(ram * RAM_SHARE) if ram else None)
        shm = free_shm()
        self.shm = int(shm * SHM_SHARE) if shm else None
        self.batch_bytes = 0
        self.worker_bytes = 0

    def learn(self, trial: Trial) -> None:
        self.batch_bytes = max(self.batch_bytes, trial.batch_bytes)
        if trial.setting.worker_type == "process":
            self.worker_bytes = max(self.worker_bytes, trial.worker_bytes)

    def tight(self, s: Setting) -> bool:
        """Whether ``s``'s batches take a notable share (``TIGHT``) of the memory it may use."""
        if s.total == 0 or not self.batch_bytes:
            return False
        limit = min(x for x in (self.memory, self.shm, 1 << 62) if x is not None)
        return s.total * s.prefetch_factor * self.batch_bytes > TIGHT * limit

    def __call__(self, s: Setting) -> str | None:
        if s.total == 0 or not self.batch_bytes:
            return None
        ring = s.total * s.prefetch_factor * self.batch_bytes  # Ray actors' batches land in the ring too
        workers = s.num_workers * self.worker_bytes if s.worker_type == "process" else 0
        if self.shm is not None and ring > self.shm:
            return f"its {_mb(ring)} of batches exceed {SHM_SHARE:.0%} of the free shared memory ({_mb(self.shm)})"
        if self.memory is not None and ring + workers > self.memory:
            return f"needs ~{_mb(ring + workers)} (batches {_mb(ring)} + workers {_mb(workers)}), memory budget {_mb(self.memory)}"
        return None


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB"


def _check(budget_s, max_workers, tolerance, worker_types) -> tuple:
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or budget_s <= 0:
        raise ValueError(f"budget_s must be a number of seconds > 0, got {budget_s!r}")
    if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(max_workers, int)
                                    or max_workers < 0):  # fmt: skip
        raise ValueError(f"max_workers must be an int >= 0 or None, got {max_workers!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in [0, 1), e.g. 0.03, got {tolerance!r}")
    if isinstance(worker_types, str):
        worker_types = (worker_types,)
    bad = [t for t in worker_types if t not in WORKER_TYPES]
    if not worker_types or bad:
        raise ValueError(f"worker_types must be a non-empty subset of {WORKER_TYPES}, got {worker_types!r}")
    return tuple(worker_types)


def remote_actors(remote) -> int:
    """The most Ray actors ``tune(remote=...)`` tries: 0 for none; True for the connected cluster's CPUs.

    Raises:
        ValueError: ``remote`` is neither a bool nor an int >= 0.
        ImportError: Ray is not installed (the message names ``pip install 'fastfeed[ray]'``).
        RuntimeError: no Ray cluster to connect to (the message says how to start one).
    """
    if remote is False or remote is None or remote == 0:
        return 0
    if remote is not True and (isinstance(remote, bool) or not isinstance(remote, int) or remote < 0):
        raise ValueError(f"remote must be True (the cluster's CPUs), False or a number of Ray actors >= 0, "
                         f"got {remote!r}")  # fmt: skip
    from .._workers.ray import connect as ray_connect  # Ray is optional: imported only when remote workers are asked for

    ray_connect.connect()  # a clear error now, before any local trial, when there is no cluster
    if remote is not True:
        return remote
    summary = ray_connect.cluster_summary()
    cpus = int(summary["cpus"]) if summary else 0
    if cpus < 1:
        raise RuntimeError("fastfeed.tune(remote=True): the Ray cluster has no CPU for an actor; add a node "
                           "(ray start --address=HEAD:6379 --num-cpus=N) or pass remote=N")  # fmt: skip
    return cpus


def min_workers_for(kwargs: dict) -> int:
    """1 when the loader's other arguments need workers (torch rejects them with num_workers=0)."""
    if kwargs.get("persistent_workers") or kwargs.get("multiprocessing_context") is not None:
        return 1
    return 0


def tune(dataset, *, step=None, budget_s: float = 60, max_workers: int | None = None, tolerance: float = 0.03,
         memory_budget: int | None = None, worker_types=("process",), remote: int | bool = 0,
         on_trial: Callable[[Trial, Trial | None], None] | None = None, **loader_kwargs) -> TuneResult:  # fmt: skip
    """Find the cheapest ``num_workers`` / ``prefetch_factor`` / ``worker_type`` within ``tolerance`` of the best.

    Each setting runs on a fresh ``fastfeed.DataLoader(dataset, **loader_kwargs, ...)`` (see
    ``fastfeed.tuning.search`` for the order of the search, ``measure`` for the windows).

    Args:
        step: the training step: None measures loading alone; a float is a synthetic step of
            that many seconds (spent waiting, as the host waits for a GPU); a callable is
            called with each batch. With CUDA in use, windows synchronise at their edges.
        budget_s: a hard cap on the tuning's wall time; when it runs out, the best so far is
            returned with ``converged=False`` and a warning.
        max_workers: the largest ``num_workers`` tried; default twice this rank's CPUs
            (I/O-bound datasets want more workers than cores).
        tolerance: settings within this fraction of the best throughput count as equal; the
            cheapest is chosen.
        memory_budget: bytes a setting may use (ring batches plus worker memory); default half
            the available RAM. Batches in shared memory are also held to 80% of its free space.
            Settings over it are skipped, with the reason in ``trials``.
        worker_types: the worker types to choose from ("process", "thread").
        remote: Ray actors to add beside the local workers, once their best count is found: the most to try
            (an int), True for as many as the connected cluster has CPUs, 0 for none. Their count is
            bisected with the local workers fixed; a result with actors has ``remote`` > 0 and
            ``loader_kwargs()`` with ``worker_type=("process", "ray"), num_workers=(local, remote)``. Needs
            ``pip install 'fastfeed[ray]'`` and a running cluster (the user's ``ray.init``, or
            ``ray.init(address="auto")``). ``ray_options`` in ``loader_kwargs`` reach every actor.
        on_trial: called with each trial and the best so far (progress bars).
        **loader_kwargs: the rest of the loader's arguments (``batch_size``, ``collate_fn``, ...).

    Under an initialised ``torch.distributed``, every rank tunes, then all take the result of
    the rank whose input is slowest, judged from every rank's measurements (see
    ``fastfeed.tuning.agree``; ``decided_by`` names it). Call it on every rank, in the same
    order: each waits until all have measured.
    """
    DataLoader = loader_class()
    types = _check(budget_s, max_workers, tolerance, worker_types)
    for key in ("num_workers", "prefetch_factor", "worker_type"):
        if key in loader_kwargs:
            raise ValueError(f"tune() chooses {key}: leave it out of the loader arguments")
    started = time.monotonic()
    deadline = started + budget_s
    max_remote = remote_actors(remote)
    if max_workers is None:
        max_workers = 2 * rank_cpus(loader_kwargs)
    budget = Budget(memory_budget)
    budget.batch_bytes = measure.probe_batch_bytes(DataLoader, dataset, loader_kwargs)
    search = Search(max_workers=max_workers, tolerance=tolerance, worker_types=types,
                    min_workers=min_workers_for(loader_kwargs), fits=budget, tight=budget.tight,
                    max_remote=max_remote)  # fmt: skip

    def trial_of(setting: Setting, first: bool) -> Trial:
        return measure.run(DataLoader, dataset, loader_kwargs, setting, step, tolerance=tolerance, deadline=deadline,
                           first=first)  # fmt: skip

    converged = drive(search, trial_of, on_trial, budget.learn)
    result = finish(search, converged, started, budget_s, loader_kwargs.get("batch_size", 1))
    return agree.slowest_on_all_ranks(result, agree.tag_for("tune", dataset, loader_kwargs))


def drive(search: Search, trial_of: Callable[[Setting, bool], Trial], on_trial=None, learn=None) -> bool:
    """Measure what ``search`` proposes until it is done (True) or the budget runs out (False).

    ``trial_of(setting, first)`` measures one setting and raises ``measure.OutOfTime`` past the deadline.
    """
    while (setting := search.propose()) is not None:
        try:
            trial = trial_of(setting, not search.order)
        except measure.OutOfTime as out:
            if out.trial is not None:
                search.report(out.trial)
                if on_trial is not None:
                    on_trial(out.trial, search.trials.get(search.choice()))
            return False
        if learn is not None:
            learn(trial)
        search.report(trial)
        if on_trial is not None:
            chosen = search.choice()
            on_trial(trial, search.trials.get(chosen) if chosen else None)
    return True


def finish(search: Search, converged: bool, started: float, budget_s: float, batch_size) -> TuneResult:
    """The result of a search, with a warning when the budget cut it short."""
    result = _result(search, converged, time.monotonic() - started, batch_size)
    if not converged:
        warnings.warn(f"fastfeed.tune: the budget of {budget_s} s ran out after {len(search.order)} trials; "
                      f"returning the best so far ({result.setting}). Raise budget_s to finish the search.",
                      RuntimeWarning, stacklevel=3)  # fmt: skip
    return result


def _result(search: Search, converged: bool, elapsed: float, batch_size) -> TuneResult:
    chosen = search.choice()
    if chosen is None:
        raise RuntimeError("fastfeed.tune: no setting could be measured (all were skipped or the budget "
                           f"was too small): {[f'{t.setting}: {t.skipped}' for t in search.order]}")  # fmt: skip
    trial = search.trials[chosen]
    return TuneResult(
        num_workers=chosen.num_workers, prefetch_factor=chosen.prefetch_factor, worker_type=chosen.worker_type,
        throughput=trial.median, samples_per_s=trial.median * batch_size if batch_size else None,
        stall_fraction=trial.stall_fraction, input_bound=search.input_bound, trials=list(search.order),
        elapsed_s=elapsed, converged=converged and search.done, batch_size=batch_size, remote=chosen.remote,
    )  # fmt: skip
