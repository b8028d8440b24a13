"""Trial records to figures: the median, min and max over rounds of each candidate/baseline ratio, and their lines.

Absolute times do not carry between runs on a shared machine, so every figure is a ratio of two trials of the
same round.
"""

from __future__ import annotations

import statistics
from typing import Any


# figure -> (record key, scale to the display unit, display unit, floor). Ratios use the raw
# key, and only where the baseline exceeds the floor: a PSS growth of under 1 MB is noise
# (e.g. torch at nw=0 on 4 KB batches), and a ratio of noise means nothing.
FIGURES = {
    "throughput": ("batches_per_s", 1.0, "batch/s", 0.0),
    "main_cpu_s": ("main_cpu_s", 1.0, "s", 0.0),
    "tree_cpu_s": ("tree_cpu_s", 1.0, "s", 0.0),
    "peak_pss": ("pss_delta_mb", 1.0, "MB", 1.0),
    "peak_pss_abs": ("pss_peak_mb", 1.0, "MB", 0.0),
    "peak_footprint": ("foot_delta_mb", 1.0, "MB", 1.0),
    "ttfb": ("ttfb_s", 1e3, "ms", 0.0),
    "ctor_ttfb": ("ctor_ttfb_s", 1e3, "ms", 0.0),
    "ttfb_hot": ("ttfb_hot_s", 1e3, "ms", 0.0),  # epoch mode only: first batch of epoch 2 and later
    "stall": ("stall_fraction", 100.0, "%", 0.0),  # with a step only: the loop's share spent waiting for input
}
GBPS = ("bytes_per_s", 1e-9, "GB/s", 0.0)


def figures_for(unit: str) -> dict[str, tuple[str, float, str, float]]:
    """:data:`FIGURES` for a workload whose throughput is in ``unit`` (``"GB/s"``: bytes, else batches)."""
    return {**FIGURES, "throughput": GBPS} if unit == "GB/s" else FIGURES


def summarize(comp: Any, records: list[dict], num: str = "candidate", den: str = "baseline") -> dict:
    """Median, min and max over rounds of the candidate/baseline ratio, for every figure.

    Args:
        comp: The ``comparison.Comparison`` the records belong to.
        records: Its trial records, from :func:`compare`.
        num: Role of the ratio's numerator (``"candidate"`` or a variant's tag).
        den: Role of its denominator (``"baseline"`` or ``"candidate"``).

    Returns:
        Figure -> ``{median, min, max, candidate, baseline, unit}`` (candidate and baseline are
        medians of absolute values in ``unit``, of ``num`` and ``den``). Figures only: the project's own
        targets for them are checked by ``benchmarks/targets.py``, never here.
    """
    rounds: dict[int, dict[str, dict]] = {}
    for rec in records:
        rounds.setdefault(rec["round"], {})[rec["role"]] = rec
    out: dict[str, Any] = {}
    for fig, (key, scale, unit, floor) in figures_for(comp.workload.unit).items():
        pairs = [(r[num].get(key), r[den].get(key)) for r in rounds.values()
                 if r[num].get(key) is not None and r[den].get(key) is not None]
        ratios = [c / b for c, b in pairs if b > floor]
        stat = dict(median=None, min=None, max=None, candidate=None, baseline=None, unit=unit)
        if pairs:
            stat.update(candidate=statistics.median(c for c, _ in pairs) * scale,
                        baseline=statistics.median(b for _, b in pairs) * scale)
        if ratios:
            stat.update(median=statistics.median(ratios), min=min(ratios), max=max(ratios))
        out[fig] = stat
    return out


def fmt(value: float) -> str:
    """A figure for people: ``31,800`` rather than ``3.18e+04``, ``2.03`` rather than ``2.0312``."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def format_line(key: str, fig: str, stat: dict, names: tuple[str, str]) -> str:
    """One printed line per figure, e.g. ``transport nw=2  fastfeed/torch throughput  median 7.1x ...``."""
    cand, base = names
    ratio = ("median n/a" if stat["median"] is None else
             f"median {stat['median']:.2f}x (min {stat['min']:.2f}x, max {stat['max']:.2f}x)")
    line = f"{key}  {cand}/{base} {fig}  {ratio}"
    if stat["candidate"] is not None:
        line += f"  {cand} {fmt(stat['candidate'])} {stat['unit']}  {base} {fmt(stat['baseline'])} {stat['unit']}"
    return line
