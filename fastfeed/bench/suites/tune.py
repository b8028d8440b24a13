"""Tuning: is fastfeed.tune() right every time, on a quiet machine and on a busy one, at a fraction of a grid's time?

Four workloads, each with a different optimum:
  (a) cpu      CPU-bound __getitem__, about 0.6 ms of pure Python per sample, batch 16: the optimum is about the cores;
  (b) latency  I/O-like __getitem__ (time.sleep, 1 ms per sample): the optimum is well above the cores;
  (c) step     a 50 ms training step, cheap loading: not input-bound;
  (d) memory   in-memory tensors: 0 or 1 workers;
and, only when named (--workloads tail), (e) tail: a heavy-tailed per-sample cost (3% of samples wait 15 ms).

Two conditions: quiet, and busy, with two busy loops (processes spinning on this rank's CPUs) beside everything
measured, as a neighbour's job is on a shared machine. In each condition the grid measures every setting of
nw 0..max x pf {1, 2, 4, 8} once, with fastfeed.tuning.measure's default (a fresh loader, warm-up, 3 windows of
0.5 s, up to 6 while they spread; the tuner's own trials take 3, and it measures settings within the noise of each
other again in turn instead). Then fastfeed.tune() runs 10 times, quiet and busy in turn, and right after each run,
in the same condition, its setting and that condition's grid best are measured head to head, interleaved (A B,
B A, ...): a medians' comparison from minutes apart would count the machine's drift, and the max over many noisy
medians' luck (the winner's curse), against it.

Per run: quality = the tuned setting's throughput / the grid best's (the means over the head-to-head rounds, which
the A B B A order keeps free of a linear drift; exactly 1 when the tuner chose the grid's best), with its standard
error (the spread of the rounds' ratios over the square root of their number): the rounds go on, two at a time,
while that error is over ``SE_GOAL``, up to ``MAX_ROUNDS``, unless the tuned setting is better than the grid's best
by twice the error. CPU-bound samples on a shared 2-core VM spread a round's ratio by 6-22% (4 rounds: an error of
3-11%, as wide as the 5% a target tells apart); the other workloads by 0.3-2%, which 4 rounds settle. Time ratio =
the tuning's wall time / the grid's, in the same condition; the chosen nw less the grid's knee (the fewest workers
within tolerance of the grid's best). Per workload: quality's minimum (the run a user would have got at worst) and
median, the worst time ratio and nw - knee, the same split quiet / busy, the noise the tuner saw (the cores other
processes held during its trials) and the duels it ran.

Run: fastfeed bench tune [--quick], or
  .venv/bin/python -m fastfeed.bench.suites.tune [--workloads cpu latency ...] [--runs N] [--max-workers N]
      [--out DIR] [--report PATH]
(--report writes the result as a fastfeed bench report too: docs/bench/tune.json is one, and the table in
docs/benchmarks/standard.md is made from it.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import Dataset

import fastfeed
from fastfeed.tuning import measure, offline
from fastfeed.tuning.result import Setting

TOLERANCE = 0.03  # the tuner's default, and the knee's
PREFETCH = (1, 2, 4, 8)
RUNS = 10  # tuner runs per workload, quiet and busy in turn
ROUNDS = 4  # head-to-head rounds after each run at least: A B, B A, A B, B A
MAX_ROUNDS = 12  # ... and at most, while the quality's standard error is over SE_GOAL
SE_GOAL = 0.02
BUSY_LOOPS = 2
CPU_SAMPLE_S = 0.0006  # the CPU-bound workload's pure Python per sample
# Head-to-head trials take MIN_WINDOWS windows each, never more: their rounds, not extra windows, average the noise
# out, and a busy condition would otherwise stretch every trial to MAX_WINDOWS.
DUEL_TOLERANCE = float("inf")
# What a step of the run takes on a quiet 2-core machine, for the estimate printed at its start: a trial's start-up
# and warm-up, beside its windows (a grid's: 3 to 6, a head to head's: 3), and a tuner run.
EST_START_S, EST_TUNE_S = 0.8, 18.0
# --quick's grid and head-to-head windows: a smoke run of the code path, whose figures are not the benchmark's (its
# time ratio compares the tuner's 0.5 s windows with these)
QUICK_WINDOW_S = 0.2

# A busy loop (argv: the pid of the run it serves): it spins until killed, and ends on its own once that process is
# gone (or a zombie), so that an interrupted run leaves nothing spinning. It looks every 100,000 iterations (a few ms).
SPIN = ("import sys\nowner = int(sys.argv[1])\n\n\ndef alive(pid):\n    try:\n"
        "        with open(f'/proc/{pid}/stat') as f:\n            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'\n"
        "    except OSError:\n        return False\n\n\nwhile alive(owner):\n    for _ in range(100_000):\n"
        "        pass\n")  # fmt: skip
# The loops' starter (argv: the run's pid, how many, SPIN): it starts them, each in its own session, prints their
# pids and exits, so that they are no descendants of the run. The tuner counts its own process tree's CPU time as its
# workers' and the rest of the CPUs' busy time as others' (fastfeed.tuning.noise), and a neighbour's job is not its
# child: loops started as the run's children read as its workers' CPU, and the noise the tuner saw as none.
START = ("import subprocess, sys\nfor _ in range(int(sys.argv[2])):\n"
         "    p = subprocess.Popen([sys.executable, '-c', sys.argv[3], sys.argv[1]], stdin=subprocess.DEVNULL,\n"
         "                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)\n"
         "    print(p.pid, flush=True)\n")  # fmt: skip


def work(iterations: int) -> int:
    """Pure Python arithmetic: CPU time that a busy neighbour takes away, unlike a wait on the clock."""
    x = 0
    for k in range(iterations):
        x += k * k
    return x


_iterations_per_s: float | None = None


def iterations_for(seconds: float) -> int:
    """The ``work`` iterations that take ``seconds`` of CPU here: from the fastest of several timings of a probe (a
    timing another process stretched is not this CPU's speed), once per process."""
    global _iterations_per_s
    if _iterations_per_s is None:
        probe = 20_000
        fastest = float("inf")
        for _ in range(9):
            t0 = time.perf_counter()
            work(probe)
            fastest = min(fastest, time.perf_counter() - t0)
        _iterations_per_s = probe / fastest
    return max(1, round(seconds * _iterations_per_s))


class CpuBound(Dataset):
    def __init__(self, n=200_000, cost_s=CPU_SAMPLE_S):
        self.n, self.iterations = n, iterations_for(cost_s)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        work(self.iterations)
        return torch.full((256,), i, dtype=torch.float32)


class LatencyBound(Dataset):
    def __init__(self, n=200_000, wait_s=0.001):
        self.n, self.wait_s = n, wait_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.wait_s)
        return torch.full((256,), i, dtype=torch.float32)


