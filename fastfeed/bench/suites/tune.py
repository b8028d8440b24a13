"""Tuning: does fastfeed.tune() find what an exhaustive grid finds, at a fraction of its time?

Five workloads, each with a different optimum:
  (a) cpu      CPU-bound __getitem__ (a busy loop): the optimum is about the cores;
  (b) latency  I/O-like __getitem__ (time.sleep): the optimum is well above the cores;
  (c) step     a 50 ms training step, cheap loading: not input-bound;
  (d) memory   in-memory tensors: 0 or 1 workers;
  (e) tail     heavy-tailed per-sample cost (3% of samples stall 15 ms): more workers and prefetch.

For each, in the same run: the grid measures every setting of nw 0..max x pf {1, 2, 4, 8} with
the tuner's own measurement (fastfeed.tuning.measure), then fastfeed.tune() runs 3 times. The
tuned settings and the grid's best are then measured head to head, interleaved, 5 rounds, so
the winner's curse of a max over many noisy medians does not count against the tuner.

Reported per workload: throughput ratio tuned / grid best, tuning time / grid time, chosen nw
against the grid's knee, agreement of the 3 reruns (how far apart, by the head-to-head figures),
and for (c) whether and how fast the tuner says "not input-bound".

Run: .venv/bin/python benchmarks/tune.py [--quick] [--workloads a b ...] [--max-workers N] [--out DIR]

Measured:
  (2026-11-30, 2-core VM, torch 2.13 CPU, `.venv/bin/python benchmarks/tune.py`)
  | workload | grid best | grid knee | tuned (3 runs) | tuned / best | tune time / grid | reruns agree |
  |---|---|---|---|---|---|---|
  | (a) cpu | nw=3 pf=8 process | nw=2 | nw=2 pf=4 process; nw=2 pf=2 process | 0.99x | 0.28x (14.1 s / 50 s) | within 1.3% |
  | (b) latency | nw=4 pf=4 process | nw=4 | nw=4 pf=2 process; nw=4 pf=4 process | 0.99x | 0.35x (15.1 s / 43 s) | within 1.3% |
  | (c) step | nw=2 pf=2 process | nw=0 | nw=0 pf=- process | 0.99x | 0.15x (5.0 s / 34 s) | within 0.0% |
  | (d) memory | nw=0 pf=- process | nw=0 | nw=0 pf=- process | 1.00x | 0.25x (12.8 s / 51 s) | within 0.0% |
  | (e) tail | nw=4 pf=8 process | nw=4 | nw=4 pf=8 process | 1.00x | 0.30x (16.1 s / 54 s) | within 0.0% |
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset


import fastfeed  # noqa: E402
from fastfeed.tuning import measure, offline  # noqa: E402
from fastfeed.tuning.result import Setting  # noqa: E402

TOLERANCE = 0.03
PREFETCH = (1, 2, 4, 8)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class CpuBound(Dataset):
    def __init__(self, n=200_000, cost_s=0.00025):
        self.n, self.cost_s = n, cost_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        _spin(self.cost_s)
        return torch.full((256,), i, dtype=torch.float32)


class LatencyBound(CpuBound):
    def __getitem__(self, i):
        time.sleep(self.cost_s)
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

    def __getitem__(self, i):
        _spin(0.0001)
        if hashlib.blake2b(i.to_bytes(8, "little"), digest_size=1).digest()[0] < 8:  # 8/256 ~ 3%
            time.sleep(0.015)
        return torch.full((256,), i, dtype=torch.float32)


WORKLOADS = {
    "a": ("cpu", lambda: CpuBound(), dict(batch_size=16), None),
    "b": ("latency", lambda: LatencyBound(cost_s=0.001), dict(batch_size=16), None),
    "c": ("step", lambda: CpuBound(cost_s=0.00005), dict(batch_size=16), 0.05),
    "d": ("memory", lambda: InMemory(), dict(batch_size=16), None),
    "e": ("tail", lambda: HeavyTail(), dict(batch_size=16), None),
}


def grid(dataset, base: dict, step, max_workers: int) -> tuple[dict, float]:
    """Every setting measured once, as the tuner measures one; returns {setting: trial}, seconds."""
    started = time.monotonic()
    trials = {}
    settings = [Setting("process", 0, None)] + [Setting("process", nw, pf) for nw in range(1, max_workers + 1)
                                                for pf in PREFETCH]  # fmt: skip
    for s in settings:
        trials[s] = measure.run(fastfeed.DataLoader, dataset, base, s, step, tolerance=TOLERANCE,
                                deadline=float("inf"))  # fmt: skip
    return trials, time.monotonic() - started


def knee(trials: dict) -> int:
    """The smallest nw whose best prefetch is within tolerance of the grid's best."""
    best = max(t.median for t in trials.values())
    return min(s.num_workers for s, t in trials.items() if t.median >= (1 - TOLERANCE) * best)


