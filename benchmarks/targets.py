"""The project's own development targets for the standard workloads, checked against a report.

These are the figures the project set out to reach, not facts about anyone's run, so fastfeed itself never
prints them: `fastfeed bench`, the demo and the README show the measured figures only. This script is where the
project checks itself against them:

  .venv/bin/python benchmarks/targets.py docs/bench/standard.json          # a `fastfeed bench` report
  .venv/bin/python benchmarks/targets.py bench-results/transport-*.json    # a script's result (benchmarks/*.py)
  .venv/bin/python benchmarks/targets.py bench-results/tune-*.json         # benchmarks/tune.py's result
  .venv/bin/python benchmarks/targets.py docs/bench/shards.json            # fastfeed bench shards' report
  .venv/bin/python benchmarks/targets.py bench-results/bench-*.json        # fastfeed bench ray's report

One line per target that a figure of the report answers, then the count met; exit 1 when one was missed.
The scripts under benchmarks/ (transport.py, jpeg.py...) print the same lines after their figures, and
exit as their suite does. A target is met by the median over rounds: judge a ratio near its target with more
`--rounds`, not with one run.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Target:
    """A figure's target: ``summary[key][figure]["median"] op value`` for every summary key matching ``key``.

    Attributes:
        workload: The workload (or script, ``overhead-stats``) whose results it applies to.
        key: A regular expression the whole summary key must match (``"transport nw=2 epochs of 60"``).
        figure: The figure (``throughput``, ``ttfb``, ``peak_footprint``...).
        op: ``">="`` or ``"<="``.
        value: The ratio to reach.
    """

    workload: str
    key: str
    figure: str
    op: str
    value: float

    def met(self, median: float | None) -> bool:
        return median is not None and (median >= self.value if self.op == ">=" else median <= self.value)


# The comparisons' targets, fastfeed/torch (or a variant/torch) unless said otherwise.
TARGETS = (
    # transport: at nw=2, 6x torch's workers; with workers, at least torch loading in the loop (0.9x in steady
    # state, where torch at nw=0 only stacks: the bytes never cross a process; 1.0x over whole epochs).
    Target("transport", r"transport nw=2( epochs of \d+)?", "throughput", ">=", 6.0),
    Target("transport", r"transport nw=\d+ vs torch nw=0 epochs of \d+", "throughput", ">=", 1.0),
    Target("transport", r"transport nw=\d+ vs torch nw=0", "throughput", ">=", 0.9),
    Target("overhead", r"overhead nw=2", "throughput", ">=", 4.0),
    # overhead.py --stats: the measurement layer costs at most 2% at every worker count.
    Target("overhead-stats", r"overhead nw=\d+", "throughput", ">=", 0.98),
    Target("startup", r"startup nw=\d+( epochs of \d+)?", "ttfb", "<=", 1.0),
    Target("startup", r"startup nw=\d+ epochs of \d+", "ttfb_hot", "<=", 0.5),
    Target("startup", r"startup nw=\d+( epochs of \d+)?", "peak_pss", "<=", 1.0),
    Target("startup", r"startup nw=\d+( epochs of \d+)?", "peak_footprint", "<=", 1.0),
    Target("jpeg", r"jpeg nw=\d+", "peak_footprint", "<=", 1.0),
    # fastfeed's DALI path on the CPU, against torch with Pillow: images/s.
    Target("jpeg", r"jpeg nw=\d+ dali", "throughput", ">=", 1.25),
    Target("prefetch", r"prefetch nw=\d+ pf=\d+", "throughput", ">=", 0.97),
)
# files (fastfeed bench files, benchmarks/io.py): over HTTP, read-ahead and the cache's epoch 2 against torch.
FILES = {("http", "readahead"): 4.0, ("http", "cached"): 10.0}
# shards (fastfeed bench shards, benchmarks/shards.py): Shards over each peer's throughput on HTTP; resumed at 50% over
# an epoch start's time to first batch; epoch 2's downloads with the data 2x the cache, over the ideal (data - cache).
SHARDS = {"http_throughput": 1.2, "resume": 1.5, "cache": 1.1}
# ray (fastfeed bench ray, benchmarks/ray.py): batches/s over the ideal N / t_batch (capped by the rate at which the
# loop can receive), for every actor count up to scaling_up_to.
RAY = {"scaling": 0.8, "scaling_up_to": 8}
# tune: tuned / grid best (the worst run's), tuning time / grid time (the slowest run's), chosen nw against the knee,
# and (c)'s call; reports of the benchmark's earlier form (3 quiet reruns, no "runs") also the reruns' spread.
TUNE = {"throughput": 0.95, "time": 0.3, "knee_slack": 1, "agreement": 0.03, "not_input_bound_s": 10.0}


@dataclass(frozen=True)
class Check:
    """One target against its measured figure."""

    where: str
    what: str
    measured: str
    ok: bool

    def line(self) -> str:
        return f"{self.where}  {self.what}  measured {self.measured}  {'ok' if self.ok else 'MISSED'}"


def comparison_checks(workload: str, summary: dict) -> list[Check]:
    """The targets of a runner result's ``summary`` (``"<workload> <label>"`` -> figure -> stats)."""
    out = []
    for key, figures in summary.items():
        for t in TARGETS:
            if t.workload == workload and re.fullmatch(t.key, key) and t.figure in figures:
                median = figures[t.figure].get("median")
                shown = "n/a" if median is None else f"{median:.2f}x"
                out.append(Check(key, f"{t.figure} {t.op} {t.value}x", shown, t.met(median)))
    return out


