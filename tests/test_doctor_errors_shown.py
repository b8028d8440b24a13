"""What the doctor shows when a script fails: the script's traceback (alone, or the failing rank's in a job, above the
launcher's block), the hint to launch a DDP script as a job, error lines prefixed once, plain --help, and a job's
six questions answered for the rank its verdict is about."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fastfeed.cli import main
from fastfeed.doctor.jobreport import JobReport
from fastfeed.doctor.ranks import RankRecord

from _timelines import make

pytestmark = pytest.mark.fastfeed_only

RAISES = textwrap.dedent('''
    import os


    def main():
        if os.environ.get("RANK", "1") == "1":
            raise ValueError("rank 1 fails here")


    main()
''')


def _script(tmp_path, text: str):
    path = tmp_path / "train.py"
    path.write_text(text)
    return str(path)


def test_a_script_that_raises_shows_its_traceback_from_its_own_frames(tmp_path, capsys):
    """Alone, the script's traceback is shown with its file and lines, from the script's first frame (none of the
    doctor's or runpy's), then the doctor's one-line account; no job hint for an error that is not about RANK."""
    path = _script(tmp_path, RAISES)
    assert main(["doctor", "--no-whatif", path]) == 1
    err = capsys.readouterr().err
    frames = [line for line in err.splitlines() if line.startswith("  File ")]
    assert frames == [f'  File "{path}", line 10, in <module>', f'  File "{path}", line 7, in main'], err
    assert "ValueError: rank 1 fails here" in err
    assert err.index("Traceback") < err.index("fastfeed doctor: the script gave the doctor no batches"), err
    assert "--nproc-per-node" not in err


def test_a_ddp_script_run_alone_is_told_to_run_as_a_job(tmp_path, capsys, monkeypatch):
    """A script whose init_process_group finds RANK unset gets the --nproc-per-node hint, after its traceback."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    path = _script(tmp_path, 'import torch.distributed as dist\n\ndist.init_process_group("gloo")\n')
    assert main(["doctor", "--no-whatif", path]) == 1
    err = capsys.readouterr().err
    assert "environment variable RANK expected, but not set" in err
    hint = next(line for line in err.splitlines() if "--nproc-per-node" in line)
    assert hint.startswith("fastfeed doctor: the script expects torchrun's environment") and "N ranks" in hint
    assert err.index(f'File "{path}", line 3') < err.index(hint), err


@pytest.mark.parametrize("job", [[], ["--nproc-per-node", "2"]])
def test_a_missing_script_is_said_once(tmp_path, capsys, job):
    """No script at the path: one "fastfeed doctor:" prefix, alone or as a job's launcher."""
    missing = str(tmp_path / "nowhere.py")
    assert main(["doctor", *job, missing]) == 1
    err = capsys.readouterr().err
    assert f"fastfeed doctor: no script at '{missing}'" in err and "fastfeed doctor: fastfeed doctor" not in err, err


def test_help_is_plain_text_without_rst_backticks(capsys):
    """``fastfeed doctor --help`` shows its description without reStructuredText's double backticks."""
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    out = capsys.readouterr().out
    assert "(--demo comes last" in out and "python SCRIPT ARGS through runpy" in out and "`" not in out, out


@pytest.mark.hang_limit(60)
def test_a_failing_ranks_traceback_comes_before_the_launchers_block(tmp_path):
    """A real 2-rank launch of a script that raises on rank 1: rank 1's traceback (its file and lines) is in the
    output, above torch elastic's failure block, and the doctor exits 1."""
    path = _script(tmp_path, RAISES)
    proc = subprocess.Popen([sys.executable, "-m", "fastfeed", "doctor", "--nproc-per-node", "2", "--no-whatif", path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)  # fmt: skip
    try:
        out = proc.communicate(timeout=40)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 1, out[-3000:]
    assert "fastfeed doctor: rank 1: the script raised:" in out, out[-3000:]
    top = out.index("fastfeed doctor: rank 1: the script raised:")
    assert out.index(f'File "{path}", line 7, in main', top) < out.index("Root Cause"), out[-3000:]
    assert out.index('raise ValueError("rank 1 fails here")', top) < out.index("fastfeed doctor: a rank of the job")
    assert "runpy" not in out[top:out.index("Root Cause")], out[-3000:]


def test_a_jobs_six_questions_are_the_straggling_ranks_and_say_so():
    """Rank 1 waits 30 ms a batch, rank 0 2 ms then waits for it: the job's questions are rank 1's (its host
    stalls near its input share, not rank 0's few), named as such in the JSON and on the page."""
    n = 40
    zero = RankRecord(rank=0, timeline=make([0.002] * n, [0.005 + 0.028] * n))
    one = RankRecord(rank=1, timeline=make([0.030] * n, [0.005] * n))
    report = JobReport([zero, one], command=["test"])
    d = report.to_dict()
    assert d["job"]["stragglers"] == [1] and d["questions_rank"] == 1 == d["job"]["about"]
    stalls = d["questions"][2]
    assert stalls["question"] == "Are there host-side stalls before kernel launches?"
    assert stalls["value"] == pytest.approx(d["ranks"][1]["shares"]["input"], abs=0.05) and stalls["value"] > 0.8
    assert d["ranks"][0]["questions"][2]["value"] < 0.2  # what rank 0's loop alone answered
    assert "The six questions (rank 1's loop, the rank the verdict is about)</h2>" in report.html(d)
