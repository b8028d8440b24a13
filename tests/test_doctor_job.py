"""The doctor on a job of several ranks: real jobs (torch's launcher, gloo on CPU), and the split and verdict on
recorded ones.

Each scenario runs ``tests/_ddp_train.py``, a plain DDP script on torch's DataLoader with DistributedSampler, as
a user would run it, under one of ``fastfeed doctor --nproc-per-node 2``, ``torchrun -m fastfeed doctor`` and two
launchers for two nodes on loopback (each mode in at least one scenario: ``JOBS``). Each asserts the job's verdict,
its stragglers and every rank's shares, skipped, naming the load, where the verdict needs idle cores that other
processes held (``_load``).
"""

from __future__ import annotations

import html
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fastfeed.doctor.jobverdict import judge
from fastfeed.doctor.ranks import RankRecord, split

from _load import OthersLoad, skip_unless_idle
from _timelines import make

SCRIPT = str(Path(__file__).with_name("_ddp_train.py"))
STEPS = 40
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

# rank 1's one worker spins a core, and input/workers (rather than input/cpu) needs half a core more free; the
# closing launch's two workers on rank 1 need both cores but a quarter of one (test_doctor's budget); in "compute"
# both ranks spin a core in their steps, and their workers' batches wait for a core (input/cpu) when others hold one
IDLE_CORES = 1.75
# A job takes 8 to 17 s on 2 idle cores and many times that on busy ones: a guard against hangs, not a time limit,
# of two and a half minutes a launch, which tests/conftest.py stretches with the machine's load (up to 4x). A job's
# own timeout is the backstop past the most it stretches to.
JOB_HANG_S = 150
JOB_TIMEOUT_S = 4 * JOB_HANG_S + 30

SCENARIOS = {
    # rank 1's samples cost 16x rank 0's, one worker each: rank 1 is input-bound, rank 0 waits in the all-reduce
    "one slow rank": ["--slow-rank", "1", "--slow-ms", "8", "--sample-ms", "0.5"],
    # every rank's samples wait 20 ms (reads), one worker each: input-bound alike. Alike ranks must differ by
    # less than the 10% of a step that makes a straggler: with 8 ms samples (32 ms batches) a few ms of handing
    # each batch over on 2 busy cores came near it (one run in 5 or so called a rank a straggler)
    "alike": ["--sample-ms", "20", "--io"],
    # 30 ms of CPU per step, fast samples
    "compute": ["--compute-ms", "30"],
    # 20M gradients all-reduced per step (80 MB), fast samples, half a millisecond of compute
    "sync": ["--params", "20000000", "--compute-ms", "0.5"],
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _doctor(*args: str) -> list[str]:
    return [sys.executable, "-m", "fastfeed", "doctor", *args]


def _end(proc: subprocess.Popen) -> None:
    """End a launcher cut short (its timeout, or the test's hang guard) with its ranks: torch's elastic agent puts
    each rank in a session of its own and ends them on SIGTERM, which it needs the time to do; SIGKILL for what is
    left of the launcher's session after that."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def run_job(mode: str, scenario: list[str], out: Path, steps: int = STEPS, whatif: bool = False,
            timeout: float = JOB_TIMEOUT_S) -> dict:  # fmt: skip
    """The job's report.json, from ``mode``: launch (fastfeed's launcher), torchrun, or two_nodes."""
    opts = ["--steps", str(steps), "--out", str(out), "--html", *([] if whatif else ["--no-whatif"])]
    if mode == "launch":
        runs = [_doctor("--nproc-per-node", "2", *opts, SCRIPT, *scenario)]
    elif mode == "torchrun":
        runs = [[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(_port()), "-m", "fastfeed", "doctor", *opts, SCRIPT, *scenario]]  # fmt: skip
    else:
        endpoint = f"127.0.0.1:{_port()}"
        runs = [_doctor("--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
                        endpoint, *opts, SCRIPT, *scenario) for node in (1, 0)]  # fmt: skip
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                              start_new_session=True) for cmd in runs]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in reversed(procs)]
    finally:
        for p in procs:
            _end(p)
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(outputs)[-6000:]
    if mode == "two_nodes":
        assert "node 1's ranks are measured; node 0 reports on the job" in outputs[-1], outputs[-1][-3000:]
    return json.loads((out / "report.json").read_text())


def check_report(d: dict) -> None:
    """What holds of any job's report, whatever the load: a rank each, shares that add up, and question 5 (the
    measured sync of the rank the job's verdict is about, its slowest, which it names)."""
    job, ranks = d["job"], d["ranks"]
    shares = {r["rank"]: r["shares"] for r in ranks}
    said = f"{job['verdict']['line']} | " + " | ".join(f"{r}: {s}" for r, s in shares.items())
    assert [r["rank"] for r in ranks] == [0, 1], said
    for s in shares.values():
        assert sum(s.values()) == pytest.approx(1.0), said
    about = d["questions_rank"]
    assert about == job["about"] and (not job["stragglers"] or about in job["stragglers"]), said
    q5 = d["questions"][4]
    assert q5["value"] == pytest.approx(shares[about]["sync"], abs=0.02) and "not distributed" not in q5["how"], q5


