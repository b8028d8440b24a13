"""The tuner's benchmark (fastfeed/bench/suites/tune.py): the arithmetic its verdicts rest on (the knee, the head to
head's quality, a workload's row), its busy loops' lifetime, and its rows in the report's table, CSV and plot."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time

import pytest

import _leaks
from fastfeed.bench import plot, report
from fastfeed.bench.suites import tune
from fastfeed.tuning.result import Setting


def S(nw: int, pf: int | None = 2) -> Setting:
    return Setting("process", nw, None if nw == 0 else pf)


def test_knee_is_the_fewest_workers_within_tolerance_of_the_best():
    figures = {S(0): 40.0, S(1, 2): 70.0, S(2, 1): 95.0, S(2, 4): 98.0, S(3, 8): 100.0, S(4, 2): 99.0}
    assert tune.best(figures) == S(3, 8)
    assert tune.knee(figures) == 2  # 98 is within 3% of 100, whatever prefetch got it
    assert tune.knee(figures, tolerance=0.01) == 3
    assert tune.knee({S(0): 100.0, S(1): 101.0}) == 0


def test_head_to_head_reverses_the_order_each_round_so_a_drift_cancels():
    """A machine slowing down by 5% a trial: A B B A gives both settings the same mean position in time, so their
    means' ratio is the true one; A B A B would charge the drift to the later one."""
    tuned, grid_best = S(2, 2), S(3, 8)
    true = {tuned: 90.0, grid_best: 100.0}
    calls = []

    def measure(s):
        calls.append(s)
        return true[s] * (1 - 0.05 * (len(calls) - 1))

    duel = tune.head_to_head(measure, tuned, grid_best, rounds=2)
    assert calls == [tuned, grid_best, grid_best, tuned]
    assert tune.quality(duel) == pytest.approx(0.9)
    a_b_a_b = [true[tuned] * (1 - 0.05 * t) for t in (0, 2)], [true[grid_best] * (1 - 0.05 * t) for t in (1, 3)]
    assert tune.quality({"tuned": a_b_a_b[0], "best": a_b_a_b[1]}) > 0.91  # the order is what removes the bias


def test_the_head_to_head_goes_on_in_pairs_of_rounds_while_the_quality_is_uncertain():
    """Rounds whose ratios spread 10% go on past the first 4, two at a time, up to the most allowed; rounds that agree
    stop at 4, as do rounds that show the tuned setting clearly better however they spread; the error is the spread
    of the rounds' log ratios over the square root of their number."""
    tuned, grid_best = S(2, 2), S(3, 8)

    def measuring(spread, level=95.0):
        calls = []

        def measure(s):
            calls.append(s)
            swing = (1 + spread) if calls.count(tuned) % 2 else (1 - spread)  # rounds alternately high and low
            return level * swing if s == tuned else 100.0
        return measure, calls

    steady, calls = measuring(0.001)
    duel = tune.head_to_head(steady, tuned, grid_best, rounds=4, most=12)
    assert len(calls) == 8 and tune.quality_se(duel) < tune.SE_GOAL
    noisy, calls = measuring(0.1)
    duel = tune.head_to_head(noisy, tuned, grid_best, rounds=4, most=12)
    assert len(duel["tuned"]) == 12 and tune.quality_se(duel) > tune.SE_GOAL
    assert calls[-4:] == [tuned, grid_best, grid_best, tuned]  # the last two rounds a pair, as the first
    logs = [math.log(t / b) for t, b in zip(duel["tuned"], duel["best"])]
    assert tune.quality_se(duel) == pytest.approx(statistics.stdev(logs) / math.sqrt(12))
    noisy, calls = measuring(0.1)
    assert len(tune.head_to_head(noisy, tuned, grid_best, rounds=4)["tuned"]) == 4  # no more than asked by default
    better, calls = measuring(0.1, level=80.0)
    duel = tune.head_to_head(better, grid_best, tuned, rounds=4, most=12)  # the tuned one 1.25x: clear of 1 at 4
    assert len(duel["tuned"]) == 4 and tune.quality_se(duel) > tune.SE_GOAL
    assert tune.quality_se({"tuned": [], "best": []}) == 0.0 and tune.quality_se({"tuned": [1.0], "best": [1.0]}) > 9


def test_the_grid_best_chosen_is_quality_one_without_a_measurement():
    calls = []
    duel = tune.head_to_head(calls.append, S(2), S(2), rounds=4)
    assert calls == [] and tune.quality(duel) == 1.0


def _run(cond, quality, nw, knee, time_ratio, noise=None, duels=0, chosen=None):
    return dict(condition=cond, quality=quality, nw=nw, knee=knee, time_ratio=time_ratio, tune_s=time_ratio * 50,
                noise=noise, duels=duels, chosen=chosen or str(S(nw)), input_bound=True, converged=True)


GRIDS = {"quiet": dict(best="nw=2 pf=4 process", knee=2, seconds=50.0, figures={"nw=2 pf=4 process": 100.0}),
         "busy": dict(best="nw=2 pf=2 process", knee=1, seconds=60.0, figures={"nw=2 pf=2 process": 60.0})}


