"""The doctor's report on a job of several ranks: one verdict for the job, then one line per rank.

``report.json`` keeps the single-process report's fields at the top level, for rank 0 (its verdict knows the
sync it measured against the other ranks), but for ``questions``: the six questions are answered for the rank the
job's verdict is about (its slowest, a straggler when there are any), named by ``questions_rank``. It adds:

- ``job``: ``{"verdict": {bottleneck (input | compute | sync), cause, severity, line}, "stragglers": [rank, ...]
  (empty: no rank is slower than the others), "lost": the share of their loop the other ranks lose waiting for
  the stragglers, "step_s", "collectives_s" (per step, the sync even the slowest rank has), "about" (the slowest
  rank), "world", "advice": [... each with "rank": the rank whose loader it changes, and the job's predicted
  gain]}``;
- ``ranks``: ``[{"rank", "host", "local_rank", "offset_s", "verdict": {...}, "shares": {"input", "sync",
  "compute"} (fractions of that rank's loop), "own_step_s", "samples_per_s", ...}]``.

``whatif.closing`` is the job's: the advised setting applied on every rank in a second launch, the job's measured
gain (its slowest rank's rate, once every worker has made its first batch) against the predicted one.
"""

from __future__ import annotations

from . import memory
from .evidence import ms
from .jobverdict import JobVerdict, judge
from .ranks import RankRecord
from .report import Report, needs, write_page, write_texts

CEILINGS_SKIPPED = ("for a job, each rank's loader alone or the script fed cached batches would be a second job "
                    "whose ranks compete for the machine; the closing launch measures the advice instead")


