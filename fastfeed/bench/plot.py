"""PNG plots of a ``fastfeed bench`` report: each loader's throughput relative to torch, and throughput by workers.

The report's numbers are ratios measured in the same run, because absolute times do not carry between runs on a
shared machine; the first plot shows those ratios as bars (the median over rounds) with whiskers (min to max) and a
line at 1.0, torch, so that "faster or not, and how surely" reads at a glance. The second, drawn only when a workload
ran at two or more worker counts, shows absolute throughput against ``num_workers``: how each loader scales.

Drawn with ``matplotlib.figure.Figure`` on the Agg canvas, never through ``pyplot``, like the doctor's timeline:
``fastfeed bench`` may run inside a notebook whose pyplot state is the user's. matplotlib is optional
(``pip install 'fastfeed[plot]'``) and imported only when a plot is asked for.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

from .._mpl import agg

NEEDS_MATPLOTLIB = "fastfeed bench's plots need matplotlib: pip install 'fastfeed[plot]'"
THROUGHPUT_PNG = "bench-throughput.png"
WORKERS_PNG = "bench-workers.png"
TORCH = "torch"
REFERENCE = "black"
TORCH_COLOUR = "dimgrey"
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
LABEL_WIDTH = 14  # characters per line of a bar's label: "nw=2 vs torch nw=0" breaks, "nw=2" does not
LEGEND = {"loc": "best", "fontsize": 8, "framealpha": 0.85}  # inside: beside the panel, it leaves a gap in the grid
LOG_SPAN = 30  # absolute throughputs this many times apart go on a log axis, so the slow loader's line is not flat
FILES_UNITS = {"http": "files/s", "local": "files/s", "tokens": "windows/s"}


# --- entry point ---------------------------------------------------------------------------------------------------


def save(report: dict, out_dir: Path) -> list[Path]:
    """Write ``bench-throughput.png`` and, where some workload ran at several worker counts, ``bench-workers.png``
    into ``out_dir``; returns the paths written. Raises ImportError when matplotlib is missing."""
    figure_cls, canvas_cls = _matplotlib()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workloads = report.get("workloads") or {}
    panels = [p for name, entry in workloads.items() if (p := _ratio_panel(name, entry)) is not None]
    _share_colours(panels, (bar[1] for p in panels for bar in p["bars"]))
    paths = [_draw(figure_cls, canvas_cls, panels, _ratio_axes, out_dir / THROUGHPUT_PNG,
                   _suptitle("throughput relative to torch: bars the median over rounds, whiskers min to max", report),
                   width=_ratio_width(panels))]  # fmt: skip
    curves = [c for name, entry in workloads.items() if (c := _workers_panel(name, entry)) is not None]
    _share_colours(curves, (loader for c in curves for loader in c["loaders"]))
    if curves:
        paths.append(_draw(figure_cls, canvas_cls, curves, _workers_axes, out_dir / WORKERS_PNG,
                           _suptitle("throughput by num_workers: the medians over rounds", report), width=5.5))
    return paths


def _matplotlib():
    return agg(NEEDS_MATPLOTLIB)


def _suptitle(what: str, report: dict) -> str:
    """The plot's question, then when and how the report was made: a PNG travels without its JSON."""
    made = " ".join(str(report[k]) for k in ("command", "time") if report.get(k))
    return f"fastfeed bench: {what}" + (f"\n{textwrap.shorten(made, 150)}" if made else "")


def _draw(figure_cls, canvas_cls, panels: list[dict], draw_one, path: Path, title: str, width: float) -> Path:
    """One subplot per panel in a grid sized to stay readable from 1 to 8 of them; unused cells left blank."""
    count = max(len(panels), 1)
    cols = 1 if count == 1 else 2 if count <= 4 or width > 7 else 3
    rows = math.ceil(count / cols)
    inches = width * cols + 1.5
    fig = figure_cls(figsize=(inches, 4.2 * rows + 0.8), dpi=100, layout="constrained")
    canvas_cls(fig)
    try:
        axes = fig.subplots(rows, cols, squeeze=False).ravel()
        for ax, panel in zip(axes, panels):
            draw_one(ax, panel)
        if not panels:
            _no_data(axes[0], "no workloads in this report")
        for ax in axes[count:]:
            ax.set_visible(False)
        fig.suptitle("\n".join(textwrap.fill(line, int(inches * 11)) for line in title.split("\n")), fontsize=11)
        fig.savefig(path, format="png")
    finally:
        fig.clear()
    return path


