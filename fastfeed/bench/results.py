"""Running a script's comparisons end to end: one line per figure, then the result as JSON and CSV.

The result holds every trial's record, the summaries and the parameters of the run (versions, machine, git
commit, load average), so that a figure can be traced back to the trials it came from.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader

from . import session
from .comparison import Comparison, compare, resolve_candidate, tagged
from .summary import FIGURES, format_line, summarize

REPO = Path(__file__).resolve().parent.parent.parent  # the checkout, when fastfeed runs from one (git commit)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def _json_name(obj: Any) -> str:
    """A variant's loader factory in ``params``: its qualified name (a function is not JSON)."""
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{obj.__module__}.{obj.__qualname__}"
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def write_results(script: str, result: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write ``result`` to ``<out_dir>/<script>-<timestamp>.json`` and its trial records to ``.csv``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{script}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while (out_dir / f"{stem}.json").exists():  # two runs in one second must not overwrite
        n += 1
        stem = f"{script}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    json_path, csv_path = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    json_path.write_text(json.dumps(result, indent=1, default=_json_name) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in result["rounds"] for k in r)))
        writer.writeheader()
        writer.writerows(result["rounds"])
    return json_path, csv_path


def run_script(script: str, comparisons: list[Comparison], args: argparse.Namespace,
               figures: Sequence[str] = tuple(FIGURES), quiet: bool = False,
               baseline: tuple[type, str] = (TorchDataLoader, "torch")) -> dict:
    """Run every comparison, print one line per figure, write JSON and CSV.

    Args:
        script: Name of the script, used for the output files.
        comparisons: What to measure.
        args: Parsed common flags (see ``flags.parse_args``).
        figures: Figures to print (the JSON holds all of them).
        quiet: Print nothing but the output paths (the demo prints its own table).
        baseline: The baseline class and its name (torch's DataLoader, unless a script asks
            another question: overhead.py --stats compares fastfeed with its stats off).

    Returns:
        The result: ``workload``, ``params``, ``rounds`` (trial records) and ``summary``
        (``"<workload> <label>"`` -> figure -> stats; see :class:`Comparison` for variants' keys).
    """
    candidate, cand_name = resolve_candidate(args.candidate)
    base_cls, base_name = baseline
    names = (cand_name, base_name)
    if args.mp_context in ("spawn", "forkserver"):
        # Start these helpers now, so that they are not charged to the first trial.
        from multiprocessing import forkserver, resource_tracker
        resource_tracker.ensure_running()
        if args.mp_context == "forkserver":
            forkserver.ensure_running()
    say = (lambda *a: None) if quiet else print
    say(f"# candidate {cand_name} = {candidate.__module__}.{candidate.__qualname__}, baseline {base_name}; "
        f"{args.rounds} rounds, {os.cpu_count()} CPUs, torch {torch.__version__}")
    records, summary, pairs = [], {}, {}
    load_start = os.getloadavg()
    for comp in comparisons:
        recs = compare(comp, candidate, base_cls, args.rounds, args.mp_context, names)
        key = f"{comp.workload.name} {comp.label}"
        records += recs
        cand = tagged(cand_name, comp.candidate_tag)
        ratios = [(key, "candidate", "baseline", (cand, base_name))]  # summary key, num, den, names
        for tag in comp.variants:
            if session.SESSION.variants is not None and tag not in session.SESSION.variants:
                continue
            ratios += [(f"{key} {tag}", tag, "baseline", (tagged(cand_name, tag), base_name)),
                       (f"{key} {tag}/{comp.candidate_tag or 'candidate'}", tag, "candidate",
                        (tagged(cand_name, tag), cand))]
        for skey, num, den, pair in ratios:
            summary[skey] = summarize(comp, recs, num, den)
            pairs[skey] = dict(comparison=comp.label, num=pair[0], den=pair[1],
                               num_workers=_count(comp.candidate_kwargs.get("num_workers")))
            for fig in figures:
                say(format_line(key, fig, summary[skey][fig], pair))
    result = dict(
        workload={c.workload.name: dict(c.workload.describe, unit=c.workload.unit) for c in comparisons},
        params=dict(
            script=script, argv=sys.argv[1:], quick=args.quick, rounds=args.rounds, mp_context=args.mp_context,
            candidate=cand_name, candidate_class=f"{candidate.__module__}.{candidate.__qualname__}",
            baseline_class=f"{base_cls.__module__}.{base_cls.__qualname__}",
            comparisons=[dict(asdict(c), workload=c.workload.name, epochs=c.epochs) for c in comparisons],
            python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
            cpus=os.cpu_count(), torch_threads=torch.get_num_threads(), machine=platform.platform(), git=_git_commit(),
            # Other load on the machine skews everything, torch at nw=0 most (its intra-op threads spin).
            loadavg_start=load_start, loadavg_end=os.getloadavg(),
            time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        ),
        rounds=records,
        summary=summary,
        pairs=pairs,  # summary key -> the comparison, the loaders of its ratio (numerator/denominator), nw
    )
    paths = write_results(script, result, args.out)
    print("# wrote " + ", ".join(str(p) for p in paths))
    return result


def _count(num_workers) -> int | None:
    """A comparison's worker count for plots, or None when it has none to plot (``"auto"``)."""
    return num_workers if isinstance(num_workers, int) else None
