"""A job's verdict: which rank holds the job back and why, or what holds every rank back alike.

Every rank of a data-parallel job runs at the slowest rank's pace, so the job has one bottleneck even when its
ranks' own verdicts differ (the slow rank input-bound, the others sync-bound waiting for it). Per rank, ``own``
is the time per step it needs alone (input and compute, no sync, and at least its workers' time per batch: a rank
that waits for others gives its workers that time, so its own input wait understates it;
``RankSplit.own_per_step``):

- **Stragglers.** When some rank would idle at least ``STRAGGLER_GAP`` of each step waiting for the slowest one,
  the ranks within ``SLOW_GROUP`` of a step of the slowest are the stragglers. The job's bottleneck is theirs
  (input with its cause, or compute), and the others lose their sync beyond the collectives' own time
  (the slowest rank's sync per step: it waits for nobody) waiting for them.
- **Otherwise** the ranks are alike, and the job's bottleneck comes from the mean shares: ``sync`` when the
  collectives themselves take at least ``HIGHLY`` of the loop and more than input or compute do; ``input`` when
  the ranks wait ``HIGHLY`` or more of their loop for the loader, or more than they compute (a moderate wait
  beside a much longer compute leaves the job compute-bound: removing it gains little); else ``compute``.

Advice targets the slowest rank's loader; its predicted gain is the job's: the job's step is predicted as the
slowest of (the advised rank's predicted step, every other rank's own step plus the collectives' time).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from . import memory
from .ranks import RankRecord, RankSplit, split
from .verdict import HIGHLY, MODERATELY, Verdict, _severity, diagnose

STRAGGLER_GAP = 0.10
SLOW_GROUP = 0.05


@dataclass
class RankView:
    """One rank as the job's verdict sees it: its records, its loop split, and its own verdict."""

    record: RankRecord
    split: RankSplit
    verdict: Verdict

    @property
    def rank(self) -> int:
        return self.record.rank

    def as_dict(self) -> dict:
        v, sp = self.verdict, self.split
        ev = v.evidence
        return {"rank": self.rank, "host": self.record.host, "local_rank": self.record.local_rank,
                "offset_s": self.record.offset, "error": self.record.error,
                "verdict": {"bottleneck": v.bottleneck, "cause": v.cause, "severity": v.severity, "line": v.line},
                "shares": sp.shares(), "own_step_s": sp.own_per_step(), "batches": sp.batches,
                "waiting_for_others_s": sp.waiting_for_others_s,
                "samples_per_s": ev["samples_per_s"], "warm_batches_per_s": ev["warm_batches_per_s"],
                "wait_p50_s": ev["wait_p50_s"], "step_p50_s": ev["step_p50_s"],
                "questions": v.questions, "advice": v.advice}  # fmt: skip


