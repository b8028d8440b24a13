"""A ``fastfeed bench`` report: one JSON file per run, its CSV, markdown for a README, and two reports compared.

The report (schema ``fastfeed.bench/1``) keeps each workload's full result (every trial's record) under
its name with its kind (see ``standard``), plus the machine as ``fastfeed info`` describes it, the versions
and the exact command. Figures are ratios to torch measured in the same run, so two reports compare by their
ratios: the same code on a noisier machine moves both sides.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from pathlib import Path

from .._atomic import write_atomic
from .summary import fmt

SCHEMA = "fastfeed.bench/1"
COSTS = ("main_cpu_s", "tree_cpu_s", "peak_footprint", "ttfb", "ttfb_hot")  # lower is better
GAINS = ("throughput", "order_time", "order_memory")  # higher is better (order_*: whole order over window)


def assemble(workloads: dict, command: str) -> dict:
    """The report of one run: ``workloads`` is ``{name: {"kind", "result"}}``."""
    import numpy
    import torch

    from .. import __version__, info

    return portable({
        "schema": SCHEMA,
        "command": command,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info.report(),
        "versions": {"fastfeed": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
                     "python": platform.python_version(), "platform": platform.platform()},
        "workloads": workloads,
    })  # fmt: skip


def portable(obj, cwd: str | None = None):
    """``obj`` with this machine's paths made relative: to the working directory, to the checkout fastfeed runs
    from, or to ``~``, so that a report can be committed or shared without naming anyone's directories."""
    import fastfeed

    prefixes = [(os.path.abspath(cwd or os.getcwd()) + os.sep, ""),
                (os.path.dirname(os.path.dirname(os.path.abspath(fastfeed.__file__))) + os.sep, ""),
                (os.path.expanduser("~") + os.sep, "~" + os.sep)]  # fmt: skip

    def fix(value):
        if isinstance(value, str):
            for prefix, short in prefixes:
                value = value.replace(prefix, short)
            return value
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value

    return fix(obj)


def load(path) -> dict:
    with open(path) as f:
        report = json.load(f)
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a fastfeed bench report (schema {SCHEMA}); the scripts under benchmarks/ "
                         "write their own JSON, fastfeed bench --out writes reports")  # fmt: skip
    return report


