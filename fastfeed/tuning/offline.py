"""``fastfeed.tune()``: find the cheapest loader setting within tolerance of the best, by measuring."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from typing import Callable

from .. import _memory, config, topology
from .._workers import WORKER_TYPES
from . import agree, measure
from .result import Setting, Trial, TuneResult
from .search import Search

SHM_SHARE = 0.8  # of the free space where batch segments live
RAM_SHARE = 0.5  # of the available memory: the default memory budget
TIGHT = 0.1  # batches in flight above this share of the budget make memory a concern
# A worker's private memory that grows by more than this over the first trial is copying what it reads of the
# parent's memory (copy-on-read): its growth is projected over the dataset, not taken as it stood at the end.
COPY_ON_READ_MIN = 4 << 20
DUEL_WINDOWS = 2  # a duel's round is a short trial: the rounds, not its windows, answer its noise
# An ordinary trial takes this many windows, however much they spread: settings that come within the noise of each
# other are measured again in turn (the duels), which answers drift that more windows one after the other do not.
# With CPU-bound samples on a 2-core VM, a trial's windows spread 20-40% (its speed drifts), so every trial took
# the 6 windows a spread asks for (3.2 s, against 1.7), for a median no closer to the next trial's.
TRIAL_WINDOWS = measure.MIN_WINDOWS


def windows_for(search: Search) -> int:
    """The windows to measure ``search``'s last proposal with: a duel's round's, or an ordinary trial's."""
    return DUEL_WINDOWS if search.in_duel else TRIAL_WINDOWS

log = logging.getLogger("fastfeed")

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

    A setting needs ``num_workers * prefetch_factor`` batches in shared memory (the ring) plus each worker's
    private memory (USS). The first trial (few workers) measures both; until then every setting fits.

    A worker's cost is predicted, not just read off the first trial: a forked worker that reads the dataset's
    Python objects copies the pages holding them (reading an object writes its reference count), so its private
    memory grows with the samples it has read, toward the size of those objects, for as long as it runs. So the
    cost is the worker's USS once it had made its first batches plus its growth over the trial projected to the
    whole dataset read (persistent workers read every sample, epoch after epoch), capped by what there is to copy:
    the dataset's large Python containers (``containers``, ``fastfeed.sharing.large_containers``), or else the
    parent's own private memory (``parent_bytes``), which is all a forked worker can copy of it.

    Args:
        memory_budget: bytes a setting may use; None: ``RAM_SHARE`` of the memory available now, so that no setting
            chosen is predicted to leave less than the rest of it to the training process and the machine.
        containers: the dataset's large Python containers (``Container`` tuples).
        dataset_len: the dataset's samples (None: unsized; the growth is then taken as measured).
        parent_bytes: the tuning process's USS (None: read now).
    """

    def __init__(self, memory_budget: int | None, containers=(), dataset_len: int | None = None,
                 parent_bytes: int | None = None):  # fmt: skip
        if memory_budget is not None and (isinstance(memory_budget, bool) or memory_budget <= 0):
            raise ValueError(f"memory_budget must be a number of bytes > 0, or None, got {memory_budget!r}")
        ram = topology.meminfo_bytes("MemAvailable")
        self.memory = memory_budget if memory_budget is not None else (int(ram * RAM_SHARE) if ram else None)
        shm = free_shm()
        self.shm = int(shm * SHM_SHARE) if shm else None
        self.batch_bytes = 0
        self.worker_bytes = 0  # one worker's predicted cost
        self.start_bytes = self.growth_bytes = self.projected_growth_bytes = 0
        self.containers = list(containers)
        self.dataset_len = dataset_len
        if parent_bytes is None:
            own = _memory.usage(os.getpid())
            parent_bytes = own.uss if own is not None else 0
        self.parent_bytes = parent_bytes

    def learn(self, trial: Trial) -> None:
        self.batch_bytes = max(self.batch_bytes, trial.batch_bytes)
        if trial.setting.worker_type == "process" and trial.worker_bytes:
            start, projected = self.predict(trial)
            if start + projected > self.worker_bytes:
                self.worker_bytes = start + projected
                self.start_bytes, self.growth_bytes, self.projected_growth_bytes = start, trial.growth_bytes, projected

    def predict(self, trial: Trial) -> tuple[int, int]:
        """One worker's USS at the start of ``trial`` and its growth, projected (see the class docstring)."""
        start = trial.worker_start_bytes or trial.worker_bytes
        growth = trial.growth_bytes
        if growth < COPY_ON_READ_MIN or trial.samples_per_worker <= 0:
            return start, growth  # no copy-on-read to speak of: the trial's end stands
        per_sample = growth / trial.samples_per_worker
        horizon = self.dataset_len if self.dataset_len else trial.samples_per_worker
        there = sum(c.est_bytes for c in self.containers) if self.containers else self.parent_bytes
        projected = min(per_sample * horizon, there) if there else per_sample * horizon
        return start, int(max(growth, projected))

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
            return (f"needs ~{_mb(ring + workers)} (batches {_mb(ring)} + workers {_mb(workers)}, "
                    f"{s.num_workers} x {_mb(self.worker_bytes)}), memory budget {_mb(self.memory)}")  # fmt: skip
        return None

    def max_workers(self, s: Setting, upto: int) -> int:
        """The most ``num_workers`` up to ``upto`` that fit with ``s``'s other choices (prefetch, type, actors)."""
        n = upto
        while n > 0 and self(Setting(s.worker_type, n, s.prefetch_factor or 2, s.remote)):
            n -= 1
        return n

    def summary(self, s: Setting, upto: int) -> dict | None:
        """``TuneResult.memory``: the estimate, and the most workers that fit beside ``s``; None before any
        worker was measured."""
        if not self.worker_bytes:
            return None
        return {"worker_bytes": self.worker_bytes, "start_bytes": self.start_bytes,
                "growth_bytes": self.growth_bytes, "projected_growth_bytes": self.projected_growth_bytes,
                "containers": [list(c) for c in self.containers], "budget_bytes": self.memory,
                "max_workers": self.max_workers(s, upto)}  # fmt: skip