def _share_colours(panels: list[dict], names) -> None:
    """One colour per loader name across the figure, so that a loader keeps its colour in every subplot; torch, the
    baseline everywhere, always the same grey."""
    others = [n for n in dict.fromkeys(names) if n != TORCH]
    colours = {TORCH: TORCH_COLOUR, **{n: COLOURS[i % len(COLOURS)] for i, n in enumerate(others)}}
    for panel in panels:
        panel["colours"] = colours


def _no_data(ax, text: str) -> None:
    """Say why a subplot is empty, rather than leave blank axes that look like a drawing failure."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


# --- throughput relative to torch ----------------------------------------------------------------------------------


def _ratio_panel(name: str, entry: dict) -> dict | None:
    """A workload's bars: ``{"title", "reference", "ylabel", "bars": [(label, loader, median, min, max)]}``;
    None for a kind this module does not know (a newer report), so that the rest still gets drawn."""
    kind, result = entry.get("kind"), entry.get("result") or {}
    if kind == "comparison":
        return _comparison_bars(name, result)
    if kind == "files":
        return _files_bars(name, result)
    if kind == "tune":
        return _tune_bars(name, result)
    return None


def _comparison_bars(name: str, result: dict) -> dict:
    """Each summary key whose ratio is to torch: the runner's other keys compare fastfeed with itself (threads over
    processes), a different question. A report whose baseline is not torch (overhead --stats) shows its ratios
    to that baseline instead, and says so."""
    pairs, summary = result.get("pairs") or {}, result.get("summary") or {}
    den = TORCH if any(p.get("den") == TORCH for p in pairs.values()) else _baseline(pairs)
    several = len(result.get("workload") or {}) > 1  # then say which of them each bar is
    bars = []
    for key, pair in pairs.items():
        stat = (summary.get(key) or {}).get("throughput")
        if pair.get("den") != den or stat is None:
            continue
        label = key if several else str(pair.get("comparison", key))
        bars.append((f"{_wrap(label)}\n{pair.get('num')}", pair.get("num"),
                     stat.get("median"), stat.get("min"), stat.get("max")))  # fmt: skip
    units = {w.get("unit") for w in (result.get("workload") or {}).values() if w.get("unit")}
    return dict(title=_title(name, ", ".join(sorted(units))), reference=den or TORCH, bars=bars,
                ylabel=f"throughput / {den or TORCH} (same run)")  # fmt: skip


def _wrap(label: str) -> str:
    """A comparison's label on lines of its parts, "nw=2 / vs torch nw=0 / epochs of 30", so that ten bars' labels
    fit side by side; a part still too long for a bar's width wraps too."""
    parts = re.sub(r" (vs |epochs )", r"\n\1", label).split("\n")
    return "\n".join(textwrap.fill(part, LABEL_WIDTH) for part in parts)


def _baseline(pairs: dict) -> str | None:
    """The baseline of a run against something other than torch: a denominator that is never a numerator."""
    nums = {p.get("num") for p in pairs.values()}
    return next((p.get("den") for p in pairs.values() if p.get("den") not in nums), None)


def _title(name: str, unit: str) -> str:
    """The workload's name with its throughput unit: the ratios have none, the figures behind them do."""
    return f"{name} (throughput in {unit})" if unit else name


