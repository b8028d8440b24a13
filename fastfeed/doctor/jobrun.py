"""One rank of a job under the doctor: ``torchrun ... -m fastfeed doctor SCRIPT`` runs this on every rank.

Each rank runs the script under its own watch, as the single-process doctor does, for the same ``--steps``
batches. Then rank 0 answers the others' clock requests, gathers every rank's records through the job's store
(``jobstore``), judges the job (``jobverdict``) and posts the decision: the setting a closing launch should
apply, if any. Each rank waits for that decision, so that the launcher of every node can read it
(``FASTFEED_DOCTOR_JOB_DIR``: a directory each of fastfeed's launchers gives its ranks; see ``launch``).

Under plain torchrun, rank 0 prints and saves the job's report itself; under ``fastfeed doctor
--nproc-per-node``, it leaves the job's records in the launcher's directory and the launcher reports, after the
closing launch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .._atomic import write_atomic
from . import jobstore, script
from .jobreport import JobReport
from .ranks import RankRecord
from .script import say

JOB_DIR = "FASTFEED_DOCTOR_JOB_DIR"


class RankFailed(RuntimeError):
    """The script raised on this rank: the rank exits with an error, and the launcher ends the job."""



def run_rank(env: dict, target: str, argv: list[str], module: bool, steps: int,
             overrides: dict | None = None) -> JobReport | None:  # fmt: skip
    """Run this rank's part; on rank 0, return the job's report (None on the other ranks)."""
    rank, world = env["rank"], env["world"]
    if rank == 0:
        say(f"measuring {target} on {world} ranks for up to {steps} batches each")
    settings = dict(overrides or {})
    to_fastfeed = bool(settings.pop("fastfeed", False))
    report, watch, error = script.run(target, argv, module, steps=steps, overrides=settings or None,
                                      to_fastfeed=to_fastfeed, job=True)  # fmt: skip
    watch.hooks.release()
    jobstore.capture()  # a script that never made its process group ends here with nothing to capture
    record = RankRecord(rank=rank, timeline=report.timeline, host=jobstore.host(), local_rank=env["local_rank"],
                        cuda=jobstore.cuda_used(), error=None if error is None else repr(error))  # fmt: skip
    if error is not None:
        # The traceback (file and line) goes to this rank's stderr, which the launcher passes through: the
        # launcher's own failure block, printed once it has ended the job, comes after it.
        script.show_traceback(error, f"rank {rank}: the script")
        # The other ranks may be waiting for this one inside a collective, and only its exit lets the launcher end
        # the job: waiting here for rank 0's verdict would hang it.
        raise RankFailed(f"rank {rank}: the script ended with {error!r}; the launcher ends the job") from error
    store = jobstore.connect()
    if rank == 0:
        jobstore.serve_clock(store, world)
        records = jobstore.gather(store, record, world)
        job = JobReport(records, command=report.command)
        setting = job.closing_advice()
        jobstore.post_decision(store, {"closing": setting})
        _leave({"closing": setting}, job)
        return job
    record.offset = jobstore.offset_to_rank0(store, rank)
    jobstore.publish(store, record)
    _leave(jobstore.read_decision(store), None)
    return None


def _leave(decision: dict, job: JobReport | None) -> None:
    """For fastfeed's launcher: the decision (every rank), and the job's records (rank 0)."""
    directory = os.environ.get(JOB_DIR)
    if not directory:
        return
    write_atomic(Path(directory) / "decision.json", json.dumps(decision))
    if job is not None:
        write_atomic(Path(directory) / "job.json", json.dumps(job.records_dict(), default=str))
