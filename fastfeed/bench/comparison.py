"""A comparison (one question asked of a candidate loader and torch's) and its interleaved rounds of trials.

Each round runs the baseline and the candidate (and any variants) back to back, rotating which goes first,
so drift in the machine's state hits every side alike.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader as TorchDataLoader

from . import session
from .summary import figures_for, fmt
from .trial import run_epochs, run_trial

CANDIDATE_ENV = "FASTFEED_BENCH_CANDIDATE"


@dataclass(frozen=True)
class Comparison:
    """One question asked of candidate and baseline: the same workload, maybe different kwargs.

    Attributes:
        workload: A ``workloads.Workload``.
        label: Short name, e.g. ``"nw=2"`` or ``"nw=2 vs torch nw=0"``.
        candidate_kwargs: Loader kwargs for the candidate, on top of the workload's.
        baseline_kwargs: Loader kwargs for torch, on top of the workload's.
        warmup: Untimed batches per trial, the first included (at least 1).
        batches: Timed batches per trial.
        mem_batches: Batches per trial iterated, untimed, for the peak PSS.
        candidate_tag: Appended to the candidate's printed name (``"process"``: ``fastfeed-process``).
        variants: More candidate sides, run in the same rounds: tag -> candidate kwargs (on top of
            the workload's), or tag -> ``(factory, kwargs)`` for a side whose loader is not the
            candidate class but ``factory(dataset, **kwargs)`` (jpeg.py's DALI side: a pipeline,
            not a ``DataLoader``). Variant ``v`` is summarized against the baseline, under the key
            ``"<workload> <label> <v>"``, and against the candidate, under
            ``"<workload> <label> <v>/<candidate_tag or 'candidate'>"``.
        step_s: A synthetic training step of this many seconds after each timed batch (``fastfeed bench
            --step``): throughput is then the loop's, and ``stall`` the share of it spent waiting for input.
        epoch_batches: 0: a trial is one iterator over warm-up, timed and memory batches (steady
            state). N > 0: epoch mode, a trial is whole epochs of N batches of one loader (see
            :func:`run_epochs`); ``warmup`` is then unused (epoch 1 is the warm-up) and ``batches``
            sets the number of timed epochs, :attr:`epochs`.
        prime: Run one untimed priming trial per side before round 0. A script whose comparisons
            share a workload may prime only the first (prefetch.py: 32 comparisons).
    """

    workload: Any
    label: str
    candidate_kwargs: dict
    baseline_kwargs: dict
    warmup: int
    batches: int
    mem_batches: int
    candidate_tag: str = ""
    variants: dict = field(default_factory=dict)
    epoch_batches: int = 0
    prime: bool = True
    step_s: float = 0.0

    @property
    def epochs(self) -> int:
        """Timed epochs per trial in epoch mode (0 in steady state): about ``batches`` timed
        batches, and at least 2, so that the hot time to first batch is a median of two or more."""
        return timed_epochs(self.batches, self.epoch_batches)


def timed_epochs(batches: int, epoch_batches: int) -> int:
    """Timed epochs for ``batches`` timed batches in epochs of ``epoch_batches``: ``ceil``, at least 2."""
    return max(2, math.ceil(batches / epoch_batches)) if epoch_batches > 0 else 0


def resolve_candidate(spec: str | None = None) -> tuple[type, str]:
    """Find the candidate loader class.

    Args:
        spec: ``"torch"``, ``"module"`` or ``"module:Class"``; default: ``$FASTFEED_BENCH_CANDIDATE``,
            else ``fastfeed``.

    Returns:
        The class and the name to print for it (``torch*`` when it is torch's own).
    """
    spec = spec or os.environ.get(CANDIDATE_ENV) or "fastfeed"
    module, _, attr = ("torch.utils.data" if spec == "torch" else spec).partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr or "DataLoader")
    except (ImportError, AttributeError) as exc:
        sys.exit(f"candidate {spec!r} is not importable ({exc!r}); "
                 f"{CANDIDATE_ENV}=torch measures torch against itself")
    return cls, "torch*" if cls is TorchDataLoader else module.split(".")[0]


def _kwargs(comp: Comparison, own: dict, mp_context: str | None) -> dict:
    kwargs = {**comp.workload.loader_kwargs, **own}
    # torch rejects a context at nw=0; a side that sets its own (None: thread workers) keeps it.
    if mp_context and kwargs.get("num_workers", 0) > 0 and "multiprocessing_context" not in own:
        kwargs["multiprocessing_context"] = mp_context
    return kwargs


def tagged(name: str, tag: str) -> str:
    return f"{name}-{tag}" if tag else name


def compare(comp: Comparison, candidate: type, baseline: type = TorchDataLoader, rounds: int = 5,
            mp_context: str | None = None, names: tuple[str, str] = ("candidate", "torch")) -> list[dict]:
    """Run ``rounds`` rounds of baseline and candidate trials (and variants), interleaved.

    Round r runs baseline then candidate when r is even, the reverse when odd, so drift in
    the machine's state (frequency, page cache, neighbours) hits both sides alike. With
    variants, round r runs the sides (baseline, candidate, variants...) rotated left by r, so
    over a multiple of their number of rounds each side runs in each position equally often.
    One untimed priming trial per side first absorbs one-time costs (lazy imports, helper processes),
    unless ``comp.prime`` is false.
    In epoch mode (``comp.epoch_batches > 0``) a trial is :func:`run_epochs`, else :func:`run_trial`.

    Args:
        comp: What to compare.
        candidate: The candidate loader class.
        baseline: The baseline loader class, torch's DataLoader.
        rounds: Number of rounds.
        mp_context: ``multiprocessing_context`` for both loaders when they have workers.
        names: Names of candidate and baseline, stored in the records (the candidate's and the
            variants' with their tags appended).

    Returns:
        One record per trial (``(2 + len(comp.variants)) * rounds``); ``role`` is ``"baseline"``,
        ``"candidate"`` or a variant's tag.
    """
    sides = {
        "baseline": (baseline, _kwargs(comp, comp.baseline_kwargs, mp_context), names[1]),
        "candidate": (candidate, _kwargs(comp, comp.candidate_kwargs, mp_context),
                      tagged(names[0], comp.candidate_tag)),
    }
    for tag, own in comp.variants.items():
        if session.SESSION.variants is not None and tag not in session.SESSION.variants:
            continue
        if tag in sides:
            raise ValueError(f"a variant may not be named {tag!r}")
        factory, own = own if isinstance(own, tuple) else (candidate, own)
        sides[tag] = (factory, _kwargs(comp, own, mp_context), tagged(names[0], tag))
    for cls, kwargs, _ in sides.values() if comp.prime else ():
        run_trial(cls, comp.workload, kwargs, warmup=1, batches=1)
    n = comp.epoch_batches
    if n > 0:  # one epoch of the warm-up, all timed epochs' batches, the sampled part of epoch 1
        counts = dict(warmup=n, batches=n * comp.epochs, mem_batches=min(comp.mem_batches, n - 1))
    else:
        counts = dict(warmup=comp.warmup, batches=comp.batches, mem_batches=comp.mem_batches)
    records = []
    roles = list(sides)
    bar = _progress(comp, rounds * len(roles))
    for r in range(rounds):
        k = r % len(roles)
        order = roles[k:] + roles[:k]  # two sides: (baseline, candidate), (candidate, baseline), ...
        for position, role in enumerate(order):
            cls, kwargs, name = sides[role]
            rec = dict(workload=comp.workload.name, comparison=comp.label, round=r, position=position,
                       role=role, loader=name, num_workers=kwargs.get("num_workers", 0),
                       **counts, epoch_batches=n, epochs=comp.epochs)
            t0 = time.perf_counter()
            if n > 0:
                rec.update(run_epochs(cls, comp.workload, kwargs, n, comp.epochs, comp.mem_batches))
            else:
                rec.update(run_trial(cls, comp.workload, kwargs, comp.warmup, comp.batches, comp.mem_batches,
                                     comp.step_s or session.SESSION.step_s))
            rec["wall_s"] = time.perf_counter() - t0  # the whole trial: dataset, sampling, teardown
            records.append(rec)
            if bar is not None:
                bar.set_postfix_str(f"{name} {_shown(comp, rec)}")
                bar.update()
    if bar is not None:
        bar.close()
    return records


def _progress(comp: Comparison, trials: int):
    return session.progress(trials, f"{comp.workload.name} {comp.label}")


def _shown(comp: Comparison, rec: dict) -> str:
    """A trial's throughput in the workload's unit, for the progress bar."""
    key, scale, unit, _ = figures_for(comp.workload.unit)["throughput"]
    value = rec.get(key)
    return "-" if value is None else f"{fmt(value * scale)} {unit}"
