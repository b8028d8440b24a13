"""The doctor's outputs from synthetic timelines: the PNG timeline (matplotlib, never pyplot) and the Perfetto trace."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from matplotlib.figure import Figure

from fastfeed.doctor import plot, trace
from fastfeed.doctor.timeline import EpochRecord, LoaderRecord, Timeline, WorkerRecord

pytestmark = [pytest.mark.fastfeed_only, pytest.mark.usefixtures("fonts_open")]  # fonts: see conftest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EPOCHS, BATCHES, WORKERS = 2, 40, 2
PIDS = [4000 + w for w in range(WORKERS)]
START = 50.0


def _timeline(*, gpu: bool = True, kind: str = "fastfeed", batches: int = BATCHES) -> Timeline:
    """2 epochs of ``batches`` batches, a stall every tenth one, samples each 0.1 s; fastfeed's has worker records (the
    first batch's end unknown), torch's only its workers' pids and their CPU in the samples."""
    t = START
    rec = LoaderRecord(id=0, kind=kind, made_at="train.py:12", num_workers=WORKERS, prefetch_factor=2, batch_size=8)
    for _ in range(EPOCHS):
        ep = EpochRecord(ready=[] if kind == "fastfeed" else None, pids=PIDS)
        for i in range(batches):
            wait = 0.04 if i % 10 == 0 else 0.001
            ep.asks.append(t)
            ep.returns.append(t + wait)
            if ep.ready is not None:
                ep.ready.append(0 if wait > 0.01 else 1)
            t += wait + 0.02
        if kind == "fastfeed":
            ep.h2d = [0.002] * batches
            for w in range(WORKERS):
                ends = ep.returns[w::WORKERS]  # each worker's batch done when it was returned
                ep.workers.append(WorkerRecord([0.015] * len(ends), [0.003] * len(ends), list(ends)))
        rec.epochs.append(ep)
        t += 0.3
    if kind == "fastfeed":
        rec.epochs[0].workers[0].ends[0] = 0.0
    samples, x = [], START + 0.1
    while x <= t:
        s = {"t": x, "dt": 0.1, "cpu_busy": 0.6, "iowait": None if len(samples) % 3 else 0.1, "disk_read_mbps": 80.0}
        if gpu:
            s.update(gpu_util=0.3 if len(samples) % 4 else 0.95, gpu_mem_util=0.2)
        if kind == "torch":
            s["proc_cpu"] = {str(p): 0.8 for p in PIDS}
        samples.append(s)
        x += 0.1
    return Timeline(start=START, end=t, loaders=[rec], samples=samples, cpus=2,
                    gpu={"index": 0, "name": "fake"} if gpu else None)  # fmt: skip


