"""The doctor's one picture of a stall: a PNG with the loop, the GPU, the CPUs and the workers on one time axis.

A verdict says *that* the GPU idles and why; this picture lets the user see it: the red waits line up with the
GPU's dips, and the panels beneath show whether the CPUs, the disk or the workers were the ones behind.

A job of several ranks gets one picture of them all (``job_png``): a lane per rank on one time axis, each batch's
input wait, sync and compute side by side, so the rank that waits for its input stands out from those that wait
for it in the step's collectives.

It is drawn with ``matplotlib.figure.Figure`` on the Agg canvas, never through ``pyplot``: the doctor runs inside
the user's training script and must leave pyplot's global figures and backend as it found them. matplotlib is
optional (``pip install 'fastfeed[plot]'``) and imported only when a picture is asked for.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np

from .._mpl import agg
from .ranks import RankRecord, RankSplit
from .timeline import LoaderRecord, Timeline

NEEDS_MATPLOTLIB = "the doctor's PNG timeline needs matplotlib: pip install 'fastfeed[plot]'"
STALL = "tab:red"
SYNC = "tab:orange"
COMPUTE = "tab:blue"
NO_DATA = "no data"
LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.005, 1), "fontsize": 8}  # right of the panel, off the data
MAX_BATCHES_DRAWN = 2000  # more than this and each is under a pixel: draw means over time bins instead
BINS = 600
CLIP_RATIO = 20  # waits or steps this many times the 95th percentile go off the axis, not flatten the rest
MAX_LANES = 16  # a job's picture draws this many ranks at most: 64 lanes would be too thin to read
LANE_IN = 0.5  # inches of a job's picture per rank drawn
LANE_LABEL = {"width": 48, "max_lines": 3, "placeholder": " ..."}  # a lane's label, wrapped to fit its height
SAMPLES_IN = 2  # inches of a job's picture for its samples panel
JOB_BASE_IN = SAMPLES_IN + 1.5  # and for that panel, the title and the time axis


def timeline_png(timeline: Timeline, path, title: str | None = None) -> Path:
    """Draw ``timeline`` into a PNG at ``path``: step and wait per batch, GPU, CPU, worker busy and memory panels.

    ``title``: a line at the top, the doctor's verdict. Raises ImportError when matplotlib is missing.
    """
    figure_cls, canvas_cls = _matplotlib()
    fig = figure_cls(figsize=(12, 10), dpi=100, layout="constrained")
    canvas_cls(fig)
    try:
        axes = draw_timeline(fig, timeline)
        return _save(fig, axes, timeline.end - timeline.start, "seconds since the watch started",
                     title or "fastfeed doctor: timeline", path)  # fmt: skip
    finally:
        fig.clear()


def draw_timeline(fig, timeline: Timeline) -> list:
    """The panels of ``timeline_png`` drawn on ``fig`` (a matplotlib ``Figure``), top to bottom: the loop's
    batches, the GPU, the CPUs, the workers' busy share, and, when memory was sampled, memory (each worker's
    private memory, the machine's available memory on the right axis). Returns their axes, in that order."""
    memory = any(s.get("proc_uss") or s.get("mem_available") is not None for s in timeline.samples)
    ratios = [3, 2, 2, 2] + ([2] if memory else [])
    axes = fig.subplots(len(ratios), 1, sharex=True, gridspec_kw={"height_ratios": ratios})
    rec = timeline.primary()
    _batches_panel(axes[0], timeline, rec)
    _gpu_panel(axes[1], timeline)
    _cpu_panel(axes[2], timeline)
    _workers_panel(axes[3], timeline, rec)
    if memory:
        _memory_panel(axes[4], timeline, rec)
    _mark_epochs(axes, timeline, rec)
    return list(axes)


