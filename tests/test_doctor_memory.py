"""The doctor measures memory: each worker's private memory (USS) and the machine's available memory beside the
stall records, copy-on-read named with the dataset's attribute, ``fastfeed.share`` advised with its saving, and
memory in report.json, the text, the HTML page and the PNG."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import _chromium as chromium
import pytest
from _chromium import needs_chromium

from fastfeed import _memory
from fastfeed.doctor import sampler
from fastfeed.doctor.report import Report
from fastfeed.doctor.timeline import EpochRecord, LoaderRecord, Timeline

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "_memory_meta.py"
MB = 2**20

ROLLUP = """55d4c0a8e000-7ffd2b1f2000 ---p 00000000 00:00 0                          [rollup]
Rss:               51200 kB
Pss:               30720 kB
Pss_Anon:          20480 kB
Shared_Clean:      10240 kB
Shared_Dirty:       2048 kB
Private_Clean:      4096 kB
Private_Dirty:     34816 kB
Referenced:        51200 kB
Anonymous:         36864 kB
Swap:               3072 kB
SwapPss:            1024 kB
Locked:                0 kB
"""


def test_rollup_parsed_as_private_clean_dirty_and_private_swap():
    u = _memory.parse_rollup(ROLLUP)
    assert u.uss == (4096 + 34816 + 1024) * 1024  # SwapPss: the swap that is this process's own share
    assert u.pss == (30720 + 1024) * 1024
    assert u.rss == 51200 * 1024
    assert _memory.parse_rollup("") is None  # an exiting process: no figures, not zeros


def test_a_child_that_dirties_memory_shows_it_as_uss():
    """32 MB written by a child after it starts is its own memory: its USS grows by at least that."""
    code = ("import sys\nsys.stdout.write('go\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
            "b = bytearray(32 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
            "sys.stdout.write('done\\n'); sys.stdout.flush(); sys.stdin.readline()\n")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "go\n"
        before = _memory.usage(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        after = _memory.usage(child.pid)
        assert before is not None and after is not None
        assert after.uss - before.uss >= 30 * MB
        assert _memory.largest_uss([child.pid, 2**22 + 7]) >= 30 * MB  # a pid that does not exist is passed over
        assert _memory.largest_uss([2**22 + 7]) == 0
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()


def test_the_sampler_reads_each_watched_process_uss_and_the_available_memory():
    probe = sampler.Probe(pids=lambda: [os.getpid()])
    try:
        first = probe.read()
        second = probe.read()  # within MEMORY_INTERVAL: memory is not read again
    finally:
        probe.close()
    assert first.uss[os.getpid()] > 0
    assert first.mem_available is not None and first.mem_available > 0
    assert second.uss is None
    s = sampler.delta(first, second)
    assert tuple(s) == sampler.SAMPLE_KEYS and s["proc_uss"] is None and s["mem_available"] is None
    assert sampler.delta(second, first)["proc_uss"] == {str(os.getpid()): first.uss[os.getpid()]}


# -- the analysis, on timelines made to measure ------------------------------------------------------------------


def _timeline(uss_of, containers=None, seconds=4.0) -> Timeline:
    """A loader of 2 workers (pids 11, 12) taking a batch of 64 every 10 ms; ``uss_of(t)``: each worker's USS at
    ``t`` s, read every 0.5 s; the machine has 8 GB, 6 GB available."""
    asks = [0.01 * i for i in range(int(seconds / 0.01))]
    epoch = EpochRecord(asks=asks, returns=[a + 0.008 for a in asks], pids=[11, 12])
    rec = LoaderRecord(id=0, kind="torch", made_at="train.py:9", num_workers=2, prefetch_factor=2, batch_size=64,
                       epochs=[epoch], containers=containers)  # fmt: skip
    samples = []
    for k in range(1, int(seconds / 0.1) + 1):
        t = 0.1 * k
        read = k % 5 == 0
        samples.append({"t": t, "dt": 0.1, "proc_cpu": {}, "mem_available": 6 << 30 if read else None,
                        "proc_uss": {"11": uss_of(t), "12": uss_of(t) + MB} if read else None})  # fmt: skip
    return Timeline(start=0.0, end=seconds, loaders=[rec], samples=samples, cpus=2, mem_total=8 << 30)


ITEMS = ["items", "list", 1_000_000, 300 * MB]


def test_growth_with_the_reads_is_named_copy_on_read_with_the_attribute_and_share_advised():
    """Pages copied as samples are read: USS climbs with the batches, then levels off once all are copied."""
    d = Report(timeline=_timeline(lambda t: 20 * MB + min(t, 3.0) * 40 * MB, [ITEMS])).to_dict()
    m = d["memory"]
    assert m["copy_on_read"] and m["tracks_reads_r"] > 0.9
    assert m["worker_growth_bytes"] == 100 * MB  # first read at 0.5 s, level from 3 s: 2.5 s x 40 MB/s
    assert m["culprit"] == {"name": "items", "kind": "list", "count": 1_000_000, "est_bytes": 300 * MB}
    assert m["saving_bytes"] == pytest.approx(2 * m["worker_growth_bytes"], abs=2)
    assert m["more_workers"] == m["saving_bytes"] // m["worker_start_bytes"]
    assert m["available_min"] == 6 << 30 and m["headroom"] == pytest.approx(0.75)
    share = [a for a in d["advice"] if a["change"] == "dataset = fastfeed.share(dataset)"]
    assert len(share) == 1 and share[0]["needs"] and share[0]["setting"] is None  # never the closing run's
    assert share[0]["predicted_saving_bytes"] == m["saving_bytes"] and "dataset.items" in share[0]["why"]
    text = Report(timeline=_timeline(lambda t: 20 * MB + min(t, 3.0) * 40 * MB, [ITEMS])).summary()
    assert "copy-on-read" in text and "dataset.items (list of 1,000,000 Python objects" in text


def test_growth_that_does_not_follow_the_reads_is_not_called_copy_on_read():
    """Memory that jumps once and then falls back (a buffer allocated and freed) is reported, not named."""
    def jump(t):
        return 20 * MB + (60 * MB if 1.0 <= t < 1.8 else 0) + (30 * MB if t >= 3.5 else 0)

    d = Report(timeline=_timeline(jump, [ITEMS])).to_dict()
    assert d["memory"]["workers"] and not d["memory"]["copy_on_read"]
    assert not any("fastfeed.share" in a["change"] for a in d["advice"])
    flat = Report(timeline=_timeline(lambda t: 20 * MB, [ITEMS])).to_dict()
    assert flat["memory"]["worker_growth_bytes"] == 0 and not flat["memory"]["copy_on_read"]


def test_without_a_named_container_copy_on_read_is_still_said():
    d = Report(timeline=_timeline(lambda t: 20 * MB + t * 30 * MB, [])).to_dict()
    assert d["memory"]["copy_on_read"] and d["memory"]["culprit"] is None
    assert "no large list, tuple or dict found" in Report(timeline=_timeline(lambda t: 20 * MB + t * 30 * MB,
                                                                             [])).summary()  # fmt: skip


# -- the doctor on a script -------------------------------------------------------------------------------------


def _doctor(tmp_path: Path, *script_args: str) -> tuple[dict, str, Path]:
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "fastfeed", "doctor", "--no-whatif", "--steps", "600", "--out", str(out),
           str(SCRIPT), "--items", "200000", *script_args]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "report.json").read_text()), done.stdout, out


@pytest.fixture(scope="module")
def dicts_run(tmp_path_factory):
    """The doctor on the script whose dataset holds 200k dicts, once for the tests that read its outputs."""
    return _doctor(tmp_path_factory.mktemp("dicts"))


def test_doctor_names_copy_on_read_on_a_torch_script_with_200k_dicts(dicts_run):
    d, text, out = dicts_run
    m = d["memory"]
    assert len(m["workers"]) == 2
    assert m["copy_on_read"], text
    assert m["worker_growth_bytes"] >= 16 * MB  # 200k dicts are ~60 MB: a worker reading 20k of them copies pages
    assert m["culprit"]["name"] == "items" and m["culprit"]["count"] == 200_000
    assert m["culprit"]["est_bytes"] >= 16 * MB
    assert m["available_min"] > 0 and m["mem_total"] >= m["available_min"]
    share = next(a for a in d["advice"] if a["change"] == "dataset = fastfeed.share(dataset)")
    assert share["predicted_saving_bytes"] == m["saving_bytes"] >= 2 * 16 * MB
    assert share["more_workers"] >= 1
    assert "copy-on-read" in text and "dataset.items" in text and "fastfeed.share(dataset)" in text
    page = (out / "report.html").read_text()
    assert 'id="memory"' in page and "copy-on-read" in page and "dataset.items" in page
    # the timeline's two memory tracks, in the data its script draws from
    assert "memory: each worker's private memory (USS, MB)" in page
    assert "memory: the machine's available memory (MB of " in page
    assert "saves " in page  # the advice's predicted column: memory saved, not speed
    assert (out / "timeline.png").stat().st_size > 0
    _memory_panel_drawn(out / "timeline.json", pids=[w["pid"] for w in m["workers"]])


def _memory_panel_drawn(timeline_json: Path, pids: list[int]) -> None:
    """The PNG's memory panel, drawn again from the run's records: a line per worker, and the machine's
    available memory on the right axis."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from fastfeed.doctor import plot

    tl = Timeline.from_dict(json.loads(timeline_json.read_text()))
    fig = Figure(figsize=(12, 12))
    axes = plot.draw_timeline(fig, tl)
    panel = axes[4]
    assert "USS" in panel.get_ylabel()
    labels = [line.get_label() for line in panel.get_lines()]
    assert labels == [f"worker pid {p}" for p in pids]
    twins = [ax for ax in fig.axes if ax not in axes]
    assert twins and "available GB" in twins[0].get_ylabel()