class JobReport:
    """Every rank's records and what the doctor makes of them."""

    def __init__(self, records: list[RankRecord], whatif: dict | None = None, command: list | None = None) -> None:
        self.records = sorted(records, key=lambda r: r.rank)
        self.whatif = whatif if whatif is not None else {"skipped": {"ceilings": CEILINGS_SKIPPED}}
        self.command = command or []
        self.job: JobVerdict = judge(self.records)

    @classmethod
    def from_dict(cls, d: dict) -> JobReport:
        """From ``records_dict()``."""
        return cls([RankRecord.from_dict(r) for r in d["records"]], d.get("whatif"), d.get("command"))

    def records_dict(self) -> dict:
        """Everything the report is computed from (``job.json``; ``from_dict`` reads it back)."""
        return {"records": [r.to_dict() for r in self.records], "whatif": self.whatif, "command": self.command}

    def closing_advice(self) -> dict | None:
        """The advice the closing launch applies: the first with a setting that runs here (``needs`` unset), or
        None."""
        for item in self.job.advice:
            if item.get("setting") and not item.get("needs"):
                return {k: item[k] for k in ("change", "setting", "rank", "predicted_gain", "predicted_samples_per_s")}
        return None

    def job_rate(self) -> dict:
        """The job's pace: its slowest rank's batches/s (and once warm), with each rank's."""
        rates = [v.verdict.evidence for v in self.job.ranks]
        warm = [e["warm_batches_per_s"] for e in rates]
        return {"batches_per_s": min(e["batches_per_s"] for e in rates),
                "samples_per_s": min(e["samples_per_s"] for e in rates),
                "warm_batches_per_s": None if any(w is None for w in warm) else min(warm),
                "ranks": [{"rank": v.rank, "batches_per_s": e["batches_per_s"], "warm_batches_per_s": w}
                          for v, e, w in zip(self.job.ranks, rates, warm)]}  # fmt: skip

    def to_dict(self) -> dict:
        zero = self.job.ranks[0]
        top = Report(timeline=zero.record.timeline, command=self.command, sync=zero.split)
        top.whatif = self.whatif
        d = top.to_dict()
        d["job"] = {**self.job.as_dict(), "world": len(self.records), **self.job_rate()}
        # The six questions are asked of one loop: the rank the job's verdict is about (its slowest), not rank 0,
        # whose loop may only wait for it.
        about = next(v for v in self.job.ranks if v.rank == self.job.about)
        d["questions"], d["questions_rank"] = about.verdict.questions, about.rank
        d["ranks"] = [v.as_dict() for v in self.job.ranks]
        return d

    def summary(self, d: dict | None = None) -> str:
        """The text: the job's verdict first, then one line per rank, the advice and the what-if."""
        d = d or self.to_dict()
        job = d["job"]
        lines = [job["verdict"]["line"],
                 f"job: {job['world']} ranks, {job['samples_per_s']:.1f} samples/s per rank at the slowest rank's "
                 f"pace, step {ms(job['step_s'])} (collectives {ms(job['collectives_s'])} of it)"]  # fmt: skip
        for r in d["ranks"]:
            s = r["shares"]
            line = r["verdict"]["line"].removeprefix("verdict: ")
            lines.append(f"  rank {r['rank']} ({r['host']}, local rank {r['local_rank']}): input {s['input']:.0%}, "
                         f"sync {s['sync']:.0%}, compute {s['compute']:.0%}; {line}; "
                         f"{r['samples_per_s']:.1f} samples/s, step p50 {ms(r['step_p50_s'])}"
                         + (f"; ended with {r['error']}" if r["error"] else ""))  # fmt: skip
        lines += memory.job_lines(job.get("memory"))
        lines.append("advice:" if job["advice"] else
                     "advice: none; no rank's input pipeline is what holds this job back")  # fmt: skip
        for a in job["advice"]:
            gain = "" if a["predicted_gain"] is None else f" -> predicted job gain {a['predicted_gain']:.2f}x"
            who = "" if a.get("rank") is None else f" (rank {a['rank']}'s loader, applied on every rank)"
            lines.append(f"  - {a['change']}{who}{gain}: {a['why']}{needs(a)}")
        c = d["whatif"].get("closing")
        if c:
            lines.append(f"what-if: the job again with {c['change']}: {c['samples_per_s']:.1f} samples/s per rank, "
                         f"measured {c['gain']:.2f}x (predicted {_x(c.get('predicted_gain'))})")  # fmt: skip
        for key, why in d["whatif"].get("skipped", {}).items():
            lines.append(f"what-if {key}: not run ({why})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _labels(self) -> list[str]:
        """A line per rank, in the order of ``records``: its verdict."""
        return [f"rank {v.rank}: {v.verdict.line.removeprefix('verdict: ')}" for v in self.job.ranks]

    def html(self, d: dict | None = None) -> str:
        """The job's report as one self-contained HTML page (``fastfeed.doctor.html``): the job's verdict, the
        ranks, a zoomable timeline with a lane per rank, the six questions of the rank the verdict is about, the
        advice and the what-if."""
        from . import html

        d = d or self.to_dict()
        data = html.job_data(self.records, [v.split for v in self.job.ranks], labels=self._labels(),
                             keep=self.job.stragglers)  # fmt: skip
        return html.page(d, self.summary(d), data)

    def save(self, directory, plot: bool = True, trace: bool = True, html: bool = False) -> dict:
        """Write report.json, report.txt, job.json (every rank's records), trace.json (a track per rank) and
        timeline.png (a lane per rank) into ``directory``, and with ``html``, report.html (``html()``); returns the
        paths (the PNG's reason without matplotlib)."""
        from . import plot as plotting
        from . import trace as tracing

        d = self.to_dict()
        out, paths = write_texts(directory, d, self.summary(d), "job.json", self.records_dict())
        if html:
            paths["html"] = write_page(out / "report.html", self.html(d))
        splits = [v.split for v in self.job.ranks]
        start = min((r.timeline.start + r.offset for r in self.records), default=0.0)
        if trace:
            paths["trace"] = tracing.write_job_trace(self.records, splits, start, out / "trace.json")
        if plot:
            labels = self._labels()
            try:
                paths["png"] = plotting.job_png(self.records, splits, out / "timeline.png", title=d["job"]["verdict"]
                                                ["line"], labels=labels, keep=self.job.stragglers)  # fmt: skip
            except ImportError as e:
                paths["png"] = str(e)
        return paths


def _x(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"
