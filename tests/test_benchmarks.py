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

from _first_run import TARGET

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
import targets  # noqa: E402  (benchmarks/targets.py: the project's targets, checked against a result)

sys.path.remove(str(BENCH))
FIGURES = {"throughput", "main_cpu_s", "tree_cpu_s", "peak_pss", "peak_pss_abs", "peak_footprint", "ttfb",
           "ctor_ttfb", "ttfb_hot", "stall"}
STATS = {"median", "min", "max", "candidate", "baseline", "unit"}
RECORD = {"workload", "comparison", "round", "position", "role", "loader", "num_workers", "ttfb_s",
          "batches_per_s", "bytes_per_s", "main_cpu_s", "tree_cpu_s", "pss_base_mb", "pss_peak_mb", "pss_delta_mb",
          "foot_delta_mb", "epoch_batches", "epochs", "ttfb_hot_s", "stop_s"}


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
    """Run ``benchmarks/<script>.py --quick`` into ``out``; return its JSON after checking the files, and that the
    script printed the project's targets after its figures (where it has some)."""
    proc = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--quick", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if script not in ("demo", "with_accelerate"):
        assert "# targets: " in proc.stdout, proc.stdout[-2000:]
    (json_path,) = out.glob(f"{script}-*.json")
    (csv_path,) = out.glob(f"{script}-*.csv")
    result = json.loads(json_path.read_text())
    assert set(result) == {"workload", "params", "rounds", "summary", "pairs"}
    with csv_path.open() as f:
        assert len(list(csv.DictReader(f))) == len(result["rounds"])
    for rec in result["rounds"]:
        assert RECORD <= set(rec)
        assert rec["leftover_procs"] == 0
    for figures in result["summary"].values():
        assert set(figures) == FIGURES
        assert all(set(stat) == STATS for stat in figures.values())  # figures only: no target in the result
    return result


def target_of(result: dict, key: str, figure: str) -> str | None:
    """The target benchmarks/targets.py checks ``figure`` of summary ``key`` against, e.g. ``">= 6.0x"``."""
    found = [c.what for c in targets.checks(result) if c.where == key and c.what.startswith(figure + " ")]
    return found[0].removeprefix(figure + " ") if found else None


def check_epochs(result: dict, n: int) -> None:
    """Epoch-mode records: whole epochs of ``n`` batches, at least 2 timed, each with a hot time to first batch."""
    recs = [r for r in result["rounds"] if r["epoch_batches"] == n]
    assert recs
    for rec in recs:
        assert rec["epochs"] >= 2 and rec["batches"] == n * rec["epochs"] and rec["warmup"] == n
        assert rec["ttfb_hot_s"] > 0 and rec["stop_s"] >= 0 and rec["batches_per_s"] > 0
        assert rec["bytes"] == rec["batches"] * 64 * 3 * 224 * 224  # every timed batch, whole


def test_transport(tmp_path, bench_env):
    """transport.py by default runs epochs of two lengths (60 and 300; --quick shortens them to 6 and 12).

    One round, and --batches 1: the fewest timed epochs a trial runs (2, for the hot time to first batch's median);
    the records, summary and targets are the same at any size."""
    result = run_quick("transport", tmp_path, bench_env, "--rounds", "1", "--batches", "1")
    summary = result["summary"]
    assert set(summary) == {f"transport nw=2{vs} epochs of {n}" for vs in ("", " vs torch nw=0") for n in (6, 12)}
    for n in (6, 12):
        check_epochs(result, n)
        same = summary[f"transport nw=2 epochs of {n}"]
        assert target_of(result, f"transport nw=2 epochs of {n}", "throughput") == ">= 6.0x"
        assert target_of(result, f"transport nw=2 vs torch nw=0 epochs of {n}", "throughput") == ">= 1.0x"
        assert same["throughput"]["unit"] == "GB/s" and same["ttfb_hot"]["median"] > 0
        assert same["peak_footprint"]["candidate"] > 0
    assert len(result["rounds"]) == 2 * 2 * 2 * result["params"]["rounds"]
    assert all(c["candidate_kwargs"]["persistent_workers"] is False for c in result["params"]["comparisons"])
    # The pool: at least 8x the last-level cache and 300 MB.
    describe = result["workload"]["transport"]
    assert describe["pool_mb"] >= 300 and describe["pool_sizing"] == "8x LLC, >= 300 MB"
    if describe["llc_mb"] is not None:
        assert describe["pool_mb"] >= 8 * describe["llc_mb"] * 2**20 / 1e6


