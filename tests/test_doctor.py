"""The doctor end to end: scenario scripts with a known bottleneck, the watch() API, its hooks, alerts and outputs."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader

import fastfeed
from fastfeed import doctor
from fastfeed.cli import main
from fastfeed.doctor.demo import Decoded

from _load import CPUS, OthersLoad, skip_if_others_held, skip_unless_idle

pytestmark = pytest.mark.fastfeed_only

# The scenarios' batches: 80 of the demo's (16 ms of decoding each, one worker) keep each of the doctor's runs (the
# measured one, the ceilings, the closing re-run) over a second long and past its workers' start, which the warm
# rates its gains compare leave out; 120 made each run half as long again.
STEPS = 80
# A doctor run with its what-ifs takes 10 to 15 s on 2 idle cores, and many times that on cores other processes
# keep busy (past two minutes beside two busy loops and other suites): a guard against hangs, not a time limit, of
# three minutes, which tests/conftest.py stretches with the machine's load (up to 4x). The run's own timeout is the
# backstop past the most it stretches to.
DOCTOR_HANG_S = 180
slow_under_load = pytest.mark.hang_limit(DOCTOR_HANG_S)


def run_doctor(*args, steps=STEPS, whatif=True, timeout=4 * DOCTOR_HANG_S + 30, out=None):
    """``fastfeed doctor`` on the built-in scenario with ``args``: the JSON report it prints (``--json``), or with
    ``out``, its report.json there and the text it printed."""
    cmd = [sys.executable, "-m", "fastfeed", "doctor", "--steps", str(steps), *([] if whatif else ["--no-whatif"]),
           *(["--out", str(out)] if out else ["--json"]), "--demo", *args]  # fmt: skip
    # In a session of its own: a doctor cut short (its timeout, or the test's hang guard) is ended with its workers.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr
    if out:
        return json.loads((out / "report.json").read_text()), stdout
    return json.loads(stdout[stdout.index('{\n  "schema"'):])


def verdict(report):
    return report["verdict"]["bottleneck"], report["verdict"]["cause"]


# One CPU-bound worker takes a core, and the doctor says input/workers when half a core more is free
# (verdict.FREE_CORES_MIN); re-run, the advised workers need 1.3 cores between them to be measured 1.3x faster.
# 1.75 cores: a quarter kept for the main loop (it sleeps in its step) and the counters' noise.
TOO_FEW_WORKERS_CORES = 1.75


@slow_under_load
def test_too_few_workers_on_idle_cores_is_input_workers_and_the_advice_helps_when_rerun():
    """One decoding worker with a core idle: input/workers; the advised num_workers, re-run, is measured faster.

    On cores that other processes keep busy the doctor rightly says input/cpu: the test is then skipped, naming
    the load it measured."""
    if CPUS < 2:
        pytest.skip("needs a second core for the advice to help")
    with OthersLoad() as others:
        r = run_doctor()
    skip_unless_idle(others, TOO_FEW_WORKERS_CORES, r)
    assert verdict(r) == ("input", "workers"), r["verdict"]
    assert r["verdict"]["severity"] == "highly"
    closing = r["whatif"]["closing"]
    assert closing["setting"]["num_workers"] >= 2
    assert closing["gain"] >= 1.3, closing
    assert r["whatif"]["compute_ceiling"]["samples_per_s"] > r["steps"]["samples_per_s"] * 1.3
    assert len(r["questions"]) == 6


@slow_under_load
def test_every_core_busy_decoding_is_input_cpu():
    """As many decoding workers as cores, and a short step: input/cpu, with no advice to add local workers (only
    remote ones: tests/test_doctor_ray.py)."""
    r = run_doctor("--workers", str(CPUS), "--step-ms", "2", whatif=False)
    assert verdict(r) == ("input", "cpu"), (r["verdict"], r["system"])
    assert not any(a["setting"] and "num_workers" in a["setting"] and "worker_type" not in a["setting"]
                   for a in r["advice"])  # fmt: skip
    assert any("ray" in a["change"] for a in r["advice"]), r["advice"]


# The worker sleeps in its reads and the main loop in its step: together they use under a quarter of a core, and
# the doctor tells reads (input/io) from a shortage of cores by half a core being free (verdict.FREE_CORES_MIN;
# on busier cores a worker that uses little CPU may be waiting for one): one core, with a quarter to spare.
READS_CORES = 1.0


@slow_under_load
def test_reads_that_wait_are_input_io_and_more_workers_help_when_rerun():
    """Samples that sleep in reads: input/io (workers blocked), advising more workers, which re-measure faster."""
    with OthersLoad() as others:
        r = run_doctor("--read-ms", "1", "--sample-ms", "0", "--step-ms", "4")
    skip_unless_idle(others, READS_CORES, r)
    assert verdict(r) in (("input", "io"), ("input", "workers")), r["verdict"]
    closing = r["whatif"]["closing"]
    assert closing["setting"]["num_workers"] > 1
    assert closing["gain"] >= 1.5, closing


@pytest.fixture(scope="module")
def compute_run(tmp_path_factory):
    """The doctor with --out on a step slower than loading, once for the tests that read its verdict and its
    outputs: (report.json, the text it printed, the directory, what other processes took of the cores meanwhile)."""
    out = tmp_path_factory.mktemp("compute") / "report"
    with OthersLoad() as others:
        r, text = run_doctor("--step-ms", "30", "--sample-ms", "0.1", "--workers", "2", steps=60, whatif=False, out=out)
    return r, text, out, others


def test_a_slow_step_is_compute(compute_run):
    """A step slower than loading: compute-bound, and nothing to change in the loader. (Beside other processes that
    hold the cores, its two workers can fall behind a 30 ms step: the test then skips, naming their load.)"""
    r = compute_run[0]
    if verdict(r) != ("compute", None):
        skip_if_others_held(compute_run[3], f"the verdict was {r['verdict']['line']!r}")
    assert verdict(r) == ("compute", None), r["verdict"]
    assert not any(a["setting"] for a in r["advice"])


# The main loop decodes 16 ms of every 24 ms batch (two thirds of a core); the advice is local workers when half a
# core more is free (verdict.FREE_CORES_MIN), and, re-run, they are measured 1.3x faster with under a core between
# them: one and a half cores, with a quarter to spare.
TORCH_NO_WORKERS_CORES = 1.5


@slow_under_load
def test_a_script_on_torchs_own_loader_without_workers():
    """torch's DataLoader with num_workers=0: measured as it is, with fastfeed's what-if beside it, and advice that
    helps when re-measured (where the cores are idle: on busy ones the advice is Ray workers instead)."""
    with OthersLoad() as others:
        r = run_doctor("--torch", "--workers", "0")
    assert r["loader"]["kind"] == "torch" and r["loader"]["num_workers"] == 0
    assert r["verdict"]["bottleneck"] == "input", r["verdict"]
    assert r["whatif"]["input_ceiling_fastfeed"]["samples_per_s"] > 0
    if CPUS >= 2:
        skip_unless_idle(others, TORCH_NO_WORKERS_CORES, r)
        assert r["whatif"]["closing"]["gain"] >= 1.3, r["whatif"]["closing"]


def test_the_text_report_opens_with_the_verdict_and_out_writes_every_file(compute_run):
    """The text's first line is the verdict; --out writes the JSON, text, HTML page, timeline, trace and PNG."""
    r, text, out, _ = compute_run
    assert text.splitlines()[0] == r["verdict"]["line"] and text.startswith("verdict: ")
    for name in ("report.json", "report.txt", "report.html", "timeline.json", "trace.json", "timeline.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "report.html").read_text().lstrip().lower().startswith("<!doctype html")
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TRAIN_SCRIPT = """
import socket, sys, time
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 256
    def __getitem__(self, i):
        time.sleep(0.001)
        return torch.tensor([float(i)])

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    loader = DataLoader(Slow(), batch_size=int(sys.argv[1]))
    try:
        for batch in loader:
            dist.all_reduce(batch)
            time.sleep(0.002)
    finally:
        dist.destroy_process_group()
"""


def test_a_script_by_path_with_its_arguments_and_its_collectives(tmp_path):
    """A script path runs as __main__ with its own arguments; its loader is placed at its line, and the time in
    torch.distributed collectives answers question 5."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "fastfeed", "doctor", "--json", "--no-whatif", "--steps", "30",
                           str(script), "4"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout[proc.stdout.index('{\n  "schema"'):])
    assert r["loader"]["made_at"] == "train.py:19" and r["loader"]["batch_size"] == 4
    assert r["steps"]["batches"] == 30
    distributed = r["questions"][4]
    assert distributed["question"] == "Does distributed sync dominate?" and distributed["value"] > 0


def test_a_what_if_run_that_fails_is_reported_not_fatal(tmp_path, capsys):
    """A script that refuses to run twice: the measured run is diagnosed and the what-if says why it has no figure.

    The doctor runs in this process (``fastfeed.cli.main``, which ``python -m fastfeed`` exits with), as it runs
    the script and its what-ifs in its own: the script makes no worker, and a fresh interpreter cost more than it."""
    script = tmp_path / "once.py"
    script.write_text(
        "import os, sys, time, torch\n"
        "from torch.utils.data import DataLoader\n"
        "if os.path.exists(sys.argv[1]):\n"
        "    raise RuntimeError('second run refused')\n"
        "open(sys.argv[1], 'w').close()\n"
        "for batch in DataLoader(torch.arange(400.0).reshape(-1, 1), batch_size=4):\n"
        "    time.sleep(0.001)\n"
    )
    code = main(["doctor", "--json", "--steps", "20", str(script), str(tmp_path / "ran")])
    said = capsys.readouterr()
    assert code == 0, said.err
    r = json.loads(said.out[said.out.index('{\n  "schema"'):])
    assert r["steps"]["batches"] == 20
    assert r["whatif"]["compute_ceiling"] is None
    assert "second run refused" in r["whatif"]["skipped"]["compute_ceiling"]


# The CLI's refusals, in this process (fastfeed.cli.main is what ``python -m fastfeed`` exits with): a fresh
# interpreter importing torch for each took 2 to 3 s, for a check that needs none. The script runs in the doctor's
# process either way (``script.run``), under its watch, which is released whatever the script does.
@pytest.mark.parametrize("args, message", [
    (["no_such_script.py"], "no script at"),
    (["-m", "json.tool", "--help"], "no batches to measure"),
])  # fmt: skip
def test_a_script_that_gives_no_batches_is_a_clear_error(args, message, capsys):
    """A missing script, or one that never iterates a loader, exits 1 saying why."""
    assert main(["doctor", *args]) == 1
    assert message in capsys.readouterr().err


def test_steps_must_be_positive(capsys):
    """--steps 0 is refused with a message."""
    assert main(["doctor", "--steps", "0", "--demo"]) == 2
    assert "--steps" in capsys.readouterr().err


# -- the Python API -------------------------------------------------------------------------------


def _dataset(n=256, sample_ms=0.2):
    return Decoded(n, sample_ms, 0.0)


def test_watch_ends_the_loop_after_steps_and_restores_the_loader_classes():
    """watch(steps=N) ends the loop after N batches, swallows its StopWatch, and leaves no patch behind."""
    before = (TorchLoader.__iter__, TorchLoader.__init__, fastfeed.DataLoader.__iter__, fastfeed.DataLoader.__init__)
    loader = fastfeed.DataLoader(_dataset(), batch_size=8, num_workers=2)
    done = 0
    with doctor.watch(steps=10) as report:
        for _ in range(3):
            for _batch in loader:
                done += 1
    assert done == 10
    assert (TorchLoader.__iter__, TorchLoader.__init__, fastfeed.DataLoader.__iter__,
            fastfeed.DataLoader.__init__) == before  # fmt: skip
    rec = report.timeline.primary()
    assert rec.kind == "fastfeed" and rec.made_at == "before the watch"
    assert rec.batches == 10
    assert len(rec.epochs[0].workers) == 2 and all(w.ends[0] > 0 for w in rec.epochs[0].workers)
    assert report.verdict().line.startswith("verdict: ")


def test_watches_do_not_nest():
    """A second watch inside the first is refused."""
    with doctor.watch():
        with pytest.raises(RuntimeError, match="already recording"):
            with doctor.watch():
                pass


def test_a_torch_loader_is_recorded_with_its_workers_cpu():
    """torch's own loader inside a watch: its batches, where it was made, and its worker processes' CPU."""
    with doctor.watch(interval=0.05) as report:
        loader = TorchLoader(_dataset(sample_ms=1.0), batch_size=8, num_workers=2)
        for _batch in loader:
            time.sleep(0.002)
    rec = report.timeline.primary()
    assert rec.kind == "torch" and rec.made_at.startswith("test_doctor.py:")
    assert rec.batches == 32
    assert len(rec.epochs[0].pids) == 2
    cpu = [s["proc_cpu"].get(str(rec.epochs[0].pids[0])) for s in report.timeline.samples]
    assert max(c for c in cpu if c is not None) > 0.3


def test_overrides_build_fastfeed_loaders_with_the_setting_and_the_same_batches():
    """The closing-the-loop hooks: torch's DataLoader, even through a name bound before, becomes fastfeed's with the
    setting forced, and yields torch's batches."""
    alias = TorchLoader
    ds = torch.arange(40).float()
    torch.manual_seed(0)
    expected = [b.clone() for b in TorchLoader(ds, batch_size=4, shuffle=True)]
    with doctor.watch(overrides={"num_workers": 2}, to_fastfeed=True):
        torch.manual_seed(0)
        loader = alias(ds, batch_size=4, shuffle=True)
        got = [b.clone() for b in loader]
    assert isinstance(loader, fastfeed.DataLoader) and loader.num_workers == 2
    assert all(torch.equal(a, b) for a, b in zip(expected, got)) and len(got) == len(expected)
    assert type(TorchLoader(ds)) is TorchLoader  # undone


def test_cached_mode_yields_one_batch_an_epochs_worth_of_times():
    """The compute ceiling's hooks: every epoch is the first batch again, len(loader) times, with no worker."""
    loader = fastfeed.DataLoader(_dataset(64), batch_size=8, num_workers=1)
    with doctor.watch(cached=True):
        batches = [b for b in loader]
    assert len(batches) == len(loader) == 8
    assert all(b is batches[0] for b in batches)


@pytest.mark.parametrize("sample_ms, step_s, alerts", [(1.0, 0.001, 1), (0.01, 0.01, 0)],
                         ids=["stalled", "not stalled"])  # fmt: skip
def test_the_alert_warns_once_with_the_verdict_when_the_loop_stalls_long_enough(caplog, sample_ms, step_s, alerts):
    """alert_stall/alert_after_s: a loop stalled for longer than alert_after_s logs one warning carrying the verdict;
    a loop whose step is slower than loading logs none."""
    loader = fastfeed.DataLoader(_dataset(2048, sample_ms=sample_ms), batch_size=8, num_workers=1)
    with caplog.at_level(logging.WARNING, logger="fastfeed"), OthersLoad() as others:
        with doctor.watch(seconds=2.0, interval=0.05, alert_stall=0.2, alert_after_s=0.5) as report:
            for _batch in loader:
                time.sleep(step_s)
    if not alerts:
        # The worker needs little CPU but a core when it wakes: on cores other processes hold, its batches come late
        # and the loop does stall (a third of it, beside a load average of 28 here), which the alert rightly says.
        skip_unless_idle(others, READS_CORES, report.to_dict())
    got = [r.getMessage() for r in caplog.records if "fastfeed doctor" in r.getMessage()]
    assert len(got) == alerts, got
    assert all("waiting for input" in m and "verdict: " in m for m in got)


def test_report_save_writes_every_output(tmp_path, fonts_open):
    """report.save(dir) writes report.json (the schema), report.txt, timeline.json, trace.json and timeline.png."""
    loader = fastfeed.DataLoader(_dataset(), batch_size=8, num_workers=1)
    with doctor.watch() as report:
        for _batch in loader:
            pass
    paths = report.save(tmp_path)
    assert json.loads(paths["json"].read_text())["schema"] == "fastfeed.doctor/1"
    assert paths["text"].read_text().startswith("verdict: ")
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert json.loads(paths["trace"].read_text())["traceEvents"]


def test_fastfeeds_stages_appear_in_torchs_profiler():
    """The device stage's wait and copy show as record_function ranges, named as torch names its loader's."""
    loader = fastfeed.DataLoader(torch.arange(64).float(), batch_size=8, num_workers=1, device="cpu")
    with torch.profiler.profile() as prof:
        for _batch in loader:
            pass
    names = {e.name for e in prof.events()}
    assert "enumerate(DataLoader)#DeviceIter.__next__" in names
    assert "fastfeed::h2d" in names