def _memory_panel(ax, timeline: Timeline, rec: LoaderRecord | None) -> None:
    """Each worker process's private memory (USS, MB) and, on the right axis, the machine's available memory: a
    worker that copies the dataset as it reads it (copy-on-read) climbs while the machine's headroom falls."""
    pids = list(dict.fromkeys(p for ep in rec.epochs for p in ep.pids)) if rec is not None else []
    drawn = 0
    for pid in pids:
        xs, ys = _sampled(timeline, lambda s, pid=pid: (s.get("proc_uss") or {}).get(str(pid)))
        if xs is not None:
            keep = ~np.isnan(ys)  # memory is read every few ticks: join the readings, not the gaps between
            label = f"worker pid {pid}" if len(pids) <= 8 else (f"{len(pids)} workers" if not drawn else None)
            ax.plot(xs[keep], ys[keep] / 2**20, lw=1, marker=".", ms=2, label=label)
            drawn += 1
    xs, ys = _sampled(timeline, lambda s: s.get("mem_available"))
    if not drawn and xs is None:  # memory of other processes only: none of this loader's workers
        _no_data(ax, "no memory figures for this loader's workers")
        return
    if drawn:
        ax.set_ylabel("workers' private\nmemory (USS, MB)")
        ax.set_ylim(bottom=0)
        ax.legend(**{**LEGEND, "bbox_to_anchor": (1.06, 1)})
    else:
        ax.set_yticks([])
    if xs is not None:
        keep = ~np.isnan(ys)
        right = ax.twinx()
        right.plot(xs[keep], ys[keep] / 2**30, color="grey", ls="--", lw=1, label="machine: available")
        total = f" of {timeline.mem_total / 2**30:.1f}" if timeline.mem_total else ""
        right.set_ylabel(f"available GB{total}", color="grey")
        right.set_ylim(bottom=0, top=(timeline.mem_total / 2**30 * 1.05) if timeline.mem_total else None)
        right.legend(loc="lower left", bbox_to_anchor=(1.06, 0), fontsize=8)


def job_png(ranks: list[RankRecord], splits: list[RankSplit], path, title: str | None = None,
            labels: list[str] | None = None, keep: list[int] | None = None,
            start: float | None = None) -> Path:  # fmt: skip
    """Draw one job's ranks into a PNG at ``path``: a lane per rank on one time axis, each batch's input wait (red),
    sync (orange) and compute (blue), and beneath, each rank's GPU busy (CPU busy where no rank has GPU samples).

    ``splits``: ``ranks.split(ranks)``, matched to ``ranks`` by rank. ``title``: a line at the top, the job's
    verdict. ``labels``: a line per rank, in the order of ``ranks``, in place of its shares ("rank 1: input 92%
    sync 1% compute 7%"). At most ``MAX_LANES`` ranks are drawn: those in ``keep`` (the stragglers, labelled in
    red), then the lowest; the picture says how many were left out. ``start``: the job's start on rank 0's clock,
    which the time axis counts from (default: the earliest rank's start). Past ``MAX_BATCHES_DRAWN`` batches a
    lane shows, per time bin, the share of it each part took instead of each batch. Raises ImportError when
    matplotlib is missing.
    """
    figure_cls, canvas_cls = _matplotlib()
    drawn = _lanes(ranks, keep)
    if start is None:
        start = min((r.timeline.start + r.offset for r in ranks), default=0.0)
    span = max((r.timeline.end + r.offset - start for r in ranks), default=0.0)
    lanes = max(len(drawn), 1)
    fig = figure_cls(figsize=(12, JOB_BASE_IN + LANE_IN * lanes), dpi=100, layout="constrained")
    canvas_cls(fig)
    try:
        axes = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [LANE_IN * lanes, SAMPLES_IN]})
        _ranks_panel(axes[0], ranks, {sp.rank: sp for sp in splits}, drawn, labels, start, span, keep)
        _job_samples_panel(axes[1], ranks, drawn, start)
        return _save(fig, axes, span, "seconds since the job started (rank 0's clock)",
                     title or "fastfeed doctor: job timeline", path)  # fmt: skip
    finally:
        fig.clear()


