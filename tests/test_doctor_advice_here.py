"""The doctor's advice ranked by what this machine can run: Ray actors with no cluster reachable are worded as what
to start and never become the closing run, and a closing run that fails is one line of the report."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastfeed.doctor import cli, diagnose, verdict, whatif
from fastfeed.doctor.report import Report
from fastfeed.doctor.script import BRIEF, brief

from _timelines import make

pytestmark = pytest.mark.fastfeed_only

N = 200
# Two CPU-bound workers at 40 ms a batch on two busy cores, a 10 ms step: input/cpu, and 3 Ray actors advised
CPU_BOUND = dict(worker_s=0.040, worker_cpu=0.95, samples={"cpu_busy": 0.98, "main_cpu": 0.1})
# torch's loader measured alone against fastfeed's twin: fastfeed's is advised, a setting this machine can run
TWIN = {"input_ceiling": {"batches_per_s": 50.0}, "input_ceiling_fastfeed": {"batches_per_s": 80.0}}
NO_CLUSTER = ("runs on a running Ray cluster and found none on this machine and RAY_ADDRESS is not set; start one "
              "first: `ray start --head` on one machine, `ray start --address=<head>:6379` on each CPU node "
              "(or call ray.init(address=...) yourself before iterating the loader). (Could not find any running "
              "Ray instance.\nPlease specify the one to connect to by setting RAY_ADDRESS)")  # fmt: skip


@pytest.fixture
def cluster(monkeypatch):
    """Ray installed, and a cluster reachable or not as the test sets ``cluster.up``."""
    state = SimpleNamespace(up=False)
    monkeypatch.setattr(verdict, "ray_installed", lambda: True)
    monkeypatch.setattr(verdict, "ray_cluster_reachable", lambda: state.up)
    return state


def _ray(advice: list[dict]) -> dict:
    (a,) = [a for a in advice if "ray" in a["change"]]
    return a


def test_ray_advice_without_a_cluster_ranks_after_what_runs_here_and_says_what_to_start(cluster):
    """No cluster reachable: fastfeed's loader (runnable here) is the closing run's advice, and the Ray actors come
    after it, with their predicted gain and what to start, and no run of them is tried."""
    v = diagnose(make([0.010] * N, [0.010] * N, kind="torch", **CPU_BOUND), TWIN)
    ray = _ray(v.advice)
    best = whatif.closing_choice(v.advice)
    assert best["setting"] == {"fastfeed": True}, v.advice
    assert v.advice.index(best) < v.advice.index(ray), v.advice
    assert ray["predicted_gain"] > 1.5 and ray["setting"]["num_workers"] == (2, 3)
    assert "ray start --head" in ray["needs"] and "RAY_ADDRESS" in ray["needs"]
    text = Report(timeline=make([0.010] * N, [0.010] * N, kind="torch", **CPU_BOUND), command=["t"]).summary()
    (line,) = [x for x in text.splitlines() if "ray" in x and x.startswith("  - ")]
    assert "-> predicted" in line and "Not measured here: it needs a Ray cluster" in line and "ray start --head" in line
    cluster.up = True  # the same loop with a cluster reachable: the actors are runnable, and the closing run's
    v = diagnose(make([0.010] * N, [0.010] * N, kind="torch", **CPU_BOUND), TWIN)
    assert whatif.closing_choice(v.advice) is _ray(v.advice) and _ray(v.advice)["needs"] is None


def _examine(monkeypatch, timeline, rerun):
    """``cli.examine`` on a recorded ``timeline`` standing for the script's run, every what-if run faked but the
    closing one, which ``rerun`` answers."""
    report = Report(timeline=timeline, command=["train.py"])
    loader = object()
    hooks = SimpleNamespace(loaders=lambda: {timeline.loaders[0].id: loader}, release=lambda: None)
    monkeypatch.setattr(cli.script, "run", lambda *a, **k: (report, SimpleNamespace(hooks=hooks), None))
    monkeypatch.setattr(cli.whatif, "input_ceiling", lambda *a: None)
    monkeypatch.setattr(cli.whatif, "compute_ceiling", lambda *a: (None, "faked"))
    monkeypatch.setattr(cli.whatif, "rerun", rerun)
    return cli.examine("train.py", [], steps=50)


def test_a_loop_whose_only_setting_is_ray_actors_with_no_cluster_tries_no_closing_run(cluster, monkeypatch):
    """Input/cpu on fastfeed's loader, no cluster: the closing run is not attempted, and its one line says what the
    Ray advice needs and its predicted gain."""
    tried = []
    report = _examine(monkeypatch, make([0.010] * N, [0.010] * N, **CPU_BOUND), lambda *a: tried.append(a))
    assert tried == []
    why = report.whatif["skipped"]["closing"]
    assert "num_workers=(2, 3) needs a Ray cluster" in why and "ray start --head" in why and "predicted" in why
    assert "\n" not in why and "closing" not in report.whatif


def test_a_closing_run_that_fails_is_one_line_with_no_traceback(cluster, monkeypatch):
    """A closing run that raises before its first batch (Ray's long error, as a cluster gone meanwhile gives) is
    reported as one line: the exception's type and its message's first line, cut short."""
    cluster.up = True

    def failing(target, argv, module, steps, setting):
        report = Report(timeline=make([], []), command=["train.py"])
        watch = SimpleNamespace(hooks=SimpleNamespace(release=lambda: None))
        return whatif._outcome(report, watch, RuntimeError("worker_type='ray' " + NO_CLUSTER))

    report = _examine(monkeypatch, make([0.010] * N, [0.010] * N, **CPU_BOUND), failing)
    why = report.whatif["skipped"]["closing"]
    assert why.startswith('with worker_type=("process", "ray"), num_workers=(2, 3): the run yielded no batches '
                          "(RuntimeError: worker_type='ray' runs on a running Ray cluster"), why
    assert "\n" not in why and "Traceback" not in why and "Please specify" not in why and len(why) < 300, why
    (line,) = [x for x in report.summary().splitlines() if x.startswith("  closing: not run")]
    assert line.endswith(" ...))"), line  # the message, cut short, closes both brackets


def test_brief_is_one_line_cut_at_a_word_and_keeps_a_short_message_whole():
    """A long or multi-line message is cut to its first line, at most BRIEF characters, at a word; a short one
    stays as it is."""
    long = brief(RuntimeError("word " * 100))
    assert long.startswith("RuntimeError: word word") and long.endswith(" ...") and "\n" not in long
    assert len(long) <= len("RuntimeError: ") + BRIEF + len(" ...")
    assert brief(ValueError("bad value")) == "ValueError: bad value"
    assert brief(KeyError("RANK")) == "KeyError: 'RANK'"
    assert brief(ValueError("first\nsecond")) == "ValueError: first ..."
