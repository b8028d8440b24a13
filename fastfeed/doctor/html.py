"""The doctor's report as one self-contained HTML page (``report.html``): ``fastfeed doctor --html``, or
``report.save(directory, html=True)`` from ``fastfeed.doctor.watch()``.

The page opens with the verdict, then the timeline, then the six questions, the advice (predicted against
measured) and the what-if runs, then the text report. It is made from what the text, PNG and trace are made from
(``Report.to_dict()`` and the timeline; a job's ``JobReport`` and its ranks' records) and needs nothing else: its
CSS, its script and its drawing are inline, its Content-Security-Policy forbids every request, so it opens the
same offline, from a mail attachment or a CI artifact.

The timeline is an SVG the page's script draws from the records embedded as JSON: the training loop's stalls
(red) and steps (blue), each worker's batches, and the GPU's and the CPUs' utilisation (whatever was sampled), on
one time axis; a job gets a lane per rank (its input wait, compute and sync) and each rank's GPU (or CPU) busy.
The wheel zooms around the pointer, a drag pans, a double-click or "reset" shows the whole run again. Past
``MAX_SPANS`` spells in one lane, the lane shows each time bin's share of each part instead of each spell.

Every text from the records (paths, dataset names, the command) is escaped (``html.escape`` in the markup;
``<``, ``>`` and ``&`` as JSON escapes in the embedded data, which the script only ever sets as text).
The page records any script error on ``<html data-errors>`` and sets ``data-rendered`` once it has drawn, so a
headless browser's ``--dump-dom`` shows whether it worked.
"""

from __future__ import annotations

import json
import math
from html import escape

import numpy as np

from . import memory
from .evidence import ms
from .ranks import RankRecord, RankSplit
from .timeline import LoaderRecord, Timeline

STALL, SYNC, COMPUTE = "#d62728", "#ff7f0e", "#1f77b4"  # matplotlib's tab:red, tab:orange, tab:blue, as the PNG
WORKER = "#2ca02c"
SERIES = {"gpu_util": ("GPU busy", "#2ca02c"), "gpu_mem_util": ("GPU memory bandwidth", "#bcbd22"),
          "cpu_busy": ("CPU busy", "#9467bd"), "iowait": ("iowait", "#8c564b")}  # fmt: skip
RANK_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
                "#17becf"]  # fmt: skip
MAX_SPANS = 20000  # spells in one part of one lane; past it, the lane shows shares over BINS time bins
BINS = 2000
MAX_POINTS = 4000  # samples in one line; past it, means over time bins
MAX_LANES = 256  # a job's ranks drawn; the stragglers first, then the lowest ranks
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
WHATIF_TITLES = (("compute_ceiling", "compute ceiling (cached batch)"),
                 ("input_ceiling", "input ceiling (loader, no step)"),
                 ("input_ceiling_fastfeed", "input ceiling, fastfeed.DataLoader"))  # fmt: skip


# -- the timeline's data -------------------------------------------------------------------------------------------


def _r(x: float) -> float:
    return round(float(x), 6) + 0.0  # microseconds; + 0.0: no "-0.0"


def _part(name: str, colour: str, starts, lengths, span: float) -> dict | None:
    """One kind of spell in a lane: ``spans`` [[start, length], ...] (seconds since the start, sorted), or past
    ``MAX_SPANS``, ``bins``: each bin's share covered. None when there is no spell."""
    starts, lengths = np.asarray(starts, float), np.asarray(lengths, float)
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    if not starts.size:
        return None
    order = np.argsort(starts, kind="stable")
    starts, lengths = starts[order], lengths[order]
    if starts.size <= MAX_SPANS:
        return {"name": name, "colour": colour, "spans": [[_r(a), _r(b)] for a, b in zip(starts, lengths)]}
    from .plot import _busy_fraction  # numpy only: plot imports matplotlib when it draws, not before

    edges = np.linspace(0.0, max(span, 1e-3), BINS + 1)
    share = _busy_fraction(np.column_stack([starts, lengths]), edges)
    return {"name": name, "colour": colour, "bins": {"t0": 0.0, "dt": _r(edges[1]),
                                                     "share": [round(float(s), 3) for s in share]}}  # fmt: skip


def _lane(label: str, parts: list, strong: bool = False, key: str | None = None, full: str | None = None) -> dict:
    """A lane: ``label`` on its left (``full``: its tooltip, when longer), ``strong`` in red."""
    return {"label": label, "full": full or label, "parts": [p for p in parts if p is not None], "strong": strong,
            "key": key}