def test_transport_steady_state(tmp_path, bench_env):
    """--epoch-batches 0 runs the steady state: one iterator, the 0.9x target against torch at nw=0, no ttfb_hot."""
    result = run_quick("transport", tmp_path, bench_env, "--epoch-batches", "0", "--pool-items", "64", "--rounds", "1",
                       "--batches", "5")  # fmt: skip
    summary = result["summary"]
    assert set(summary) == {"transport nw=2", "transport nw=2 vs torch nw=0"}
    assert target_of(result, "transport nw=2 vs torch nw=0", "throughput") == ">= 0.9x"
    assert summary["transport nw=2"]["ttfb_hot"]["median"] is None
    assert result["workload"]["transport"]["pool_items"] == 64
    assert all(r["epoch_batches"] == 0 and r["ttfb_hot_s"] is None for r in result["rounds"])


def test_pool_items_follow_llc(tmp_path):
    """The transport pool is 8x the LLC read from sysfs (the highest level, not an instruction cache), or 300 MB."""
    from fastfeed.bench import workloads
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                                  (2, "Unified", "1280K"), (3, "Unified", "49152K")]):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert workloads.last_level_cache(tmp_path) == (48 * 2**20, "sysfs L3")
    size, source = workloads.last_level_cache(tmp_path / "absent")  # no sysfs: getconf, else unknown
    assert source in ("getconf L3", "getconf L2", "unknown") and (size is None) == (source == "unknown")
    assert workloads.transport_pool_items(48 * 2**20) == 2675  # 403 MB: 8x 48 MiB
    assert workloads.transport_pool_items(8 * 2**20) == 1993  # 300 MB: the floor
    assert workloads.transport_pool_items(None) * workloads.IMAGE_BYTES >= 300e6


def test_overhead(tmp_path, bench_env):
    """overhead.py compares candidate and torch at nw=0, 1 and 2 in batches/s (one round of 20 timed batches: the
    harness runs the same as --quick's 2 of 200)."""
    result = run_quick("overhead", tmp_path, bench_env, "--rounds", "1", "--batches", "20")
    assert set(result["summary"]) == {"overhead nw=0", "overhead nw=1", "overhead nw=2"}
    assert all(figs["throughput"]["unit"] == "batch/s" for figs in result["summary"].values())