def _save(fig, axes, span: float, xlabel: str, title: str, path) -> Path:
    """The shared time axis (``span`` seconds) under the last of ``axes``, the title, and the PNG at ``path``."""
    if span > 0:
        axes[-1].set_xlim(0, span)
    axes[-1].set_xlabel(xlabel)
    fig.suptitle(textwrap.fill(title, 110), fontsize=11)
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def _matplotlib():
    return agg(NEEDS_MATPLOTLIB)


def _ranks_panel(ax, ranks: list[RankRecord], by_rank: dict, drawn: list[int], labels: list[str] | None,
                 start: float, span: float, keep: list[int] | None) -> None:  # fmt: skip
    """A lane per drawn rank, rank 0's on top, labelled on the left, the labels of those in ``keep`` in red; see
    ``job_png``."""
    if not drawn:
        _no_data(ax, NO_DATA)
        return
    from matplotlib.patches import Patch  # matplotlib is there: job_png imported it

    most = max((by_rank[ranks[i].rank].batches for i in drawn if ranks[i].rank in by_rank), default=0)
    edges = np.linspace(0.0, max(span, 1e-3), BINS + 1) if most > MAX_BATCHES_DRAWN else None
    texts = []
    for k, i in enumerate(drawn):
        sp = by_rank.get(ranks[i].rank)
        if sp is not None:
            _lane(ax, k, _parts(sp, start), edges)
        texts.append(textwrap.fill(labels[i] if labels is not None else _shares(ranks[i].rank, sp), **LANE_LABEL))
    ax.set_yticks(range(len(drawn)), labels=texts, fontsize=8)
    kept = set(keep or ())
    for text, i in zip(ax.get_yticklabels(), drawn):
        if ranks[i].rank in kept:
            text.set_color(STALL)
    ax.set_ylim(len(drawn) - 0.5, -0.5)
    keys = [Patch(color=STALL, label="input wait (stall)"), Patch(color=SYNC, label="sync"),
            Patch(color=COMPUTE, label="compute")]  # fmt: skip
    per = None if edges is None else f"share of each {edges[1]:.2g} s"
    ax.legend(handles=keys, title=per, title_fontsize=8, **LEGEND)
    ax.set_title("each rank's loop: input wait, then compute, then sync (drawn at the step's end)", fontsize=9,
                 loc="left")  # fmt: skip
    if len(drawn) < len(ranks):
        ax.set_title(f"{len(ranks) - len(drawn)} of {len(ranks)} ranks not drawn", fontsize=9, loc="right",
                     color=STALL)  # fmt: skip


def _lanes(ranks: list[RankRecord], keep: list[int] | None) -> list[int]:
    """The indices in ``ranks`` of those a job's picture draws, by rank: those in ``keep``, then the lowest, up to
    ``MAX_LANES`` in all."""
    by_rank = sorted(range(len(ranks)), key=lambda i: ranks[i].rank)
    kept = set(keep or ())
    chosen = [i for i in by_rank if ranks[i].rank in kept][:MAX_LANES]
    chosen += [i for i in by_rank if ranks[i].rank not in kept][: MAX_LANES - len(chosen)]
    return sorted(chosen, key=lambda i: ranks[i].rank)


def _parts(sp: RankSplit, start: float) -> list[tuple[str, np.ndarray]]:
    """A rank's input waits, computes and syncs as (colour, spells): sorted (start, length) rows, seconds since
    ``start``; each step's sync at its end, its compute before it (the split does not say when the sync was)."""
    asks, returns = np.asarray(sp.asks, float) - start, np.asarray(sp.returns, float) - start
    computes, syncs = np.asarray(sp.computes, float), np.asarray(sp.syncs, float)
    rows = [(STALL, asks, returns - asks), (COMPUTE, returns, computes), (SYNC, returns + computes, syncs)]
    return [(colour, np.column_stack([at, length]).reshape(-1, 2)) for colour, at, length in rows]