def _render(tl: Timeline, path, monkeypatch, title: str | None = None) -> tuple[list[str], dict]:
    """Draw ``tl`` into ``path``; return the figure's words (title, panel notes, legends) and its labelled lines
    (label: (x, y)) as it was saved."""
    words, lines = [], {}
    save = Figure.savefig

    def spy(fig, *args, **kwargs):
        words.append(fig.get_suptitle())
        for ax in fig.axes:
            legend = ax.get_legend()
            words.extend(t.get_text() for t in ax.texts + (legend.get_texts() if legend else []))
            lines.update((line.get_label(), line.get_data()) for line in ax.lines)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    out = plot.timeline_png(tl, path, title=title)
    assert out == path and path.read_bytes()[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", path.read_bytes()[16:24])
    assert (width, height) == (1200, 1000)
    assert 10_000 < path.stat().st_size < 5_000_000
    return words, lines


def test_png_with_gpu_samples_draws_every_panel(tmp_path, monkeypatch):
    """A timeline with GPU samples gives a PNG whose GPU and worker panels have data and whose title is the verdict."""
    words, _ = _render(_timeline(), tmp_path / "t.png", monkeypatch, title="input-bound: the GPU waits 40% of the time")
    assert words[0] == "input-bound: the GPU waits 40% of the time"
    assert {"GPU busy", "CPU busy", "iowait", "step", "wait (stall)", "worker 0", "worker 1"} <= set(words)
    assert not any("NVML" in w or w == "no data" for w in words)


def test_png_without_gpu_samples_says_nvml_is_unavailable(tmp_path, monkeypatch):
    """Without gpu_util in any sample the GPU panel says so instead of drawing."""
    words, _ = _render(_timeline(gpu=False), tmp_path / "t.png", monkeypatch)
    assert "no GPU utilisation (NVML unavailable)" in words
    assert "GPU busy" not in words


def test_png_for_torchs_loader_plots_its_workers_cpu(tmp_path, monkeypatch):
    """A loader without worker records gets its worker processes' CPU from the samples."""
    words, _ = _render(_timeline(kind="torch"), tmp_path / "t.png", monkeypatch)
    assert {f"worker CPU (pid {p})" for p in PIDS} <= set(words)


def test_png_of_an_empty_timeline_says_no_data(tmp_path, monkeypatch):
    """A timeline with no loaders and no samples still gives a PNG, each panel saying there is no data."""
    words, _ = _render(Timeline(start=START, end=START), tmp_path / "t.png", monkeypatch)
    assert words.count("no data") == 4


def test_png_worker_busy_adds_up_to_the_recorded_spells(tmp_path, monkeypatch):
    """Each worker's busy fractions, times the bin width, add up to its recorded fetch + collate seconds."""
    tl = _timeline()
    _, lines = _render(tl, tmp_path / "t.png", monkeypatch)
    for w in range(WORKERS):
        x, busy = lines[f"worker {w}"]
        records = [ep.workers[w] for ep in tl.loaders[0].epochs]
        spells = sum(f + c for r in records for f, c, end in zip(r.fetch, r.collate, r.ends) if end)
        assert sum(busy) / 100 * (x[1] - x[0]) == pytest.approx(spells)
    assert max(lines[f"mean of {WORKERS}"][1]) <= 100


def test_png_of_a_long_run_draws_means_over_time(tmp_path, monkeypatch):
    """Past MAX_BATCHES_DRAWN batches the batch panel draws each time bin's mean step and wait, not every batch."""
    words, lines = _render(_timeline(batches=plot.MAX_BATCHES_DRAWN // EPOCHS + 1), tmp_path / "t.png", monkeypatch)
    step = next(label for label in lines if label.startswith("step, mean per"))
    assert any(w.startswith("wait (stall), mean per") for w in words)
    assert np.nanmean(lines[step][1]) == pytest.approx(20)


def test_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    """Without matplotlib, timeline_png raises ImportError naming the fastfeed[plot] extra."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"fastfeed\[plot\]"):
        plot.timeline_png(_timeline(), tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_png_leaves_pyplot_alone(tmp_path):
    """Drawing never imports pyplot (checked in a fresh interpreter, where nothing else has)."""
    code = (
        "import json, sys\n"
        "from fastfeed.doctor import plot\n"
        "from fastfeed.doctor.timeline import Timeline\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
        "plot.timeline_png(Timeline.from_dict(json.load(sys.stdin)), sys.argv[1])\n"
        "print('pyplot' if 'matplotlib.pyplot' in sys.modules else 'clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.png")], input=json.dumps(_timeline().to_dict()),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["clean"]
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC


def test_trace_is_well_formed_json_sorted_from_the_start(tmp_path):
    """The written trace round-trips as JSON; every event is complete, sorted, and timed from the watch's start."""
    path = trace.write_trace(_timeline(), tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    assert doc == json.loads(json.dumps(trace.chrome_trace(_timeline())))
    assert doc["displayTimeUnit"] == "ms" and "\n" not in path.read_text()
    events = doc["traceEvents"]
    assert all({"name", "ph", "pid", "tid", "ts"} <= ev.keys() for ev in events)
    assert all(ev["dur"] >= 0 for ev in events if ev["ph"] == "X")
    assert [ev["ts"] for ev in events] == sorted(ev["ts"] for ev in events)
    assert min(ev["ts"] for ev in events) >= 0
    first_wait = next(ev for ev in events if ev["name"] == "wait")
    assert first_wait["ts"] == 0 and first_wait["dur"] == pytest.approx(40_000)
    assert first_wait["args"] == {"batch": 0, "epoch": 0, "ready": 0}


def test_trace_puts_waits_steps_and_copies_on_the_main_process():
    """One wait per batch, one step between batches and one H2D copy per batch, each on its own named track."""
    events = trace.chrome_trace(_timeline())["traceEvents"]
    names = {ev["args"]["name"] for ev in events if ev["ph"] == "M" and ev["name"].endswith("_name")}
    assert {"main process", "loader 0 (fastfeed, made at train.py:12): wait"} <= names
    spans = [ev for ev in events if ev["ph"] == "X" and ev["pid"] == 1]
    per_name = Counter(ev["name"] for ev in spans)
    assert per_name == {"wait": EPOCHS * BATCHES, "step": EPOCHS * (BATCHES - 1), "h2d": EPOCHS * BATCHES}
    assert all(len({ev["tid"] for ev in spans if ev["name"] == n}) == 1 for n in per_name)
    assert len({ev["tid"] for ev in spans}) == 3


def test_trace_gives_each_worker_process_its_own_track():
    """Each worker's fetch and collate spells land on its own pid, those with an unknown end left out."""
    tl = _timeline()
    events = trace.chrome_trace(tl)["traceEvents"]
    per_track = Counter((ev["pid"], ev["tid"], ev["name"]) for ev in events if ev["name"] in ("fetch", "collate"))
    known = [sum(1 for ep in tl.loaders[0].epochs for end in ep.workers[w].ends if end) for w in range(WORKERS)]
    assert known == [EPOCHS * BATCHES // WORKERS - 1, EPOCHS * BATCHES // WORKERS]
    assert per_track == {(p, p, name): n for p, n in zip(PIDS, known) for name in ("fetch", "collate")}
    names = {ev["pid"]: ev["args"]["name"] for ev in events if ev["name"] == "process_name"}
    assert names[PIDS[1]] == f"loader 0 worker 1 (pid {PIDS[1]})"
    fetch = next(ev for ev in events if ev["name"] == "fetch" and ev["pid"] == PIDS[1])
    collate = next(ev for ev in events if ev["name"] == "collate" and ev["pid"] == PIDS[1])
    assert fetch["ts"] + fetch["dur"] == pytest.approx(collate["ts"], abs=0.01)


def test_trace_counters_follow_the_sampled_figures():
    """Counters appear for the figures the samples have: GPU ones only with GPU samples, none without samples."""

    def counters(tl):
        return Counter(ev["name"] for ev in trace.chrome_trace(tl)["traceEvents"] if ev["ph"] == "C")

    with_gpu, without = _timeline(), _timeline(gpu=False, kind="torch")
    n = len(with_gpu.samples)
    assert counters(with_gpu) == {"cpu %": n, "gpu %": n, "disk MB/s": n}
    assert counters(without) == {"cpu %": len(without.samples), "disk MB/s": len(without.samples)}
    assert counters(Timeline(start=START, end=START)) == {}
    gpu = next(ev for ev in trace.chrome_trace(with_gpu)["traceEvents"] if ev["name"] == "gpu %")
    assert gpu["args"] == {"gpu_util": pytest.approx(95.0), "gpu_mem_util": pytest.approx(20.0)}
    assert gpu["ts"] == pytest.approx(0, abs=0.01)


def test_trace_of_torchs_loader_has_no_worker_spells():
    """A loader without worker records gives waits and steps but no worker tracks or H2D copies."""
    events = trace.chrome_trace(_timeline(kind="torch"))["traceEvents"]
    assert Counter(ev["name"] for ev in events if ev["ph"] == "X") == {"wait": EPOCHS * BATCHES,
                                                                      "step": EPOCHS * (BATCHES - 1)}  # fmt: skip
    assert {ev["pid"] for ev in events} == {1}