def files_checks(result: dict) -> list[Check]:
    """The targets of the files workload's result (``{"http": {"readahead": {"ratio"...}}, ...}``)."""
    out = []
    for (name, side), value in FILES.items():
        figs = (result.get(name) or {}).get(side)
        if figs:
            out.append(Check(f"files {name} {side}", f"files/s >= {value}x torch", f"{figs['ratio']:.2f}x",
                             figs["ratio"] >= value))
    return out


def shards_checks(result: dict) -> list[Check]:
    """The targets of the shards workload's result (``fastfeed/bench/suites/shards.py``)."""
    out = []
    for peer, figs in ((result.get("http") or {}).get("vs") or {}).items():
        median = figs["throughput"]["median"]
        out.append(Check(f"shards http fastfeed/{peer}", f"samples/s >= {SHARDS['http_throughput']}x",
                         f"{median:.2f}x", median >= SHARDS["http_throughput"]))
    resume = (result.get("resume") or {}).get("fastfeed")
    if resume:
        median = resume["ratio"]["median"]
        out.append(Check("shards resume fastfeed", f"first batch resumed at 50% / epoch start <= {SHARDS['resume']}x",
                         f"{median:.2f}x", median <= SHARDS["resume"]))
    cache = result.get("cache") or {}
    if cache.get("fastfeed"):
        ratio = cache["fastfeed"]["epoch2_bytes"] / cache["ideal_bytes"]
        out.append(Check("shards cache fastfeed", f"epoch 2 downloads / (data - cache) <= {SHARDS['cache']}x",
                         f"{ratio:.2f}x", ratio <= SHARDS["cache"]))
    return out


def ray_checks(result: dict) -> list[Check]:
    """The targets of the ray workload's result (``fastfeed/bench/suites/ray.py``)."""
    out = []
    for row in (result.get("scaling") or {}).get("rows", []):
        if row["actors"] <= RAY["scaling_up_to"]:
            median = row["vs_capped"]["median"]
            out.append(Check(f"ray scaling {row['actors']} actors", f"batches/s / ideal >= {RAY['scaling']}x",
                             f"{median:.2f}x", median >= RAY["scaling"]))
    return out


def tune_checks(rows: list[dict]) -> list[Check]:
    """The targets of the tune workload's rows (one per workload, as ``fastfeed/bench/suites/tune.py`` writes)."""
    out = []
    for r in rows:
        where = f"tune {r['workload']}"
        se = r.get("quality_min_se")  # the worst run's quality's standard error, where the report has it
        out += [
            Check(where, f"tuned / grid best >= {TUNE['throughput']}x",
                  f"{r['throughput_ratio']:.2f}x" + (f" (±{se:.3f})" if se else ""),
                  r["throughput_ratio"] >= TUNE["throughput"]),
            Check(where, f"tuning time / grid <= {TUNE['time']}x", f"{r['time_ratio']:.2f}x",
                  r["time_ratio"] <= TUNE["time"]),
            Check(where, f"nw <= knee + {TUNE['knee_slack']}", f"nw={r['chosen_nw']}, knee nw={r['grid_knee']}",
                  r["chosen_nw"] <= r["grid_knee"] + TUNE["knee_slack"]),
        ]
        if "runs" not in r:  # the earlier form's reruns of one condition: they agree. The quiet and busy runs of the
            # current form are held to the worst run's quality instead, which the first check reads.
            out.append(Check(where, f"reruns within {TUNE['agreement']:.0%}", f"{r['agreement']:.1%}",
                             r["agreement"] <= TUNE["agreement"]))
        if r.get("step_s") is not None or r["workload"].endswith(" step"):  # (c): a step, cheap loading
            slowest = max(r["tune_s"])
            out.append(Check(where, f"not input-bound, said in < {TUNE['not_input_bound_s']:.0f} s",
                             f"input-bound {any(r['input_bound'])} in {slowest:.1f} s",
                             not any(r["input_bound"]) and slowest < TUNE["not_input_bound_s"]))
    return out


def checks(result: dict) -> list[Check]:
    """Every target a result answers: a ``fastfeed bench`` report, a script's result, or tune.py's rows."""
    if result.get("schema", "").startswith("fastfeed.bench/"):
        out = []
        for name, entry in result["workloads"].items():
            out += CHECKERS[entry["kind"]](name, entry["result"])
        return out
    if "summary" in result:
        return comparison_checks(result["params"]["script"], result["summary"])
    if "rows" in result:
        return tune_checks(result["rows"])
    if result.get("workload") == "shards":
        return shards_checks(result)
    if result.get("workload") == "ray":
        return ray_checks(result)
    return files_checks(result)


CHECKERS: dict[str, Callable[[str, dict], list[Check]]] = {
    "comparison": lambda name, res: comparison_checks(res["params"]["script"], res["summary"]),
    "files": lambda name, res: files_checks(res),
    "shards": lambda name, res: shards_checks(res),
    "ray": lambda name, res: ray_checks(res),
    "tune": lambda name, res: tune_checks(res["rows"]),
}


def report(result: dict, file=sys.stdout) -> bool:
    """Print every target of ``result`` against its figure; returns whether all were met."""
    found = checks(result)
    for c in found:
        print(c.line(), file=file)
    missed = sum(not c.ok for c in found)
    print(f"# targets: {len(found) - missed} of {len(found)} met", file=file)
    return not missed


def run(main: Callable[[], dict]) -> None:
    """A script's entry point: run the suite's ``main``, then print its targets (the exit status stays the suite's)."""
    result = main()
    print()
    report(result)


def cli(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths or paths[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if paths else 2
    ok = True
    for path in paths:
        print(f"# {path}")
        ok &= report(json.loads(Path(path).read_text()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cli())