def _points(xs: np.ndarray, ys: list) -> list:
    """[[t, value or None], ...], at most ``MAX_POINTS`` (means over time bins past it)."""
    ys = np.asarray([math.nan if y is None else y for y in ys], float)
    if xs.size > MAX_POINTS:
        edges = np.linspace(xs.min(), xs.max(), MAX_POINTS + 1)
        bins = np.clip(np.searchsorted(edges, xs, side="right") - 1, 0, MAX_POINTS - 1)
        ok = ~np.isnan(ys)
        sums = np.bincount(bins[ok], weights=ys[ok], minlength=MAX_POINTS)
        counts = np.bincount(bins[ok], minlength=MAX_POINTS)
        with np.errstate(invalid="ignore", divide="ignore"):
            ys = np.where(counts > 0, sums / np.maximum(counts, 1), math.nan)
        xs = edges[1:]
    return [[_r(x), None if math.isnan(y) else round(float(y), 2)] for x, y in zip(xs, ys)]


def _series(samples: list[dict], shift: float, keys) -> list[dict]:
    """Each of ``keys`` (sample key, label, colour, scale) present in ``samples`` as a line; times + ``shift``."""
    out = []
    for key, label, colour, scale in keys:
        ys = [s.get(key) if not callable(key) else key(s) for s in samples]
        if all(y is None for y in ys):
            continue
        xs = np.asarray([s["t"] for s in samples], float) + shift
        out.append({"name": label, "colour": colour, "points": _points(xs, [None if y is None else y * scale
                                                                            for y in ys])})  # fmt: skip
    return out


def _loader_parts(rec: LoaderRecord, start: float, span: float, shift: float = 0.0) -> list:
    """A loader's waits (stalls) and steps, as two parts of one lane."""
    asks, returns, step_at, step_len = [], [], [], []
    for ep in rec.epochs:
        n = min(len(ep.asks), len(ep.returns))
        asks += ep.asks[:n]
        returns += ep.returns[:n]
        step_at += ep.returns[: n - 1]
        step_len += [a - r for a, r in zip(ep.asks[1:n], ep.returns[: n - 1])]
    a, r = np.asarray(asks, float) - start + shift, np.asarray(returns, float) - start + shift
    return [_part("input wait (stall)", STALL, a, r - a, span),
            _part("step", COMPUTE, np.asarray(step_at, float) - start + shift, step_len, span)]


def timeline_data(timeline: Timeline) -> dict:
    """What the page's timeline draws for one process: its loaders' lanes (the training loader first), its
    workers' lanes, the GPU and CPU lines, the epochs' starts."""
    start, span = timeline.start, max(timeline.end - timeline.start, 0.0)
    primary = timeline.primary()
    tracks = []
    loaders = sorted(timeline.loaders, key=lambda rec: rec is not primary)
    if loaders:
        lanes = []
        for rec in loaders:
            what = f"loader {rec.id} ({rec.kind}, made at {rec.made_at}, num_workers={rec.num_workers})"
            lanes.append(_lane(f"loader {rec.id} ({rec.kind})", _loader_parts(rec, start, span),
                               strong=rec is primary and len(loaders) > 1, key=f"loader-{rec.id}", full=what))
        title = "the loop: waiting for a batch (stall), then the step"
        if primary is not None:
            title += f"; {'the training loader, ' if len(loaders) > 1 else ''}loader {primary.id}, made at " \
                     f"{primary.made_at}"
        tracks.append({"title": title, "lanes": lanes})
    if primary is not None and any(ep.workers for ep in primary.epochs):
        count = max(len(ep.workers) for ep in primary.epochs)
        lanes = []
        for w in range(count):
            rows = [(end - c - f - start, f + c) for ep in primary.epochs if w < len(ep.workers)
                    for f, c, end in zip(ep.workers[w].fetch, ep.workers[w].collate, ep.workers[w].ends) if end]
            at, length = zip(*rows) if rows else ((), ())
            lanes.append(_lane(f"worker {w}", [_part("worker making a batch", WORKER, at, length, span)]))
        tracks.append({"title": f"loader {primary.id}'s workers: making a batch (fetch + collate)", "lanes": lanes})
    shift = -start
    gpu = _series(timeline.samples, shift, [(k, *SERIES[k], 100) for k in ("gpu_util", "gpu_mem_util")])
    tracks.append({"title": "GPU %" + ("" if gpu else ": no GPU utilisation (NVML unavailable)"), "series": gpu,
                   "ymax": 100})  # fmt: skip
    cpu = _series(timeline.samples, shift, [(k, *SERIES[k], 100) for k in ("cpu_busy", "iowait")])
    tracks.append({"title": f"CPU % ({timeline.cpus} CPUs)", "series": cpu, "ymax": 100})
    if primary is not None and not any(ep.workers for ep in primary.epochs):
        pids = list(dict.fromkeys(p for ep in primary.epochs for p in ep.pids))
        procs = _series(timeline.samples, shift, [
            (lambda s, p=p: (s.get("proc_cpu") or {}).get(str(p)), f"worker pid {p}",
             RANK_COLOURS[i % len(RANK_COLOURS)], 100) for i, p in enumerate(pids)])  # fmt: skip
        if procs:
            tracks.append({"title": "worker processes' CPU (% of a core)", "series": procs, "ymax": None})
    tracks += _memory_tracks(timeline, primary, shift)
    marks = [_r(ep.asks[0] - start) for ep in (primary.epochs if primary else [])[1:] if ep.asks]
    return {"span": _r(span), "xlabel": "seconds since the watch started", "tracks": tracks, "marks": marks}


