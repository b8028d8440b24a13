"""`fastfeed bench ray`: Ray actors on each of their paths against worker processes, their scaling and local plus
remote, end to end at --quick size on the local cluster the suite starts, and the parts of it that decide a figure
(the datasets, the paths checked, the tables, the targets' reading).

These check the harness and what its report holds, not speed: no figure is held to a target here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from _first_run import TARGET
from _load import load_stretch
from fastfeed.bench import extras, report, standard
from fastfeed.bench.suites import ray as suite

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import targets  # noqa: E402  (benchmarks/targets.py: the project's targets, checked against a result)

sys.path.remove(str(REPO / "benchmarks"))

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
# The quick run's 280 s on an idle machine stretch with the load (up to 4x): pytest-timeout's limit, which covers the
# module's fixture, is raised to match. Guards against a hang, not a speed check.
pytestmark = pytest.mark.timeout(300 * 4 + 60)


def _env() -> dict:
    # Actors may take minutes to start on a machine busy with other work: the run's loaders wait 600 s for them, not
    # the 120 s default (as tests/_ray.py's patient_starts gives the Ray modules).
    # And its actors run at the ordinary priority, not Ray's nice 15, as the tests' cluster's do (tests/_ray.py).
    env = dict(os.environ, PYTHONPATH=str(REPO), FASTFEED_RAY_START_TIMEOUT_S="600", RAY_worker_niceness="0")
    env.pop("RAY_ADDRESS", None)  # the suite starts and connects to its own cluster
    return env


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory) -> tuple[dict, str]:
    """One ``fastfeed bench ray --quick --rounds 1`` run: its saved report and its output. One round of the overhead
    and mixed parts (--quick's is 2): each Ray loader starts its actors afresh, a Python importing torch each, which
    is most of the run; the parts, paths and tables are the same for any number of rounds."""
    out = tmp_path_factory.mktemp("bench-ray")
    proc = subprocess.run([sys.executable, "-m", "fastfeed", "bench", "ray", "--quick", "--rounds", "1", "--out",
                           str(out)], cwd=out, capture_output=True, text=True, timeout=280 * load_stretch(),
                          env=_env())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("bench-*.json")
    return report.load(path), proc.stdout + proc.stderr


@needs_ray
def test_quick_run_measures_every_part_on_a_loopback_cluster(quick_report):
    """A quick run starts a CPU-less head (the loop's node, with the trainer resource) and two CPU nodes, all on
    127.0.0.1, and measures transport through actors on each path beside processes, the receive rate, every actor
    count against its ideal, and local plus remote; each trial's workers took the path its row names."""
    rep, _ = quick_report
    assert rep["workloads"]["ray"]["kind"] == "ray"
    res = rep["workloads"]["ray"]["result"]
    nodes = res["cluster"]["nodes"]
    assert len(nodes) == 3 and all(n["alive"] for n in nodes)
    assert {n["address"] for n in nodes} == {"127.0.0.1"}
    assert sorted(n["cpus"] for n in nodes) == [0.0, 8.0, 8.0]
    (head,) = [n for n in nodes if n["head"]]
    assert head["cpus"] == 0 and head["resources"] == {"trainer_node": suite.TRAINER_SLOTS}
    assert head["node_id"] == res["cluster"]["driver_node"]
    over = res["overhead"]
    assert over["batch_bytes"] == 64 * 3 * 224 * 224
    rows = over["rows"]
    assert {name: (r["where"], r["path_env"], r["path"]) for name, r in rows.items()} == {
        "trainer node": ("the trainer's node", "auto", "shm"), "other node": ("another node", "auto", "stream"),
        "other node, store": ("another node", "store", "object store")}  # fmt: skip
    for figs, path in [(over["process"], "process")] + [(r, r["path"]) for r in rows.values()]:
        assert len(figs["rounds"]) == res["params"]["rounds"]
        for rec in figs["rounds"]:
            assert rec["worker_paths"] == [path, path]
            assert rec["batch_bytes"] == over["batch_bytes"] and rec["bytes_per_s"] > 0
            assert rec["main_cpu_s_per_batch"] > 0 and rec["actors_left"] == 0
            assert 0 < rec["loop_cpu_s_per_batch"] <= rec["main_cpu_s_per_batch"] * 1.01  # its own thread's share
    for r in rows.values():
        assert r["vs"]["throughput"]["median"] > 0 and r["vs"]["main_cpu"]["median"] > 0
        assert r["vs"]["loop_cpu"]["median"] > 0 and r["vs"]["wire"]["median"] > 0
    wire = over["wire"]  # bare loopback TCP, each round
    assert len(wire["rounds"]) == res["params"]["rounds"] and wire["gb_per_s"]["min"] > 0
    assert all(rec["batch_bytes"] == over["batch_bytes"] for rec in wire["rounds"])
    receive = res["receive"]
    assert receive["batches_per_s"]["median"] > 0 and receive["batch_bytes"] == 64 * 3 * 64 * 64
    assert receive["worker_paths"] == ["stream"] * receive["actors"]  # the other nodes' actors, path auto
    rows = res["scaling"]["rows"]
    assert [r["actors"] for r in rows] == res["params"]["actors"]
    t_batch = res["scaling"]["t_batch_s"]
    assert t_batch >= res["params"]["t_batch"]  # a sleep lasts at least what it asks
    for r in rows:
        assert r["ideal_batches_per_s"] == pytest.approx(r["actors"] / t_batch)
        assert r["capped_ideal_batches_per_s"] == min(r["ideal_batches_per_s"], receive["batches_per_s"]["median"])
        assert r["vs_capped"]["median"] > 0 and r["actors_left"] == 0
    mixed = res["mixed"]
    assert set(mixed["loaders"]) == {"process 1", "process 1 + ray 1", "process 2"}
    assert set(mixed["vs"]) == {"process 1 + ray 1", "process 2"}
    assert {rec["worker_paths"][1] for rec in mixed["loaders"]["process 1 + ray 1"]["rounds"]} == {"stream"}


@needs_ray
def test_quick_run_leaves_no_actor_process_or_segment(quick_report):
    """After every loader and at the end, no actor is alive, and once the cluster is shut down none of its
    processes and no /dev/shm entry of its is left."""
    rep, _ = quick_report
    res = rep["workloads"]["ray"]["result"]
    assert res["actors_left"] == 0
    assert res["left_behind"] == {"procs": 0, "shm": []}


@needs_ray
def test_quick_run_prints_its_tables_and_targets_read_them(quick_report):
    """The run prints the tables the report makes (figures only), and benchmarks/targets.py finds a scaling target
    for every actor count it ran."""
    rep, output = quick_report
    tables = report.markdown(rep, ["ray"])
    assert '| worker_type="process" | process |' in tables and '| worker_type="ray" on the trainer\'s node | shm |' \
        in tables and '| worker_type="ray" on another node | stream |' in tables  # fmt: skip
    assert '| worker_type="ray" on another node, FASTFEED_RAY_PATH=store | object store |' in tables
    assert "N / t_batch" in tables and "| process 1 + ray 1 |" in tables and tables in output
    assert not TARGET.search(tables) and not TARGET.search(output)
    found = {c.where for c in targets.checks(rep)}
    assert found == {f"ray scaling {n} actors" for n in rep["workloads"]["ray"]["result"]["params"]["actors"]}
    assert "| bare TCP between two processes of this machine (loopback) |" in tables
    keys = {(r["key"], r["figure"]) for r in report.figure_rows(rep)}
    for key in ("overhead ray shm/process", "overhead ray stream/process", "overhead ray/process"):
        assert {(key, "throughput"), (key, "main_cpu_s"), (key, "loop_cpu_s")} <= keys


@needs_ray
@pytest.mark.hang_limit(200)
def test_the_script_runs_with_ray_importable_beside_it(tmp_path):
    """benchmarks/ray.py, whose name is Ray's, still imports Ray (not itself), writes its result and prints the
    targets after the figures. Its smallest run: the mixed part alone, one round of 2 batches, on one worker node."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ray.py"), "--quick", "--parts", "mixed",
                           "--rounds", "1", "--mixed-batches", "2", "--nodes", "1", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=180 * load_stretch(), env=_env())  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# targets: 0 of 0 met" in proc.stdout  # the mixed part has no target
    (path,) = tmp_path.glob("ray-*.json")
    res = json.loads(path.read_text())
    assert res["workload"] == "ray" and set(res["mixed"]["loaders"]) == {"process 1", "process 1 + ray 1",
                                                                         "process 2"}  # fmt: skip
    assert res["left_behind"] == {"procs": 0, "shm": []}


def test_costly_ships_as_its_spec_and_rebuilds_the_same_items():
    """A Costly dataset pickles to its spec (bytes, not its 400 MB pool), and the copy yields the same items."""
    ds = suite.Costly(10, (3, 32, 32), pool_items=4)
    data = pickle.dumps(ds)
    assert len(data) < 1000
    copy = pickle.loads(data)
    assert len(copy) == 10 and all(bool((copy[i] == ds[i]).all()) for i in range(10))
    assert copy.spec == ds.spec
    with pytest.raises(ValueError, match="'sleep' or 'spin'"):
        suite.Costly(1, (1,), 1, how="burn")


def test_spin_spends_cpu_and_sleep_does_not():
    """A spinning item costs its thread's CPU time; a sleeping one costs wall time and almost no CPU."""
    spin = suite.Costly(1, (4,), 1, cost_s=0.03, how="spin")
    cpu0 = time.thread_time()
    spin[0]
    assert time.thread_time() - cpu0 >= 0.03
    sleep = suite.Costly(1, (4,), 1, cost_s=0.03, how="sleep")
    cpu0, w0 = time.thread_time(), time.perf_counter()
    sleep[0]
    assert time.perf_counter() - w0 >= 0.03 and time.thread_time() - cpu0 < 0.015


def test_a_missing_ray_is_skipped_with_its_pip_line(monkeypatch):
    """Without ray, fastfeed bench skips the ray workload with one line naming the extra, and the suite itself
    raises the same words."""
    real = extras.installed
    monkeypatch.setattr(extras, "installed", lambda module: module != "ray" and real(module))
    assert standard.missing_extra("ray") == "needs ray, which is not installed: pip install 'fastfeed[ray]'"
    with pytest.raises(ImportError, match=r"pip install 'fastfeed\[ray\]'"):
        suite.main(["--quick"])


def _stats(m: float, lo: float | None = None, hi: float | None = None) -> dict:
    return {"median": m, "min": m if lo is None else lo, "max": m if hi is None else hi}


def _row(n: int, ratio: float, t_batch: float = 0.1) -> dict:
    return {"actors": n, "ideal_batches_per_s": n / t_batch, "capped_ideal_batches_per_s": n / t_batch,
            "capped": False, "batches_per_s": _stats(ratio * n / t_batch), "vs_capped": _stats(ratio)}


def _paths_row(where: str, env: str, path: str, gb: float, cpu_ms: float, vs: float) -> dict:
    return {"where": where, "path_env": env, "path": path, "gb_per_s": _stats(gb), "main_cpu_ms_per_batch":
            _stats(cpu_ms), "loop_cpu_ms_per_batch": _stats(cpu_ms / 4), "ttfb_s": 1.2,
            "rounds": [{"worker_paths": [path, path]}] * 2,
            "vs": {"throughput": _stats(vs, vs - 0.1, vs + 0.1), "main_cpu": _stats(cpu_ms),  # over 1 ms a batch
                   "loop_cpu": _stats(cpu_ms), "wire": _stats(vs * 2)}}  # over 0.25 ms, and 1.5 GB/s


def test_markdown_rows_and_targets_of_a_ray_result():
    """The tables and CSV rows of a ray result (a row per path, naming the path its workers took), and the scaling
    target read for 1-8 actors only (16 is reported, not held to it): a ratio under 0.8x at 8 actors is missed."""
    res = {
        "workload": "ray",
        "overhead": {"batch_bytes": 9633792, "num_workers": 2,
                     "process": {"gb_per_s": _stats(3.0, 2.5, 3.5), "main_cpu_ms_per_batch": _stats(1.0),
                                 "loop_cpu_ms_per_batch": _stats(0.25), "ttfb_s": 0.05,
                                 "rounds": [{"worker_paths": ["process", "process"]}] * 2},
                     "wire": {"gb_per_s": _stats(1.5), "main_cpu_ms_per_batch": _stats(1.1),
                              "vs": {"throughput": _stats(0.5)}},
                     "rows": {"trainer node": _paths_row("the trainer's node", "auto", "shm", 2.7, 0.5, 0.9),
                              "other node": _paths_row("another node", "auto", "stream", 1.8, 2.0, 0.6),
                              "other node, store": _paths_row("another node", "store", "object store", 0.6, 5.0,
                                                              0.2)}},  # fmt: skip
        "receive": {"actors": 8, "batch_bytes": 786432, "batches_per_s": _stats(400.0), "gb_per_s": _stats(0.31),
                    "worker_paths": ["stream"] * 8},
        "scaling": {"t_batch_s": 0.1, "rows": [dict(_row(n, r), worker_paths=["stream"] * n)
                                               for n, r in ((1, 0.95), (8, 0.7), (16, 0.5))]},  # fmt: skip
        "mixed": {"local": 1, "t_batch_s": 0.032, "machine_cores": 2,
                  "loaders": {"process 1": {"batches_per_s": _stats(30.0),
                                            "rounds": [{"worker_paths": ["process"]}]},
                              "process 1 + ray 1": {"batches_per_s": _stats(45.0),
                                                    "rounds": [{"worker_paths": ["process", "stream"]}]}},
                  "vs": {"process 1 + ray 1": _stats(1.5)}},
        "actors_left": 0, "left_behind": {"procs": 0, "shm": []},
    }
    rep = {"schema": report.SCHEMA, "workloads": {"ray": {"kind": "ray", "result": res}}}
    text = report.markdown(rep)
    assert "| loop thread CPU per batch | process CPU per batch |" in text
    assert ('| worker_type="process" | process | 3.00 (2.50-3.50) | - | 0.25 (0.25-0.25) ms | 1.00 (1.00-1.00) ms | '
            "50 ms |") in text
    assert ('| worker_type="ray" on the trainer\'s node | shm | 2.70 (2.70-2.70) | **0.90x** (0.80-1.00) | '
            "0.12 (0.12-0.12) ms | 0.50 (0.50-0.50) ms | 1,200 ms |") in text
    assert ('| worker_type="ray" on another node | stream | 1.80 (1.80-1.80) | **0.60x** (0.50-0.70) | 0.50 '
            "(0.50-0.50) ms | 2.00 (2.00-2.00) ms |") in text
    assert ('| worker_type="ray" on another node, FASTFEED_RAY_PATH=store | object store | 0.60 (0.60-0.60) | '
            "**0.20x** (0.10-0.30) |") in text
    assert ("| bare TCP between two processes of this machine (loopback) | - | 1.50 (1.50-1.50) | 0.50x (0.50-0.50) "
            "| - | 1.10 (1.10-1.10) ms | - |") in text
    assert "The stream reaches **1.20x** (1.20-1.20) of bare loopback TCP" in text
    assert "from 8 actors (path stream) with no cost per sample" in text
    assert "| actors (t_batch 100 ms, path stream) |" in text and "2 cores, actors path stream) |" in text
    assert "| 8 | 56.0 (56.0-56.0) | 80.0 | **0.70x** (0.70-0.70) |" in text
    assert "| process 1 + ray 1 | 45.0 (45.0-45.0) | **1.50x** (1.50-1.50) |" in text
    assert "0 actors, 0 processes, 0 /dev/shm entries" in text and not TARGET.search(text)
    rows = {(r["key"], r["figure"]): (r["median"], r["numerator"], r["denominator"]) for r in report.figure_rows(rep)}
    assert rows[("overhead ray shm/process", "throughput")] == (0.9, 2.7, 3.0)
    assert rows[("overhead ray stream/process", "main_cpu_s")] == (2.0, 2.0, 1.0)
    assert rows[("overhead ray stream/process", "loop_cpu_s")] == (2.0, 0.5, 0.25)
    assert rows[("overhead ray/process", "throughput")] == (0.2, 0.6, 3.0)  # the store's: as reports before paths
    rows = {key: median for key, (median, _, _) in rows.items()}
    assert rows[("scaling 16 actors", "throughput_vs_ideal")] == 0.5
    assert rows[("mixed process 1 + ray 1 / process 1", "throughput")] == 1.5
    assert {(c.where, c.ok) for c in targets.checks(rep)} == {("ray scaling 1 actors", True),
                                                              ("ray scaling 8 actors", False)}  # fmt: skip
    assert {(c.where, c.ok) for c in targets.checks(res)} == {("ray scaling 1 actors", True),
                                                              ("ray scaling 8 actors", False)}  # fmt: skip
    json.dumps(res)


def test_a_report_from_before_the_paths_still_reads():
    """A committed report with one Ray row (the object store, no paths recorded) renders and compares as before."""
    over = {"batch_bytes": 9633792, "num_workers": 2,
            "process": {"gb_per_s": _stats(3.0), "main_cpu_ms_per_batch": _stats(1.0), "ttfb_s": 0.05},
            "ray": {"gb_per_s": _stats(1.5), "main_cpu_ms_per_batch": _stats(4.0), "ttfb_s": 1.2},
            "vs": {"throughput": _stats(0.5, 0.4, 0.6), "main_cpu": _stats(4.0, 3.0, 5.0)}}  # fmt: skip
    rep = {"schema": report.SCHEMA, "workloads": {"ray": {"kind": "ray", "result": {"overhead": over}}}}
    text = report.markdown(rep)
    assert '| worker_type="ray" | - | 1.50 (1.50-1.50) | **0.50x** (0.40-0.60) | 4.00 (4.00-4.00) ms |' in text
    rows = {(r["key"], r["figure"]): r["median"] for r in report.figure_rows(rep)}
    assert rows == {("overhead ray/process", "throughput"): 0.5, ("overhead ray/process", "main_cpu_s"): 4.0}


class _FakeLoader:
    """Stands in for a loader in ``steady``: notes FASTFEED_RAY_PATH when its iterator starts, as a Ray pool reads
    it, and reports the paths it was built with."""

    def __init__(self, paths):
        self.paths, self.env_at_iter = paths, "unread"

    def __iter__(self):
        self.env_at_iter = os.environ.get(suite.PATH_ENV)
        return iter([torch.zeros(4, dtype=torch.uint8)] * 8)

    def stats(self):
        return types.SimpleNamespace(worker_paths=self.paths)


def test_noted_trial_forces_the_path_while_the_pool_starts_and_records_the_paths(monkeypatch):
    """The loader's iterator starts under FASTFEED_RAY_PATH as the row asks ("auto" overrides one set outside), the
    variable is put back afterwards, and the record holds the paths the workers took, read after the timed
    window."""
    from fastfeed.bench.suites import ray_trials

    monkeypatch.setattr(ray_trials, "wait_actors_gone", lambda: 0)
    monkeypatch.setenv(suite.PATH_ENV, "shm")
    made = []
    rec = suite.noted_trial(lambda: made.append(_FakeLoader(("stream", "stream"))) or made[-1], "auto", 2, 3)
    assert made[0].env_at_iter == "auto" and os.environ[suite.PATH_ENV] == "shm"
    assert rec["worker_paths"] == ["stream", "stream"] and rec["windows"][0]["batch_bytes"] == 4
    monkeypatch.delenv(suite.PATH_ENV)
    rec = suite.noted_trial(lambda: made.append(_FakeLoader(())) or made[-1], "store", 2, 3)
    assert made[1].env_at_iter == "store" and suite.PATH_ENV not in os.environ
    assert rec["worker_paths"] == []  # FASTFEED_STATS=0: nothing recorded, which the overhead part refuses


def test_a_row_whose_workers_took_another_path_stops_the_overhead_part(monkeypatch):
    """An overhead row whose workers fell back (here the other node's, to the object store) is not measured under
    its name: the part raises, naming the row and the paths taken."""
    taken = iter([["process"] * 2, ["shm"] * 2, ["object store"] * 2])  # the sides in the first round's order

    def trial(make, env, warmup, batches, windows=1):
        return {"ttfb_s": 0.1, "actors_left": 0, "worker_paths": next(taken),
                "windows": [{"bytes_per_s": 1e9, "main_cpu_s_per_batch": 1e-3, "loop_cpu_s_per_batch": 1e-4}]}

    monkeypatch.setattr(suite, "noted_trial", trial)
    args = types.SimpleNamespace(warmup=1, batches=1, pool_items=1, rounds=1)
    with pytest.raises(RuntimeError, match=r"'other node' \(FASTFEED_RAY_PATH=auto\).*'object store'.*not 'stream'"):
        suite.overhead_part(args, say=lambda *a: None)
