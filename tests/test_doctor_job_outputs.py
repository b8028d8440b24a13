"""A job's outputs from synthetic ranks: one Perfetto trace with a process per rank, one PNG with a lane per rank."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections import Counter

import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from fastfeed.doctor import plot, trace
from fastfeed.doctor.ranks import RankRecord, split

from _timelines import make

pytestmark = [pytest.mark.fastfeed_only, pytest.mark.usefixtures("fonts_open")]  # fonts: see conftest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EPOCHS, BATCHES, STEP = 2, 12, 0.05
WORKER_PIDS = (1000, 1001)  # what make() gives every rank's two workers: equal across ranks, as on two machines


def _rank(rank: int, *, wait: float = 0.01, sync: float = 0.0, offset: float = 0.0, host: str = "node0",
          batches: int = BATCHES, gpu: bool = False) -> RankRecord:  # fmt: skip
    """A rank that waits ``wait`` for each batch and steps ``STEP`` + ``sync``, sleeping ``sync`` of it (its
    ``blocked`` readings say so, as a CPU backend's collective would), on a clock ``offset`` s behind rank 0's;
    2 epochs, 2 workers with records, a sample each 0.1 s (GPU ones with ``gpu``)."""
    figures = {"cpu_busy": 0.25 + 0.01 * rank, **({"gpu_util": 0.5} if gpu else {})}
    tl = make([wait] * batches, [STEP + sync] * batches, worker_s=0.005, samples=figures, epochs=EPOCHS, gpu=gpu)
    for ep in tl.loaders[0].epochs:
        ep.blocked = [wait + i * (wait + sync) for i in range(len(ep.asks))]  # slept so far, at each return
    return RankRecord(rank=rank, timeline=tl, offset=offset, host=host, local_rank=rank % 2)


def _job(**kwargs) -> list[RankRecord]:
    """Three ranks in step, given out of order: rank 1 waits for its input, ranks 0 and 2 for rank 1 in sync."""
    return [_rank(2, sync=0.15, host="node1", **kwargs), _rank(0, sync=0.15, **kwargs), _rank(1, wait=0.16, **kwargs)]


def _start(ranks: list[RankRecord]) -> float:
    return min(r.timeline.start + r.offset for r in ranks)


def _processes(events: list[dict]) -> dict[int, str]:
    return {ev["pid"]: ev["args"]["name"] for ev in events if ev["name"] == "process_name"}


def _main_pids(events: list[dict]) -> dict[int, int]:
    """rank -> the pid of its main process in the trace."""
    return {int(name.split()[1]): pid for pid, name in _processes(events).items() if "worker" not in name}


def test_job_trace_is_sorted_json_with_a_process_per_rank_in_rank_order(tmp_path):
    """The written trace round-trips as JSON, sorted by time from the job's start, with one main process per rank,
    named and sorted by rank, each holding its loader's wait, step and sync tracks."""
    ranks = _job()
    path = trace.write_job_trace(ranks, split(ranks), _start(ranks), tmp_path / "job.json")
    doc = json.loads(path.read_text())
    assert doc == json.loads(json.dumps(trace.job_trace(ranks, split(ranks), _start(ranks))))
    assert doc["displayTimeUnit"] == "ms" and "\n" not in path.read_text()
    events = doc["traceEvents"]
    assert all({"name", "ph", "pid", "tid", "ts"} <= ev.keys() for ev in events)
    assert [ev["ts"] for ev in events] == sorted(ev["ts"] for ev in events)
    assert min(ev["ts"] for ev in events) == 0
    main = _main_pids(events)
    names = _processes(events)
    assert [names[main[r]] for r in range(3)] == ["rank 0 (node0, local rank 0)", "rank 1 (node0, local rank 1)",
                                                  "rank 2 (node1, local rank 0)"]  # fmt: skip
    order = {ev["pid"]: ev["args"]["sort_index"] for ev in events if ev["name"] == "process_sort_index"}
    assert sorted(main, key=lambda r: order[main[r]]) == [0, 1, 2]
    loader = "loader 0 (fastfeed, made at train.py:12)"
    for r, pid in main.items():
        tracks = {ev["args"]["name"] for ev in events if ev["name"] == "thread_name" and ev["pid"] == pid}
        assert tracks == {f"{loader}: {what}" for what in ("wait", "step", "sync")}, r
        spans = Counter(ev["name"] for ev in events if ev["ph"] == "X" and ev["pid"] == pid)
        assert spans["wait"] == EPOCHS * BATCHES and spans["step"] == EPOCHS * (BATCHES - 1)
        assert Counter(ev["name"] for ev in events if ev["ph"] == "C" and ev["pid"] == pid) == {
            "cpu %": len(ranks[[x.rank for x in ranks].index(r)].timeline.samples)}  # fmt: skip


def test_job_trace_sync_spans_add_up_to_each_ranks_split():
    """Each rank's sync spans add up to its split's sync, its compute spans to its compute, and each sync ends its
    step: where the next batch was asked for."""
    ranks = _job()
    splits = {sp.rank: sp for sp in split(ranks)}
    events = trace.job_trace(ranks, list(splits.values()), _start(ranks))["traceEvents"]
    main = _main_pids(events)
    assert splits[0].sync_s == pytest.approx(0.15 * EPOCHS * (BATCHES - 1))
    assert splits[1].sync_s == pytest.approx(0, abs=1e-9)  # arrivals in step differ by float rounding at most
    for r, sp in splits.items():
        mine = [ev for ev in events if ev["ph"] == "X" and ev["pid"] == main[r]]
        assert sum(ev["dur"] for ev in mine if ev["name"] == "sync") == pytest.approx(sp.sync_s * 1e6, abs=0.1)
        assert sum(ev["dur"] for ev in mine if ev["name"] == "compute") == pytest.approx(sp.compute_s * 1e6, abs=0.1)
        asks = {(ev["args"]["epoch"], ev["args"]["batch"]): ev["ts"] for ev in mine if ev["name"] == "wait"}
        for ev in (ev for ev in mine if ev["name"] == "sync"):
            nxt = asks[ev["args"]["epoch"], ev["args"]["batch"] + 1]
            assert ev["ts"] + ev["dur"] == pytest.approx(nxt, abs=0.01)
            assert ev["args"]["waiting_for_others_ms"] == pytest.approx(150, abs=0.01)
    assert sum(ev["name"] == "sync" for ev in events) == 2 * EPOCHS * (BATCHES - 1)  # ranks 0 and 2 each step


def test_job_trace_shifts_each_rank_by_its_offset():
    """A rank whose clock is 2 s behind rank 0's has its waits, steps, workers' spells and counters 2 s later than
    rank 0's same records, and its syncs still end its (shifted) steps."""
    ranks = [_rank(0, sync=0.15), _rank(1, sync=0.15, offset=2.0)]
    events = trace.job_trace(ranks, split(ranks), _start(ranks))["traceEvents"]
    rank_of = {pid: int(name.split()[1]) for pid, name in _processes(events).items()}  # workers' too

    def first(name, r):
        return next(ev["ts"] for ev in events if ev["name"] == name and rank_of[ev["pid"]] == r)

    assert first("wait", 0) == 0
    for name in ("wait", "step", "fetch", "collate", "cpu %"):
        assert first(name, 1) - first(name, 0) == pytest.approx(2e6, abs=0.01), name
    sync = next(ev for ev in events if ev["name"] == "sync" and rank_of[ev["pid"]] == 1)
    assert sync["ts"] + sync["dur"] == pytest.approx(first("wait", 1) + (0.01 + STEP + 0.15) * 1e6, abs=0.01)


def test_job_trace_pids_never_collide_across_ranks():
    """Two ranks whose workers have the same pids get distinct processes, the real pid kept in their names, all
    within the uint32 that Perfetto reads a pid as."""
    ranks = _job()
    events = trace.job_trace(ranks, split(ranks), _start(ranks))["traceEvents"]
    names = _processes(events)
    assert len(names) == 3 * (1 + len(WORKER_PIDS))
    assert len(set(names.values())) == len(names)
    assert all(0 < pid < 2**32 for pid in names)
    assert {ev["pid"] for ev in events} == set(names)  # every event on a named process
    for r in range(3):
        for w, real in enumerate(WORKER_PIDS):
            who = f"rank {r} loader 0 worker {w} (pid {real})"
            pid = next(p for p, name in names.items() if name == who)
            spells = Counter(ev["name"] for ev in events if ev["pid"] == pid and ev["ph"] == "X")
            assert spells == {"fetch": EPOCHS * BATCHES // 2, "collate": EPOCHS * BATCHES // 2}, who


def _render(ranks, path, monkeypatch, lanes: int, **kwargs) -> dict:
    """Draw ``ranks`` into ``path``; check it is a PNG ``lanes`` lanes high and return what the figure said (its
    words, lane labels and their colours, panel y labels, labelled lines) and drew (bars as (colour, lane,
    seconds), fills)."""
    seen = {"words": [], "lanes": [], "colours": [], "ylabels": [], "lines": [], "bars": [], "fills": []}
    save, bars, fill = Figure.savefig, Axes.broken_barh, Axes.fill_between

    def on_save(fig, *args, **kw):
        seen["words"].append(fig.get_suptitle())
        for ax in fig.axes:
            legend = ax.get_legend()
            seen["words"] += [ax.get_title("left"), ax.get_title("right")] + [t.get_text() for t in ax.texts]
            if legend:
                seen["words"] += [t.get_text() for t in legend.get_texts()] + [legend.get_title().get_text()]
            seen["ylabels"].append(ax.get_ylabel())
            seen["lines"] += [line.get_label() for line in ax.lines if not line.get_label().startswith("_")]
        seen["lanes"] = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        seen["colours"] = [t.get_color() for t in fig.axes[0].get_yticklabels()]
        return save(fig, *args, **kw)

    def on_bars(ax, xranges, yrange, **kw):
        seen["bars"].append((kw["facecolors"], round(yrange[0] + 0.4), sum(width for _, width in xranges)))
        return bars(ax, xranges, yrange, **kw)

    def on_fill(ax, x, y1, y2, **kw):
        seen["fills"].append((kw["color"], x, y1, y2))
        return fill(ax, x, y1, y2, **kw)

    monkeypatch.setattr(Figure, "savefig", on_save)
    monkeypatch.setattr(Axes, "broken_barh", on_bars)
    monkeypatch.setattr(Axes, "fill_between", on_fill)
    out = plot.job_png(ranks, split(ranks), path, **kwargs)
    assert out == path and path.read_bytes()[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", path.read_bytes()[16:24])
    assert (width, height) == (1200, round(100 * (plot.JOB_BASE_IN + plot.LANE_IN * lanes)))
    return seen


def test_job_png_draws_a_lane_per_rank_with_its_shares(tmp_path, monkeypatch):
    """Each rank gets a lane, rank 0's on top, labelled with its input, sync and compute shares; the title is the
    job's verdict; the panel beneath plots each rank's CPU busy."""
    ranks = _job()
    seen = _render(ranks, tmp_path / "job.png", monkeypatch, lanes=3, title="rank 1 waits for its input")
    assert seen["words"][0] == "rank 1 waits for its input"
    assert {"input wait (stall)", "sync", "compute"} <= set(seen["words"])
    assert not any(w.endswith("not drawn") for w in seen["words"])
    shares = {sp.rank: sp.shares() for sp in split(ranks)}
    assert seen["lanes"] == [f"rank {r}: input {s['input']:.0%} sync {s['sync']:.0%} compute {s['compute']:.0%}"
                             for r, s in sorted(shares.items())]  # fmt: skip
    assert seen["lanes"][1] == "rank 1: input 78% sync 0% compute 22%"
    assert seen["ylabels"][1] == "CPU busy %" and seen["lines"] == ["rank 0", "rank 1", "rank 2"]


def test_job_png_bars_add_up_to_each_ranks_split(tmp_path, monkeypatch):
    """In each rank's lane the red bars add up to its input wait, the orange to its sync, the blue to its compute."""
    ranks = _job()
    seen = _render(ranks, tmp_path / "job.png", monkeypatch, lanes=3)
    drawn = {(lane, colour): seconds for colour, lane, seconds in seen["bars"]}
    for sp in split(ranks):
        assert drawn.get((sp.rank, plot.STALL), 0) == pytest.approx(sp.input_s)
        assert drawn.get((sp.rank, plot.SYNC), 0) == pytest.approx(sp.sync_s)
        assert drawn.get((sp.rank, plot.COMPUTE), 0) == pytest.approx(sp.compute_s)
    assert drawn[0, plot.SYNC] > 0 and drawn[1, plot.STALL] > drawn[0, plot.STALL]
    assert not seen["fills"]


def test_job_png_of_a_long_run_draws_shares_over_time(tmp_path, monkeypatch):
    """Past MAX_BATCHES_DRAWN batches each lane stacks every time bin's shares instead of a bar per batch; the
    shares times the bin width add up to the rank's input, sync and compute."""
    batches = plot.MAX_BATCHES_DRAWN // EPOCHS + 1
    ranks = [_rank(0, sync=0.15, batches=batches), _rank(1, wait=0.16, batches=batches)]
    seen = _render(ranks, tmp_path / "job.png", monkeypatch, lanes=2)
    assert not seen["bars"]
    assert any(w.startswith("share of each") for w in seen["words"])
    assert len(seen["fills"]) == 3 * len(ranks)
    for sp in split(ranks):  # the lanes' fills in rank order, three each
        fills = {colour: (x, y1, y2) for colour, x, y1, y2 in seen["fills"][3 * sp.rank : 3 * sp.rank + 3]}
        for colour, seconds in ((plot.STALL, sp.input_s), (plot.SYNC, sp.sync_s), (plot.COMPUTE, sp.compute_s)):
            x, foot, top = fills[colour]
            assert sum(foot - top) / 0.8 * (x[1] - x[0]) == pytest.approx(seconds, rel=1e-6, abs=1e-9), colour


def test_job_png_of_64_ranks_draws_16_keeping_the_stragglers(tmp_path, monkeypatch):
    """Of 64 ranks the picture draws MAX_LANES, its height capped there, the ranks it is told to keep among them
    (labelled in red), and says how many it left out."""
    ranks = [_rank(r, sync=0.15, batches=4) for r in range(64)]
    seen = _render(ranks, tmp_path / "job.png", monkeypatch, lanes=plot.MAX_LANES, keep=[63, 40])
    drawn = [int(label.split()[1].rstrip(":")) for label in seen["lanes"]]
    assert drawn == list(range(plot.MAX_LANES - 2)) + [40, 63]
    assert [r for r, colour in zip(drawn, seen["colours"]) if colour == plot.STALL] == [40, 63]
    assert "48 of 64 ranks not drawn" in seen["words"]
    assert not seen["lines"]  # 16 lines' labels would hide the panel


def test_job_png_labels_replace_the_shares(tmp_path, monkeypatch):
    """``labels``, given in the order of ``ranks``, label the lanes, drawn in rank order, a long one wrapped to fit
    its lane; GPU samples are plotted in place of the CPU's."""
    ranks = _job(gpu=True)
    verdict = "highly input-bound (workers/cpu): 78% of the loop waiting for batches, " * 3
    labels = [f"rank {r.rank}: {verdict if r.rank == 1 else 'fine'}" for r in ranks]
    seen = _render(ranks, tmp_path / "job.png", monkeypatch, lanes=3, labels=labels)
    assert seen["lanes"][::2] == ["rank 0: fine", "rank 2: fine"]
    wrapped = seen["lanes"][1].splitlines()
    assert len(wrapped) == 3 and all(len(line) <= 48 for line in wrapped)
    assert wrapped[0] == "rank 1: highly input-bound (workers/cpu): 78% of" and wrapped[-1].endswith("...")
    assert seen["ylabels"][1] == "GPU busy %"


def test_job_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    """Without matplotlib, job_png raises ImportError naming the fastfeed[plot] extra, and writes nothing."""
    ranks = _job()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"fastfeed\[plot\]"):
        plot.job_png(ranks, split(ranks), tmp_path / "job.png")
    assert not (tmp_path / "job.png").exists()


def test_job_png_leaves_pyplot_alone(tmp_path):
    """Drawing a job never imports pyplot (checked in a fresh interpreter, where nothing else has)."""
    code = (
        "import json, sys\n"
        "from fastfeed.doctor import plot\n"
        "from fastfeed.doctor.ranks import RankRecord, split\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
        "ranks = [RankRecord.from_dict(d) for d in json.load(sys.stdin)]\n"
        "plot.job_png(ranks, split(ranks), sys.argv[1])\n"
        "print('pyplot' if 'matplotlib.pyplot' in sys.modules else 'clean')\n"
    )
    records = json.dumps([r.to_dict() for r in _job()])
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.png")], input=records, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["clean"]
    assert (tmp_path / "job.png").read_bytes()[:8] == PNG_MAGIC