def _readings(samples: list[dict], key) -> list[dict]:
    """The samples in which ``key(sample)`` was read: memory is read every few ticks, and a line through the
    ticks between would break at each."""
    return [s for s in samples if key(s) is not None]


def _memory_tracks(timeline: Timeline, primary: LoaderRecord | None, shift: float) -> list[dict]:
    """Each worker process's private memory (USS) and the machine's available memory, in MB, as two tracks; none
    when neither was sampled."""
    tracks = []
    pids = list(dict.fromkeys(p for ep in primary.epochs for p in ep.pids)) if primary is not None else []
    series = []
    for i, pid in enumerate(pids):
        def uss(s, pid=str(pid)):
            return (s.get("proc_uss") or {}).get(pid)

        series += _series(_readings(timeline.samples, uss), shift,
                          [(uss, f"worker pid {pid}", RANK_COLOURS[i % len(RANK_COLOURS)], 1 / 2**20)])  # fmt: skip
    if series:
        tracks.append({"title": "memory: each worker's private memory (USS, MB)", "series": series, "ymax": None})
    available = _series(_readings(timeline.samples, lambda s: s.get("mem_available")), shift,
                        [("mem_available", "available", "#7f7f7f", 1 / 2**20)])  # fmt: skip
    if available:
        total = f" of {timeline.mem_total / 2**20:,.0f}" if timeline.mem_total else ""
        tracks.append({"title": f"memory: the machine's available memory (MB{total})", "series": available,
                       "ymax": timeline.mem_total / 2**20 if timeline.mem_total else None})  # fmt: skip
    return tracks


def _drawn(ranks: list[RankRecord], keep: list[int] | None) -> tuple[list[int], int]:
    """The indices in ``ranks`` of those drawn (``keep`` first, then the lowest, ``MAX_LANES`` in all), by rank."""
    order = sorted(range(len(ranks)), key=lambda i: ranks[i].rank)
    kept = set(keep or ())
    chosen = [i for i in order if ranks[i].rank in kept][:MAX_LANES]
    chosen += [i for i in order if ranks[i].rank not in kept][: MAX_LANES - len(chosen)]
    return sorted(chosen, key=lambda i: ranks[i].rank), len(ranks) - len(chosen)


def job_data(ranks: list[RankRecord], splits: list[RankSplit], labels: list[str] | None = None,
             keep: list[int] | None = None, start: float | None = None) -> dict:  # fmt: skip
    """What the page's timeline draws for a job: a lane per rank (input wait, compute, then sync, on rank 0's
    clock, as ``plot.job_png`` draws them), and each rank's GPU busy (CPU busy where no rank has GPU samples)."""
    if start is None:
        start = min((r.timeline.start + r.offset for r in ranks), default=0.0)
    span = max((r.timeline.end + r.offset - start for r in ranks), default=0.0)
    by_rank = {sp.rank: sp for sp in splits}
    drawn, left_out = _drawn(ranks, keep)
    kept = set(keep or ())
    lanes = []
    for i in drawn:
        r, sp = ranks[i], by_rank.get(ranks[i].rank)
        parts = []
        if sp is not None and sp.batches:
            asks, returns = np.asarray(sp.asks, float) - start, np.asarray(sp.returns, float) - start
            computes, syncs = np.asarray(sp.computes, float), np.asarray(sp.syncs, float)
            parts = [_part("input wait (stall)", STALL, asks, returns - asks, span),
                     _part("compute", COMPUTE, returns, computes, span),
                     _part("sync", SYNC, returns + computes, syncs, span)]  # fmt: skip
        full = labels[i] if labels is not None else f"rank {r.rank}"
        short = f"rank {r.rank}" + (f": {sp.shares()['input']:.0%} input" if sp is not None and sp.batches else "")
        lanes.append(_lane(short, parts, strong=r.rank in kept, key=f"rank-{r.rank}", full=full))
    title = "each rank's loop: input wait, then compute, then sync (drawn at the step's end)"
    if left_out:
        title += f"; {left_out} of {len(ranks)} ranks not drawn"
    tracks = [{"title": title, "lanes": lanes}]
    gpu = any(s.get("gpu_util") is not None for i in drawn for s in ranks[i].timeline.samples)
    key, what = ("gpu_util", "GPU busy %") if gpu else ("cpu_busy", "CPU busy %")
    series = []
    for n, i in enumerate(drawn):
        r = ranks[i]
        series += _series(r.timeline.samples, r.offset - start,
                          [(key, f"rank {r.rank}", RANK_COLOURS[n % len(RANK_COLOURS)], 100)])  # fmt: skip
    tracks.append({"title": f"each rank's {what}", "series": series, "ymax": 100})
    return {"span": _r(span), "xlabel": "seconds since the job started (rank 0's clock)", "tracks": tracks,
            "marks": []}  # fmt: skip


