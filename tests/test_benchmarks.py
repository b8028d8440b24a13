"""The benchmark scripts run end to end in --quick mode and write the promised JSON and CSV.

These check the harness, not speed: no figure is asserted. The candidate is fastfeed.DataLoader
when it imports, else torch's own DataLoader (FASTFEED_BENCH_CANDIDATE=torch), so the harness
is tested while the loader is being written.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
FIGURES = {"throughput", "main_cpu_s", "tree_cpu_s", "peak_pss", "peak_pss_abs", "peak_footprint", "ttfb",
           "ctor_ttfb"}
STATS = {"median", "min", "max", "candidate", "baseline", "unit"}
RECORD = {"workload", "comparison", "round", "position", "role", "loader", "num_workers", "ttfb_s",
          "batches_per_s", "bytes_per_s", "main_cpu_s", "tree_cpu_s", "pss_base_mb", "pss_peak_mb", "pss_delta_mb"}


@pytest.fixture(scope="module")
def bench_env() -> dict:
    """Environment for the scripts: torch as the candidate unless fastfeed.DataLoader imports."""
    env = dict(os.environ)
    probe = subprocess.run([sys.executable, "-c", "from fastfeed import DataLoader"], cwd=REPO,
                           capture_output=True)
    if probe.returncode != 0:
        env["FASTFEED_BENCH_CANDIDATE"] = "torch"
    return env


def run_quick(script: str, out: Path, env: dict, *extra: str) -> dict:
    """Run ``benchmarks/<script>.py --quick`` into ``out``; return its JSON after checking the files."""
    proc = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--quick", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (json_path,) = out.glob(f"{script}-*.json")
    (csv_path,) = out.glob(f"{script}-*.csv")
    result = json.loads(json_path.read_text())
    assert set(result) == {"workload", "params", "rounds", "summary"}
    with csv_path.open() as f:
        assert len(list(csv.DictReader(f))) == len(result["rounds"])
    for rec in result["rounds"]:
        assert RECORD <= set(rec)
        assert rec["leftover_procs"] == 0
    for figures in result["summary"].values():
        assert set(figures) == FIGURES
        assert all(STATS <= set(stat) for stat in figures.values())
    return result


def test_transport(tmp_path, bench_env):
    """transport.py compares same-nw and against torch at nw=0, with the 0.9x throughput bar."""
    result = run_quick("transport", tmp_path, bench_env)
    assert set(result["summary"]) == {"transport nw=2", "transport nw=2 vs torch nw=0"}
    assert result["summary"]["transport nw=2 vs torch nw=0"]["throughput"]["bar"] == ">=0.9"
    assert result["summary"]["transport nw=2"]["throughput"]["unit"] == "GB/s"
    assert len(result["rounds"]) == 2 * 2 * result["params"]["rounds"]


def test_overhead(tmp_path, bench_env):
    """overhead.py compares candidate and torch at nw=0, 1 and 2 in batches/s."""
    result = run_quick("overhead", tmp_path, bench_env)
    assert set(result["summary"]) == {"overhead nw=0", "overhead nw=1", "overhead nw=2"}
    assert all(figs["throughput"]["unit"] == "batch/s" for figs in result["summary"].values())


def test_startup(tmp_path, bench_env):
    """startup.py reports time to first batch and peak PSS with their 1.0x bars."""
    result = run_quick("startup", tmp_path, bench_env)
    figures = result["summary"]["startup nw=2"]
    assert figures["ttfb"]["bar"] == "<=1.0" and figures["peak_pss"]["bar"] == "<=1.0"
    assert figures["peak_footprint"]["bar"] == "<=1.0"
    assert figures["ttfb"]["median"] > 0 and figures["peak_pss_abs"]["median"] > 0


def test_startup_spawn(tmp_path, bench_env):
    """The workloads' datasets pickle, so both loaders start workers under spawn."""
    result = run_quick("startup", tmp_path, bench_env, "--rounds", "1", "--mp-context", "spawn")
    assert result["params"]["mp_context"] == "spawn" and result["params"]["rounds"] == 1


def test_jpeg(tmp_path, bench_env):
    """jpeg.py runs fastfeed's worker processes and threads against torch's processes in the same rounds."""
    pytest.importorskip("PIL")
    result = run_quick("jpeg", tmp_path, bench_env)
    summary, rounds = result["summary"], result["params"]["rounds"]
    if result["params"]["candidate"] == "torch*":  # no worker_type: the two process sides only
        assert set(summary) == {"jpeg nw=2"}
        assert len(result["rounds"]) == 2 * rounds
    else:
        assert set(summary) == {"jpeg nw=2", "jpeg nw=2 thread", "jpeg nw=2 thread/process"}
        assert len(result["rounds"]) == 3 * rounds
        assert {r["loader"] for r in result["rounds"]} == {"fastfeed-process", "fastfeed-thread", "torch"}
        # Every round runs all three sides, each first in a different round.
        assert sorted(r["role"] for r in result["rounds"] if r["position"] == 0) == ["baseline", "candidate"]
    assert result["workload"]["jpeg"]["batch_size"] == 64
    for figures in summary.values():
        assert figures["throughput"]["unit"] == "batch/s"
        assert figures["throughput"]["median"] > 0 and figures["tree_cpu_s"]["median"] > 0


def test_demo(tmp_path, bench_env):
    """demo.py runs the transport and overhead questions and prints one table row per comparison."""
    proc = subprocess.run([sys.executable, str(BENCH / "demo.py"), "--quick", "--out", str(tmp_path)],
                          cwd=REPO, env=bench_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(next(tmp_path.glob("demo-*.json")).read_text())
    assert len(result["summary"]) == 5
    assert all(key in proc.stdout for key in result["summary"])


def test_gpu_check_without_cuda_says_so():
    """gpu_check.py on a machine without CUDA says that nothing was measured, and exits 0."""
    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA is present: gpu_check.py measures for real (run it by hand)")
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0 and "no CUDA device here" in proc.stdout, proc.stdout + proc.stderr
