"""`fastfeed bench shards`: fastfeed.io.Shards against webdataset and Mosaic's streaming, end to end at --quick size,
and the parts of it that decide a figure (the cache simulation, the skip lines, the tables).

These check the harness and what its report holds, not speed: no figure is held to a target here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _first_run import TARGET
from fastfeed.bench import peers, report
from fastfeed.bench.suites import shards

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import targets  # noqa: E402  (benchmarks/targets.py: the project's targets, checked against a result)

sys.path.remove(str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory) -> tuple[dict, str]:
    """One ``fastfeed bench shards --quick`` run: its saved report and its output."""
    out = tmp_path_factory.mktemp("bench-shards")
    proc = subprocess.run([sys.executable, "-m", "fastfeed", "bench", "shards", "--quick", "--out", str(out)],
                          cwd=out, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("bench-*.json")
    return report.load(path), proc.stdout + proc.stderr


def test_quick_run_reports_every_figure_of_every_loader(quick_report):
    """A quick run measures every installed loader on HTTP and local disk, with every sample once per epoch (for
    fastfeed and webdataset), and no worker left behind."""
    rep, _ = quick_report
    res = rep["workloads"]["shards"]["result"]
    assert rep["workloads"]["shards"]["kind"] == "shards"
    loaders = res["params"]["loaders"]
    assert "fastfeed" in loaders and set(loaders) | set(res["skipped"]) == set(shards.LOADERS)
    n = res["params"]["samples"]
    for storage in ("http", "local"):
        part = res[storage]
        assert set(part["loaders"]) == set(loaders)
        for name, figs in part["loaders"].items():
            assert figs["samples_per_s"] > 0 and figs["ttfb_s"] > 0, (storage, name)
            for rec in figs["rounds"]:
                assert rec["leftover_procs"] == 0, (storage, name)
                if name != "mosaic":  # Mosaic may repeat a sample to even out its partitions
                    assert rec["samples"] == rec["unique"] == n, (storage, name, rec)
        assert set(part["vs"]) == set(loaders) - {"fastfeed"}
        for figs in part["vs"].values():
            assert figs["throughput"]["median"] > 0 and figs["ttfb"]["median"] > 0


def test_quick_run_resumes_and_counts_epoch_2s_downloads(quick_report):
    """Resume: fastfeed's resumed first batch is the batch the stopped run would have yielded next, webdataset says
    it has none; cache: fastfeed's own count of epoch 2's downloads is what the server sent, next to LRU's figure
    and the ideal."""
    rep, _ = quick_report
    res = rep["workloads"]["shards"]["result"]
    resume = res["resume"]
    assert resume["fastfeed"]["exact"] is True and resume["fastfeed"]["ratio"]["median"] > 0
    if "webdataset" in res["params"]["loaders"]:
        assert resume["webdataset"] == "no resume"
    cache = res["cache"]
    assert cache["ideal_bytes"] == cache["data_bytes"] - cache["cache_bytes"] > 0
    ff = cache["fastfeed"]
    assert ff["epoch2_bytes"] == ff["epoch2_served"] > 0
    assert cache["lru"]["epoch2_bytes"] > 0 and cache["belady"]["epoch2_bytes"] <= cache["lru"]["epoch2_bytes"]
    if "mosaic" in res["params"]["loaders"]:
        assert cache["mosaic"]["epoch2_bytes"] is not None or cache["mosaic"]["error"]
    assert res["shm_left"] == []


def test_quick_run_prints_its_tables_and_targets_read_them(quick_report):
    """The run prints the tables the README takes from the report (figures only), and benchmarks/targets.py finds
    the shards targets in the report."""
    rep, output = quick_report
    tables = report.markdown(rep, ["shards"])
    assert "| http | fastfeed.io.Shards |" in tables and "resumed at 50%" in tables and "(data - cache)" in tables
    assert not TARGET.search(tables) and not TARGET.search(output)
    found = {c.where for c in targets.checks(rep)}
    assert {"shards resume fastfeed", "shards cache fastfeed"} <= found
    assert any(w.startswith("shards http fastfeed/") for w in found) or not set(rep["workloads"]["shards"]["result"]
                                                                               ["http"]["vs"])  # fmt: skip


def test_lru_and_farthest_next_use_on_a_known_order():
    """The cache simulation: on a cyclic order over 3 shards with room for 2, LRU misses every time in epoch 2 and
    farthest next use (Belady) only once, and each epoch's bytes are counted apart."""
    uses = [[0, 1, 2], [0, 1, 2]]
    sizes = [10, 20, 30]
    assert shards.simulate(uses, sizes, capacity=50, policy="lru") == [60, 60]
    # Belady: epoch 1 evicts 1 (next used last) for 2; epoch 2 finds 0, evicts 0 (not used again) for 1, finds 2.
    assert shards.simulate(uses, sizes, capacity=50, policy="farthest") == [60, 20]
    assert shards.simulate(uses, sizes, capacity=60, policy="lru") == [60, 0]