# -- the page --------------------------------------------------------------------------------------------------------


def _e(x) -> str:
    return escape("" if x is None else str(x), quote=True)


def _fmt(value, unit: str) -> str:
    from .report import _fmt as fmt

    return fmt(value, unit)


def _num(x, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def _x(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    """A table; ``rows``' cells are markup already escaped."""
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _questions(d: dict) -> str:
    rows = [[str(i), _e(q["question"]), f'<span class="num">{_e(_fmt(q["value"], q["unit"]))}</span>', _e(q["how"])]
            for i, q in enumerate(d["questions"], 1)]  # fmt: skip
    rank = d.get("questions_rank", 0)
    who = f" (rank {rank}'s loop, the rank the verdict is about)" if "job" in d else ""
    return (f'<section id="questions"><h2>The six questions{who}</h2>'
            + _table(["#", "question", "answer", "how it was measured"], rows, "questions") + "</section>")


def _advice(d: dict) -> str:
    job = "job" in d
    advice = d["job"]["advice"] if job else d["advice"]
    whatif = d.get("whatif") or {}
    closing = whatif.get("closing")
    skipped = (whatif.get("skipped") or {}).get("closing")
    if not advice:
        none = ("no rank's input pipeline is what holds this job back" if job
                else "the input pipeline is not what holds this loop back")
        return f'<section id="advice"><h2>Advice</h2><p class="none">None: {_e(none)}.</p></section>'
    rows, tried = [], False
    for a in advice:
        predicted = ("not predicted" if a.get("predicted_gain") is None else
                     f"{_num(a.get('predicted_samples_per_s'))} samples/s ({_x(a['predicted_gain'])})")
        if a.get("predicted_saving_bytes") is not None:  # fastfeed.share: memory, not speed
            predicted = (f"saves {memory.mb(a['predicted_saving_bytes'])} of memory, room for "
                         f"{a.get('more_workers')} more workers")
        if a.get("needs"):  # advice for another machine: what to start, never run here
            measured = f'<span class="muted">not measured here: needs {_e(a["needs"])}</span>'
        elif closing and closing.get("change") == a["change"]:
            measured = (f"<strong>{_num(closing.get('samples_per_s'))} samples/s ({_x(closing.get('gain'))})"
                        "</strong>")
            tried = True
        elif a.get("setting") and not tried and skipped:
            measured = f'<span class="muted">not measured: {_e(skipped)}</span>'
            tried = True
        else:
            measured = '<span class="muted">not measured</span>'
        change = _e(a["change"])
        if job and a.get("rank") is not None:
            change += f'<div class="muted">rank {_e(a["rank"])}\'s loader, applied on every rank</div>'
        rows.append([change, _e(predicted), measured, _e(a["why"])])
    what = "predicted job gain" if job else "predicted"
    return ('<section id="advice"><h2>Advice, best first: predicted against measured</h2>'
            + _table(["change", what, "measured (closing what-if run)", "why"], rows, "advice") + "</section>")


def _memory(d: dict) -> str:
    """The workers' private memory, the machine's headroom and copy-on-read, when memory was sampled."""
    m = d.get("memory")
    whole = (d.get("job") or {}).get("memory")  # a job's: summed over its ranks, above rank 0's own workers
    if not m and not whole:
        return ""
    out = ['<section id="memory"><h2>Memory</h2>']
    out += [f"<p>{_e(line)}</p>" for line in memory.job_lines(whole)]
    if not m:
        return "".join(out) + "</section>"
    rows = [[_e(w["pid"]), _e(memory.mb(w["start_bytes"])), _e(memory.mb(w["end_bytes"])),
             _e(memory.mb(w["peak_bytes"])), f'<span class="num">{_e(memory.mb(w["growth_bytes"]))}</span>']
            for w in m["workers"]]  # fmt: skip
    out += [f"<p>{_e(line)}</p>" for line in memory.lines(m)]
    if rows:
        out.append(_table(["worker pid", "private (USS) at start", "at the end", "peak", "growth"], rows, "memory"))
    out.append("</section>")
    return "".join(out)


def _whatifs(d: dict) -> str:
    whatif = d.get("whatif") or {}
    job = "job" in d
    measured = d["job"]["samples_per_s"] if job else d["steps"]["samples_per_s"]
    runs = [("measured run" + (" (slowest rank's pace, per rank)" if job else ""), measured, "")]
    for key, title in WHATIF_TITLES:
        run = whatif.get(key)
        if run:
            runs.append((title, run.get("samples_per_s"), ""))
    c = whatif.get("closing")
    if c:
        note = (f"predicted {_num(c.get('predicted_samples_per_s'))} samples/s ({_x(c.get('predicted_gain'))}), "
                f"measured {_x(c.get('gain'))}" + ("" if c.get("gain_with_startup") is None else
                                                   f" ({_x(c.get('gain_with_startup'))} with the workers' start-up)"))
        runs.append(((("the job again with " if job else "with ") + c["change"]), c.get("samples_per_s"), note))
    top = max((r[1] or 0.0 for r in runs), default=0.0) or 1.0
    rows = []
    for title, rate, note in runs:
        width = 0.0 if rate is None else max(0.0, min(100.0, 100.0 * rate / top))
        bar = f'<div class="bar"><div style="width:{width:.1f}%"></div></div>'
        rows.append([_e(title), f'<span class="num">{_e(_num(rate))}</span>', bar, _e(note)])
    out = ['<section id="whatif"><h2>What-if runs (samples/s)</h2>',
           _table(["run", "samples/s", "", "predicted against measured"], rows, "whatif")]
    skipped = whatif.get("skipped") or {}
    if skipped:
        out.append("<ul class=\"skipped\">" + "".join(f"<li>{_e(k)}: not run ({_e(why)})</li>"
                                                     for k, why in skipped.items()) + "</ul>")  # fmt: skip
    if not whatif or set(whatif) == {"skipped"} and not skipped:
        out.append('<p class="none">No what-if run (--no-whatif, or a report from watch()).</p>')
    out.append("</section>")
    return "".join(out)


def _ranks(d: dict) -> str:
    if "ranks" not in d:
        return ""
    stragglers = set(d["job"].get("stragglers") or ())
    rows = []
    for r in d["ranks"]:
        s = r["shares"]
        rank = _e(r["rank"]) + (' <span class="tag">straggler</span>' if r["rank"] in stragglers else "")
        rows.append([rank, _e(r["host"]), _e(r["local_rank"]), f"{s['input']:.0%}", f"{s['sync']:.0%}",
                     f"{s['compute']:.0%}", _e(_num(r["samples_per_s"])), _e(ms(r["step_p50_s"])),
                     _e(r["verdict"]["line"].removeprefix("verdict: "))
                     + ("" if not r.get("error") else f'<div class="bad">ended with {_e(r["error"])}</div>')])
    job = d["job"]
    head = (f"<p>{_e(job['world'])} ranks, {_e(_num(job['samples_per_s']))} samples/s per rank at the slowest "
            f"rank's pace, step {_e(ms(job['step_s']))} (collectives {_e(ms(job['collectives_s']))} of it)</p>")
    return ('<section id="ranks"><h2>Ranks</h2>' + head
            + _table(["rank", "host", "local rank", "input", "sync", "compute", "samples/s", "step p50", "verdict"],
                     rows, "ranks") + "</section>")  # fmt: skip


def _json_for_script(data) -> str:
    """JSON that is safe inside ``<script>``: no ``<``, ``>`` or ``&`` (``</script>`` in a name ends nothing)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, default=str)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def page(d: dict, text: str, timeline: dict) -> str:
    """The page: ``d`` (a report's ``to_dict()``), ``text`` (its ``summary``), ``timeline`` (``timeline_data``
    or ``job_data``)."""
    job = "job" in d
    verdict = (d["job"] if job else d)["verdict"]["line"]
    command = " ".join(str(c) for c in d.get("command") or [])
    sub = f"fastfeed {d.get('fastfeed', '')}" + (f" · {command}" if command else "")
    body = [
        f'<p id="verdict" class="verdict sev-{_e((d["job"] if job else d)["verdict"]["severity"])}">{_e(verdict)}</p>',
        f'<p id="about" class="sub">fastfeed doctor report · {_e(sub)}</p>',
        _ranks(d),
        '<section id="timeline"><h2>Timeline</h2>'
        '<div class="controls"><button type="button" data-zoom="in">zoom in</button>'
        '<button type="button" data-zoom="out">zoom out</button><button type="button" data-zoom="reset">reset'
        '</button><span id="ff-range" class="muted"></span><span id="ff-at" class="muted"></span></div>'
        '<div id="ff-legend" class="legend"></div><div id="ff-chart" class="chart"></div>'
        '<p class="muted hint">Wheel (or the buttons) to zoom around the pointer, drag to pan, double-click to '
        "reset.</p></section>",
        _questions(d),
        _memory(d),
        _advice(d),
        _whatifs(d),
        f'<section id="text"><details><summary>The text report</summary><pre>{_e(text)}</pre></details></section>',
    ]
    title = "fastfeed doctor: " + verdict.removeprefix("verdict: ")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_e(title)}</title>'
            f"<script>{_ERRORS}</script><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(part for part in body if part)
            + f'\n<script type="application/json" id="ff-data">{_json_for_script(timeline)}</script>'
            + f"\n<script>{_JS}</script>\n</body></html>\n")


# The first script of the page: any later error lands on <html data-errors>, for a headless browser's dump.
_ERRORS = """
(function(){var n=0;function note(m){n+=1;var r=document.documentElement;r.setAttribute('data-errors',String(n));
r.setAttribute('data-error',String(m).slice(0,300));}
window.addEventListener('error',function(e){note(e.message||'error');});
window.addEventListener('unhandledrejection',function(e){note('unhandled rejection: '+(e.reason||''));});})();
"""

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1400px;
padding:16px 24px;color:#222;background:#fff}
.verdict{font-size:20px;font-weight:600;margin:4px 0 2px;padding:10px 14px;border-left:6px solid #888;
background:#f6f6f6}
.verdict.sev-highly{border-color:#d62728;background:#fdeeee}.verdict.sev-moderately{border-color:#ff7f0e;
background:#fff5ea}.verdict.sev-not{border-color:#2ca02c;background:#eef8ee}
.sub,.muted{color:#666}.sub{margin:0 0 12px;font-size:12px;word-break:break-all}
h2{font-size:16px;margin:22px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
table{border-collapse:collapse;width:100%}th,td{text-align:left;vertical-align:top;padding:4px 8px;
border-bottom:1px solid #eee}th{font-weight:600;background:#fafafa}.num{font-variant-numeric:tabular-nums;
font-weight:600;white-space:nowrap}
.bar{background:#f0f0f0;width:220px;height:12px}.bar div{background:#1f77b4;height:12px}
.tag{background:#d62728;color:#fff;border-radius:3px;padding:0 4px;font-size:11px}.bad{color:#d62728}
.controls button{margin-right:6px;font:inherit;padding:2px 10px}.controls span{margin-left:12px;font-size:12px}
.legend{margin:6px 0;font-size:12px}.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px}
.chart{width:100%;border:1px solid #ddd;cursor:grab;user-select:none;touch-action:none}
.chart.dragging{cursor:grabbing}.chart svg{display:block}.hint{font-size:12px;margin:4px 0}
pre{white-space:pre-wrap;font-size:12px;background:#f8f8f8;padding:10px}
ul.skipped{color:#666;font-size:13px}
"""

_JS = r"""
(function(){
'use strict';
var D=JSON.parse(document.getElementById('ff-data').textContent);
var NS='http://www.w3.org/2000/svg';
var chart=document.getElementById('ff-chart');
var LEFT=170,RIGHT=12,LANE=20,TITLE=18,SERIES=90,AXIS=40,GAP=8;
var span=Math.max(D.span,1e-3),v0=0,v1=span,W=800;
function el(name,attrs,parent){var e=document.createElementNS(NS,name);for(var k in attrs){e.setAttribute(k,attrs[k]);}
  if(parent){parent.appendChild(e);}return e;}
function txt(s,attrs,parent){var e=el('text',attrs,parent);e.textContent=s;return e;}
function X(t){return LEFT+(t-v0)/(v1-v0)*W;}
function lowerBound(spans,t){var lo=0,hi=spans.length;while(lo<hi){var m=(lo+hi)>>1;
  if(spans[m][0]<t){lo=m+1;}else{hi=m;}}return lo;}
function fmt(t,step){var d=Math.max(0,Math.min(6,-Math.floor(Math.log10(step))));return t.toFixed(d);}
function niceStep(range){var raw=range/8,p=Math.pow(10,Math.floor(Math.log10(raw))),f=raw/p;
  return (f<1.5?1:f<3.5?2:f<7.5?5:10)*p;}
// the longest spell of each part, for the search that finds the first spell in view
D.tracks.forEach(function(tr){(tr.lanes||[]).forEach(function(l){l.parts.forEach(function(p){
  if(p.spans){var m=0;p.spans.forEach(function(s){if(s[1]>m){m=s[1];}});p.longest=m;}});});});
function legend(){var box=document.getElementById('ff-legend'),seen={};
  D.tracks.forEach(function(tr){(tr.lanes||[]).forEach(function(l){l.parts.forEach(function(p){
    if(seen[p.name]){return;}seen[p.name]=1;var s=document.createElement('span'),i=document.createElement('i');
    i.style.background=p.colour;s.appendChild(i);s.appendChild(document.createTextNode(p.name));
    box.appendChild(s);});});});
}
function height(){var h=AXIS;
  D.tracks.forEach(function(tr){h+=TITLE+(tr.lanes?tr.lanes.length*LANE:SERIES)+GAP;});return h;}
function drawLane(g,lane,y){
  var foot=null;
  lane.parts.forEach(function(p){
    if(p.spans){var s=p.spans,i=lowerBound(s,v0-p.longest),lastPx=-1;
      for(;i<s.length&&s[i][0]<=v1;i++){var a=X(s[i][0]),b=X(s[i][0]+s[i][1]);if(b<LEFT){continue;}
        a=Math.max(a,LEFT);b=Math.min(b,LEFT+W);var w=b-a;
        if(w<1){if(Math.floor(a)===lastPx){continue;}lastPx=Math.floor(a);w=1;}
        el('rect',{x:a.toFixed(2),y:y+2,width:w.toFixed(2),height:LANE-4,fill:p.colour},g);}
    }else if(p.bins){var b=p.bins,n=b.share.length;if(!foot){foot=new Array(n).fill(0);}
      var i0=Math.max(0,Math.floor((v0-b.t0)/b.dt)),i1=Math.min(n,Math.ceil((v1-b.t0)/b.dt));
      for(var k=i0;k<i1;k++){var sh=b.share[k];if(sh<=0){continue;}var h=sh*(LANE-4);
        var xa=Math.max(X(b.t0+k*b.dt),LEFT),xb=Math.min(X(b.t0+(k+1)*b.dt),LEFT+W);
        el('rect',{x:xa.toFixed(2),y:(y+LANE-2-foot[k]-h).toFixed(2),width:Math.max(xb-xa,0.5).toFixed(2),
          height:h.toFixed(2),fill:p.colour},g);foot[k]+=h;}}
  });
}
function drawSeries(g,tr,y){
  var top=tr.ymax;if(!top){top=1;tr.series.forEach(function(s){s.points.forEach(function(p){
    if(p[1]!==null&&p[1]>top){top=p[1];}});});top*=1.05;}
  var h=SERIES-6;function Y(v){return y+h-v/top*h+3;}
  el('line',{x1:LEFT,x2:LEFT+W,y1:Y(0),y2:Y(0),stroke:'#ccc'},g);
  txt(String(Math.round(top)),{x:LEFT-4,y:Y(top)+8,'text-anchor':'end','font-size':10,fill:'#888'},g);
  txt('0',{x:LEFT-4,y:Y(0),'text-anchor':'end','font-size':10,fill:'#888'},g);
  if(!tr.series.length){txt('no data',{x:LEFT+W/2,y:y+SERIES/2,'text-anchor':'middle',fill:'#999'},g);return;}
  tr.series.forEach(function(s){var d='',down=false,pts=s.points;
    for(var i=0;i<pts.length;i++){var t=pts[i][0],v=pts[i][1],from=i>0?pts[i-1][0]:t-0.1;
      if(from>v1){break;}
      if(v===null||t<v0){down=false;continue;}
      var yv=Y(v).toFixed(1);
      if(down){d+='V'+yv;}else{d+='M'+X(Math.max(from,v0)).toFixed(1)+' '+yv;}
      d+='H'+X(Math.min(t,v1)).toFixed(1);down=true;}
    if(d){el('path',{d:d,fill:'none',stroke:s.colour,'stroke-width':1.3},g);}});
  tr.series.forEach(function(s,k){if(k>=6){return;}txt(s.name,{x:8,y:y+12+k*12,'font-size':10,fill:s.colour},g);});
  if(tr.series.length>6){txt('and '+(tr.series.length-6)+' more',{x:8,y:y+12+6*12,'font-size':10,fill:'#888'},g);}
}
function render(){
  W=Math.max(200,chart.clientWidth-LEFT-RIGHT);
  while(chart.firstChild){chart.removeChild(chart.firstChild);}
  var H=height(),svg=el('svg',{width:LEFT+W+RIGHT,height:H,'font-size':11,'font-family':'system-ui,sans-serif'});
  chart.appendChild(svg);
  var clip=el('clipPath',{id:'ff-clip'},el('defs',{},svg));el('rect',{x:LEFT,y:0,width:W,height:H},clip);
  var y=4,step=niceStep(v1-v0),grid=el('g',{},svg);
  D.tracks.forEach(function(tr){
    txt(tr.title,{x:4,y:y+12,'font-weight':600,'font-size':12},svg);y+=TITLE;
    var g=el('g',{'clip-path':'url(#ff-clip)',class:'ff-track'},svg);
    if(tr.lanes){tr.lanes.forEach(function(lane){
      var lg=el('g',{class:'ff-lane','data-lane':lane.key||lane.label},g);
      el('rect',{x:LEFT,y:y+1,width:W,height:LANE-2,fill:'#fafafa'},lg);
      var label=lane.label.length>26?lane.label.slice(0,25)+'\u2026':lane.label;
      var t=txt(label,{x:LEFT-6,y:y+LANE/2+4,'text-anchor':'end',fill:lane.strong?'#d62728':'#333',
        'font-weight':lane.strong?600:400},svg);
      el('title',{},t).textContent=lane.full;
      drawLane(lg,lane,y);y+=LANE;});}
    else{drawSeries(el('g',{class:'ff-series'},svg),tr,y);y+=SERIES;}
    y+=GAP;});
  for(var t=Math.ceil(v0/step)*step;t<=v1;t+=step){var x=X(t);
    el('line',{x1:x,x2:x,y1:0,y2:y,stroke:'#eee'},grid);
    txt(fmt(t,step),{x:x,y:y+12,'text-anchor':'middle','font-size':10,fill:'#555'},svg);}
  (D.marks||[]).forEach(function(m){if(m>=v0&&m<=v1){var x=X(m);
    el('line',{x1:x,x2:x,y1:0,y2:y,stroke:'#999','stroke-dasharray':'3,3'},svg);}});
  txt(D.xlabel,{x:LEFT+W/2,y:y+24,'text-anchor':'middle','font-size':11,fill:'#555'},svg);
  document.getElementById('ff-range').textContent='showing '+fmt(v0,step/10)+' to '+fmt(v1,step/10)+' s of '+
    fmt(span,niceStep(span)/10)+' s';
}
function zoom(f,at){var t=at===undefined?(v0+v1)/2:at,w=Math.min(span,Math.max((v1-v0)*f,1e-6));
  var a=t-(t-v0)*w/(v1-v0);a=Math.max(0,Math.min(a,span-w));v0=a;v1=a+w;render();}
function timeAt(ev){var r=chart.getBoundingClientRect();return v0+(ev.clientX-r.left-LEFT)/W*(v1-v0);}
chart.addEventListener('wheel',function(ev){ev.preventDefault();
  zoom(ev.deltaY>0?1.25:0.8,Math.max(v0,Math.min(v1,timeAt(ev))));},{passive:false});
var drag=null;
chart.addEventListener('mousedown',function(ev){drag={x:ev.clientX,a:v0,b:v1};chart.classList.add('dragging');});
window.addEventListener('mouseup',function(){drag=null;chart.classList.remove('dragging');});
window.addEventListener('mousemove',function(ev){
  if(drag){var d=(ev.clientX-drag.x)/W*(drag.b-drag.a),w=drag.b-drag.a;
    var a=Math.max(0,Math.min(drag.a-d,span-w));if(a!==v0){v0=a;v1=a+w;render();}}
  var r=chart.getBoundingClientRect();if(ev.clientX>=r.left+LEFT&&ev.clientX<=r.right&&ev.clientY>=r.top&&
    ev.clientY<=r.bottom){document.getElementById('ff-at').textContent='pointer at '+timeAt(ev).toFixed(4)+' s';}});
chart.addEventListener('dblclick',function(){v0=0;v1=span;render();});
document.querySelectorAll('button[data-zoom]').forEach(function(b){b.addEventListener('click',function(){
  var k=b.getAttribute('data-zoom');
  if(k==='in'){zoom(0.5);}else if(k==='out'){zoom(2);}else{v0=0;v1=span;render();}});});
window.addEventListener('resize',render);
legend();render();
var v=document.getElementById('verdict'),cs=window.getComputedStyle(v);
document.documentElement.setAttribute('data-verdict-visible',
  (cs.display!=='none'&&cs.visibility!=='hidden'&&v.getBoundingClientRect().height>0)?'yes':'no');
document.documentElement.setAttribute('data-rendered',String(chart.querySelectorAll('.ff-lane').length));
})();
"""

