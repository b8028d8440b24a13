"""Every command works on a plain `pip install fastfeed`, or says which extra it needs.

Each command runs in a subprocess whose imports are those of a base install: a sitecustomize (tests/_first_run.py)
refuses aiohttp, matplotlib, pynvml, Pillow, NVIDIA DALI and Accelerate in it and in every Python process it starts.
A standard workload whose extra is missing is skipped with one line naming it, and the run and its report go on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _first_run import BASE_INSTALL, TARGET

REPO = Path(__file__).resolve().parent.parent
DATASET = """
import torch
class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 256
    def __getitem__(self, i):
        return torch.full((8,), float(i))
dataset = Numbers()
"""
TRAIN = """
from torch.utils.data import DataLoader
from numbers_ds import Numbers
print("batches", sum(1 for _ in DataLoader(Numbers(), batch_size=32, num_workers=1)))
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    """The environment of a base install, and a working directory with a dataset module and a torch script."""
    site, work = tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("work")
    (site / "sitecustomize.py").write_text(BASE_INSTALL)
    (work / "numbers_ds.py").write_text(DATASET)
    (work / "train.py").write_text(TRAIN)
    env = dict(os.environ, FASTFEED_CACHE_DIR=str(work / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"env": env, "cwd": work}


def fastfeed(base: dict, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastfeed", *args], cwd=base["cwd"], env=base["env"],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def check_says_extras(out: str) -> None:
    """Every line naming a pip install names one of fastfeed's extras, and no path of anyone's checkout."""
    for line in out.splitlines():
        if "pip install" in line:
            assert "pip install 'fastfeed[" in line or "pip install fastfeed[" in line, line
            assert ".venv" not in line and str(REPO) not in line, line


def test_the_optional_packages_are_refused(base):
    """The check can fail: in that environment the optional packages neither import nor are found."""
    code = ("import importlib.util\nfor m in ('aiohttp', 'matplotlib', 'pynvml', 'PIL', 'nvidia.dali', 'accelerate'):\n"
            "    assert importlib.util.find_spec(m) is None, m\n"
            "    try:\n        __import__(m)\n    except ModuleNotFoundError:\n        pass\n"
            "    else:\n        raise SystemExit(m + ' imported')\nprint('refused')")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=base["env"], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "refused", proc.stderr


def test_bench_skips_what_needs_an_extra_and_writes_its_report(base, tmp_path):
    """fastfeed bench --quick: jpeg (Pillow) is skipped and files runs without its HTTP part (aiohttp), each with one
    line naming the extra; the other workloads run, the report is written, the plots say what they need. One round,
    overhead at nw=2 alone (--num-workers applies to the comparison workloads: files runs as it does)."""
    proc = fastfeed(base, "bench", "--quick", "jpeg", "files", "overhead", "--rounds", "1", "--num-workers", "2",
                    "--out", str(tmp_path), timeout=240)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert "# jpeg: skipped, it needs Pillow, which is not installed: pip install 'fastfeed[bench]'" in lines
    assert "# files http: skipped, it needs aiohttp, which is not installed: pip install 'fastfeed[remote]'" in lines
    assert sum("skipped" in line for line in lines) == 2
    assert "# no plots: fastfeed bench's plots need matplotlib: pip install 'fastfeed[plot]'" in lines
    (path,) = tmp_path.glob("bench-*.json")
    rep = json.loads(path.read_text())
    assert set(rep["workloads"]) == {"files", "overhead"}
    assert set(rep["workloads"]["files"]["result"]) == {"local", "tokens"}
    assert set(rep["workloads"]["overhead"]["result"]["summary"]) == {"overhead nw=2"}
    assert rep["workloads"]["overhead"]["result"]["summary"]["overhead nw=2"]["throughput"]["median"] > 0
    check_says_extras(out)
    assert not TARGET.search(proc.stdout), [line for line in lines if TARGET.search(line)]


def test_bench_plot_and_markdown_of_a_report(base, tmp_path):
    """--plot of a saved report names the [plot] extra (exit 2); its tables print without any extra."""
    proc = fastfeed(base, "bench", "--from", str(REPO / "docs/bench/standard.json"), "--plot", "--out", str(tmp_path))
    assert proc.returncode == 2 and "pip install 'fastfeed[plot]'" in proc.stderr, proc.stdout + proc.stderr
    check_says_extras(proc.stderr)
    proc = fastfeed(base, "bench", "--from", str(REPO / "docs/bench/standard.json"), "--markdown", "transport")
    assert proc.returncode == 0 and "| nw=2 epochs of 60 | fastfeed |" in proc.stdout, proc.stderr


def test_doctor_writes_its_report_without_the_png(base, tmp_path):
    """fastfeed doctor --out writes the report, trace and text, and says the PNG needs the [plot] extra."""
    proc = fastfeed(base, "doctor", "--steps", "40", "--no-whatif", "--out", str(tmp_path / "doc"), "--demo",
                    timeout=180)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert {p.name for p in (tmp_path / "doc").iterdir()} >= {"report.json", "report.txt", "trace.json"}
    assert "pip install 'fastfeed[plot]'" in out and "verdict:" in out
    check_says_extras(out)
    assert not TARGET.search(out)


def test_tune_info_and_run(base, tmp_path):
    """fastfeed tune measures and saves a config, fastfeed info says what is missing, fastfeed run replaces a torch
    script's loader."""
    proc = fastfeed(base, "tune", "numbers_ds:dataset", "--batch-size", "32", "--max-workers", "1", "--budget", "20",
                    "--out", str(tmp_path / "loader.json"), timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "num_workers" in json.loads((tmp_path / "loader.json").read_text())["loader_kwargs"]
    proc = fastfeed(base, "info", "--json")
    assert proc.returncode == 0, proc.stderr
    available = json.loads(proc.stdout)["available"]
    assert available["dali"] is None and "not installed" in available["nvml"], available
    proc = fastfeed(base, "run", "train.py")
    assert proc.returncode == 0 and "batches 8" in proc.stdout, proc.stderr[-3000:]
    assert "fastfeed run: 1 of 1 DataLoader(s) replaced" in proc.stderr


def test_imports(base):
    """fastfeed.io and fastfeed.accelerate import without their extras; fastfeed.dali raises an ImportError that
    names its extra."""
    code = ("import fastfeed, fastfeed.io, fastfeed.accelerate, fastfeed.doctor, fastfeed.bench.suites.files\n"
            "try:\n    import fastfeed.dali\nexcept ImportError as e:\n    print(e)\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=base["env"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pip install 'fastfeed[dali]'" in proc.stdout
    check_says_extras(proc.stdout)
