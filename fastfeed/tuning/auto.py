"""``DataLoader(num_workers="auto", prefetch_factor="auto")``: the arguments, the cache, the tuner.

At construction, an ``"auto"`` value is replaced by a placeholder that torch validates
like any count (so torch's own errors for impossible combinations come out as they would),
then the cache is looked up. A hit sets the tuned values at once; a miss gives the loader
an ``online.OnlineTuner``, which tunes on its first epoch and then settles.
"""

from __future__ import annotations

import logging

from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate

from .cache import Cache, fingerprint, key_of
from .online import OnlineTuner
from .result import TuneResult
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
    from .offline import Budget, min_workers_for, rank_cpus

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
    if entry is not None:
        result = TuneResult.from_dict(entry["result"])
        apply(loader, result)
        log.info("fastfeed: num_workers=%r prefetch_factor=%r from the tuning cache (%s): %s",
                 auto.num_workers, auto.prefetch_factor, cache.path, result.setting)  # fmt: skip
        return
    fixed_nw = None if auto.num_workers == AUTO else auto.num_workers
    fixed_pf = None if auto.prefetch_factor == AUTO else (auto.prefetch_factor or DEFAULT_PREFETCH)
    base = {"persistent_workers": loader.persistent_workers, "multiprocessing_context": loader.multiprocessing_context}
    min_workers = max(min_workers_for(base), 1 if loader.timeout > 0 else 0)
    budget = Budget(None)
    search = Search(
        max_workers=2 * rank_cpus({"device": loader.device, "numa": loader.numa}), tolerance=TOLERANCE,
        worker_types=(loader.worker_type,), num_workers=fixed_nw, prefetch_factor=fixed_pf,
        min_workers=min_workers, fits=budget, tight=budget.tight,
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


def apply(loader, result: TuneResult) -> None:
    loader.num_workers = result.num_workers
    loader.prefetch_factor = result.prefetch_factor
    loader.worker_type = result.worker_type
    loader.tune_result = result