def _files_bars(name: str, result: dict) -> dict:
    """Read-ahead and cache against torch's plain reads, for each storage measured; ArrayFiles against torch over
    np.memmap for the tokens. Each ratio is torch's time over fastfeed's: throughput relative to torch."""
    bars = []
    for storage in ("http", "local"):
        for side in ("readahead", "cached"):
            fig = (result.get(storage) or {}).get(side)
            if fig and fig.get("ratio") is not None:
                bars.append((f"{storage}\n{side}", side, fig["ratio"], fig.get("min"), fig.get("max")))
    tokens = result.get("tokens")
    if tokens and tokens.get("ratio") is not None:
        bars.append(("tokens\nArrayFiles", "ArrayFiles", tokens["ratio"], tokens.get("min"), tokens.get("max")))
    units = dict.fromkeys(FILES_UNITS[s] for s in FILES_UNITS if s in result)
    return dict(title=_title(name, ", ".join(units)), reference=TORCH, bars=bars,
                ylabel="throughput / torch (same run)")  # fmt: skip


def _tune_bars(name: str, result: dict) -> dict:
    """The tuner's pick over the exhaustive grid's best, per workload, with the time it took beneath: what tuning
    gives up, against what it saves. The bar is the worst run's ratio, the one a user could get, with a whisker up
    to the best run's; rows from before the tuner's runs were kept (``quality``) hold the worst alone."""
    bars = []
    for row in result.get("rows") or []:
        label, quality = str(row.get("workload", "?")), row.get("quality")
        if quality is not None:
            label += f"\nworst of {len(row.get('runs') or [])} runs"
        if row.get("time_ratio") is not None:
            label += f"\ntuned in {row['time_ratio']:.2f}x\nthe grid's time"
        if quality is not None:
            bars.append((label, "tuned", quality["min"], quality["min"], quality["max"]))
        else:
            bars.append((label, "tuned", row.get("throughput_ratio"), None, None))
    return dict(title=_title(name, "batch/s"), reference="grid best", bars=bars,
                ylabel="throughput / grid best (same run)")  # fmt: skip


def _ratio_width(panels: list[dict]) -> float:
    """Inches per subplot: room for the most bars any workload has, each label a few words wide."""
    most = max((len(p["bars"]) for p in panels), default=1)
    return max(4.5, 0.95 * most + 1.5)


def _ratio_axes(ax, panel: dict) -> None:
    """Bars at the median ratio, whiskers from min to max, each bar's value on it, and the reference at 1.0."""
    ax.set_title(panel["title"], fontsize=10, loc="left")
    ax.axhline(1.0, color=REFERENCE, ls="--", lw=1, zorder=1)
    ax.text(1.01, 1.0, f"{panel['reference']}\n= 1.0", transform=ax.get_yaxis_transform(), ha="left", va="center",
            fontsize=8)  # beside the axes, where no bar can cover it
    bars = panel["bars"]
    if not bars:
        _no_data(ax, "no throughput ratios measured")
        return
    colours = panel["colours"]
    xs = range(len(bars))
    top = 1.0
    for x, (_, loader, median, low, high) in zip(xs, bars):
        top = max([top, *(v for v in (median, low, high) if v is not None)])
        if median is None:
            ax.text(x, 0.05, "n/a", ha="center", va="bottom", fontsize=8, color="grey")
            continue
        ax.bar(x, median, width=0.65, color=colours[loader], alpha=0.85, zorder=2)
        if low is not None and high is not None:
            ax.errorbar(x, median, yerr=[[median - low], [high - median]], fmt="none", ecolor="black",
                        elinewidth=1, capsize=4, zorder=3)  # fmt: skip
        ax.annotate(f"{median:.2f}x", (x, max(median, high or median)), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=9, zorder=4,
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})  # fmt: skip
    ax.set_xticks(list(xs), [label for label, *_ in bars], fontsize=8)
    ax.set_xlim(-0.6, len(bars) - 0.4)
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel(panel["ylabel"])


# --- throughput by num_workers -------------------------------------------------------------------------------------


