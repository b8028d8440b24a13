"""The standard workloads of ``fastfeed bench``: each is a suite module, run with the command's options.

A suite's ``main(argv)`` is what its script under ``benchmarks/`` runs; here it gets the options that
apply to it and returns its result, which the report keeps under the workload's name with its kind:
``comparison`` (the runner's interleaved rounds: transport, overhead, jpeg, text, startup), ``files``
(storage behind latency, read-ahead and cache), ``shards`` (tar shards: fastfeed.io.Shards against webdataset and
Mosaic's streaming), ``tune`` (the tuner against an exhaustive grid) or ``ray`` (Ray actors as workers, on a local
cluster the suite starts).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from . import extras

KINDS = {"transport": "comparison", "overhead": "comparison", "jpeg": "comparison", "text": "comparison",
         "startup": "comparison", "files": "files", "shards": "shards", "tune": "tune",
         "ray": "ray"}  # fmt: skip
STANDARD = tuple(KINDS)
NEEDS_WORKERS = {"jpeg": "compares worker processes, threads and DALI's threads", "startup": "times worker start-up"}


def missing_extra(name: str) -> str | None:
    """For a standard workload that cannot run on this install, what it needs and the ``pip install`` that
    brings it (``fastfeed bench`` skips it with that line); None otherwise, and for any other target."""
    return extras.missing_for(name) if name in KINDS else None


def run(name: str, *, quick: bool, rounds: int | None, num_workers: list | None, out: Path) -> dict:
    """Run standard workload ``name``; returns ``{"kind", "result"}``.

    Raises:
        ValueError: an option this workload cannot take (``auto`` workers, 0 workers where it needs some).
    """
    suite = importlib.import_module(f"fastfeed.bench.suites.{name}")
    kind = KINDS[name]
    argv = (["--out", str(out)] if kind not in ("files", "shards", "ray") else []) + (["--quick"] if quick else [])
    if rounds is not None and kind != "tune":
        argv += ["--rounds", str(rounds)]
    if num_workers and kind == "comparison":
        if "auto" in num_workers:
            raise ValueError(f"{name}: --num-workers auto is for your own dataset (fastfeed bench module:attr); "
                             "the standard workloads compare fixed counts")  # fmt: skip
        counts = [n for n in num_workers if n > 0] if name in NEEDS_WORKERS else num_workers
        if not counts:
            raise ValueError(f"{name} {NEEDS_WORKERS[name]}: give --num-workers of 1 or more")
        argv += ["--num-workers", *map(str, counts)]
    return {"kind": kind, "result": suite.main(argv)}