def _lane(ax, k: int, parts: list[tuple[str, np.ndarray]], edges: np.ndarray | None) -> None:
    """Lane ``k`` (the band around y = k): each part's spells as bars, or with ``edges``, each bin's shares stacked
    from the lane's foot: input, then sync, then compute."""
    if edges is None:
        for colour, spells in parts:
            spells = spells[spells[:, 1] > 0]
            ax.broken_barh(spells, (k - 0.4, 0.8), facecolors=colour, linewidth=0)
        return
    mids, foot = (edges[:-1] + edges[1:]) / 2, np.full(len(edges) - 1, k + 0.4)
    for colour, spells in sorted(parts, key=lambda part: [STALL, SYNC, COMPUTE].index(part[0])):
        top = foot - 0.8 * _busy_fraction(spells, edges)
        ax.fill_between(mids, foot, top, step="mid", color=colour, linewidth=0)
        foot = top


def _shares(rank: int, sp: RankSplit | None) -> str:
    if sp is None or not sp.batches:
        return f"rank {rank}: no batches"
    s = sp.shares()
    return f"rank {rank}: input {s['input']:.0%} sync {s['sync']:.0%} compute {s['compute']:.0%}"


def _job_samples_panel(ax, ranks: list[RankRecord], drawn: list[int], start: float) -> None:
    """Each drawn rank's GPU busy on the job's time axis, or its CPU busy where no drawn rank has GPU samples."""
    gpu = any(s.get("gpu_util") is not None for i in drawn for s in ranks[i].timeline.samples)
    key, what = ("gpu_util", "GPU busy %") if gpu else ("cpu_busy", "CPU busy %")
    lines = 0
    for i in drawn:
        r = ranks[i]
        xs, ys = _sampled(r.timeline, lambda s: s.get(key))
        if xs is not None:
            label = f"rank {r.rank}" if len(drawn) <= 8 else None  # past 8, a legend would hide the lines
            ax.step(xs + r.timeline.start + r.offset - start, ys * 100, where="pre", lw=0.8, label=label)
            lines += 1
    if not lines:
        _no_data(ax, NO_DATA)
        return
    ax.set_ylabel(what)
    ax.set_ylim(0, 105)
    if len(drawn) <= 8:
        ax.legend(**LEGEND)


def _batches_panel(ax, timeline: Timeline, rec: LoaderRecord | None) -> None:
    if rec is None or not rec.batches:
        _no_data(ax, NO_DATA)
        return
    ax.set_title(f"loader {rec.id} ({rec.kind}, made at {rec.made_at}), num_workers={rec.num_workers}",
                 fontsize=9, loc="left")  # fmt: skip
    wait_x, wait, step_x, step = _per_batch(timeline, rec)
    if len(wait) > MAX_BATCHES_DRAWN:
        edges = np.linspace(0.0, timeline.end - timeline.start, BINS + 1)
        x, per = (edges[:-1] + edges[1:]) / 2, f", mean per {edges[1]:.2g} s"
        wait, step = _bin_mean(wait_x, wait, edges), _bin_mean(step_x, step, edges)
        ax.fill_between(x, 0, wait, color=STALL, step="mid", label=f"wait (stall){per}")
        ax.plot(x, step, color="tab:blue", lw=1, zorder=3, label=f"step{per}")
    else:
        ax.vlines(wait_x, 0, wait, color=STALL, lw=1.5, label="wait (stall)")
        ax.plot(step_x, step, color="tab:blue", lw=1, zorder=3, label="step")
    ax.set_ylabel("ms per batch")
    _clip(ax, np.concatenate([wait, step]))
    looped = sum(ep.returns[-1] - ep.asks[0] for ep in rec.epochs if ep.returns)
    stalled = sum(sum(ep.waits()) for ep in rec.epochs)
    ax.legend(**LEGEND, title=f"waits: {stalled / max(looped, 1e-9):.0%}\nof the loop", title_fontsize=8)