def test_a_workload_row_keeps_the_worst_run_and_the_split():
    runs = [_run("quiet", 1.0, 2, 2, 0.2), _run("busy", 0.93, 3, 1, 0.3, {"max_cores": 1.8, "repeated": 2}, 1),
            _run("quiet", 0.97, 2, 2, 0.25), _run("busy", 0.99, 2, 1, 0.28, {"max_cores": 1.2, "repeated": 1}, 2)]
    row = tune.summarize("(a) cpu", runs, GRIDS, None)
    assert row["quality"] == {"min": 0.93, "median": pytest.approx(0.98), "max": 1.0}
    assert row["by_condition"]["quiet"]["quality"]["min"] == 0.97 and row["by_condition"]["busy"]["runs"] == 2
    assert [row["by_condition"][c]["nw_over_knee_max"] for c in ("quiet", "busy")] == [0, 2]
    assert row["nw_over_knee_max"] == 2 and (row["chosen_nw"], row["grid_knee"]) == (3, 1)  # the busy run's knee
    assert row["time"]["max"] == row["time_ratio"] == 0.3 and row["throughput_ratio"] == 0.93
    assert row["noise_max_cores"] == 1.8 and row["noise_repeated"] == 3 and row["duels"] == 3
    assert row["agreement"] == pytest.approx(0.07)
    assert row["grid"] == GRIDS["quiet"]["figures"]
    bare = tune.summarize("(d) memory", [_run("quiet", 1.0, 0, 0, 0.2)], {"quiet": GRIDS["quiet"]}, None)
    assert bare["noise_max_cores"] is None and bare["noise_repeated"] is None  # a tuner that reports no noise


def test_rows_reach_the_table_the_csv_and_the_plot():
    runs = [_run("quiet", 1.0, 2, 2, 0.2), _run("busy", 0.93, 3, 1, 0.3, {"max_cores": 1.8, "repeated": 2}, 1)]
    row = tune.summarize("(a) cpu", runs, GRIDS, None)
    table = tune.markdown([row])
    assert "| (a) cpu | quiet: nw=2 pf=4 process (nw=2); busy: nw=2 pf=2 process (nw=1) |" in table
    assert "| **0.93x** | 0.97x | 1.00x / 0.93x | 0.30x | +2 | 1.80 (2) | 1 |" in table
    runs[1]["quality_se"] = 0.031
    assert "| **0.93x** (±0.03) | 0.97x |" in tune.markdown([tune.summarize("(a) cpu", runs, GRIDS, None)])
    rep = {"workloads": {"tune": {"kind": "tune", "result": {"rows": [row]}}}}
    figs = {r["figure"]: r for r in report.figure_rows(rep)}
    assert (figs["throughput"]["min"], figs["throughput"]["max"]) == (0.93, 1.0)
    assert figs["tune_time"]["max"] == 0.3
    (bar,) = plot._tune_bars("tune", {"rows": [row]})["bars"]
    assert bar[2:] == (0.93, 0.93, 1.0) and "worst of 2 runs" in bar[0]


def test_rows_of_the_earlier_reruns_keep_their_table():
    old = dict(workload="(a) cpu", grid_best="nw=3 pf=8 process", grid_knee=3, chosen=["nw=3 pf=2 process"] * 3,
               throughput_ratio=0.95, time_ratio=0.29, tune_s=[12.9], grid_s=44.0, agreement=0.06)
    assert "| (a) cpu | nw=3 pf=8 process | nw=3 | nw=3 pf=2 process | 0.95x | 0.29x" in tune.markdown([old])
    rep = {"workloads": {"tune": {"kind": "tune", "result": {"rows": [old]}}}}
    assert [r["median"] for r in report.figure_rows(rep)] == [0.95, 0.29]


def test_workloads_by_name_or_letter():
    assert [tune._letter(w) for w in ("cpu", "b", "step", "memory")] == ["a", "b", "c", "d"]
    with pytest.raises(Exception, match="no workload 'disk'"):
        tune._letter("disk")


def test_busy_loops_spin_outside_this_tree_during_the_block_and_end_however_it_ends():
    """The loops run while the block does, as no descendants of this process (a neighbour's job is not the tuner's
    child: its CPU would read as the workers'), and are killed when it ends, however it ends."""
    with pytest.raises(RuntimeError):
        with tune.condition("busy") as pids:
            assert len(pids) == tune.BUSY_LOOPS and all(tune.spinning(pid) for pid in pids)
            assert not set(pids) & _leaks.descendants(os.getpid()), "a busy loop is in this process's tree"
            raise RuntimeError("a measurement failed")
    assert not any(tune.spinning(pid) for pid in pids)
    with tune.condition("quiet") as none:
        assert none == []


def test_a_busy_loop_whose_parent_died_ends_on_its_own():
    """A run killed before its finally: its loops notice it gone and stop, rather than spin forever."""
    starter = ("import os, subprocess, sys\n"
               f"p = subprocess.Popen([sys.executable, '-c', {tune.SPIN!r}, str(os.getpid())],\n"
               "                     stdout=subprocess.DEVNULL)\n"
               "print(p.pid)")  # the loop must not hold this pipe open: run() waits for its end
    parent = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=60, check=True)
    pid = int(parent.stdout)
    deadline = time.monotonic() + 30  # a hang guard, not a bound: it checks every 100,000 iterations
    while tune.spinning(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if tune.spinning(pid):
        os.kill(pid, 9)
        pytest.fail(f"busy loop {pid} went on spinning after its parent exited")