def check(name: str, d: dict) -> None:
    """The scenario's verdict, stragglers and every rank's shares."""
    job, ranks = d["job"], d["ranks"]
    verdict = job["verdict"]
    shares = {r["rank"]: r["shares"] for r in ranks}
    said = f"{name}: {verdict['line']} | " + " | ".join(f"{r}: {s}" for r, s in shares.items())
    if name == "one slow rank":
        assert (verdict["bottleneck"], verdict["cause"], job["stragglers"]) == ("input", "workers", [1]), said
        assert shares[1]["input"] > 0.5 and shares[0]["sync"] > 0.5 and shares[0]["input"] < 0.2, said
        assert ranks[0]["verdict"]["bottleneck"] == "sync" and ranks[0]["verdict"]["cause"] == "stragglers", said
        assert job["lost"] > 0.5 and "rank 1 holds the job back" in verdict["line"], said
        assert [a["rank"] for a in job["advice"] if a["setting"]] == [1], job["advice"]
    elif name == "alike":
        assert (verdict["bottleneck"], job["stragglers"]) == ("input", []), said
        assert all(s["input"] > 0.5 and s["sync"] < 0.25 for s in shares.values()), said
    elif name == "compute":
        assert (verdict["bottleneck"], job["stragglers"]) == ("compute", []), said
        assert all(s["input"] < 0.10 and s["compute"] > 0.5 for s in shares.values()), said
    else:
        assert (verdict["bottleneck"], verdict["cause"], job["stragglers"]) == ("sync", "collectives", []), said
        # Each rank spends about half its loop in the all-reduce and half making the gradients it reduces (one
        # pass over them): which half is larger on one rank swings with the machine's load (0.47 against 0.49 on
        # rank 0 in one run here), so each rank's sync is held to a floor that a 0% read (DDP's all-reduce inside
        # backward, missed) cannot reach, and the job's verdict above says which dominates.
        assert all(s["sync"] > 0.3 and s["input"] < 0.10 for s in shares.values()), said


def check_text(out: Path, d: dict) -> None:
    """report.txt: the job's verdict line first, then a line per rank; report.html (--html): the verdict first, a
    lane per rank."""
    text = (out / "report.txt").read_text().splitlines()
    assert text[0] == d["job"]["verdict"]["line"]
    assert [line.split(":")[0].strip().split(" (")[0] for line in text[2:4]] == ["rank 0", "rank 1"], text
    page = (out / "report.html").read_text()
    body = page[page.index("<body>"):]
    assert body.startswith(f'<body>\n<p id="verdict" class="verdict sev-{d["job"]["verdict"]["severity"]}">'
                           f'{html.escape(d["job"]["verdict"]["line"])}</p>'), body[:300]  # fmt: skip
    data = json.loads(re.search(r'<script type="application/json" id="ff-data">(.*?)</script>', page, re.S)[1])
    assert [lane["key"] for lane in data["tracks"][0]["lanes"]] == ["rank-0", "rank-1"]


# Each scenario under one launch mode and each mode in at least one scenario, not every scenario under every mode
# (which took three times as long): the modes share the whole path from a rank's records to the job's verdict.
# Under each, every rank runs ``jobrun.run_rank`` (the script under its own watch, as ``fastfeed doctor`` runs one),
# and rank 0 gathers every rank's records through the job's store (``jobstore.gather``, each rank's clock brought
# onto rank 0's) and judges them (``JobReport`` -> ``jobverdict.judge``). The modes differ only in how the ranks
# are started and who writes the report: torchrun starts them and rank 0 writes it; fastfeed's launcher starts them
# (one launcher per node for two nodes, node 1's ranks reporting to node 0's store) and writes it from the records
# rank 0 left (``JobReport.from_dict``). So each mode's own part is checked by one job: torchrun with "sync" (its
# verdict holds on busy cores, so a mode is checked under load too), two nodes with "alike" (ranks on two nodes
# whose clocks, brought onto one, must show no straggler), and fastfeed's launcher with "compute" and with "one
# slow rank", which is the closing launch's test below (more steps, then the closing launch): it checks that
# job's verdict, shares and report.txt the same way.
JOBS = [("launch", "compute"), ("torchrun", "sync"), ("two_nodes", "alike")]
# The scenarios whose verdict needs idle cores: "sync" is the all-reduce's whichever rank is slower.
NEEDS_IDLE = ("one slow rank", "alike", "compute", "sync")