class InMemory(Dataset):
    def __init__(self, n=200_000):
        self.data = torch.randn(n, 64)
        self.labels = torch.randint(0, 10, (n,))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], self.labels[i]


class HeavyTail(CpuBound):
    """0.1 ms of CPU per sample, and 3% of samples (fixed by index) wait 15 ms, as a slow read does."""

    def __init__(self, n=200_000):
        super().__init__(n, cost_s=0.0001)

    def __getitem__(self, i):
        work(self.iterations)
        if hashlib.blake2b(i.to_bytes(8, "little"), digest_size=1).digest()[0] < 8:  # 8/256 ~ 3%
            time.sleep(0.015)
        return torch.full((256,), i, dtype=torch.float32)


# letter: (name, dataset factory, loader arguments, step seconds)
WORKLOADS = {
    "a": ("cpu", lambda: CpuBound(), dict(batch_size=16), None),
    "b": ("latency", lambda: LatencyBound(), dict(batch_size=16), None),
    "c": ("step", lambda: CpuBound(cost_s=0.00005), dict(batch_size=16), 0.05),
    "d": ("memory", lambda: InMemory(), dict(batch_size=16), None),
    "e": ("tail", lambda: HeavyTail(), dict(batch_size=16), None),
}
DEFAULT = ("a", "b", "c", "d")  # (e) only when named: the four, in the full run's time
QUICK = ("b", "c")
NAMES = {name: letter for letter, (name, *_) in WORKLOADS.items()}


