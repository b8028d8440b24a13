"""``fastfeed doctor --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint H:P] SCRIPT``: a job, launched.

The job is launched as torchrun launches it, by torch's own elastic launcher (``torch.distributed.run``): every
rank runs ``python -m fastfeed doctor ... SCRIPT ARGS`` under torchrun's environment (``jobrun``), and the
launcher on node 0 hosts the store the ranks report through. A single node gets a rendezvous on a free local
port (launched again on another if a process takes it before the launcher binds it); several nodes use the static
rendezvous at ``--rdzv-endpoint`` (node 0's address), as torchrun does.

Each launch has a rendezvous id of its own (torchrun's ``--rdzv-id``, ``TORCHELASTIC_RUN_ID`` on its ranks), and
the ranks' keys in the store go under it (``jobstore.run_prefix``): a decision or clock answer of the measured
launch is never read by the closing one. Every node derives the same ids, from ``--rdzv-id`` or the endpoint.

After the measured launch, each launcher reads the decision its ranks received from rank 0 (``decision.json``
in the directory it gave them). When the advice has a setting, every node's launcher launches the job a second
time with it applied on every rank (the closing what-if), and node 0's launcher, whose rank 0 left the job's
records, reports predicted against measured.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import tempfile
import uuid
from pathlib import Path

from . import whatif
from .jobreport import JobReport
from .jobrun import JOB_DIR
from .script import say

log = logging.getLogger("fastfeed")

# Launches of one job on a single node, each on a port picked afresh, before a port taken under it is an error: a
# port found free is taken by another process before the launcher binds it only rarely, and not so many times over.
PORT_TRIES = 5
LAUNCHES = ("measured", "closing")  # each launch's part of its rendezvous id
_ID_CHARS = re.compile(r"[A-Za-z0-9._-]+")


class LaunchFailed(RuntimeError):
    """A launch of the job failed (a rank exited with an error, or the rendezvous did not happen)."""


class PortTaken(LaunchFailed):
    """The launcher could not host the job's store: another process held its port. No rank had started."""