@pytest.mark.fastfeed_only
def test_overhead_stats(tmp_path, bench_env):
    """overhead.py --stats compares fastfeed with its measurement layer against FASTFEED_STATS=0."""
    proc = subprocess.run([sys.executable, str(BENCH / "overhead.py"), "--quick", "--stats", "--num-workers", "1",
                           "--rounds", "1", "--batches", "20", "--out", str(tmp_path)], cwd=REPO, env=bench_env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fastfeed/fastfeed-nostats throughput" in proc.stdout
    (json_path,) = tmp_path.glob("overhead-stats-*.json")
    result = json.loads(json_path.read_text())
    assert result["params"]["baseline_class"].endswith("StatsOff")


@pytest.mark.fastfeed_only
@pytest.mark.hang_limit(300)
def test_tune_benchmark(tmp_path, bench_env):
    """tune.py --quick compares fastfeed.tune() with the grid on two workloads; targets.py checks each target.

    --max-workers 1: the grid is nw 0, and nw 1 x each prefetch (5 settings, not --quick's 9), and the tuner's
    search as short; the harness (grid, knee, reruns, head to head, the table, the targets) runs the same."""
    proc = subprocess.run([sys.executable, str(BENCH / "tune.py"), "--quick", "--max-workers", "1", "--out",
                           str(tmp_path)], cwd=REPO, env=bench_env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (json_path,) = tmp_path.glob("tune-*.json")
    rows = json.loads(json_path.read_text())["rows"]
    assert json.loads(json_path.read_text())["max_workers"] == 1
    assert [r["workload"] for r in rows] == ["(b) latency", "(c) step"]
    for row in rows:
        assert "checks" not in row
        assert sorted(row["grid"]) == sorted(["nw=0 pf=- process"] + [f"nw=1 pf={pf} process" for pf in (1, 2, 4, 8)])
        assert all(s.startswith(("nw=0 ", "nw=1 ")) for s in row["chosen"])  # the tuner kept to --max-workers
    checks = targets.tune_checks(rows)
    # quality, time and knee; (c): not input-bound too (the reruns' spread is checked in the earlier form's rows only)
    assert [c.where for c in checks] == ["tune (b) latency"] * 3 + ["tune (c) step"] * 4
    assert "| workload |" in proc.stdout and "# targets: " in proc.stdout


@pytest.mark.fastfeed_only
@pytest.mark.hang_limit(300)
def test_doctor_benchmark(bench_env):
    """doctor.py measures the doctor's overhead on two loops and the demo's end-to-end time, with its targets (a
    developer's script, under benchmarks/). One round of 30 batches (--quick's is 2 of 100): the loops, their table
    rows and the demo's diagnosis run the same at any size."""
    proc = subprocess.run([sys.executable, str(BENCH / "doctor.py"), "--rounds", "1", "--batches", "30"], cwd=REPO,
                          env=bench_env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in ("overhead, step loop", "overhead, input loop", "fastfeed doctor --demo, end to end"):
        assert row in proc.stdout
    assert "verdict: " in proc.stdout


@pytest.mark.fastfeed_only
def test_io_benchmark(bench_env):
    """io.py --quick runs the HTTP, local and token-window workloads against torch and prints the table."""
    proc = subprocess.run([sys.executable, str(BENCH / "io.py"), "--quick"], cwd=REPO, env=bench_env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| (http) |" in proc.stdout and "| (local) |" in proc.stdout and "(tokens) ArrayFiles" in proc.stdout


def test_startup(tmp_path, bench_env):
    """startup.py reports time to first batch of epochs 1 and 2+, and peak PSS; targets.py has their targets (one
    round: its figures are the same for any number)."""
    result = run_quick("startup", tmp_path, bench_env, "--rounds", "1")
    key = "startup nw=2 epochs of 10"
    figures = result["summary"][key]
    assert target_of(result, key, "ttfb") == "<= 1.0x" and target_of(result, key, "peak_pss") == "<= 1.0x"
    assert target_of(result, key, "peak_footprint") == "<= 1.0x" and target_of(result, key, "ttfb_hot") == "<= 0.5x"
    assert figures["ttfb"]["median"] > 0 and figures["peak_pss_abs"]["median"] > 0
    assert figures["ttfb_hot"]["median"] > 0
    check_epochs(result, 10)


@pytest.mark.fastfeed_only
def test_with_accelerate(tmp_path, bench_env):
    """with_accelerate.py: fastfeed's loader, and prepared by Accelerate, against torch's prepared by Accelerate,
    with and without use_stateful_dataloader, in epochs."""
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata")
    result = run_quick("with_accelerate", tmp_path, bench_env, "--rounds", "1", "--mem-batches", "2")
    sides = ("", " accelerate", " accelerate/candidate")
    assert set(result["summary"]) == {f"transport prepare{s} nw=2{v}" for s in ("", ", stateful") for v in sides}
    assert result["params"]["baseline_class"].endswith("torch_prepared")
    check_epochs(result, 6)


def test_startup_spawn(tmp_path, bench_env):
    """The workloads' datasets pickle, so both loaders start workers under spawn.

    One worker, one iterator (--epoch-batches 0): every spawned worker imports torch afresh (seconds of CPU each),
    and in epochs of persistent_workers=False each epoch would start them again, to prove nothing more."""
    result = run_quick("startup", tmp_path, bench_env, "--rounds", "1", "--mp-context", "spawn", "--num-workers", "1",
                       "--epoch-batches", "0")  # fmt: skip
    assert result["params"]["mp_context"] == "spawn" and result["params"]["rounds"] == 1
    assert set(result["summary"]) == {"startup nw=1"}
    assert all(r["num_workers"] == 1 and r["peak_procs"] >= 2 for r in result["rounds"])  # a worker was running


def _dali_importable() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import fastfeed.dali"], cwd=REPO, capture_output=True)
    return probe.returncode == 0


def test_jpeg(tmp_path, bench_env):
    """jpeg.py runs fastfeed's worker processes, worker threads and DALI pipeline against torch's processes in the
    same rounds (the DALI side only where NVIDIA DALI is installed)."""
    pytest.importorskip("PIL")
    # Two rounds, each side first in one; 1 + 2 + 1 batches a trial (--quick's 2 + 8 + 3): every batch decodes 64 JPEGs.
    result = run_quick("jpeg", tmp_path, bench_env, "--warmup", "1", "--batches", "2", "--mem-batches", "1")
    summary, rounds = result["summary"], result["params"]["rounds"]
    if result["params"]["candidate"] == "torch*":  # no worker_type, not fastfeed: the two process sides only
        assert set(summary) == {"jpeg nw=2"}
        assert len(result["rounds"]) == 2 * rounds
    else:
        dali = _dali_importable()
        tags = ("thread", "dali") if dali else ("thread",)
        assert set(summary) == {"jpeg nw=2"} | {f"jpeg nw=2 {t}{vs}" for t in tags for vs in ("", "/process")}
        assert len(result["rounds"]) == (2 + len(tags)) * rounds
        loaders = {"fastfeed-process", "torch"} | {f"fastfeed-{t}" for t in tags}
        assert {r["loader"] for r in result["rounds"]} == loaders
        # Every round runs all sides, each first in a different round.
        assert sorted(r["role"] for r in result["rounds"] if r["position"] == 0) == ["baseline", "candidate"]
        if dali:
            check_dali_side(result)
    assert result["workload"]["jpeg"]["batch_size"] == 64
    assert target_of(result, "jpeg nw=2", "peak_footprint") == "<= 1.0x"
    assert summary["jpeg nw=2"]["peak_footprint"]["candidate"] > 0
    for figures in summary.values():
        assert figures["throughput"]["unit"] == "batch/s"
        assert figures["throughput"]["median"] > 0 and figures["tree_cpu_s"]["median"] > 0


def check_dali_side(result: dict) -> None:
    """The DALI side: the issue's target, whole batches, and all its work in the main process (DALI's threads)."""
    summary = result["summary"]
    assert target_of(result, "jpeg nw=2 dali", "throughput") == ">= 1.25x"
    assert target_of(result, "jpeg nw=2 dali/process", "throughput") is None
    assert summary["jpeg nw=2 dali"]["peak_footprint"]["candidate"] > 0
    for rec in (r for r in result["rounds"] if r["role"] == "dali"):
        assert rec["num_workers"] == 2 and rec["bytes"] == rec["batches"] * 64 * 3 * 224 * 224
        # No child process: getrusage(RUSAGE_SELF) and the process tree's /proc ticks see the same threads.
        assert rec["peak_procs"] == 1
        assert abs(rec["main_cpu_s"] - rec["tree_cpu_s"]) <= 0.05 + 0.1 * rec["tree_cpu_s"]


def test_jpeg_dali_crops_are_pils():
    """The DALI side's images are PIL's pixels: each a 224x224 window of the PIL-decoded file, flipped or not,
    bit for bit; over 64 images the flips go both ways and the corners spread over the image."""
    pytest.importorskip("PIL")
    if not _dali_importable():
        pytest.skip("fastfeed.dali does not import (NVIDIA DALI is not installed)")
    import numpy as np
    from PIL import Image

    from fastfeed.bench import workloads
    paths = workloads.jpeg_files()[:4]
    loader = workloads.dali_jpeg_loader(workloads.JpegDataset(64, paths), batch_size=64, num_workers=2)
    (images,) = next(iter(loader))
    loader.close()
    assert images.shape == (64, 3, 224, 224) and images.dtype == __import__("torch").uint8
    refs = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    found = [_window(refs[k % 4], images[k].permute(1, 2, 0).numpy()) for k in range(64)]
    assert None not in found
    flips = {flip for _, _, flip in found}
    ys, xs = [y for y, _, _ in found], [x for _, x, _ in found]
    assert flips == {False, True} and min(xs) < 0.3 < 0.7 < max(xs) and min(ys) < 0.3 < 0.7 < max(ys)


def _window(ref, crop):
    """``(y, x, flipped)`` of the window of ``ref`` (HWC) that ``crop`` is, corners as fractions of their range."""
    from numpy.lib.stride_tricks import sliding_window_view

    h, w = crop.shape[:2]
    # (y, x, channel, 8): the first 8 pixels of every window's top row, to find the candidates fast
    heads = sliding_window_view(ref[: ref.shape[0] - h + 1], 8, axis=1)[:, : ref.shape[1] - w + 1]
    for flipped, img in ((False, crop), (True, crop[:, ::-1])):
        for y, x in zip(*(heads == img[0, :8].T).all(axis=(2, 3)).nonzero()):
            if (ref[y : y + h, x : x + w] == img).all():
                return y / (ref.shape[0] - h), x / (ref.shape[1] - w), flipped
    return None


def test_prefetch(tmp_path, bench_env):
    """prefetch.py compares at each num_workers and prefetch_factor, in batches/s; the target is 0.97x each (one
    round)."""
    result = run_quick("prefetch", tmp_path, bench_env, "--num-workers", "1", "3", "--prefetch-factors", "1", "4",
                       "--rounds", "1")  # fmt: skip
    summary = result["summary"]
    assert set(summary) == {f"prefetch nw={nw} pf={pf}" for nw in (1, 3) for pf in (1, 4)}
    for key, figures in summary.items():
        assert figures["throughput"]["unit"] == "batch/s" and target_of(result, key, "throughput") == ">= 0.97x"
        assert figures["throughput"]["median"] > 0
    comps = {c["label"]: c["candidate_kwargs"] for c in result["params"]["comparisons"]}
    assert comps["nw=3 pf=4"] == {"num_workers": 3, "prefetch_factor": 4}
    assert result["workload"]["prefetch"]["persistent_workers"] is True
    assert result["workload"]["prefetch"]["batch_size"] == 16


def test_demo(tmp_path, bench_env):
    """demo.py runs the transport and overhead questions, prints one table row of figures per comparison (no
    target), runs a torch script unchanged and under `fastfeed run` (which replaces its loader and leaves nothing
    behind), and ends with the doctor's verdict on its built-in scenario. One round of the comparisons (--quick's
    is 2) of 5 timed batches (--quick's: 20 for transport, 200 for overhead): the table, figures and files are the
    same for any size."""
    proc = subprocess.run([sys.executable, str(BENCH / "demo.py"), "--quick", "--rounds", "1", "--warmup", "2",
                           "--batches", "5", "--mem-batches", "2", "--out", str(tmp_path)],
                          cwd=REPO, env=bench_env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(next(tmp_path.glob("demo-*.json")).read_text())
    assert len(result["summary"]) == 5 and result["params"]["rounds"] == 1
    assert all(key in proc.stdout for key in result["summary"])
    assert not TARGET.search(proc.stdout), [line for line in proc.stdout.splitlines() if TARGET.search(line)]
    example = json.loads((tmp_path / "fastfeed-run.json").read_text())
    assert example["summary"].startswith("fastfeed run: 1 of 1 DataLoader(s) replaced by fastfeed's")
    assert example["left"] == {"processes": 0, "segments": 0} and example["ratio"] > 0
    assert example["summary"] in proc.stdout
    report = json.loads((tmp_path / "doctor-demo" / "report.json").read_text())
    assert report["verdict"]["line"] in proc.stdout.split("fastfeed doctor --demo")[-1]
    assert (tmp_path / "doctor-demo" / "timeline.png").exists()


def test_gpu_check_without_cuda_says_so():
    """gpu_check.py on a machine without CUDA says that there is no CUDA device and exits 2, measuring nothing."""
    from fastfeed.bench.gpu.facade import gpu_present

    if __import__("torch").cuda.is_available() or gpu_present():
        pytest.skip("this machine has a GPU: gpu_check.py measures for real (bash scripts/gpu_check.sh)")
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2 and "no CUDA device here" in proc.stdout, proc.stdout + proc.stderr
