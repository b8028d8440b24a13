"""``DataLoader(num_workers="auto", prefetch_factor="auto")``: the arguments, the cache, the tuner.

At construction, an ``"auto"`` value is replaced by a placeholder that torch validates
like any count (so torch's own errors for impossible combinations come out as they would),
then the cache is looked up. A hit sets the tuned values at once, and gives the loader an
``online.OnlineTuner`` over a ``recheck.Recheck``, which measures the cached ``num_workers``
against its neighbours on the first epoch: the cache entry is then marked confirmed, or
updated when a neighbour clearly won (one line to the ``fastfeed`` logger says so, and why).
A miss gives the loader an ``online.OnlineTuner`` over a ``search.Search``, which tunes on
its first epoch and then settles.
"""

from __future__ import annotations

import logging

from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate

from .cache import Cache, fingerprint, key_of
from .online import OnlineTuner
from .recheck import TRIAL_WINDOWS, TRIALS, Recheck
from .result import TuneResult, duel_line
from .search import DEFAULT_PREFETCH, Search

log = logging.getLogger("fastfeed")

AUTO = "auto"
NUM_WORKERS_INDEX = 5  # num_workers's position in torch's DataLoader(...)
PLACEHOLDER_WORKERS = 1  # what torch validates "auto" as: a count with workers
TOLERANCE = 0.03  # settings within 3% of the best count as equal


class Auto:
    """Which of ``num_workers`` / ``prefetch_factor`` were ``"auto"``, and their fixed values otherwise."""

    def __init__(self, num_workers, prefetch_factor):
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor

    @property
    def space(self) -> dict:
        return {"num_workers": self.num_workers, "prefetch_factor": self.prefetch_factor}


def _check_string(name: str, value) -> None:
    if isinstance(value, str) and value != AUTO:
        valid = "an int >= 0" if name == "num_workers" else "an int >= 1 or None"
        raise ValueError(f"{name}={value!r}: {name} must be {valid}, or 'auto' (tuned by measuring)")


def take(args: tuple, kwargs: dict) -> tuple[tuple, Auto | None]:
    """Replace ``"auto"`` in the loader's arguments by placeholders; returns the arguments and what was auto."""
    args = list(args)
    positional = len(args) > NUM_WORKERS_INDEX
    nw = args[NUM_WORKERS_INDEX] if positional else kwargs.get("num_workers", 0)
    pf = kwargs.get("prefetch_factor")
    _check_string("num_workers", nw)
    _check_string("prefetch_factor", pf)
    if nw != AUTO and pf != AUTO:
        return tuple(args), None
    if nw == AUTO:
        if positional:
            args[NUM_WORKERS_INDEX] = PLACEHOLDER_WORKERS
        else:
            kwargs["num_workers"] = PLACEHOLDER_WORKERS
    if pf == AUTO:
        # With num_workers=0 torch raises its own error for any prefetch_factor: let it.
        kwargs["prefetch_factor"] = DEFAULT_PREFETCH
    return tuple(args), Auto(nw, None if pf is None else pf)