@needs_chromium
def test_the_pages_memory_tracks_draw_in_a_browser(dicts_run, tmp_path):
    """report.html in headless Chromium: no script error, and the memory track drawn with a line per worker."""
    _, _, out = dicts_run
    dom, log = chromium.run((out / "report.html").resolve().as_uri(), tmp_path / "profile", "--enable-logging=stderr",
                            "--v=0", "--window-size=1280,2400", "--dump-dom")  # fmt: skip
    assert not [line for line in log.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    root = re.search(r"<html\b[^>]*>", dom).group(0)
    assert "data-errors" not in root and "data-rendered" in root, root
    track = dom.index(">memory: each worker's private memory (USS, MB)</text>")
    drawn = dom[track : dom.index(">memory: the machine's available memory", track)]
    assert len(re.findall(r"<path d=\"M", drawn)) == 2  # the two workers' lines
    assert drawn.count(">worker pid ") == 2


def test_doctor_calls_numpy_columns_no_copy_on_read(tmp_path):
    """The same metadata held as numpy columns is not copied as it is read: memory is reported, nothing named."""
    d, text, _ = _doctor(tmp_path, "--columns")
    m = d["memory"]
    assert len(m["workers"]) == 2 and not m["copy_on_read"]
    assert m["containers"] == []
    assert not any("fastfeed.share" in a["change"] for a in d["advice"])
    assert "memory: workers' private memory (USS)" in text and "copy-on-read" not in text
