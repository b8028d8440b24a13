"""fastfeed bench's PNG plots from small synthetic reports: ratios to torch as bars, throughput by num_workers."""

import struct
import subprocess
import sys

import pytest
from matplotlib.figure import Figure

from fastfeed.bench import plot

pytestmark = [pytest.mark.fastfeed_only, pytest.mark.usefixtures("fonts_open")]  # fonts: see conftest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _stat(median, candidate, baseline, unit="batch/s"):
    """One figure of a runner summary: the ratio's median, a min-max around it, and the sides' absolute medians."""
    return dict(median=median, min=None if median is None else median * 0.9,
                max=None if median is None else median * 1.1, candidate=candidate, baseline=baseline, unit=unit)


def _comparison(name, nws, *, thread=False, vs_torch0=False, unit="batch/s"):
    """A runner result for workload ``name`` at worker counts ``nws``: fastfeed against torch at each (torch at 100
    batch/s per worker, plus 100), with a thread variant and its ratio to the processes where asked, and transport's
    "nw=N vs torch nw=0" comparisons."""
    summary, pairs = {}, {}

    def add(key, label, num, den, nw, median, cand, base):
        summary[key] = {"throughput": _stat(median, cand, base, unit), "main_cpu_s": _stat(0.5, 1.0, 2.0, "s")}
        pairs[key] = dict(comparison=label, num=num, den=den, num_workers=nw)

    for nw in nws:
        torch_rate, proc = 100.0 * nw + 100, ("fastfeed-process" if nw and thread else "fastfeed")
        add(f"{name} nw={nw}", f"nw={nw}", proc, "torch", nw, 2.0, 2 * torch_rate, torch_rate)
        if thread and nw:
            add(f"{name} nw={nw} thread", f"nw={nw}", "fastfeed-thread", "torch", nw, 0.5, torch_rate / 2, torch_rate)
            add(f"{name} nw={nw} thread/process", f"nw={nw}", "fastfeed-thread", proc, nw, 0.25, 50.0, 200.0)
        if vs_torch0 and nw:
            add(f"{name} nw={nw} vs torch nw=0", f"nw={nw} vs torch nw=0", "fastfeed", "torch", nw, 3.0, 300.0, 100.0)
    return {"workload": {name: {"unit": unit}}, "summary": summary, "pairs": pairs}


FILES = {
    "http": {"torch": {"files_per_s": 100, "mb_per_s": 10},
             "readahead": {"files_per_s": 700, "mb_per_s": 70, "ratio": 7.0, "min": 6.5, "max": 7.5},
             "cached": {"files_per_s": 2000, "mb_per_s": 200, "ratio": 20.0, "min": 18.0, "max": 21.0}},
    "tokens": {"fastfeed": 18000, "torch": 12000, "ratio": 1.5, "min": 1.3, "max": 1.7, "mb_per_s": 70},
}  # fmt: skip
TUNE = {"rows": [{"workload": "(a) cpu", "throughput_ratio": 0.99, "time_ratio": 0.28},
                 {"workload": "(b) io", "throughput_ratio": 0.96, "time_ratio": 0.41}]}  # fmt: skip


def _report(**workloads):
    """A bench report holding ``workloads``: name -> (kind, result)."""
    return {"schema": "fastfeed.bench/1", "command": "fastfeed bench --quick", "time": "2026-12-01T00:00:00+0000",
            "workloads": {name: {"kind": kind, "result": result} for name, (kind, result) in workloads.items()}}


def _save(report, out_dir, monkeypatch) -> dict:
    """Save ``report``'s plots; return, per file name, each subplot's words (title, labels, ticks, texts) and its
    labelled lines (label: (x, y)), as saved; and check each file is a PNG of sensible size."""
    drawn = {}
    save = Figure.savefig

    def spy(fig, path, *args, **kwargs):
        drawn[path.name] = [_contents(ax) for ax in fig.axes if ax.get_visible()]
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    paths = plot.save(report, out_dir)
    assert [p.name for p in paths] == list(drawn)
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC
        width, height = struct.unpack(">II", data[16:24])
        assert 400 <= width <= 4000 and 300 <= height <= 4000
        assert 10_000 < len(data) < 5_000_000
    return drawn


def _contents(ax) -> dict:
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    legend = ax.get_legend()
    words = [ax.get_title(loc="left"), ax.get_xlabel(), ax.get_ylabel(), *ticks, *(t.get_text() for t in ax.texts)]
    words += [t.get_text() for t in legend.get_texts()] if legend else []
    lines = {line.get_label(): tuple(map(list, line.get_data())) for line in ax.lines if line.get_label()[0] != "_"}
    return {"words": words, "ticks": ticks, "lines": lines, "bars": [p.get_height() for p in ax.patches]}