def start(loader, auto: Auto) -> None:
    """Resolve ``"auto"`` on a constructed loader: from the cache, or by giving it an online tuner."""
    from .offline import Budget, dataset_memory, min_workers_for, rank_cpus

    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            "num_workers='auto' / prefetch_factor='auto' tune on the first epoch by switching settings between "
            "batches, which an IterableDataset cannot follow (its replicas are split by num_workers). Run "
            "fastfeed.tune(dataset, ...) or `fastfeed tune` once and pass the result: "
            "DataLoader(dataset, **fastfeed.load_config(path))."
        )
    collate = None if loader.collate_fn is default_collate else loader.collate_fn
    fp = fingerprint(loader.dataset, batch_size=loader.batch_size, collate_fn=collate,
                     worker_type=loader.worker_type, space=auto.space)  # fmt: skip
    key = key_of(fp)
    cache = Cache()
    entry = cache.get(key)
    base = {"persistent_workers": loader.persistent_workers, "multiprocessing_context": loader.multiprocessing_context}
    min_workers = max(min_workers_for(base), 1 if loader.timeout > 0 else 0)
    cores = rank_cpus({"device": loader.device, "numa": loader.numa})
    max_workers = 2 * cores
    if entry is not None:
        result = TuneResult.from_dict(entry["result"])
        apply(loader, result)
        log.info("fastfeed: num_workers=%r prefetch_factor=%r from the tuning cache (%s): %s",
                 auto.num_workers, auto.prefetch_factor, cache.path, result.setting)  # fmt: skip
        if auto.num_workers == AUTO and result.remote == 0 and result.worker_type in ("process", "thread"):
            fixed_pf = None if auto.prefetch_factor == AUTO else auto.prefetch_factor
            _recheck(loader, result, cache, key, fp, min_workers, max_workers, fixed_pf)
        return
    fixed_nw = None if auto.num_workers == AUTO else auto.num_workers
    fixed_pf = None if auto.prefetch_factor == AUTO else (auto.prefetch_factor or DEFAULT_PREFETCH)
    # The dataset's large Python containers, found before any worker is forked (walking them later would copy
    # them into the workers): what a worker's copy-on-read growth is projected toward (offline.Budget).
    budget = Budget(None, *dataset_memory(loader.dataset))
    search = Search(
        max_workers=max_workers, tolerance=TOLERANCE,
        worker_types=(loader.worker_type,), num_workers=fixed_nw, prefetch_factor=fixed_pf,
        min_workers=min_workers, fits=budget, tight=budget.tight, cores=cores,
    )  # fmt: skip

    def settle(result: TuneResult) -> None:
        apply(loader, result)
        cache.put(key, result, fp)
        log.info("fastfeed: tuned num_workers=%r prefetch_factor=%r -> %s (saved in %s)\n%s",
                 auto.num_workers, auto.prefetch_factor, result.setting, cache.path, result)  # fmt: skip

    from . import agree

    tag = agree.tag_for("auto", loader.dataset, {"batch_size": loader.batch_size})
    loader._ff_tuner = OnlineTuner(search, budget, TOLERANCE, settle, tag, loader.batch_size)
    first = search.propose()
    loader.num_workers, loader.prefetch_factor = first.num_workers, first.prefetch_factor


def _recheck(loader, cached: TuneResult, cache: Cache, key: str, fp: dict, min_workers: int, max_workers: int,
             prefetch_factor: int | None) -> None:
    """Give ``loader`` a tuner that confirms the cached setting on its first epoch (see ``recheck``)."""
    from . import agree
    from .offline import Budget

    budget = Budget(None)
    recheck = Recheck(cached.setting, lo=min_workers, hi=max(max_workers, min_workers), tolerance=TOLERANCE,
                      input_bound=cached.input_bound, fits=budget, prefetch_factor=prefetch_factor)  # fmt: skip
    saved = [cached]  # what the cache holds now, by this loader's doing

    def settle(result: TuneResult) -> None:
        # Called with this rank's outcome, then (under torch.distributed) with the slowest rank's.
        if result.setting == cached.setting:
            if saved[-1] is not cached:  # this rank's own outcome moved it; the slowest rank's did not
                cache.put(key, cached, fp)
                saved.append(cached)
            apply(loader, cached)
            if result.converged:
                cache.confirm(key)
                log.debug("fastfeed: the cached %s re-checked against its neighbours and confirmed (%s)",
                          cached.setting, "; ".join(str(d) for d in recheck.duels))  # fmt: skip
            return
        was = loader.tune_result.setting
        apply(loader, result)
        cache.put(key, result, fp)
        saved.append(result)
        if result.setting != was:  # one line: what changed, and the duels that showed it
            evidence = " | ".join(duel_line(d) for d in result.duels) or "-"
            log.info("fastfeed: the cached %s no longer holds here: %s is used from now on and saved in %s; "
                     "the evidence: %s", cached.setting, result.setting, cache.path, evidence)  # fmt: skip

    if recheck.propose() is None:  # no neighbour in the allowed range: nothing to compare the cached setting with
        return
    tag = agree.tag_for("auto", loader.dataset, {"batch_size": loader.batch_size})
    loader._ff_tuner = OnlineTuner(recheck, budget, TOLERANCE, settle, tag, loader.batch_size, trials=TRIALS,
                                   windows=TRIAL_WINDOWS)  # fmt: skip


def resumed(loader) -> None:
    """``load_state_dict()`` on an ``"auto"`` loader: a recheck of the cached setting that has not settled is
    dropped, and the cached setting serves the run (a search that has not settled goes on, from the state's
    position: ``online.TuningIter``).

    The run that saved the state was on this machine with this cache entry, and rechecked it (or was rechecking
    it): a resumed run is the same job going on, not a new one.
    """
    tuner = loader._ff_tuner
    if tuner is not None and isinstance(tuner.search, Recheck) and tuner.result is None:
        loader._ff_tuner = None
        apply(loader, loader.tune_result)  # (a trial of the recheck's may have left its own setting)


def apply(loader, result: TuneResult) -> None:
    loader.num_workers = result.num_workers
    loader.prefetch_factor = result.prefetch_factor
    loader.worker_type = result.worker_type
    loader.tune_result = result
