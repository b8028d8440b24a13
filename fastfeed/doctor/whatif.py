"""What-if runs: measure what the loop would do with free input, what the loader can do with no loop, and what
the advised setting really does. DS-Analyzer's differential runs, plus the check of the doctor's own advice.

Each run is bounded (``--steps`` batches and at most ``SECONDS``) and reports samples/s measured the same way as
the recorded run: the training loader's batches over its Σ(wait + step).
"""

from __future__ import annotations

import gc
import inspect
import time

from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import _DatasetKind

from ..loader import DataLoader as FastLoader
from . import script
from .evidence import gather
from .timeline import Timeline

SECONDS = 60.0
TORCH_ARGS = frozenset(inspect.signature(TorchLoader.__init__).parameters)


def _rate(tl: Timeline) -> dict | None:
    ev = gather(tl)
    if ev.batches == 0:
        return None
    return {"samples_per_s": ev.samples_per_s, "batches_per_s": ev.batches_per_s, "batches": ev.batches,
            "seconds": ev.loop_s, "stall_fraction": ev.stall_fraction,
            "warm_batches_per_s": ev.warm_batches_per_s}  # fmt: skip


def _outcome(report, watch, error) -> tuple[dict | None, str | None]:
    watch.hooks.release()
    rate = _rate(report.timeline)
    if rate is None:
        return None, f"the run yielded no batches ({'it ended' if error is None else script.brief(error)})"
    return rate, None


def gains(now: dict, then: dict) -> dict:
    """A re-run's rate (``now``) against the recorded one (``then``), each with ``samples_per_s`` and
    ``warm_batches_per_s``: ``gain`` once every worker has made its first batch where both say (a short run must
    not count starting more workers, or Ray actors, which take seconds, against a setting a training run starts
    once), ``gain_with_startup`` with it."""
    overall = now["samples_per_s"] / then["samples_per_s"] if then["samples_per_s"] else None
    warm, warm_then = now.get("warm_batches_per_s"), then.get("warm_batches_per_s")
    return {"gain": warm / warm_then if warm and warm_then else overall, "gain_with_startup": overall}


def closing_choice(advice: list[dict]) -> dict | None:
    """The advice the closing run measures: the first with a setting that can run on this machine (``needs``
    unset: advice that needs another machine, such as Ray actors with no cluster reachable, is not tried)."""
    return next((a for a in advice if a["setting"] and not a.get("needs")), None)


def no_closing(advice: list[dict]) -> str:
    """Why there is no closing run, in one line: no setting to change, or only ones that need another machine."""
    elsewhere = [a for a in advice if a.get("needs")]
    if not elsewhere:
        return "no setting to change"
    a = elsewhere[0]
    gain = "" if a["predicted_gain"] is None else f", predicted {a['predicted_gain']:.2f}x"
    return f"{a['change']} needs {a['needs']}{gain}; nothing else to measure here"


def compute_ceiling(target: str, argv: list[str], module: bool, steps: int) -> tuple[dict | None, str | None]:
    """The script again, every loader yielding one cached batch (on the GPU when the script uses one).

    Returns its rate, or None and why there is none."""
    return _outcome(*script.run(target, argv, module, steps=steps, seconds=SECONDS, cached=True))


def rerun(target: str, argv: list[str], module: bool, steps: int, setting: dict) -> tuple[dict | None, str | None]:
    """The script again with ``setting`` forced on every loader it builds (``{"fastfeed": True}``: fastfeed's).

    A setting only fastfeed's loader takes (``worker_type=("process", "ray")``) makes the script's torch loaders
    fastfeed's too. Returns its rate, or None and why there is none."""
    overrides = {k: v for k, v in setting.items() if k != "fastfeed"}
    to_fastfeed = bool(setting.get("fastfeed")) or any(k not in TORCH_ARGS for k in overrides)
    return _outcome(*script.run(target, argv, module, steps=steps, seconds=SECONDS, overrides=overrides,
                                to_fastfeed=to_fastfeed))  # fmt: skip


def input_ceiling(loader, steps: int, seconds: float = SECONDS) -> dict | None:
    """The loader alone: one epoch (up to ``steps`` batches, ``seconds``), nothing done with the batches.

    A DALI loader's threads persist, so it goes on from where the watch stopped, across epochs, for the
    whole budget: reading the rest of an interrupted epoch first would measure nothing."""
    carry_on = getattr(loader, "_continue_epoch", None)
    if carry_on is not None:
        carry_on()
    batches, t0 = 0, time.perf_counter()
    try:
        while True:
            more = batches
            it = iter(loader)
            for _ in it:
                batches += 1
                if batches >= steps or time.perf_counter() - t0 > seconds:
                    break
            del it
            if carry_on is None or batches == more or batches >= steps or time.perf_counter() - t0 > seconds:
                break
        elapsed = time.perf_counter() - t0
    finally:
        gc.collect()
    if batches == 0:
        return None
    bs = loader.batch_size or 1
    return {"samples_per_s": batches * bs / elapsed, "batches_per_s": batches / elapsed, "batches": batches,
            "seconds": elapsed}  # fmt: skip


def fastfeed_twin(loader) -> FastLoader:
    """A ``fastfeed.DataLoader`` with the arguments of a torch loader: the same batches, from fastfeed's ring."""
    kw = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
              timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
              multiprocessing_context=loader.multiprocessing_context, in_order=getattr(loader, "in_order", True))
    if loader.num_workers:
        kw.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
    if loader._dataset_kind == _DatasetKind.Iterable:  # its sampler is torch's own: not to be passed
        kw.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_size is not None:
        kw.update(batch_size=loader.batch_size, drop_last=loader.drop_last, sampler=loader.sampler)
    elif loader.batch_sampler is not None:
        kw["batch_sampler"] = loader.batch_sampler
    else:  # no automatic batching
        kw.update(batch_size=None, sampler=loader.sampler)
    return FastLoader(loader.dataset, **kw)  # fmt: skip