def test_every_kind_gets_bars_against_its_reference(tmp_path, monkeypatch):
    """Each workload's subplot has a bar per ratio to torch (none for fastfeed against itself), its value, its unit
    and the reference line; files and tune get theirs, the tuner's against the grid's best."""
    report = _report(text=("comparison", _comparison("text", [0, 2], thread=True)), files=("files", FILES),
                     tune=("tune", TUNE))  # fmt: skip
    drawn = _save(report, tmp_path, monkeypatch)
    text, files, tune = drawn["bench-throughput.png"]
    assert text["ticks"] == ["nw=0\nfastfeed", "nw=2\nfastfeed-process", "nw=2\nfastfeed-thread"]
    assert text["bars"] == [2.0, 2.0, 0.5]
    assert {"text (throughput in batch/s)", "throughput / torch (same run)", "2.00x", "0.50x", "torch\n= 1.0"} <= set(
        text["words"])  # fmt: skip
    assert files["ticks"] == ["http\nreadahead", "http\ncached", "tokens\nArrayFiles"]
    assert {"7.00x", "20.00x", "1.50x", "files (throughput in files/s, windows/s)"} <= set(files["words"])
    assert tune["bars"] == [0.99, 0.96]
    assert {"grid best\n= 1.0", "throughput / grid best (same run)", "0.99x"} <= set(tune["words"])
    assert any("0.28x" in t for t in tune["ticks"])


def test_several_worker_counts_draw_throughput_curves(tmp_path, monkeypatch):
    """Over several worker counts each loader gets a line of its absolute throughput, fastfeed's worker types each
    starting from its plain point at nw=0, where there are no workers."""
    report = _report(text=("comparison", _comparison("text", [0, 1, 2], thread=True)),
                     files=("files", FILES))  # fmt: skip
    drawn = _save(report, tmp_path, monkeypatch)
    (text,) = drawn["bench-workers.png"]
    assert {"num_workers", "throughput (batch/s)"} <= set(text["words"])
    assert text["lines"]["torch"] == ([0, 1, 2], [100.0, 200.0, 300.0])
    assert text["lines"]["fastfeed-process (nw=0: fastfeed)"] == ([0, 1, 2], [200.0, 400.0, 600.0])
    assert text["lines"]["fastfeed-thread (nw=0: fastfeed)"] == ([0, 1, 2], [200.0, 100.0, 150.0])
    assert "fastfeed" not in text["lines"]  # its one point is the start of the others


def test_one_worker_count_draws_no_curves(tmp_path, monkeypatch):
    """With one worker count per workload, a comparison against torch at other workers included, there is no curve
    to draw: only the throughput plot is written."""
    report = _report(transport=("comparison", _comparison("transport", [2], vs_torch0=True)), tune=("tune", TUNE))
    drawn = _save(report, tmp_path, monkeypatch)
    assert list(drawn) == ["bench-throughput.png"]
    assert not (tmp_path / "bench-workers.png").exists()
    assert drawn["bench-throughput.png"][0]["ticks"] == ["nw=2\nfastfeed", "nw=2\nvs torch nw=0\nfastfeed"]


def test_unmeasured_and_unknown_workloads_still_draw(tmp_path, monkeypatch):
    """A ratio not measured says n/a, an unknown kind is left out, and a report without workloads still gets its
    one PNG, saying so."""
    result = _comparison("mine", [0])
    result["summary"]["mine nw=0"]["throughput"] = _stat(None, None, None)
    drawn = _save(_report(mine=("comparison", result), later=("someday", {})), tmp_path / "a", monkeypatch)
    (mine,) = drawn["bench-throughput.png"]
    assert "n/a" in mine["words"] and mine["bars"] == []
    drawn = _save(_report(), tmp_path / "b", monkeypatch)
    assert "no workloads in this report" in drawn["bench-throughput.png"][0]["words"]


def test_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    """Without matplotlib, save raises ImportError naming the fastfeed[plot] extra, and writes nothing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'fastfeed\[plot\]'"):
        plot.save(_report(tune=("tune", TUNE)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_save_leaves_pyplot_alone(tmp_path):
    """Plotting never imports pyplot (checked in a fresh interpreter, where nothing else has)."""
    code = (
        "import sys\n"
        "from fastfeed.bench import plot\n"
        "plot.save({'workloads': {'tune': {'kind': 'tune', 'result': {'rows': []}}}}, sys.argv[1])\n"
        "print('pyplot' if 'matplotlib.pyplot' in sys.modules else 'clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["clean"]
    assert (tmp_path / "bench-throughput.png").read_bytes()[:8] == PNG_MAGIC