@pytest.mark.hang_limit(JOB_HANG_S)
@pytest.mark.parametrize(("mode", "name"), JOBS, ids=[f"{mode}-{name}" for mode, name in JOBS])
def test_a_jobs_verdict_stragglers_and_shares(mode, name, tmp_path):
    with OthersLoad() as others:
        d = run_job(mode, SCENARIOS[name], tmp_path / "out")
    check_report(d)
    check_text(tmp_path / "out", d)
    if name in NEEDS_IDLE:
        skip_unless_idle(others, IDLE_CORES, d)
    check(name, d)


@pytest.mark.hang_limit(2 * JOB_HANG_S)
def test_the_closing_launch_measures_the_job_gain_the_advice_predicts(tmp_path):
    """The "one slow rank" job under fastfeed's launcher (its verdict, stragglers, shares and report.txt, as the
    other jobs'), then the closing launch with the advised setting."""
    out = tmp_path / "out"
    with OthersLoad() as others:
        d = run_job("launch", SCENARIOS["one slow rank"], out, steps=100, whatif=True, timeout=2 * JOB_TIMEOUT_S)
    check_report(d)
    check_text(out, d)
    skip_unless_idle(others, IDLE_CORES, d)
    check("one slow rank", d)
    closing = d["whatif"]["closing"]
    assert closing["setting"] == {"num_workers": 2} and closing["rank"] == 1, closing
    assert closing["gain"] == pytest.approx(closing["predicted_gain"], rel=0.15), closing
    assert [r["rank"] for r in closing["ranks"]] == [0, 1]
    names = {e["args"]["name"] for e in json.loads((out / "trace.json").read_text())["traceEvents"]
             if e["name"] == "process_name"}  # fmt: skip
    assert any(n.startswith("rank 0") for n in names) and any(n.startswith("rank 1") for n in names), names
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the split and the verdict on recorded jobs ------------------------------------------------------------------


def _rank(rank: int, waits, steps, *, offset: float = 0.0, slept=None, cuda: bool = False) -> RankRecord:
    """A rank's record from per-batch waits and steps (seconds); ``slept``: per step, seconds the thread slept."""
    tl = make(waits, steps)
    ep = tl.loaders[0].epochs[0]
    if slept is not None:
        total, ep.blocked = 0.0, []
        for i, w in enumerate(waits):
            total += w + (slept[i - 1] if i else 0.0)  # a wait is slept through, as the loop waits on a pipe
            ep.blocked.append(total)
    shift = -offset  # this rank's clock reads ``offset`` less than rank 0's
    for e in tl.loaders[0].epochs:
        e.asks = [a + shift for a in e.asks]
        e.returns = [r + shift for r in e.returns]
    tl.start += shift
    tl.end += shift
    return RankRecord(rank=rank, timeline=tl, offset=offset, cuda=cuda)


def test_a_rank_that_had_its_batch_first_waits_the_difference_on_one_clock():
    # rank 1 waits 30 ms for each batch, rank 0 2 ms; both steps are 5 ms of compute, after which rank 0 waits
    # for rank 1 (its step lasts until rank 1 has caught up); rank 1's clock reads 7 s less than rank 0's
    n = 20
    zero = _rank(0, [0.002] * n, [0.005 + 0.028] * n)
    one = _rank(1, [0.030] * n, [0.005] * n, offset=7.0)
    s0, s1 = split([zero, one])
    assert s0.sync_s == pytest.approx(0.028 * (n - 1), rel=0.01)
    assert s1.sync_s == pytest.approx(0.0, abs=1e-9)
    assert s0.shares()["sync"] > 0.75 and s1.shares()["input"] > 0.8
    job = judge([zero, one])
    assert job.stragglers == [1] and job.bottleneck == "input"


def test_sleep_inside_a_step_is_sync_on_a_cpu_backend_and_not_where_cuda_is_used():
    # every rank arrives together (no straggler), and sleeps 40 of a 50 ms step: the collective's own time
    n = 20
    for cuda, expected in ((False, 0.040), (True, 0.0)):
        ranks = [_rank(r, [0.001] * n, [0.050] * n, slept=[0.040] * n, cuda=cuda) for r in range(2)]
        for sp in split(ranks):
            assert sp.sync_s == pytest.approx(expected * (n - 1), rel=0.01, abs=1e-9)
    ranks = [_rank(r, [0.001] * n, [0.050] * n, slept=[0.040] * n) for r in range(2)]
    job = judge(ranks)
    assert (job.bottleneck, job.cause, job.stragglers) == ("sync", "collectives", [])
    assert job.collectives_s == pytest.approx(0.040, rel=0.01)  # per step