def dataset_memory(dataset) -> tuple[list, int | None]:
    """The dataset's large Python containers (what forked workers copy as they read) and its length.

    Called before any worker is forked: walking the objects writes their reference counts, which, with workers
    alive, would copy the pages into them. A dataset that cannot be walked has none found (the budget then caps
    the growth by the parent's memory)."""
    from ..sharing.find import large_containers

    try:
        containers = large_containers(dataset)
    except Exception as e:  # a dataset's own attributes may raise when read; the tuning goes on without them
        log.debug("fastfeed.tune: the dataset's containers could not be sized (%s)", e)
        containers = []
    try:
        length = len(dataset)
    except TypeError:
        length = None
    return containers, length


def limited_by_memory(budget: Budget, chosen: Setting, trials, max_workers: int) -> bool:
    """Whether memory, not the CPUs, set the limit: a setting with more workers than ``chosen`` was skipped as
    over the budget, and ``chosen`` has as many workers as fit."""
    over = any(t.skipped and t.setting.num_workers > chosen.num_workers for t in trials)
    return over and chosen.num_workers >= budget.max_workers(chosen, max_workers)


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
            Settings over it are skipped, with the reason in ``trials``. A worker's memory is predicted
            from the first trial's: its private memory (USS) plus what it copied while reading, projected
            over the dataset (``Budget``). ``result.limited_by`` is "memory" when the budget, not the
            CPUs, set the limit, and ``result.memory`` holds the estimate.
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
    cores = rank_cpus(loader_kwargs)
    if max_workers is None:
        max_workers = 2 * cores
    containers, length = dataset_memory(dataset)
    budget = Budget(memory_budget, containers, length)
    budget.batch_bytes = measure.probe_batch_bytes(DataLoader, dataset, loader_kwargs)
    search = Search(max_workers=max_workers, tolerance=tolerance, worker_types=types,
                    min_workers=min_workers_for(loader_kwargs), fits=budget, tight=budget.tight,
                    max_remote=max_remote, cores=cores)  # fmt: skip

    def trial_of(setting: Setting, first: bool) -> Trial:
        return measure.run(DataLoader, dataset, loader_kwargs, setting, step, tolerance=tolerance, deadline=deadline,
                           first=first, windows=windows_for(search))  # fmt: skip

    def learn(trial: Trial) -> None:
        budget.learn(trial)
        why = budget(trial.setting) if trial.windows else None
        if why:  # measured before its workers' cost was known (the first trial): never the choice
            trial.skipped = f"{REJECTED}: {why}"

    converged = drive(search, trial_of, on_trial, learn)
    if search.choice() is None:
        converged = _within_memory(search, trial_of, types[0], min_workers_for(loader_kwargs)) and converged
    result = finish(search, converged, started, budget_s, loader_kwargs.get("batch_size", 1))
    result.memory = budget.summary(result.setting, max_workers)
    if limited_by_memory(budget, result.setting, result.trials, max_workers):
        result.limited_by = "memory"
    return agree.slowest_on_all_ranks(result, agree.tag_for("tune", dataset, loader_kwargs))


REJECTED = "measured, but over the memory budget"


def _within_memory(search: Search, trial_of, worker_type: str, min_workers: int) -> bool:
    """When every setting measured turned out over the memory budget, measure ``num_workers=0`` (no worker memory
    at all) where the loader's arguments allow it; where they do not, or it cannot be measured, the cheapest
    setting measured is taken after all, with a warning that says by how much it is over. False: out of time."""
    rejected = [t for t in search.order if t.windows and (t.skipped or "").startswith(REJECTED)]
    if not rejected:
        return True
    converged = True
    zero = Setting(worker_type, 0, None)
    if min_workers == 0 and zero not in search.trials:
        try:
            search.report(trial_of(zero, False))
        except measure.OutOfTime as out:
            converged = False
            if out.trial is not None:
                search.report(out.trial)
    if search.choice() is None:
        least = min(rejected, key=lambda t: t.setting.num_workers)
        warnings.warn(f"fastfeed.tune: no setting fits the memory budget ({least.skipped}); taking the cheapest "
                      f"measured, {least.setting}. Pass a larger memory_budget, free memory, or share the dataset's "
                      "metadata between the workers (dataset = fastfeed.share(dataset))", RuntimeWarning,
                      stacklevel=3)  # fmt: skip
        least.skipped = None
    return converged


def drive(search: Search, trial_of: Callable[[Setting, bool], Trial], on_trial=None, learn=None) -> bool:
    """Measure what ``search`` proposes until it is done (True) or the budget runs out (False).

    ``trial_of(setting, first)`` measures one setting and raises ``measure.OutOfTime`` past the deadline (it may
    measure a duel's round, ``search.in_duel``, with a short trial). When the budget runs out, a duel under way
    decides on the rounds it has.
    """
    while (setting := search.propose()) is not None:
        try:
            trial = trial_of(setting, not search.order)
        except measure.OutOfTime as out:
            if out.trial is not None:
                search.report(out.trial)
                if on_trial is not None:
                    on_trial(out.trial, search.trials.get(search.choice()))
            search.stop()
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
        **search.evidence(),
    )  # fmt: skip