def _free_port() -> int:
    """A local port free now: another process may take it before the launcher binds it (``launch_job`` retries)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_id(nnodes: int, endpoint: str | None, given: str | None = None) -> str:
    """The part of every launch's rendezvous id that names the job, alike on all its nodes.

    Args:
        nnodes: the job's nodes.
        endpoint: ``--rdzv-endpoint`` (node 0's HOST:PORT, which every node names), or None.
        given: ``--rdzv-id``, which every node is given alike (as torchrun's), or None.

    Returns:
        ``given``; else one made of the endpoint; else, on a single node (no other node to agree with), a random one.

    Raises:
        ValueError: ``given`` is not letters, digits, ``.``, ``_`` and ``-`` (it is part of the store's key prefix).
    """
    if given is not None:
        if not _ID_CHARS.fullmatch(given):
            raise ValueError(f"--rdzv-id {given!r}: use letters, digits, '.', '_' and '-' only (it names the job's "
                             "keys in its store)")  # fmt: skip
        return given
    if endpoint is not None:
        return "doctor-" + re.sub(r"[^A-Za-z0-9.-]", "-", endpoint)
    if nnodes > 1:
        raise ValueError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (node 0's address, as torchrun's)")
    return f"doctor-{uuid.uuid4().hex[:12]}"


def torchrun_args(nproc: int, nnodes: int, node_rank: int, endpoint: str | None, rank_argv: list[str],
                  rdzv_id: str, port: int | None = None) -> list[str]:  # fmt: skip
    """torchrun's arguments for a launch, under rendezvous id ``rdzv_id``, whose every rank runs ``python -m
    fastfeed doctor *rank_argv``; on a single node without ``endpoint``, its store listens on ``port`` (default:
    one free now)."""
    if nnodes > 1:
        if endpoint is None:
            raise ValueError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (node 0's address, as torchrun's)")
        where = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint]
    elif endpoint is not None:
        where = ["--nnodes", "1", "--rdzv-endpoint", endpoint]
    else:
        where = ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(port or _free_port())]
    return ["--nproc-per-node", str(nproc), *where, "--rdzv-backend", "static", "--rdzv-id", rdzv_id,
            "--max-restarts", "0", "-m", "fastfeed", "doctor", *rank_argv]  # fmt: skip


def launch_job(nproc: int, nnodes: int, node_rank: int, endpoint: str | None, rdzv_id: str, rank_argv: list[str],
               directory: str) -> None:  # fmt: skip
    """One launch of the job (``launch``). On a single node without ``endpoint``, a port picked for its store that
    another process took first fails the launch before any rank starts: it is launched again on another port, up
    to ``PORT_TRIES`` times. A port the user named (``endpoint``) is not changed: its clash raises PortTaken."""
    for attempt in range(1, PORT_TRIES + 1):
        port = _free_port() if endpoint is None and nnodes == 1 else None
        try:
            launch(torchrun_args(nproc, nnodes, node_rank, endpoint, rank_argv, rdzv_id, port), directory)
            return
        except PortTaken as e:
            if port is None or attempt == PORT_TRIES:
                raise
            log.info("fastfeed doctor: port %d, free when picked, was taken before the job's store bound it (%s); "
                     "launching again on another", port, e)  # fmt: skip


def launch(args: list[str], directory: str) -> None:
    """One launch through torch's elastic launcher; its ranks leave their decision (and rank 0 the job's records)
    in ``directory``. Raises LaunchFailed when any rank fails, PortTaken when the store's port is taken."""
    import torch.distributed as dist
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    saved = os.environ.get(JOB_DIR)
    os.environ[JOB_DIR] = directory
    try:
        torchrun.run(torchrun.get_args_parser().parse_args(args))
    except ChildFailedError as e:
        raise LaunchFailed(f"a rank of the job failed: {e.format_msg().strip()}") from None
    except dist.DistNetworkError as e:
        # The static rendezvous binds the store's port before any rank starts: EADDRINUSE leaves nothing running.
        if "EADDRINUSE" not in str(e):
            raise
        raise PortTaken(f"the job's store could not listen on its port: another process holds it ({e})") from None
    finally:
        if saved is None:
            os.environ.pop(JOB_DIR, None)
        else:
            os.environ[JOB_DIR] = saved


def _read(directory: str, name: str) -> dict | None:
    path = Path(directory) / name
    return json.loads(path.read_text()) if path.exists() else None


def examine_job(nproc: int, nnodes: int, node_rank: int, endpoint: str | None, target: str, argv: list[str],
                module: bool, steps: int, whatifs: bool, rdzv_id: str | None = None) -> JobReport | None:  # fmt: skip
    """The measured launch, then (``whatifs``, with a setting to try) the closing launch, each under a rendezvous
    id of its own (``job_id`` and the launch's name). Returns the job's report on node 0, None on the other nodes
    (their ranks' records went to node 0)."""
    job = job_id(nnodes, endpoint, rdzv_id)
    ids = {name: f"{job}-{name}" for name in LAUNCHES}
    script = [*(["-m"] if module else []), target, *argv]
    base = ["--steps", str(steps)]
    with tempfile.TemporaryDirectory(prefix="fastfeed-doctor-") as first:
        say(f"launching {nproc * nnodes} ranks ({nproc} per node, {nnodes} node{'s' if nnodes > 1 else ''}) "
             f"through torch.distributed.run")  # fmt: skip
        launch_job(nproc, nnodes, node_rank, endpoint, ids["measured"], [*base, *script], first)
        decision = _read(first, "decision.json") or {}
        records = _read(first, "job.json")
    report = JobReport.from_dict(records) if records else None
    if report is not None:
        report.command = ["fastfeed", "doctor", "--nproc-per-node", str(nproc), *script]
    closing = decision.get("closing")
    if not whatifs or closing is None:
        if report is not None and whatifs:
            report.whatif.setdefault("skipped", {})["closing"] = whatif.no_closing(report.job.advice)
        return report
    say(f"what-if: the job again with {closing['change']} on every rank (closing the loop)")
    overrides = json.dumps(closing["setting"])
    with tempfile.TemporaryDirectory(prefix="fastfeed-doctor-") as second:
        try:
            launch_job(nproc, nnodes, node_rank, endpoint, ids["closing"], [*base, "--overrides", overrides, *script],
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