def save(report: dict, out: Path) -> tuple[Path, Path]:
    """``bench-<time>.json`` (the report) and ``.csv`` (one row per workload, ratio and figure) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while stem.with_suffix(".json").exists():
        n += 1
        stem = out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    json_path, csv_path = stem.with_suffix(".json"), stem.with_suffix(".csv")
    write_atomic(json_path, (json.dumps(report, indent=1, default=str) + "\n").encode())
    rows = list(figure_rows(report))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["workload", "key", "figure", "median", "min", "max", "numerator",
                                               "denominator", "unit"])  # fmt: skip
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path


def figure_rows(report: dict):
    """Every figure of every workload as flat rows: ``median``/``min``/``max`` are ratios, numerator and
    denominator the absolute medians."""
    for name, entry in report["workloads"].items():
        res = entry["result"]
        if entry["kind"] == "comparison":
            for key, figs in res["summary"].items():
                for fig, st in figs.items():
                    yield dict(workload=name, key=key, figure=fig, median=st["median"], min=st["min"], max=st["max"],
                               numerator=st["candidate"], denominator=st["baseline"], unit=st["unit"])  # fmt: skip
        elif entry["kind"] == "files":
            for key, figs in res.items():
                sides = [("readahead", figs.get("readahead")), ("cached", figs.get("cached"))] if key != "tokens" \
                    else [("arrayfiles", figs)]  # fmt: skip
                for side, st in sides:
                    if st:
                        num = st.get("files_per_s", st.get("fastfeed"))
                        den = figs["torch"]["files_per_s"] if key != "tokens" else figs["torch"]
                        yield dict(workload=name, key=f"{key} {side}", figure="throughput", median=st["ratio"],
                                   min=st["min"], max=st["max"], numerator=num, denominator=den,
                                   unit="files/s" if key != "tokens" else "windows/s")
        elif entry["kind"] == "shards":
            yield from _shards_rows(name, res)
        elif entry["kind"] == "shards_scale":
            for row in res["rows"]:
                for fig, key, unit in (("order_time", "first_s", "s"), ("order_memory", "peak_bytes", "bytes")):
                    if "whole_over_window" in row:  # how many times less the window order costs than the whole
                        yield dict(workload=name, key=f"order {row['samples']:,} samples", figure=fig,
                                   median=row["whole_over_window"][key], min=None, max=None,
                                   numerator=row["whole"][key], denominator=row["window"][key], unit=unit)
        elif entry["kind"] == "ray":
            yield from _ray_rows(name, res)
        elif entry["kind"] == "memory":
            for key, st in res["summary"].items():
                torch_key = key.split(" ")[0] + " torch"
                yield dict(workload=name, key=key, figure="workers_peak_uss", median=st["uss_over_torch"], min=None,
                           max=None, numerator=st["peak_uss_mb"], denominator=res["summary"][torch_key]["peak_uss_mb"],
                           unit="MB")  # fmt: skip
            for rk in res.get("ranks", []):
                yield dict(workload=name, key=f"{rk['ranks']} ranks {'share' if rk['shared'] else 'no share'}",
                           figure="pss_over_one_copy", median=rk["over_one_copy"], min=None, max=None,
                           numerator=rk["pss_summed"] / 1e6, denominator=rk["one_copy"] / 1e6, unit="MB")
        elif entry["kind"] == "tune":
            for row in res["rows"]:
                # Over the tuner's runs (quality, time: min, median, max); rows from before they were kept hold
                # the worst run's figures alone.
                pairs = (("throughput", "quality", "throughput_ratio"), ("tune_time", "time", "time_ratio"))
                for fig, stats, worst in pairs:
                    st = row.get(stats) or {"median": row[worst], "min": None, "max": None}
                    yield dict(workload=name, key=row["workload"], figure=fig, median=st["median"], min=st["min"],
                               max=st["max"], numerator=None, denominator=None, unit="x grid")


def _shards_rows(name: str, res: dict):
    """The shards workload's figures: fastfeed over each peer (throughput, first batch) per storage, resumed over
    started (time to first batch) per loader, and epoch 2's downloads over the ideal ``data - cache`` per cache."""
    for storage in ("http", "local"):
        part = res.get(storage) or {}
        mine = (part.get("loaders") or {}).get("fastfeed")
        for peer, figs in (part.get("vs") or {}).items():
            theirs = part["loaders"][peer]
            for fig, key, unit in (("throughput", "samples_per_s", "samples/s"), ("ttfb", "ttfb_s", "s")):
                st = figs[fig]
                yield dict(workload=name, key=f"{storage} fastfeed/{peer}", figure=fig, median=st["median"],
                           min=st["min"], max=st["max"], numerator=mine[key], denominator=theirs[key], unit=unit)
    for loader, figs in (res.get("resume") or {}).items():
        if isinstance(figs, dict):
            st = figs["ratio"]
            yield dict(workload=name, key=f"resume {loader}", figure="resume_ttfb", median=st["median"],
                       min=st["min"], max=st["max"], numerator=figs["resume_ttfb_s"],
                       denominator=figs["start_ttfb_s"], unit="s")
    cache = res.get("cache") or {}
    for side in ("fastfeed", "lru", "belady", "mosaic", "webdataset"):
        figs = cache.get(side)
        if figs and figs.get("epoch2_bytes") is not None:
            ideal = figs.get("ideal_bytes", cache["ideal_bytes"])
            yield dict(workload=name, key=f"cache {side}", figure="epoch2_bytes", median=figs["epoch2_bytes"] / ideal,
                       min=None, max=None, numerator=figs["epoch2_bytes"], denominator=ideal, unit="bytes")


# --- markdown -------------------------------------------------------------------------------


def markdown(report: dict, names=None) -> str:
    """README-ready tables for ``names`` (default: every workload in the report), one per workload."""
    names = list(names or report["workloads"])
    missing = [n for n in names if n not in report["workloads"]]
    if missing:
        raise ValueError(f"the report has no workload {missing}; it has {sorted(report['workloads'])}")
    return "\n\n".join(_table(n, report["workloads"][n]) for n in names)


