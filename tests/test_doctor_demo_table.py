"""The demo's table (benchmarks/demo.py, which runs the doctor last): labels apart from their figures, and each
transport row saying what it compares and why it differs from the README's row of that name."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

# Loaded by its path, not by putting benchmarks/ on sys.path: its ray.py would then shadow Ray for every later test.
_spec = importlib.util.spec_from_file_location("demo", Path(__file__).resolve().parent.parent / "benchmarks" / "demo.py")
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)

pytestmark = pytest.mark.fastfeed_only

LONG = "transport nw=2 vs torch nw=0"  # 28 characters: as wide as the label column was


def _stat(median: float) -> dict:
    return {"median": median, "min": median / 2, "max": median * 2, "candidate": 3.5, "baseline": 0.19, "unit": "GB/s"}


def _summary(*keys: str) -> dict:
    return {key: {"throughput": _stat(18.39), **{f: _stat(1.0) for f, _ in demo.COLUMNS}} for key in keys}


def test_a_label_as_long_as_the_old_column_is_apart_from_its_ratio_and_the_columns_line_up():
    """Every row's label ends at least two spaces before its throughput, and each row's figures end where the
    header's titles do, whatever the longest label."""
    for keys in ((LONG, "transport nw=2"), (LONG + " epochs of 300", "overhead nw=0")):
        rows = demo.table(_summary(*keys), ("fastfeed", "torch")).splitlines()
        header, body = rows[1], rows[2:]
        for key, row in zip(keys, body):
            assert re.match(re.escape(key) + r"  +18\.39x \(9\.20-36\.78\)", row), row
            # the throughput column ends under its title
            assert row.index("18.39x") + len("18.39x (9.20-36.78)") == header.index("throughput") + len("throughput")
        assert "nw=018" not in "\n".join(rows)


def test_each_transport_row_says_what_it_compares_and_why_the_readmes_figure_differs():
    """A quick steady-state run's "nw=2 vs torch nw=0" row names its settings and the README's epochs rows, whose
    worker starts torch at nw=0 never pays; an epochs row names the README's row of that name; overhead rows,
    not in the README, get no note."""
    opts = {"warmup": 3, "batches": 20, "epoch_batches": [0]}
    notes = demo.readme_notes([LONG, "overhead nw=0"], opts, 2)
    assert notes[0].startswith("Transport rows against the README's") and len(notes) == 2, notes
    line = notes[1]
    assert line.startswith(f"  {LONG}: fastfeed at nw=2 against torch loading in the main process (nw=0), steady "
                           "state"), line
    assert "20 batches timed after 3 untimed, 2 rounds" in line
    assert '"nw=2 vs torch nw=0 epochs of 60" and "nw=2 vs torch nw=0 epochs of 300"' in line
    assert "worker start, which torch at nw=0 never pays" in line and "warm-up weigh more" in line
    full = demo.readme_notes([LONG + " epochs of 60"], {"warmup": 10, "batches": 200, "epoch_batches": [60]}, 5)
    assert "whole epochs of 60 batches" in full[1] and "row of this name" in full[1] and "warm-up" not in full[1]
    assert demo.readme_notes(["overhead nw=0"], opts, 2) == []