def _per_batch(timeline: Timeline, rec: LoaderRecord) -> tuple[np.ndarray, ...]:
    """Each batch's wait and step in ms at its return (seconds since the start); a NaN step ends each epoch's
    line, so it does not run across the pause between epochs."""
    wait_x, wait, step_x, step = [], [], [], []
    for ep in rec.epochs:
        returns = [r - timeline.start for r in ep.returns]
        waits, steps = ep.waits(), ep.steps()
        wait_x += returns[: len(waits)]
        wait += [w * 1e3 for w in waits]
        step_x += returns[: len(steps)]
        step += [d * 1e3 for d in steps]
        if returns:
            step_x.append(returns[-1])
            step.append(math.nan)
    return tuple(np.asarray(a, float) for a in (wait_x, wait, step_x, step))


def _bin_mean(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The mean of the ``y`` whose ``x`` falls in each bin between ``edges``; NaN in bins without any."""
    keep = ~np.isnan(y)
    bins = np.clip(np.searchsorted(edges, x[keep], side="right") - 1, 0, len(edges) - 2)
    sums = np.bincount(bins, weights=y[keep], minlength=len(edges) - 1)
    counts = np.bincount(bins, minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / counts, math.nan)


def _clip(ax, values: np.ndarray) -> None:
    """Keep a few huge values (the first batch's worker start) from flattening the rest: say them instead."""
    values = values[~np.isnan(values)]
    if not values.size:
        return
    far = values > CLIP_RATIO * max(float(np.percentile(values, 95)), 1e-3)
    off = values[far]
    if off.size:
        ax.set_ylim(0, 1.1 * values[~far].max())
        ax.text(0.01, 0.95, f"{off.size} off the axis, up to {off.max():.0f} ms", transform=ax.transAxes,
                va="top", fontsize=8, color=STALL)  # fmt: skip
    else:
        ax.set_ylim(bottom=0)


def _gpu_panel(ax, timeline: Timeline) -> None:
    if not _plot_samples(ax, timeline, (("gpu_util", "GPU busy", "tab:green"),
                                        ("gpu_mem_util", "GPU memory bandwidth", "tab:olive"))):  # fmt: skip
        _no_data(ax, "no GPU utilisation (NVML unavailable)" if timeline.samples else NO_DATA)
        return
    ax.set_ylabel("GPU %")
    ax.set_ylim(0, 105)


def _cpu_panel(ax, timeline: Timeline) -> None:
    if not _plot_samples(ax, timeline, (("cpu_busy", "CPU busy", "tab:purple"),
                                        ("iowait", "iowait", "tab:brown"))):  # fmt: skip
        _no_data(ax, NO_DATA)
        return
    ax.set_ylabel(f"CPU % ({timeline.cpus} CPUs)")
    ax.set_ylim(0, 105)


def _plot_samples(ax, timeline: Timeline, series) -> bool:
    """Plot each ``(key, label, colour)`` present in the samples, in %, each value over its interval."""
    drawn = False
    for key, label, colour in series:
        xs, ys = _sampled(timeline, lambda s, key=key: s.get(key))
        if xs is not None:
            ax.step(xs, ys * 100, where="pre", color=colour, lw=1, label=label)
            drawn = True
    if drawn:
        ax.legend(**LEGEND)
    return drawn


def _sampled(timeline: Timeline, value):
    """Sample times (since the start) and ``value(sample)`` as floats, NaN where missing; None if all are."""
    ys = [value(s) for s in timeline.samples]
    if all(y is None for y in ys):
        return None, None
    xs = np.asarray([s["t"] for s in timeline.samples], float) - timeline.start
    return xs, np.asarray([math.nan if y is None else y for y in ys], float)


def _workers_panel(ax, timeline: Timeline, rec: LoaderRecord | None) -> None:
    if rec is not None and any(ep.workers for ep in rec.epochs):
        _worker_busy(ax, timeline, rec)
    elif rec is not None and any(ep.pids for ep in rec.epochs) and _worker_cpu(ax, timeline, rec):
        ax.set_ylabel("worker CPU\n% of a core")
    else:
        _no_data(ax, NO_DATA if rec is None or rec.num_workers else "no workers (num_workers=0)")
        return
    ax.set_ylim(bottom=0)
    ax.legend(**LEGEND)


def _worker_busy(ax, timeline: Timeline, rec: LoaderRecord) -> None:
    """Each worker's share of each time bin spent in fetch + collate, from its records across epochs."""
    span = max(timeline.end - timeline.start, 1e-3)
    width = _bin_width(span)
    edges = np.arange(0.0, span + width, width)
    mids = (edges[:-1] + edges[1:]) / 2
    count = max(len(ep.workers) for ep in rec.epochs)
    busy = np.array([_busy_fraction(_intervals(timeline, rec, w), edges) for w in range(count)])
    for w, row in enumerate(busy):
        ax.plot(mids, row * 100, lw=0.8, alpha=0.6, label=f"worker {w}" if count <= 8 else None)
    ax.plot(mids, busy.mean(axis=0) * 100, color="black", lw=1.5, label=f"mean of {count}")
    ax.set_ylabel(f"workers busy %\n(per {width:.2g} s)")
    ax.set_ylim(top=105)


def _bin_width(span: float) -> float:
    """About 0.25 to 0.5 s; narrower for a short run, so it still gets some 40 bins, and wider for a long one,
    so it gets no more than the batch panel's ``BINS``."""
    return max(min(0.5, max(0.25, span / 400), span / 40), span / BINS)


def _intervals(timeline: Timeline, rec: LoaderRecord, w: int) -> np.ndarray:
    """Worker ``w``'s busy spells (start, length) in seconds since the start, sorted; unknown ends skipped."""
    rows = [(end - c - f - timeline.start, f + c) for ep in rec.epochs if w < len(ep.workers)
            for f, c, end in zip(ep.workers[w].fetch, ep.workers[w].collate, ep.workers[w].ends) if end]  # fmt: skip
    return np.array(sorted(rows), float).reshape(-1, 2)


def _busy_fraction(spells: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The fraction of each bin between ``edges`` covered by ``spells``, one worker's non-overlapping runs."""
    if not len(spells):
        return np.zeros(len(edges) - 1)
    starts, lengths = spells[:, 0], spells[:, 1]
    done_before = np.concatenate([[0.0], np.cumsum(lengths)])
    last = np.searchsorted(starts, edges, side="right") - 1  # the last spell begun by each edge
    k = np.maximum(last, 0)
    done = np.where(last >= 0, done_before[k] + np.clip(edges - starts[k], 0, lengths[k]), 0.0)
    return np.clip(np.diff(done) / np.diff(edges), 0, 1)


def _worker_cpu(ax, timeline: Timeline, rec: LoaderRecord) -> bool:
    """torch's workers leave no records: plot the CPU each worker process used, from the samples."""
    pids = list(dict.fromkeys(p for ep in rec.epochs for p in ep.pids))
    drawn = 0
    for pid in pids:
        xs, ys = _sampled(timeline, lambda s, pid=pid: (s.get("proc_cpu") or {}).get(str(pid)))
        if xs is not None:
            label = f"worker CPU (pid {pid})" if len(pids) <= 8 else f"worker CPU ({len(pids)} pids)"
            ax.step(xs, ys * 100, where="pre", lw=0.8, label=None if drawn and len(pids) > 8 else label)
            drawn += 1
    return drawn > 0


def _mark_epochs(axes, timeline: Timeline, rec: LoaderRecord | None) -> None:
    starts = [ep.asks[0] - timeline.start for ep in (rec.epochs if rec else []) if ep.asks]
    for ax in axes:
        for x in starts[1:]:
            ax.axvline(x, color="grey", ls=":", lw=0.8)


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_yticks([])