def _table(name: str, entry: dict) -> str:
    if entry["kind"] == "files":
        return _files_table(entry["result"])
    if entry["kind"] == "shards":
        return shards_markdown(entry["result"])
    if entry["kind"] == "shards_scale":
        from .suites.shards_scale import markdown as scale_markdown

        return scale_markdown(entry["result"])
    if entry["kind"] == "ray":
        return ray_markdown(entry["result"])
    if entry["kind"] == "memory":
        from .suites.memory import markdown as memory_markdown

        return memory_markdown(entry["result"])
    if entry["kind"] == "tune":
        from .suites.tune import markdown as tune_markdown

        return tune_markdown(entry["result"]["rows"])
    return _comparison_table(name, entry["result"])


def _ratio(st: dict | None, bold: bool = False) -> str:
    if not st or st.get("median") is None:
        return "-"
    text = f"{st['median']:.2f}x"
    text = f"**{text}**" if bold else text
    return text + (f" ({st['min']:.2f}-{st['max']:.2f})" if st.get("min") is not None else "")


def _abs(value, unit: str) -> str:
    return "-" if value is None else f"{fmt(value)} {unit}"


def _comparison_table(name: str, res: dict) -> str:
    """One row per loader against torch: throughput (ratio and both sides), whole-tree CPU, footprint, first batch."""
    pairs = res.get("pairs", {})
    rows = [(k, p) for k, p in pairs.items() if p["den"] == "torch"]
    summary = res["summary"]
    hot = any(summary[k].get("ttfb_hot", {}).get("median") is not None for k, _ in rows)
    stall = any(summary[k].get("stall", {}).get("candidate") is not None for k, _ in rows)
    head = ["comparison", "loader", "throughput / torch", "loader's throughput", "torch's", "CPU, whole tree / torch",
            "peak footprint / torch", "first batch / torch"] + (["first batch, later epochs / torch"] if hot else []) \
        + (["stall: loader / torch"] if stall else [])  # fmt: skip
    lines = [f"**{name}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, pair in rows:
        figs = summary[key]
        tput = figs["throughput"]
        cells = [pair["comparison"], pair["num"], _ratio(tput, bold=True), _abs(tput["candidate"], tput["unit"]),
                 _abs(tput["baseline"], tput["unit"]), _ratio(figs.get("tree_cpu_s")),
                 _ratio(figs.get("peak_footprint")), _ratio(figs.get("ttfb"))]  # fmt: skip
        if hot:
            cells.append(_ratio(figs.get("ttfb_hot")))
        if stall:
            st = figs.get("stall") or {}
            cells.append(f"{_abs(st.get('candidate'), '%')} / {_abs(st.get('baseline'), '%')}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _files_table(res: dict) -> str:
    lines = ["**files**", "", "| workload | torch | read-ahead / torch | cached (epoch 2) / torch |",
             "|---|---|---|---|"]
    for key in ("http", "local"):
        figs = res.get(key)
        if figs:
            t = figs["torch"]
            cells = [key, f"{fmt(t['files_per_s'])} files/s ({fmt(t['mb_per_s'])} MB/s)"]
            for side in ("readahead", "cached"):
                st = figs[side]
                cells.append(f"**{st['ratio']:.2f}x** ({st['min']:.2f}-{st['max']:.2f}), "
                             f"{fmt(st['files_per_s'])} files/s")
            lines.append("| " + " | ".join(cells) + " |")
    tk = res.get("tokens")
    if tk:
        lines.append(f"| tokens (ArrayFiles vs np.memmap) | {fmt(tk['torch'])} windows/s | **{tk['ratio']:.2f}x** "
                     f"({tk['min']:.2f}-{tk['max']:.2f}), {fmt(tk['fastfeed'])} windows/s | - |")
    return "\n".join(lines)


# --- two reports compared ----------------------------------------------------------------------


def compare(old: dict, new: dict, threshold: float) -> tuple[list[str], list[str]]:
    """Lines of ``new``'s ratios over ``old``'s for every figure both have, and the regressions among them.

    A throughput ratio to torch that fell by more than ``threshold``, or a cost ratio (CPU, footprint, time
    to first batch) that rose by more, is a regression.
    """
    a = {(r["workload"], r["key"], r["figure"]): r for r in figure_rows(old)}
    b = {(r["workload"], r["key"], r["figure"]): r for r in figure_rows(new)}
    lines, regressions = [], []
    for k in [k for k in b if k in a]:
        was, now = a[k]["median"], b[k]["median"]
        fig = k[2]
        if not was or now is None or fig not in GAINS + COSTS:
            continue
        change = now / was
        worse = change < 1 - threshold if fig in GAINS else change > 1 + threshold
        line = f"{k[0]:<10} {k[1]:<34} {fig:<15} {was:6.2f}x -> {now:6.2f}x  = {change:.2f}" + \
            ("  REGRESSION" if worse else "")  # fmt: skip
        lines.append(line)
        if worse:
            regressions.append(line)
    return lines, regressions


def print_lines(lines, file=None) -> None:
    # None: the sys.stdout of the call (print's own default), not the one bound when this module was imported.
    for line in lines:
        print(line, file=file)


# --- shards ------------------------------------------------------------------------------------------------------

SHARD_LOADERS = {"fastfeed": "fastfeed.io.Shards", "webdataset": "webdataset", "mosaic": "Mosaic StreamingDataset"}


def _mb(n: float) -> str:
    return f"{fmt(n / 1e6)} MB"


def shards_markdown(res: dict) -> str:
    """The shards workload's tables: throughput and first batch per storage and loader, resume, cache."""
    lines = ["**shards**", "", "| storage | loader | samples/s | fastfeed / this, samples/s | first batch | "
             "fastfeed / this, first batch |", "|---|---|---|---|---|---|"]  # fmt: skip
    for storage in ("http", "local"):
        part = res.get(storage)
        for loader, figs in (part or {}).get("loaders", {}).items():
            vs = part["vs"].get(loader, {})
            lines.append(f"| {storage} | {SHARD_LOADERS[loader]} | {fmt(figs['samples_per_s'])} "
                         f"({fmt(figs['mb_per_s'])} MB/s) | {_ratio(vs.get('throughput'), bold=True)} | "
                         f"{fmt(figs['ttfb_s'] * 1e3)} ms | {_ratio(vs.get('ttfb'))} |")
    resume = res.get("resume")
    if resume:
        lines += ["", "| loader (http) | first batch, epoch start | first batch, resumed at 50% | resumed / start | "
                  "resumed batch = the stopped run's next |", "|---|---|---|---|---|"]  # fmt: skip
        for loader, figs in resume.items():
            if isinstance(figs, dict):
                same = {True: "yes", False: "no"}.get(figs.get("exact"), "-")
                lines.append(f"| {SHARD_LOADERS[loader]} | {fmt(figs['start_ttfb_s'] * 1e3)} ms | "
                             f"{fmt(figs['resume_ttfb_s'] * 1e3)} ms | {_ratio(figs['ratio'], bold=True)} | {same} |")
            else:
                lines.append(f"| {SHARD_LOADERS[loader]} | - | {figs} | - | - |")
    cache = res.get("cache")
    if cache:
        lines += ["", "| epoch 2's downloads (http), data 2x the cache | downloaded | / (data - cache) |",
                  "|---|---|---|"]
        names = {"fastfeed": "fastfeed.io.Shards (farthest next use)", "lru": "LRU", "belady": "Belady",
                 "mosaic": "Mosaic StreamingDataset (cache_limit)", "webdataset": "webdataset (no cache)"}
        for side, label in names.items():
            figs = cache.get(side)
            if not figs:
                continue
            how = figs.get("how")
            label = f"{label}: {how}" if how else label
            if figs.get("epoch2_bytes") is None:
                lines.append(f"| {label} | {figs.get('error', 'no figure')} | - |")
                continue
            ideal = figs.get("ideal_bytes", cache["ideal_bytes"])
            lines.append(f"| {label} | {_mb(figs['epoch2_bytes'])} | **{figs['epoch2_bytes'] / ideal:.2f}x** |")
        mosaic = cache.get("mosaic")
        lines.append("")
        lines.append(f"Data {_mb(cache['data_bytes'])} of tar shards, cache {_mb(cache['cache_bytes'])}"
                     + (f"; Mosaic's MDS {_mb(mosaic['data_bytes'])}, cache_limit {_mb(mosaic['cache_bytes'])}"
                        if mosaic else "") + ".")
    return "\n".join(lines)


# --- ray ---------------------------------------------------------------------------------------------------------


def _overhead_rows(over: dict):
    """The overhead part's Ray rows: ``(key, label, figures)``; figures hold their ``vs`` the same round's processes.

    One row per path (``rows``, keyed ``overhead ray <path>/process``); a report from before the paths has one Ray
    row, through the object store (``ray``, keyed ``overhead ray/process``), which still reads."""
    if "rows" not in over:
        yield "overhead ray/process", 'worker_type="ray"', dict(over["ray"], vs=over["vs"])
        return
    for row in over["rows"].values():
        env = row.get("path_env", "auto")
        label = f'worker_type="ray" on {row["where"]}' + ("" if env == "auto" else f", FASTFEED_RAY_PATH={env}")
        # The object store's row keeps the old single row's key, so --compare pairs it with a report from before.
        key = "overhead ray/process" if row["path"] == "object store" else f"overhead ray {row['path']}/process"
        yield key, label, row


def _taken(recs) -> str:
    """The paths the workers of ``recs`` (trial records) took, each once in order; "-" where none was recorded."""
    return ", ".join(dict.fromkeys(p for rec in recs for p in rec.get("worker_paths", ()))) or "-"


def _ray_rows(name: str, res: dict):
    """The ray workload's figures: Ray actors on each path over worker processes (GB/s, loop CPU per batch), each
    actor count's batches/s over its ideal (capped by the receive rate), and local plus remote over local alone."""
    over = res.get("overhead")
    if over:
        for key, _, figs in _overhead_rows(over):
            for fig, field, unit, vs in (("throughput", "gb_per_s", "GB/s", "throughput"),
                                         ("main_cpu_s", "main_cpu_ms_per_batch", "ms", "main_cpu"),
                                         ("loop_cpu_s", "loop_cpu_ms_per_batch", "ms", "loop_cpu")):  # fmt: skip
                st = figs["vs"].get(vs)
                if st is None:  # a report from before the loop's own thread was measured
                    continue
                yield dict(workload=name, key=key, figure=fig, median=st["median"], min=st["min"], max=st["max"],
                           numerator=figs[field]["median"], denominator=over["process"][field]["median"],
                           unit=unit)  # fmt: skip
    for row in (res.get("scaling") or {}).get("rows", []):
        st = row["vs_capped"]
        yield dict(workload=name, key=f"scaling {row['actors']} actors", figure="throughput_vs_ideal",
                   median=st["median"], min=st["min"], max=st["max"], numerator=row["batches_per_s"]["median"],
                   denominator=row["capped_ideal_batches_per_s"], unit="batch/s")  # fmt: skip
    mixed = res.get("mixed")
    if mixed:
        base = mixed["loaders"][f"process {mixed['local']}"]["batches_per_s"]["median"]
        for side, st in mixed["vs"].items():
            yield dict(workload=name, key=f"mixed {side} / process {mixed['local']}", figure="throughput",
                       median=st["median"], min=st["min"], max=st["max"],
                       numerator=mixed["loaders"][side]["batches_per_s"]["median"], denominator=base, unit="batch/s")


def _range(st: dict, scale: float = 1.0, digits: int = 2) -> str:
    return f"{st['median'] * scale:.{digits}f} ({st['min'] * scale:.{digits}f}-{st['max'] * scale:.{digits}f})"


def _overhead_lines(over: dict) -> list[str]:
    """The overhead part's table: GB/s over processes (and the stream's over bare loopback TCP), and CPU per batch
    of the loop's own thread and of its whole process (Ray's threads and the stream's readers included). A report
    from before the loop's thread was measured has the process's CPU only, with each row's over processes'."""
    thread = "loop_cpu_ms_per_batch" in over["process"]

    def cpu(figs: dict, ray: bool) -> str:
        if thread:
            return f"{_range(figs['loop_cpu_ms_per_batch'])} ms | {_range(figs['main_cpu_ms_per_batch'])} ms"
        return f"{_range(figs['main_cpu_ms_per_batch'])} ms | " + (_ratio(figs["vs"]["main_cpu"], bold=True) if ray
                                                                   else "-")  # fmt: skip

    cpu_head = "loop thread CPU per batch | process CPU per batch" if thread else "loop CPU per batch | / process"
    lines = ["", f"| {fmt(over['batch_bytes'] / 1e6)} MB batches, nw={over['num_workers']} | path | GB/s | "
             f"/ process | {cpu_head} | first batch |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    figs = over["process"]
    lines.append(f'| worker_type="process" | {_taken(figs.get("rounds", ()))} | {_range(figs["gb_per_s"])} | - | '
                 f"{cpu(figs, False)} | {fmt(figs['ttfb_s'] * 1e3)} ms |")
    for _, label, figs in _overhead_rows(over):
        lines.append(f"| {label} | {_taken(figs.get('rounds', ()))} | {_range(figs['gb_per_s'])} | "
                     f"{_ratio(figs['vs']['throughput'], bold=True)} | {cpu(figs, True)} | "
                     f"{fmt(figs['ttfb_s'] * 1e3)} ms |")
    wire = over.get("wire")
    if wire:
        lines.append(f"| bare TCP between two processes of this machine (loopback) | - | {_range(wire['gb_per_s'])} | "
                     f"{_ratio(wire['vs']['throughput'])} | - | {_range(wire['main_cpu_ms_per_batch'])} ms | - |")
        for _, label, figs in _overhead_rows(over):
            if figs["path"] == "stream":
                lines += ["", f"The stream reaches {_ratio(figs['vs']['wire'], bold=True)} of bare loopback TCP in the "
                          "same rounds: over a socket a batch is copied twice (into the kernel, then out of it into "
                          "the slot), and on one machine both copies share its cores with the workers, where a worker "
                          "process writes a batch once."]  # fmt: skip
    return lines


def ray_markdown(res: dict) -> str:
    """The ray workload's tables: transport through actors on each path against processes, scaling against the
    ideal, mixed."""
    lines = ["**ray**"]
    over = res.get("overhead")
    if over:
        # A worker's path is what stats().worker_paths said in each round, not what the row asked for.
        lines += _overhead_lines(over)
    rec = res.get("receive")
    if rec:
        taken = _taken([rec])
        lines += ["", f"The loop receives {_range(rec['batches_per_s'], digits=1)} batches/s "
                  f"({_range(rec['gb_per_s'], digits=3)} GB/s) of {fmt(rec['batch_bytes'] / 1e6)} MB from "
                  f"{rec['actors']} actors{'' if taken == '-' else f' (path {taken})'} with no cost per sample."]
    scaling = res.get("scaling")
    if scaling and scaling["rows"]:
        taken = _taken(scaling["rows"])
        taken = "" if taken == "-" else f", path {taken}"
        lines += ["", f"| actors (t_batch {fmt(scaling['t_batch_s'] * 1e3)} ms{taken}) | batches/s | ideal N / t_batch"
                  " | measured / ideal (capped by the receive rate) |", "|---|---|---|---|"]  # fmt: skip
        for row in scaling["rows"]:
            ideal = f"{row['ideal_batches_per_s']:.1f}" + (f" (capped {row['capped_ideal_batches_per_s']:.1f})"
                                                            if row["capped"] else "")  # fmt: skip
            lines.append(f"| {row['actors']} | {_range(row['batches_per_s'], digits=1)} | {ideal} | "
                         f"{_ratio(row['vs_capped'], bold=True)} |")
    mixed = res.get("mixed")
    if mixed:
        cpu = mixed.get("cpu_s_per_batch")
        rows = [r for figs in mixed["loaders"].values() for r in figs.get("rounds", ())]
        actors = ", ".join(p for p in _taken(rows).split(", ") if p not in ("-", "process"))
        lines += ["", f"| CPU-bound ({fmt(cpu * 1e3) + ' ms of CPU a batch, ' if cpu else ''}t_batch "
                  f"{fmt(mixed['t_batch_s'] * 1e3)} ms, {mixed['machine_cores']} cores"
                  f"{f', actors path {actors}' if actors else ''}) | batches/s | / process {mixed['local']} |",
                  "|---|---|---|"]  # fmt: skip
        for side, figs in mixed["loaders"].items():
            vs = mixed["vs"].get(side)
            lines.append(f"| {side} | {_range(figs['batches_per_s'], digits=1)} | "
                         f"{_ratio(vs, bold=True) if vs else '1.00x'} |")
    left = res.get("left_behind")
    if left is not None:
        lines += ["", f"Left behind after the cluster's shutdown: {res.get('actors_left')} actors, "
                  f"{left['procs']} processes, {len(left['shm'])} /dev/shm entries."]
    return "\n".join(lines)
