"""``fastfeed doctor --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint H:P] SCRIPT``: a job, launched.

The job is launched as torchrun launches it, by torch's own elastic launcher (``torch.distributed.run``): every
rank runs ``python -m fastfeed doctor ... SCRIPT ARGS`` under torchrun's environment (``jobrun``), and the
launcher on node 0 hosts the store the ranks report through. A single node gets a rendezvous on a free local
port; several nodes use the static rendezvous at ``--rdzv-endpoint`` (node 0's address), as torchrun does.

After the measured launch, each launcher reads the decision its ranks received from rank 0 (``decision.json``
in the directory it gave them). When the advice has a setting, every node's launcher launches the job a second
time with it applied on every rank (the closing what-if), and node 0's launcher, whose rank 0 left the job's
records, reports predicted against measured.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

from . import whatif
from .jobreport import JobReport
from .jobrun import JOB_DIR
from .script import say


class LaunchFailed(RuntimeError):
    """A launch of the job failed (a rank exited with an error, or the rendezvous did not happen)."""



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_args(nproc: int, nnodes: int, node_rank: int, endpoint: str | None, rank_argv: list[str]) -> list[str]:
    """torchrun's arguments for a job whose every rank runs ``python -m fastfeed doctor *rank_argv``."""
    if nnodes > 1:
        if endpoint is None:
            raise ValueError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (node 0's address, as torchrun's)")
        where = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint]
    elif endpoint is not None:
        where = ["--nnodes", "1", "--rdzv-endpoint", endpoint]
    else:
        where = ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    return ["--nproc-per-node", str(nproc), *where, "--rdzv-backend", "static", "--max-restarts", "0",
            "-m", "fastfeed", "doctor", *rank_argv]  # fmt: skip


def launch(args: list[str], directory: str) -> None:
    """One launch through torch's elastic launcher; its ranks leave their decision (and rank 0 the job's records)
    in ``directory``. Raises LaunchFailed when any rank fails."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    saved = os.environ.get(JOB_DIR)
    os.environ[JOB_DIR] = directory
    try:
        torchrun.run(torchrun.get_args_parser().parse_args(args))
    except ChildFailedError as e:
        raise LaunchFailed(f"a rank of the job failed: {e.format_msg().strip()}") from None
    finally:
        if saved is None:
            os.environ.pop(JOB_DIR, None)
        else:
            os.environ[JOB_DIR] = saved


def _read(directory: str, name: str) -> dict | None:
    path = Path(directory) / name
    return json.loads(path.read_text()) if path.exists() else None


def examine_job(nproc: int, nnodes: int, node_rank: int, endpoint: str | None, target: str, argv: list[str],
                module: bool, steps: int, whatifs: bool) -> JobReport | None:  # fmt: skip
    """The measured launch, then (``whatifs``, with a setting to try) the closing launch. Returns the job's
    report on node 0, None on the other nodes (their ranks' records went to node 0)."""
    script = [*(["-m"] if module else []), target, *argv]
    base = ["--steps", str(steps)]
    with tempfile.TemporaryDirectory(prefix="fastfeed-doctor-") as first:
        say(f"launching {nproc * nnodes} ranks ({nproc} per node, {nnodes} node{'s' if nnodes > 1 else ''}) "
             f"through torch.distributed.run")  # fmt: skip
        launch(torchrun_args(nproc, nnodes, node_rank, endpoint, [*base, *script]), first)
        decision = _read(first, "decision.json") or {}
        records = _read(first, "job.json")
    report = JobReport.from_dict(records) if records else None
    if report is not None:
        report.command = ["fastfeed", "doctor", "--nproc-per-node", str(nproc), *script]
    closing = decision.get("closing")
    if not whatifs or closing is None:
        if report is not None and whatifs:
            report.whatif.setdefault("skipped", {})["closing"] = "no setting to change"
        return report
    say(f"what-if: the job again with {closing['change']} on every rank (closing the loop)")
    overrides = json.dumps(closing["setting"])
    with tempfile.TemporaryDirectory(prefix="fastfeed-doctor-") as second:
        try:
            launch(torchrun_args(nproc, nnodes, node_rank, endpoint, [*base, "--overrides", overrides, *script]),
                   second)  # fmt: skip
        except LaunchFailed as e:
            if report is not None:
                report.whatif.setdefault("skipped", {})["closing"] = f"with {closing['change']}: {e}"
            return report
        rerun = _read(second, "job.json")
    if report is None or rerun is None:
        return report
    report.whatif["closing"] = closing_result(report, JobReport.from_dict(rerun), closing)
    return report


def closing_result(before: JobReport, after: JobReport, closing: dict) -> dict:
    """The closing launch against the measured one: the job's rate, its slowest rank's (``whatif.gains``)."""
    now, then = after.job_rate(), before.job_rate()
    return {**closing, "samples_per_s": now["samples_per_s"], "batches_per_s": now["batches_per_s"],
            "warm_batches_per_s": now["warm_batches_per_s"], "ranks": now["ranks"],
            **whatif.gains(now, then)}  # fmt: skip