def head_to_head(dataset, base, step, settings: list[Setting], rounds: int) -> dict:
    """Each setting measured ``rounds`` times, interleaved; returns {setting: median batches/s}."""
    figures = {s: [] for s in settings}
    for r in range(rounds):
        order = settings if r % 2 == 0 else settings[::-1]
        for s in order:
            trial = measure.run(fastfeed.DataLoader, dataset, base, s, step, tolerance=TOLERANCE,
                                deadline=float("inf"))  # fmt: skip
            figures[s].append(trial.median)
    return {s: statistics.median(v) for s, v in figures.items()}


def run_workload(letter: str, max_workers: int, reruns: int, rounds: int) -> dict:
    name, make, base, step = WORKLOADS[letter]
    dataset = make()
    try:  # priming, one window: imports, allocator, page cache
        measure.run(fastfeed.DataLoader, dataset, base, Setting("process", 1, 2), step, tolerance=TOLERANCE,
                    deadline=0.0, first=True)  # fmt: skip
    except measure.OutOfTime:
        pass
    trials, grid_s = grid(dataset, base, step, max_workers)
    best_setting = max(trials, key=lambda s: trials[s].median)
    results = []
    for _ in range(reruns):
        t0 = time.monotonic()
        result = fastfeed.tune(dataset, step=step, max_workers=max_workers, tolerance=TOLERANCE, **base)
        results.append((result, time.monotonic() - t0))
    chosen = [r.setting for r, _ in results]
    duel = head_to_head(dataset, base, step, list(dict.fromkeys([best_setting, *chosen])), rounds)
    ratios = [duel[s] / duel[best_setting] for s in chosen]
    tuned_figs = [duel[s] for s in chosen]
    agreement = (max(tuned_figs) - min(tuned_figs)) / max(tuned_figs)
    time_ratios = [t / grid_s for _, t in results]
    k = knee(trials)
    out = dict(
        workload=f"({letter}) {name}", grid_s=grid_s, grid_best=str(best_setting), grid_knee=k,
        grid={str(s): round(t.median, 1) for s, t in sorted(trials.items())},
        chosen=[str(s) for s in chosen], tune_s=[round(t, 2) for _, t in results],
        input_bound=[r.input_bound for r, _ in results], converged=[r.converged for r, _ in results],
        head_to_head={str(s): round(v, 1) for s, v in duel.items()},
        throughput_ratio=min(ratios), time_ratio=max(time_ratios), chosen_nw=max(s.num_workers for s in chosen),
        agreement=agreement,
        step_s=step,
    )  # fmt: skip
    return out


def line(r: dict) -> str:
    return (f"{r['workload']:<14} grid best {r['grid_best']:<20} knee nw={r['grid_knee']}  tuned {', '.join(r['chosen'])}\n"
            f"{'':14} throughput {r['throughput_ratio']:.2f}x of grid best  "
            f"time {r['time_ratio']:.2f}x of grid ({max(r['tune_s']):.1f} s vs {r['grid_s']:.1f} s)  "
            f"nw {r['chosen_nw']} vs knee {r['grid_knee']}  reruns within {r['agreement']:.1%}")  # fmt: skip


def markdown(rows: list[dict]) -> str:
    out = ["| workload | grid best | grid knee | tuned (3 runs) | tuned / best | tune time / grid | reruns agree |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['workload']} | {r['grid_best']} | nw={r['grid_knee']} | {'; '.join(dict.fromkeys(r['chosen']))}"
                   f" | {r['throughput_ratio']:.2f}x | {r['time_ratio']:.2f}x ({max(r['tune_s']):.1f} s / "
                   f"{r['grid_s']:.0f} s) | within {r['agreement']:.1%} |")  # fmt: skip
    return "\n".join(out)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two workloads, max 2 workers, 1 rerun (what the tests run)")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), help="default: all five")
    p.add_argument("--max-workers", type=int, help="default: twice this rank's CPUs, as fastfeed.tune")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    args = p.parse_args(argv)
    letters = args.workloads or (["b", "c"] if args.quick else sorted(WORKLOADS))
    max_workers = args.max_workers or (2 if args.quick else 2 * offline.rank_cpus())
    reruns, rounds = (1, 1) if args.quick else (3, 5)
    print(f"# fastfeed.tune vs an exhaustive grid (nw 0..{max_workers} x pf {PREFETCH}); {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, loadavg {os.getloadavg()[0]:.2f}")  # fmt: skip
    rows = []
    for letter in letters:
        rows.append(run_workload(letter, max_workers, reruns, rounds))
        print(line(rows[-1]), flush=True)
    print(markdown(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tune-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(dict(max_workers=max_workers, rows=rows, argv=sys.argv[1:],
                                    loadavg_end=os.getloadavg()), indent=1) + "\n")  # fmt: skip
    print(f"# wrote {path}")
    return dict(rows=rows, path=str(path))


if __name__ == "__main__":
    main()