@dataclass
class JobVerdict:
    bottleneck: str  # input, compute or sync
    cause: str | None
    severity: str
    line: str
    stragglers: list[int]
    lost: float | None  # the mean share of their loop the other ranks lose waiting for the stragglers
    ranks: list[RankView]
    advice: list[dict] = field(default_factory=list)
    step_s: float = 0.0  # the job's seconds per step once its workers started (``RankSplit.step_per_batch``, mean)
    collectives_s: float = 0.0  # per step, the sync even the slowest rank has: the collectives' own time
    about: int = 0  # the rank the verdict and advice are about: the slowest (a straggler, when there are any)
    memory: dict | None = None  # fastfeed.doctor.memory.job: the workers' memory summed over the ranks

    def as_dict(self) -> dict:
        return {"verdict": {"bottleneck": self.bottleneck, "cause": self.cause, "severity": self.severity,
                            "line": self.line},
                "stragglers": self.stragglers, "lost": self.lost, "step_s": self.step_s,
                "collectives_s": self.collectives_s, "about": self.about, "advice": self.advice,
                "memory": self.memory}  # fmt: skip


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def judge(records: list[RankRecord]) -> JobVerdict:
    """The job's verdict from every rank's records (rank 0's first)."""
    splits = split(records)
    views = [RankView(r, sp, diagnose(r.timeline, sync=sp)) for r, sp in zip(records, splits)]
    steps = [sp.step_per_batch() for sp in splits if sp.batches]
    step = _mean(steps)
    own = {v.rank: v.split.own_per_step() for v in views}
    collectives = min((v.split.sync_s / max(1, v.split.batches - len(v.split.epoch_ends)) for v in views
                       if v.split.batches), default=0.0)  # fmt: skip
    slowest = max(views, key=lambda v: own[v.rank])
    stragglers: list[int] = []
    if step > 0 and max((own[slowest.rank] - o) / step for o in own.values()) >= STRAGGLER_GAP:
        stragglers = sorted(r for r, o in own.items() if (own[slowest.rank] - o) / step < SLOW_GROUP)
    shares = {key: _mean(v.split.shares()[key] for v in views) for key in ("input", "sync", "compute")}
    lost = None
    if stragglers:
        others = [v for v in views if v.rank not in stragglers]
        lost = _mean(max(0.0, v.split.sync_s - collectives * v.split.batches) / v.split.loop_s
                     for v in others if v.split.loop_s > 0)  # fmt: skip
        sv = slowest.verdict
        bottleneck = "input" if sv.bottleneck == "input" else "compute"
        cause = sv.cause if bottleneck == "input" else None
        severity = sv.severity if bottleneck == "input" else _severity(lost)
        who = ", ".join(map(str, stragglers))
        waiting = ", ".join(str(v.rank) for v in others)
        mine = slowest.split.shares()
        what = (f"{sv.severity} input-bound ({bottleneck}/{cause}): {mine['input']:.0%} of its loop waiting for input"
                if bottleneck == "input" else f"compute: {mine['compute']:.0%} of its loop computing")
        many, them = len(stragglers) > 1, len(others) > 1
        line = (f"verdict: rank{'s' * many} {who} hold{'s' * (not many)} the job back, {what}; "
                f"rank{'s' * them} {waiting} lose{'s' * (not them)} {lost:.0%} of {'their' if them else 'its'} loop "
                f"waiting for {'them' if many else 'it'}")  # fmt: skip
    elif shares["sync"] >= HIGHLY and shares["sync"] >= max(shares["input"], shares["compute"]):
        bottleneck, cause, severity = "sync", "collectives", _severity(shares["sync"])
        line = (f"verdict: {severity} sync-bound job: {shares['sync']:.0%} of every rank's loop in the collectives "
                f"(input {shares['input']:.0%}, compute {shares['compute']:.0%}); no straggler")
    elif shares["input"] >= HIGHLY or (shares["input"] >= MODERATELY and shares["input"] >= shares["compute"]):
        bottleneck, severity = "input", _severity(shares["input"])
        causes = Counter(v.verdict.cause for v in views if v.verdict.bottleneck == "input")
        cause = causes.most_common(1)[0][0] if causes else slowest.verdict.cause
        line = (f"verdict: {severity} input-bound job ({bottleneck}/{cause}): the ranks wait {shares['input']:.0%} of "
                f"their loop for input, alike; no straggler")
    else:
        bottleneck, cause, severity = "compute", None, "not"
        line = (f"verdict: compute-bound job, not input-bound: input {shares['input']:.0%}, sync {shares['sync']:.0%}"
                f" of the loop; no straggler")
    job = JobVerdict(bottleneck=bottleneck, cause=cause, severity=severity, line=line, stragglers=stragglers,
                     lost=lost, ranks=views, step_s=step, collectives_s=collectives, about=slowest.rank)  # fmt: skip
    job.memory = memory.job([(v.rank, v.record.host, v.verdict.memory) for v in views])
    job.advice = advise(job, slowest, own)
    share = memory.job_advice(job.memory)
    if share is not None:  # whatever holds the job back, every rank's workers copying the dataset costs memory
        job.advice.append(share)
    return job


def advise(job: JobVerdict, slowest: RankView, own: dict[int, float]) -> list[dict]:
    """The slowest rank's advice, each with the job's predicted gain; for a sync-bound job, what cuts the
    collectives' bytes or count."""
    if job.bottleneck == "sync":
        return [{"change": "fewer or smaller all-reduces: accumulate gradients over several batches (DDP's no_sync()),"
                           " a larger batch per rank, or bf16 gradients (DDP's bf16_compress_hook)",
                 "setting": None, "rank": None, "predicted_samples_per_s": None, "predicted_gain": None, "needs": None,
                 "why": f"the collectives take {job.collectives_s * 1e3:.1f} ms of every "
                        f"{job.step_s * 1e3:.1f} ms step on every rank, with input and compute fast"}]  # fmt: skip
    if job.bottleneck != "input":
        return []
    out = []
    primary = slowest.record.timeline.primary()
    bs = (primary.batch_size if primary else None) or 1
    now = slowest.split.step_per_batch()
    for item in slowest.verdict.advice:
        if item.get("predicted_saving_bytes") is not None:
            continue  # fastfeed.share: given once for the job, its saving summed over the ranks (memory.job_advice)
        gain = None
        rate = item.get("predicted_samples_per_s")
        if rate and job.step_s > 0 and now > 0:
            if job.stragglers:
                # the advised rank at its predicted pace; the others as they are, each paying the collectives
                others = [o + job.collectives_s for r, o in own.items() if r != slowest.rank]
                predicted = max([bs / rate, *others])
            else:  # alike ranks take the same setting and gain alike
                predicted = job.step_s * (bs / rate) / now
            gain = job.step_s / predicted
        out.append({**item, "rank": slowest.rank, "predicted_gain": gain,
                    "predicted_samples_per_s": None if gain is None else bs / job.step_s * gain})  # fmt: skip
    return out