def test_two_slow_ranks_of_four_are_both_stragglers_and_alike_ranks_none():
    n = 20
    fast, slow = ([0.002] * n, [0.033] * n), ([0.030] * n, [0.005] * n)
    ranks = [_rank(r, *(slow if r in (1, 3) else fast)) for r in range(4)]
    assert judge(ranks).stragglers == [1, 3]
    alike = [_rank(r, *slow) for r in range(4)]
    job = judge(alike)
    assert job.stragglers == [] and job.bottleneck == "input"


def test_a_moderate_wait_beside_a_long_compute_leaves_the_job_compute_bound():
    ranks = [_rank(r, [0.003] * 20, [0.040] * 20) for r in range(2)]  # 7% waiting for input
    job = judge(ranks)
    assert (job.bottleneck, job.stragglers, job.advice) == ("compute", [], [])



def test_ranks_waiting_for_a_straggler_lose_their_sync_less_the_collectives_own_time():
    """Both ranks spend 10 ms of each step in the all-reduce itself (slept on a CPU backend); rank 1 waits 30 ms per
    batch, so rank 0 also sleeps 28 ms a step waiting for it. The collectives' time is the least sync per step of
    any rank (rank 1's 10 ms: it waits for nobody), and what rank 0 loses to the straggler is its sync less that:
    (sync - 10 ms x batches) / loop = 61%, not its whole 84% sync share. Guards against the collectives taken as
    the largest rank's sync (``min`` -> ``max``: nothing would be lost) and against the collectives' own time
    counted as lost."""
    n = 20
    zero = _rank(0, [0.002] * n, [0.005 + 0.010 + 0.028] * n, slept=[0.010 + 0.028] * n)
    one = _rank(1, [0.030] * n, [0.005 + 0.010] * n, slept=[0.010] * n)
    s0, _ = split([zero, one])
    job = judge([zero, one])
    assert job.stragglers == [1] and job.about == 1
    assert job.collectives_s == pytest.approx(0.010, rel=0.02)
    assert job.lost == pytest.approx((s0.sync_s - 0.010 * n) / s0.loop_s, rel=1e-6)
    assert job.lost == pytest.approx(0.61, abs=0.02) and s0.shares()["sync"] > job.lost + 0.2
    assert "rank 0 loses 61% of its loop waiting for it" in job.line


def test_collectives_taking_a_quarter_of_a_long_compute_step_leave_the_job_compute_bound():
    """Alike ranks that spend 15 ms of a 60 ms step in the collectives: sync is 25% of the loop (at least HIGHLY)
    but compute is 74%, so the job is compute-bound, as the module says (sync only when it takes more than input
    and compute). Guards against sync judged by its share alone."""
    ranks = [_rank(r, [0.001] * 20, [0.060] * 20, slept=[0.015] * 20) for r in range(2)]
    job = judge(ranks)
    assert (job.bottleneck, job.stragglers, job.advice) == ("compute", [], [])
    assert "sync 25% of the loop" in job.line


@pytest.mark.hang_limit(JOB_HANG_S)
def test_a_rank_whose_script_raises_ends_the_job_with_its_error_and_leaves_nothing(tmp_path):
    # rank 1 raises at its 5th batch while rank 0 waits for it in the all-reduce: no hang, the error named
    cmd = _doctor("--nproc-per-node", "2", "--steps", "40", "--no-whatif", SCRIPT, "--fail-rank", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)  # fmt: skip
    try:
        out = proc.communicate(timeout=JOB_TIMEOUT_S)[0]
    finally:
        _end(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "rank 1: the script ended with RuntimeError('rank 1 failed on purpose')" in out, out[-3000:]
    assert "fastfeed doctor: a rank of the job failed" in out, out[-3000:]
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], left


def test_one_rank_watched_alone_says_what_its_sync_figure_leaves_out():
    from fastfeed.doctor.verdict import diagnose

    tl = make([0.001] * 20, [0.030] * 20)
    assert "(0: not distributed" in diagnose(tl).questions[4]["how"]
    tl.world = 4
    how = diagnose(tl).questions[4]["how"]
    assert "one of 4 ranks watched alone" in how and "--nproc-per-node" in how and "not distributed" not in how
