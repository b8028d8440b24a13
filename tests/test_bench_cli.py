"""`fastfeed bench`: the user's dataset end to end, outputs, --compare on an injected regression, and the
tables of the README and the documentation pages against the reports they came from."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastfeed.bench import report

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.fastfeed_only

MYDATA = '''
import torch
from torch.utils.data import Dataset, DataLoader

class Squares(Dataset):
    def __len__(self):
        return 50
    def __getitem__(self, i):
        return torch.full((8,), float(i * i))

def make_dataset():
    return Squares()

loader = DataLoader(Squares(), batch_size=5, num_workers=1)
'''


def bench(tmp_path, *args, check=True):
    (tmp_path / "mydata.py").write_text(MYDATA)
    proc = subprocess.run([sys.executable, "-m", "fastfeed", "bench", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=280, env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def bench_here(tmp_path, monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """``fastfeed bench ARGS`` in this process, from ``tmp_path`` (as ``python -m fastfeed`` runs it: its exit status
    is main's return): its status, stdout and stderr. For the commands that run no loader, which would otherwise
    spend seconds importing torch in a fresh interpreter to say one line."""
    from fastfeed import cli

    (tmp_path / "mydata.py").write_text(MYDATA)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # restored after the test: bench adds the working directory itself
    capsys.readouterr()
    try:
        code = cli.main(["bench", *args])
    finally:
        sys.modules.pop("mydata", None)  # the next test's mydata.py is another file
    out, err = capsys.readouterr()
    return code, out, err


def saved(tmp_path) -> dict:
    (path,) = (tmp_path / "out").glob("bench-*.json")
    return report.load(path)


@pytest.mark.hang_limit(300)
def test_a_users_dataset_at_several_worker_counts(tmp_path):
    """module:attr with --num-workers 0,2,4 --plot: one comparison per count, JSON, CSV and PNGs, a markdown table."""
    proc = bench(tmp_path, "mydata:make_dataset", "--num-workers", "0,2,4", "--quick", "--rounds", "1", "--plot",
                 "--markdown", "--out", "out")  # fmt: skip
    rep = saved(tmp_path)
    result = rep["workloads"]["make_dataset"]["result"]
    assert {p["comparison"] for p in result["pairs"].values()} == {"nw=0", "nw=2", "nw=4"}
    assert {p["num"] for p in result["pairs"].values()} >= {"fastfeed", "fastfeed-process", "fastfeed-thread"}
    assert result["workload"]["make_dataset"]["samples"] == 50
    assert rep["command"].startswith("fastfeed bench mydata:make_dataset") and rep["machine"]["topology"]
    rows = list(csv.DictReader(open(next((tmp_path / "out").glob("bench-*.csv")))))
    assert any(r["figure"] == "throughput" and r["key"] == "make_dataset nw=2" for r in rows)
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert pngs == ["bench-throughput.png", "bench-workers.png"]
    assert "| nw=4 | fastfeed-process |" in proc.stdout


@pytest.mark.hang_limit(300)
def test_a_users_dataloader_keeps_its_arguments_and_a_step_reports_stalls(tmp_path):
    """A DataLoader attr gives its batch size and worker count; --step adds the stall fraction of both loaders."""
    bench(tmp_path, "mydata:loader", "--quick", "--rounds", "1", "--step", "0.002", "--loaders", "torch,fastfeed",
          "--out", "out")  # fmt: skip
    result = saved(tmp_path)["workloads"]["loader"]["result"]
    assert result["workload"]["loader"]["batch_size"] == 5
    assert list(result["pairs"]) == ["loader nw=1"]  # the loader's own count; no thread side asked for
    stall = result["summary"]["loader nw=1"]["stall"]
    assert stall["candidate"] is not None and stall["baseline"] is not None


def test_bad_input_is_named(tmp_path, monkeypatch, capsys):
    """An unknown loader, a bad worker count, a missing attribute and a non-dataset each get a clear error."""
    for args, message in [(["overhead", "--loaders", "torch,jax"], "unknown ['jax']"),
                          (["overhead", "--num-workers", "two"], "'two' is neither a count"),
                          (["mydata:nothing"], "has no attribute 'nothing'"),
                          (["mydata"], "a dataset is given as module:attr"),
                          (["overhead", "--num-workers", "auto"], "auto is for your own dataset")]:  # fmt: skip
        code, _, err = bench_here(tmp_path, monkeypatch, capsys, *args)
        assert code == 2 and message in err, (args, err[-2000:])


def _report(throughput: float, cpu: float) -> dict:
    figs = {"throughput": dict(median=throughput, min=throughput, max=throughput, candidate=1.0, baseline=1.0,
                               unit="batch/s"),
            "tree_cpu_s": dict(median=cpu, min=cpu, max=cpu, candidate=1.0, baseline=1.0, unit="s")}  # fmt: skip
    result = {"summary": {"w nw=2": figs}, "pairs": {"w nw=2": dict(comparison="nw=2", num="fastfeed", den="torch",
                                                                    num_workers=2)}}  # fmt: skip
    return {"schema": report.SCHEMA, "workloads": {"w": {"kind": "comparison", "result": result}}}


@pytest.mark.parametrize("throughput,cpu,code", [(2.0, 0.5, 0), (1.5, 0.5, 1), (2.0, 0.7, 1), (2.1, 0.45, 0)])
def test_compare_exits_nonzero_on_a_regression(tmp_path, monkeypatch, capsys, throughput, cpu, code):
    """--compare: throughput down or CPU up by more than 10% is a regression (exit 1); within it, exit 0."""
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(_report(2.0, 0.5)))
    new.write_text(json.dumps(_report(throughput, cpu)))
    status, out, err = bench_here(tmp_path, monkeypatch, capsys, "--compare", str(old), str(new))
    assert status == code, out + err
    assert ("REGRESSION" in out) == bool(code)


BLOCK = re.compile(r"<!-- fastfeed bench --from (\S+) --markdown ?([^>]*?) -->\n(.*?)\n<!-- end -->", re.S)


def _pages():
    """The README and every Markdown page of the documentation site: where tables of figures may appear."""
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


def test_readme_tables_come_from_the_committed_reports():
    """Every table of figures in the README and the documentation pages sits in a block naming a committed report,
    and equals --markdown of it; the README holds the headline one, and every committed report is shown."""
    assert BLOCK.findall((REPO / "README.md").read_text()), "the README has no generated tables"
    shown = set()
    for page in _pages():
        text = page.read_text()
        for path, names, table in BLOCK.findall(text):
            rep = report.load(REPO / path)
            assert table == report.markdown(rep, names.split() or None), (page, path, names)
            shown.add(path)
        outside = BLOCK.sub("", text)
        # A row holding a ratio ("| transport nw=2 | 1.84x |"): a figure typed in, not generated.
        stray = [line for line in outside.splitlines() if re.match(r"\|.*\d(\.\d+)?x\b", line)]
        assert not stray, f"{page}: tables of figures outside generated blocks: {stray[:3]}"
    committed = {str(p.relative_to(REPO)) for p in (REPO / "docs" / "bench").glob("*.json")}
    assert committed <= shown, f"committed reports no page shows: {committed - shown}"


def test_markdown_of_a_saved_report(tmp_path):
    """--from REPORT --markdown prints the tables again without running anything (as a user runs it: a command of
    its own)."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_report(2.0, 0.5)))
    proc = bench(tmp_path, "--from", str(path), "--markdown")
    assert "| nw=2 | fastfeed | **2.00x** (2.00-2.00) |" in proc.stdout