def _workers_panel(name: str, entry: dict) -> dict | None:
    """A comparison workload's curves, ``lines``: ``{(loader, suffix): (label, {num_workers: throughput})}``, when it
    ran at two or more worker counts; None otherwise, as one point per loader is no curve."""
    if entry.get("kind") != "comparison":
        return None
    result = entry.get("result") or {}
    lines, unit = _points(result)
    counts = {nw for points in lines.values() for nw in points}
    if len(counts) < 2:
        return None
    units = {w.get("unit") for w in (result.get("workload") or {}).values() if w.get("unit")}
    return dict(title=name, unit=unit or ", ".join(sorted(units)), lines=_join_at_zero(lines),
                loaders=[loader for loader, _ in lines])  # all, those joined too: colours in the order the bars have


def _points(result: dict) -> tuple[dict, str]:
    """Both sides of every ratio measured with the same workers on each side, at the pair's ``num_workers``; a
    comparison against torch at other workers (transport's "nw=2 vs torch nw=0") has no one count to stand at.
    Lines are apart per epoch mode (a label's suffix, "epochs of 30"): steady state and epochs differ."""
    pairs, summary = result.get("pairs") or {}, result.get("summary") or {}
    lines: dict = {}
    unit = ""
    for key, pair in pairs.items():
        nw, stat = pair.get("num_workers"), (summary.get(key) or {}).get("throughput")
        match = re.fullmatch(rf"nw={nw}(.*)", str(pair.get("comparison", "")))
        if not isinstance(nw, int) or isinstance(nw, bool) or stat is None or not match or " vs " in match[1]:
            continue
        suffix, unit = match[1].strip(), stat.get("unit") or unit
        for loader, value in ((pair.get("num"), stat.get("candidate")), (pair.get("den"), stat.get("baseline"))):
            if value is not None:
                lines.setdefault((loader, suffix), {}).setdefault(nw, value)
    return lines, unit


def _join_at_zero(lines: dict) -> dict:
    """At num_workers=0 there are no workers, so no worker type: the runner names fastfeed there plain "fastfeed"
    and, with workers, "fastfeed-process" or "fastfeed-thread". Each such line starts from the plain loader's
    point at 0, which then needs no line of its own; the legend says whose point it is."""
    out = {}
    borrowed = set()
    for (loader, suffix), points in lines.items():
        base = (str(loader).rsplit("-", 1)[0], suffix)
        label = loader
        if 0 not in points and base != (loader, suffix) and 0 in lines.get(base, {}):
            points = {0: lines[base][0], **points}
            label = f"{loader} (nw=0: {base[0]})"
            borrowed.add(base)
        out[(loader, suffix)] = (label, points)
    return {key: v for key, v in out.items() if not (key in borrowed and set(lines[key]) == {0})}


def _workers_axes(ax, panel: dict) -> None:
    """One line per loader through its throughput at each worker count; only the counts measured are ticked."""
    ax.set_title(panel["title"], fontsize=10, loc="left")
    colours = panel["colours"]
    styles = {s: ls for s, ls in zip(dict.fromkeys(s for _, s in panel["lines"]), ("-", "--", ":", "-."))}
    values = []
    for (loader, suffix), (label, points) in panel["lines"].items():
        xs = sorted(points)
        values += [points[x] for x in xs]
        ax.plot(xs, [points[x] for x in xs], marker="o", color=colours[loader], ls=styles.get(suffix, "-"),
                label=f"{label}, {suffix}" if suffix else label)  # fmt: skip
    counts = sorted({x for _, points in panel["lines"].values() for x in points})
    ax.set_xticks(counts)
    ax.set_xlabel("num_workers")
    positive = [v for v in values if v > 0]
    log = bool(positive) and max(positive) > LOG_SPAN * min(positive)
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, 1.1 * max(values, default=1.0))  # room above the top line, off the frame
    ax.set_ylabel(f"throughput ({panel['unit']}{', log scale' if log else ''})")
    ax.grid(True, alpha=0.3)
    ax.legend(**LEGEND)
