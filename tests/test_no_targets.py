"""What users see holds measured figures only: no development target (a bar) and no pass/miss word.

The targets live in benchmarks/targets.py, which checks them against a report; fastfeed bench, the demo, the doctor
and the README's and the documentation's tables never print them. The developer's GPU verification tool (scripts/gpu_check.sh over
fastfeed/bench/gpu/ and suites/gpu.py, and its developer page docs/gpu-check.md), which exits non-zero on a missed
bar, is the one exception.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from _first_run import TARGET
from fastfeed.bench import report

REPO = Path(__file__).resolve().parent.parent
GPU_TOOL = (REPO / "fastfeed" / "bench" / "suites" / "gpu.py", REPO / "fastfeed" / "bench" / "gpu")
GPU_PAGE = REPO / "docs" / "gpu-check.md"  # the GPU tool's developer page: its pass marks are its subject
BLOCK = re.compile(r"<!-- fastfeed bench --from (\S+) --markdown ?([^>]*?) -->\n(.*?)\n<!-- end -->", re.S)


def test_the_pattern_finds_what_main_printed():
    """The check can fail: it finds the bars and words the README and `fastfeed bench` used to print."""
    for seen in ("**2.87x** (1.88-3.80; bar >=6.0x missed)", "bar <=0.5x MISSED", "bar >=1.25x ok",
                 "(bar: <= 1.0x torch)", "[throughput ok time MISS]", "ok/FAIL"):
        assert TARGET.search(seen), seen
    for fine in ("a progress bar on a terminal", "the bars the median over rounds", "**2.87x** (1.88-3.80)"):
        assert not TARGET.search(fine), fine


def test_readme_has_no_target():
    """The README's and the documentation pages' tables (generated from the committed reports) and their prose, the
    section on the GPU check too, carry no bar or pass/miss word: those are in the GPU tool's developer page."""
    readme = (REPO / "README.md").read_text()
    assert "gpu_check" in readme and TARGET.search(GPU_PAGE.read_text()), "the GPU tool's page holds its bars"
    pages = [REPO / "README.md"] + sorted(p for p in (REPO / "docs").rglob("*.md") if p != GPU_PAGE)
    assert len(pages) > 10, "the documentation pages are found"
    blocks = []
    for page in pages:
        text = page.read_text()
        tables = [line for line in text.splitlines() if line.startswith("|")]
        assert not [line for line in tables if TARGET.search(line)], page
        hits = [line for line in text.splitlines() if TARGET.search(line)]
        assert not hits, (page, hits[:5])
        made = [line for line in text.splitlines() if re.search(r"\bsessions?\b", line, re.I)]
        assert not made, (page, made[:5])  # the pages speak of fastfeed, not of how it was written
        blocks += BLOCK.findall(text)
    assert [line for line in readme.splitlines() if line.startswith("|")] and BLOCK.findall(readme)
    for path, names, _ in blocks:
        tables = report.markdown(report.load(REPO / path), names.split() or None)
        assert not TARGET.search(tables), path


def test_committed_report_holds_figures_only():
    """The committed report and its CSV keep figures, not the targets' verdicts."""
    rep = (REPO / "docs" / "bench" / "standard.json").read_text()
    assert not re.search(r'"(bar|meets_bar|bars|variant_bars|checks)"', rep)
    header = (REPO / "docs" / "bench" / "standard.csv").read_text().splitlines()[0]
    assert "bar" not in header


@pytest.mark.parametrize("path", sorted(p for p in (REPO / "fastfeed").rglob("*.py")
                                         if p != GPU_TOOL[0] and GPU_TOOL[1] not in p.parents)
                         + [REPO / "benchmarks" / "demo.py"], ids=lambda p: str(p.relative_to(REPO)))
def test_no_source_of_user_facing_output_names_a_target(path):
    """No module of fastfeed (its commands' output, their --help, its docstrings) nor the demo names a bar or a
    pass/miss word; benchmarks/targets.py holds the targets."""
    hits = [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1) if TARGET.search(line)]
    assert not hits, hits[:5]


def test_printed_figures_and_tables_carry_no_target():
    """A comparison's printed lines, its README table and the demo's table show the figures alone."""
    from fastfeed.bench import comparison, summary, workloads

    wl = workloads.Workload("toy", lambda n: None, {}, "batch/s")
    comp = comparison.Comparison(wl, "nw=2", {"num_workers": 2}, {"num_workers": 2}, 1, 2, 0)
    records = [dict(round=r, role=role, batches_per_s=v, ttfb_s=0.1, pss_delta_mb=5.0) for r in range(2)
               for role, v in (("candidate", 3.0), ("baseline", 1.0))]
    figs = summary.summarize(comp, records)
    assert figs["throughput"]["median"] == 3.0 and not {"bar", "meets_bar"} & set(figs["throughput"])
    lines = [summary.format_line("toy nw=2", f, figs[f], ("fastfeed", "torch")) for f in figs]
    assert "median 3.00x" in lines[0] and not any(TARGET.search(line) for line in lines)
    pairs = {"toy nw=2": {"comparison": "nw=2", "num": "fastfeed", "den": "torch"}}
    rep = {"workloads": {"toy": {"kind": "comparison", "result": {"summary": {"toy nw=2": figs}, "pairs": pairs}}}}
    assert "**3.00x**" in report.markdown(rep) and not TARGET.search(report.markdown(rep))
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import demo
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    table = demo.table({"toy nw=2": figs}, ("fastfeed", "torch"))
    assert "3.00x" in table and not TARGET.search(table)


def test_targets_still_check_a_report():
    """benchmarks/targets.py finds each target the committed report answers and says whether it was met."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import targets
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    committed = json.loads((REPO / "docs" / "bench" / "standard.json").read_text())
    found = {(c.where, c.what): c.ok for c in targets.checks(committed)}
    assert found[("transport nw=2 epochs of 60", "throughput >= 6.0x")] is False  # 2.87x in the committed run
    assert found[("jpeg nw=2 dali", "throughput >= 1.25x")] is True  # 1.66x
    assert found[("files http readahead", "files/s >= 4.0x torch")] is True
    assert ("tune (c) step", "not input-bound, said in < 10 s") in found
    assert len(found) > 20