def test_shard_uses_merge_consecutive_samples_of_a_shard():
    """Samples in the order yielded map to their shards by the index's starts, repeats in a row merged."""
    import numpy as np

    assert shards.shard_uses([0, 1, 5, 6, 2, 9], np.array([0, 4, 8])) == [0, 1, 0, 2]


def test_a_missing_peer_is_skipped_with_its_pip_line(monkeypatch):
    """Without webdataset or Mosaic's streaming, that loader is skipped with one line naming what to pip install."""
    monkeypatch.setattr(peers, "_found", lambda module: module != "streaming")
    lines = []
    loaders, skipped = shards._available(["fastfeed", "webdataset", "mosaic"], lines.append)
    assert loaders == ["fastfeed", "webdataset"]
    assert lines == ["# shards mosaic: skipped, it needs mosaicml-streaming, which is not installed: "
                     "pip install mosaicml-streaming"]  # fmt: skip
    assert skipped == {"mosaic": lines[0].split("it ", 1)[1]}


def test_mosaic_imports_with_the_torchvision_placeholder_only_where_torchvision_does_not():
    """`streaming.StreamingDataset` imports here; where torchvision cannot be imported, the placeholder stands in
    and says why if Mosaic's vision code ever touches it."""
    if peers.missing("mosaic"):
        pytest.skip(peers.missing("mosaic"))
    code = ("import sys\nfrom fastfeed.bench import peers\ns = peers.import_streaming()\n"
            "print(s.StreamingDataset.__name__)\ntv = sys.modules['torchvision']\n"
            "print(getattr(tv, '__fastfeed_placeholder__', False))\n"
            "if getattr(tv, '__fastfeed_placeholder__', False):\n"
            "    try:\n        tv.datasets.VisionDataset()\n    except ImportError as e:\n        print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "StreamingDataset"
    real = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0
    assert lines[1] == str(not real)
    if not real:
        assert "placeholder" in lines[2] and "MosaicML Streaming" in lines[2]


def test_markdown_and_rows_of_a_shards_result():
    """The tables and the CSV rows of a shards result: ratios to each peer, resume, cache against the ideal."""
    loaders = {n: {"samples_per_s": v, "mb_per_s": v / 10, "ttfb_s": 0.1} for n, v in
               (("fastfeed", 3000.0), ("webdataset", 1000.0))}  # fmt: skip
    vs = {"webdataset": {"throughput": {"median": 3.0, "min": 2.5, "max": 3.5},
                         "ttfb": {"median": 1.0, "min": 1.0, "max": 1.0}}}  # fmt: skip
    res = {"workload": "shards", "http": {"loaders": loaders, "vs": vs},
           "resume": {"fastfeed": {"start_ttfb_s": 0.1, "resume_ttfb_s": 0.12,
                                   "ratio": {"median": 1.2, "min": 1.1, "max": 1.3}, "exact": True},
                      "webdataset": "no resume"},
           "cache": {"data_bytes": 200e6, "cache_bytes": 100e6, "ideal_bytes": 100e6,
                     "fastfeed": {"epoch2_bytes": 105e6}, "lru": {"epoch2_bytes": 200e6, "how": "simulated"}}}
    rep = {"workloads": {"shards": {"kind": "shards", "result": res}}}
    text = report.markdown(rep)
    assert "| http | webdataset | 1,000 (100 MB/s) | **3.00x** (2.50-3.50) | 100 ms | 1.00x (1.00-1.00) |" in text
    assert "| fastfeed.io.Shards | 100 ms | 120 ms | **1.20x** (1.10-1.30) | yes |" in text
    assert "| webdataset | - | no resume | - | - |" in text
    assert "| LRU: simulated | 200 MB | **2.00x** |" in text and "| 105 MB | **1.05x** |" in text
    rows = {(r["key"], r["figure"]): r["median"] for r in report.figure_rows(rep)}
    assert rows[("http fastfeed/webdataset", "throughput")] == 3.0
    assert rows[("resume fastfeed", "resume_ttfb")] == 1.2 and rows[("cache fastfeed", "epoch2_bytes")] == 1.05
    assert not TARGET.search(text)
    found = {(c.where, c.ok) for c in targets.checks(res)}
    assert found == {("shards http fastfeed/webdataset", True), ("shards resume fastfeed", True),
                     ("shards cache fastfeed", True)}  # fmt: skip
    json.dumps(res)
