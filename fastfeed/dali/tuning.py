"""``fastfeed.dali.tune``: DALI's ``num_threads`` and ``prefetch_queue_depth`` by the tuner's search.

The same search as ``fastfeed.tune`` (``fastfeed.tuning.search``), with DALI's threads in the
place of workers and its queue depth in the place of ``prefetch_factor``: each setting builds
the pipeline afresh and is measured in windows with the user's step, as DataLoader settings are.
"""

from __future__ import annotations

import time
from typing import Callable

from ..tuning import agree, measure, offline
from ..tuning.result import Setting, Trial, TuneResult
from ..tuning.search import Search
from . import build
from .loader import DALILoader

WORKER_TYPE = "dali"


def tune(pipeline, output_map, *, step=None, budget_s: float = 60, max_threads: int | None = None,
         tolerance: float = 0.03, on_trial: Callable[[Trial, Trial | None], None] | None = None,
         **loader_kwargs) -> TuneResult:  # fmt: skip
    """Find the fewest ``num_threads`` (then the shallowest queue) within ``tolerance`` of the best throughput.

    Args:
        pipeline: the ``@pipeline_def`` function (it is built once per setting).
        output_map, **loader_kwargs: as for ``DALILoader`` (``batch_size``, the function's arguments...).
        step, budget_s, tolerance, on_trial: as for ``fastfeed.tune``.
        max_threads: the most threads tried; default twice this rank's CPUs.

    Returns:
        A ``TuneResult`` whose ``num_workers`` is ``num_threads`` and ``prefetch_factor`` is
        ``prefetch_queue_depth`` (``worker_type`` is ``"dali"``): ``DALILoader(...,
        num_threads=r.num_workers, prefetch_queue_depth=r.prefetch_factor)``.
    """
    if not build.is_pipeline_def(pipeline):
        raise TypeError("fastfeed.dali.tune needs the @pipeline_def function, to build the pipeline for each setting")
    for key in ("num_threads", "prefetch_queue_depth"):
        if key in loader_kwargs:
            raise ValueError(f"tune() chooses {key}: leave it out of the loader arguments")
    offline._check(budget_s, max_threads, tolerance, ("process",))
    started = time.monotonic()
    deadline = started + budget_s
    if max_threads is None:
        max_threads = 2 * offline.rank_cpus({"device": loader_kwargs.get("device")})
    search = Search(max_workers=max(1, max_threads), tolerance=tolerance, worker_types=(WORKER_TYPE,), min_workers=1)

    def trial_of(setting: Setting, first: bool) -> Trial:
        def make() -> DALILoader:
            return DALILoader(pipeline, output_map, num_threads=setting.num_workers,
                              prefetch_queue_depth=setting.prefetch_factor, **loader_kwargs)  # fmt: skip

        return measure.run_made(make, setting, step, tolerance=tolerance, deadline=deadline, first=first,
                                windows=offline.windows_for(search))  # fmt: skip

    converged = offline.drive(search, trial_of, on_trial)
    result = offline.finish(search, converged, started, budget_s, loader_kwargs.get("batch_size"))
    return agree.slowest_on_all_ranks(result, agree.tag_for("tune-dali", pipeline, loader_kwargs))