@contextlib.contextmanager
def condition(name: str, loops: int = BUSY_LOOPS):
    """``busy``: ``loops`` processes spinning on this rank's CPUs (they inherit its affinity), outside this process's
    tree as a neighbour's job is (``START``), while the block runs, each killed when it ends, however it ends; yields
    their pids. ``quiet``: nothing beside it (no pids)."""
    pids: list[int] = []
    try:
        if name == "busy":
            started = subprocess.run([sys.executable, "-c", START, str(os.getpid()), str(loops), SPIN],
                                     capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
            pids.extend(int(pid) for pid in started.stdout.split())
            time.sleep(0.2)  # their interpreters up and spinning before the first measurement
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # init reaps them: no longer running once killed, gone soon after
        while any(spinning(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)


def spinning(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie waiting for its parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def settings(max_workers: int) -> list[Setting]:
    return [Setting("process", 0, None)] + [Setting("process", nw, pf) for nw in range(1, max_workers + 1)
                                            for pf in PREFETCH]  # fmt: skip


def measure_one(dataset, base: dict, step, setting: Setting, tolerance: float = TOLERANCE,
                window_s: float = measure.WINDOW_S) -> float:  # fmt: skip
    """One setting's batches/s, with ``measure.run``'s default windows (a fresh loader, warm-up, the windows'
    median)."""
    return measure.run(fastfeed.DataLoader, dataset, base, setting, step, tolerance=tolerance,
                       deadline=float("inf"), window_s=window_s).median  # fmt: skip


def grid(dataset, base: dict, step, max_workers: int, window_s: float = measure.WINDOW_S) -> tuple[dict, float]:
    """Every setting measured once (``measure_one``); returns ({setting: batches/s}, seconds)."""
    started = time.monotonic()
    figures = {s: measure_one(dataset, base, step, s, window_s=window_s) for s in settings(max_workers)}
    return figures, time.monotonic() - started


def best(figures: dict) -> Setting:
    return max(figures, key=figures.get)


def knee(figures: dict, tolerance: float = TOLERANCE) -> int:
    """The fewest workers whose best prefetch is within ``tolerance`` of the grid's best."""
    top = max(figures.values())
    return min(s.num_workers for s, v in figures.items() if v >= (1 - tolerance) * top)


def head_to_head(measure_setting, tuned: Setting, grid_best: Setting, rounds: int, most: int | None = None,
                 se_goal: float = SE_GOAL) -> dict:  # fmt: skip
    """``tuned`` and ``grid_best`` measured in turn, the order reversed each round (A B, B A, ...), ``rounds`` rounds
    and then two more at a time while the quality's standard error (``quality_se``) is over ``se_goal`` and the tuned
    setting is not clearly better (``_uncertain``), up to ``most`` (default: ``rounds``). Returns ``{"tuned":
    [batches/s per round], "best": [...]}``, both empty when they are the same setting."""
    figures: dict = {"tuned": [], "best": []}
    if tuned == grid_best:
        return figures
    pair = [("tuned", tuned), ("best", grid_best)]
    most = max(rounds, most or rounds)
    r = 0
    while r < rounds or (r < most and (r % 2 == 1 or _uncertain(figures, se_goal))):  # pairs: A B, B A
        for key, setting in pair if r % 2 == 0 else pair[::-1]:
            figures[key].append(measure_setting(setting))
        r += 1
    return figures


def _uncertain(duel: dict, se_goal: float) -> bool:
    """Whether a head to head needs more rounds: its quality's error is over ``se_goal``, and the tuned setting is
    not clearly (by twice that error) better than the grid's best, which more rounds could not change."""
    se = quality_se(duel)
    return se > se_goal and math.log(quality(duel)) < 2 * se


def quality_se(duel: dict) -> float:
    """The standard error of a head to head's quality: the standard deviation of its rounds' log ratios (tuned /
    best) over the square root of their number; 0 for the grid best chosen, infinite below 2 rounds."""
    if not duel["tuned"]:
        return 0.0
    logs = [math.log(t / b) if t > 0 and b > 0 else math.inf for t, b in zip(duel["tuned"], duel["best"])]
    if len(logs) < 2 or not all(map(math.isfinite, logs)):
        return math.inf
    return statistics.stdev(logs) / math.sqrt(len(logs))


def quality(duel: dict) -> float:
    """The tuned setting's throughput over the grid best's: the ratio of their means over the rounds (an A B B A
    order gives both the same mean position in time, so a steady drift cancels); 1 when they are one setting."""
    if not duel["tuned"]:
        return 1.0
    return statistics.fmean(duel["tuned"]) / statistics.fmean(duel["best"])


def tuner_run(dataset, base: dict, step, max_workers: int, cond: str, grid_row: dict, rounds: int,
              window_s: float = measure.WINDOW_S) -> dict:  # fmt: skip
    """One fastfeed.tune() in condition ``cond``, then its choice against ``grid_row``'s best, head to head, in the
    same condition (the busy loops go on beside both)."""
    grid_best = Setting(**grid_row["best_setting"])
    with condition(cond):
        t0 = time.monotonic()
        result = fastfeed.tune(dataset, step=step, max_workers=max_workers, tolerance=TOLERANCE, **base)
        tune_s = time.monotonic() - t0
        duel = head_to_head(lambda s: measure_one(dataset, base, step, s, DUEL_TOLERANCE, window_s), result.setting,
                            grid_best, rounds, max(rounds, MAX_ROUNDS) if rounds > 1 else 1)  # fmt: skip
    return dict(
        condition=cond, chosen=str(result.setting), nw=result.num_workers, knee=grid_row["knee"],
        quality=quality(duel), quality_se=_finite(quality_se(duel)), tune_s=tune_s,
        time_ratio=tune_s / grid_row["seconds"],
        head_to_head={k: [round(v, 1) for v in vs] for k, vs in duel.items()}, trials=len(result.trials),
        input_bound=result.input_bound, converged=result.converged,
        # What the tuner saw of the noise, and the duels it ran, where its result carries them
        noise=getattr(result, "noise", None), duels=len(getattr(result, "duels", None) or []),
        notes=list(getattr(result, "notes", None) or []),
    )  # fmt: skip


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _stats(values: list) -> dict:
    return dict(min=min(values), median=statistics.median(values), max=max(values))


def summarize(label: str, runs: list[dict], grids: dict, step) -> dict:
    """A workload's row: its runs and grids, the figures over the runs, per condition too."""
    qualities = [r["quality"] for r in runs]
    worst = max(runs, key=lambda r: (r["nw"] - r["knee"], r["nw"]))
    noises = [r["noise"] for r in runs if r["noise"]]
    by_condition = {}
    for cond in grids:
        mine = [r for r in runs if r["condition"] == cond]
        if mine:
            by_condition[cond] = dict(runs=len(mine), quality=_stats([r["quality"] for r in mine]),
                                      time_ratio_max=max(r["time_ratio"] for r in mine),
                                      nw_over_knee_max=max(r["nw"] - r["knee"] for r in mine))  # fmt: skip
    first = next(iter(grids.values()))
    return dict(
        workload=label, step_s=step, runs=runs, grids=grids, by_condition=by_condition,
        quality=_stats(qualities), time=_stats([r["time_ratio"] for r in runs]),
        nw_over_knee_max=worst["nw"] - worst["knee"],
        noise_max_cores=max((n.get("max_cores") or 0.0 for n in noises), default=None),
        noise_repeated=sum(n.get("repeated") or 0 for n in noises) if noises else None,
        duels=sum(r["duels"] for r in runs),
        # The figures benchmarks/targets.py checks, under the names it reads: the worst run's quality, time ratio
        # and nw against its knee, and how far apart the runs' qualities are.
        throughput_ratio=min(qualities), time_ratio=max(r["time_ratio"] for r in runs), chosen_nw=worst["nw"],
        # the standard error of the worst run's quality (None where the run predates it, or had one round)
        quality_min_se=min(runs, key=lambda r: r["quality"]).get("quality_se"),
        grid_knee=worst["knee"], agreement=(max(qualities) - min(qualities)) / max(qualities),
        chosen=[r["chosen"] for r in runs], tune_s=[round(r["tune_s"], 2) for r in runs],
        input_bound=[r["input_bound"] for r in runs], converged=[r["converged"] for r in runs],
        grid=first["figures"], grid_best=first["best"], grid_s=first["seconds"],
    )  # fmt: skip


def run_workload(letter: str, max_workers: int, runs: int, rounds: int, window_s: float = measure.WINDOW_S) -> dict:
    name, make, base, step = WORKLOADS[letter]
    dataset = make()
    try:  # priming, one window: imports, allocator, page cache
        measure.run(fastfeed.DataLoader, dataset, base, Setting("process", 1, 2), step, tolerance=TOLERANCE,
                    deadline=0.0, first=True)  # fmt: skip
    except measure.OutOfTime:
        pass
    conds = [("quiet", "busy")[i % 2] for i in range(runs)]
    grids = {}
    for cond in dict.fromkeys(conds):
        with condition(cond):
            figures, seconds = grid(dataset, base, step, max_workers, window_s)
        top = best(figures)
        grids[cond] = dict(best=str(top), best_setting=dataclasses.asdict(top), knee=knee(figures), seconds=seconds,
                           figures={str(s): round(v, 1) for s, v in figures.items()})  # fmt: skip
        print(f"#   ({letter}) {name} grid, {cond}: best {top} {figures[top]:.1f} batches/s, knee nw={knee(figures)}, "
              f"{seconds:.0f} s", flush=True)  # fmt: skip
    out = []
    for i, cond in enumerate(conds):
        out.append(tuner_run(dataset, base, step, max_workers, cond, grids[cond], rounds, window_s))
        r = out[-1]
        se = f" ±{r['quality_se']:.3f} ({len(r['head_to_head'].get('tuned', []))} rounds)" if r["quality_se"] else ""
        print(f"#   ({letter}) {name} run {i + 1}/{runs} {cond}: {r['chosen']} in {r['tune_s']:.1f} s "
              f"({r['time_ratio']:.2f}x the grid), quality {r['quality']:.3f}{se}, nw {r['nw']} vs knee {r['knee']}, "
              f"noise {_noise(r['noise'])}, duels {r['duels']}", flush=True)  # fmt: skip
    return summarize(f"({letter}) {name}", out, grids, step)


def _noise(noise: dict | None) -> str:
    if not noise:
        return "-"
    return f"{noise.get('max_cores') or 0:.2f} cores at most, {noise.get('repeated') or 0} repeated"


def estimate_s(workloads: int, max_workers: int, runs: int, rounds: int, window_s: float) -> float:
    """The run's expected seconds (see EST_*): the head to head counted in full, as if no run chose the grid's
    best."""
    grid_trial, duel_trial = EST_START_S + 4 * window_s, EST_START_S + 3 * window_s
    per = min(runs, 2) * len(settings(max_workers)) * grid_trial + runs * (EST_TUNE_S + 2 * rounds * duel_trial)
    return workloads * per


def line(r: dict) -> str:
    q, split = r["quality"], "  ".join(f"{c}: min {s['quality']['min']:.3f} over {s['runs']}"
                                       for c, s in r["by_condition"].items())  # fmt: skip
    return (f"{r['workload']:<14} quality min {q['min']:.3f}{_se(r)} median {q['median']:.3f} ({split})\n"
            f"{'':14} time {r['time']['max']:.2f}x of the grid at most  nw - knee {r['nw_over_knee_max']:+d} at "
            f"worst  noise {_cores(r['noise_max_cores'])} at most  duels {r['duels']}  tuned {_chosen(r)}")  # fmt: skip


def _se(r: dict) -> str:
    """The worst run's quality's standard error, where its head to head had one."""
    se = r.get("quality_min_se")
    return "" if not se else f" (±{se:.2f})" if se >= 0.01 else f" (±{se:.3f})"


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} cores"


def _chosen(r: dict) -> str:
    return "; ".join(f"{s} x{n}" if n > 1 else s for s, n in Counter(r["chosen"]).most_common())


def markdown(rows: list[dict]) -> str:
    """The table of a run's rows; rows from before the quiet / busy runs (3 reruns, no ``runs``) get the table of
    their time."""
    if rows and not all("runs" in r for r in rows):
        return _reruns_markdown(rows)
    out = ["| workload | grid best (knee) | tuned (runs) | quality min (± s.e.) | quality median | min quiet / busy | "
           "tune time / grid, max | nw - knee, max | noise, max cores (repeated) | duels |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        grids = "; ".join(f"{c}: {g['best']} (nw={g['knee']})" for c, g in r["grids"].items())
        split = " / ".join(f"{r['by_condition'][c]['quality']['min']:.2f}x" if c in r["by_condition"] else "-"
                           for c in ("quiet", "busy"))  # fmt: skip
        noise = "-" if r["noise_max_cores"] is None else f"{r['noise_max_cores']:.2f} ({r['noise_repeated']})"
        out.append(f"| {r['workload']} | {grids} | {_chosen(r)} | **{r['quality']['min']:.2f}x**{_se(r)} | "
                   f"{r['quality']['median']:.2f}x | {split} | {r['time']['max']:.2f}x | {r['nw_over_knee_max']:+d} | "
                   f"{noise} | {r['duels']} |")  # fmt: skip
    return "\n".join(out)


def _reruns_markdown(rows: list[dict]) -> str:
    out = ["| workload | grid best | grid knee | tuned (3 runs) | tuned / best | tune time / grid | reruns agree |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        tuned = "; ".join(dict.fromkeys(r["chosen"]))
        out.append(f"| {r['workload']} | {r['grid_best']} | nw={r['grid_knee']} | {tuned} | "
                   f"{r['throughput_ratio']:.2f}x | {r['time_ratio']:.2f}x ({max(r['tune_s']):.1f} s / "
                   f"{r['grid_s']:.0f} s) | within {r['agreement']:.1%} |")  # fmt: skip
    return "\n".join(out)


def _letter(value: str) -> str:
    if value in WORKLOADS:
        return value
    if value in NAMES:
        return NAMES[value]
    raise argparse.ArgumentTypeError(f"no workload {value!r}: one of {', '.join(NAMES)} (or {', '.join(WORKLOADS)})")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"latency and step, 1 quiet run each, max 2 workers, 1 head-to-head round, the grid's windows "
                        f"{QUICK_WINDOW_S} s (what the tests run)")  # fmt: skip
    p.add_argument("--workloads", nargs="+", type=_letter, metavar="NAME",
                   help=f"of {', '.join(NAMES)} (or their letters); default: "
                        f"{', '.join(WORKLOADS[w][0] for w in DEFAULT)}")  # fmt: skip
    p.add_argument("--runs", type=int, help=f"tuner runs per workload, quiet and busy in turn (default {RUNS})")
    p.add_argument("--rounds", type=int, help=f"head-to-head rounds after each run at least (default {ROUNDS}; two "
                   f"more at a time while the quality's standard error is over {SE_GOAL}, up to {MAX_ROUNDS})")
    p.add_argument("--max-workers", type=int, help="default: twice this rank's CPUs, as fastfeed.tune")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--report", type=Path, help="also write the result as a fastfeed bench report here "
                   "(docs/bench/tune.json is one)")  # fmt: skip
    args = p.parse_args(argv)
    letters = args.workloads or list(QUICK if args.quick else DEFAULT)
    max_workers = args.max_workers or (2 if args.quick else 2 * offline.rank_cpus())
    runs = args.runs or (1 if args.quick else RUNS)
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    window_s = QUICK_WINDOW_S if args.quick else measure.WINDOW_S
    est = estimate_s(len(letters), max_workers, runs, rounds, window_s)
    print(f"# fastfeed.tune vs an exhaustive grid (nw 0..{max_workers} x pf {PREFETCH}), {runs} run(s) per workload, "
          f"{rounds} head-to-head round(s); {os.cpu_count()} CPUs, torch {torch.__version__}, loadavg "
          f"{os.getloadavg()[0]:.2f}; expect about {est / 60:.0f} min", flush=True)  # fmt: skip
    started = time.monotonic()
    rows = []
    for n, letter in enumerate(letters, 1):
        rows.append(run_workload(letter, max_workers, runs, rounds, window_s))
        print(line(rows[-1]), flush=True)
        elapsed = time.monotonic() - started
        if n < len(letters):
            print(f"# {elapsed / 60:.1f} min so far, about {elapsed / n * (len(letters) - n) / 60:.0f} min to go",
                  flush=True)  # fmt: skip
    print(markdown(rows))
    result = dict(max_workers=max_workers, runs=runs, rounds=rounds, busy_loops=BUSY_LOOPS, tolerance=TOLERANCE,
                  window_s=window_s, quick=args.quick,
                  rows=rows, seconds=time.monotonic() - started, argv=list(sys.argv[1:] if argv is None else argv),
                  loadavg_end=os.getloadavg())  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tune-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"# wrote {path}")
    if args.report:
        from .. import report

        command = f"fastfeed bench tune (as python -m fastfeed.bench.suites.tune, {time.strftime('%Y-%m-%d')})"
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report.assemble({"tune": {"kind": "tune", "result": result}}, command),
                                          indent=1, default=str) + "\n")  # fmt: skip
        print(f"# wrote {args.report}")
    return dict(rows=rows, path=str(path))


if __name__ == "__main__":
    main()
