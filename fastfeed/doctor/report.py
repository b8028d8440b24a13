"""The doctor's report: the verdict as text (its first line is the verdict), as JSON, and as pictures.

JSON schema (``report.json``, ``"schema": "fastfeed.doctor/1"``), top-level keys:

- ``verdict``: ``bottleneck`` (input | compute | host_sync | launch; sync for a job's rank), ``cause`` (input: cpu |
  io | workers | transfer | numa; sync: stragglers | collectives), ``severity`` (highly ≥ 20% of the loop waiting |
  moderately ≥ 5% | not), ``line`` (the text). A job's report adds ``job`` and ``ranks`` (``jobreport``).
- ``stall_fraction``: Σwait / Σ(wait + step) of the training loader (the one that yielded the most batches).
- ``steps``: that loader's batches, samples/s, wait and step quantiles (seconds), epochs, first-batch waits.
- ``loader``: what it was (kind, made_at, num_workers, prefetch_factor, batch_size, worker_type, ...;
  ``worker_split``: ``[local, remote]`` when Ray actors are among its num_workers, else null).
- ``workers``: busy fraction per worker, mean seconds per batch, CPU cores per worker process.
- ``system``: means over the loader's span of the sampler's figures (``fastfeed.doctor.sampler``): cpu_busy,
  iowait, psi_cpu, psi_io, disk_read_mbps (and its cv), disk_read_ms, main_cpu, gpu_util, gpu_mem_util, pcie_*.
- ``questions``: six entries, ``{question, value, unit, how}``: the six questions to ask of a stalling loop (step
  time vs utilisation, synthetic input, host stalls, uneven storage, distributed sync, work per step), as numbers.
- ``periodic``: stalls every ``period`` batches (``bursts``: a multiple of num_workers), or null.
- ``dips``: GPU-utilisation dips and how many the input stalls explain, or null without a GPU.
- ``memory``: ``fastfeed.doctor.memory.analyse``, or null when nothing was sampled: ``workers`` (each one's
  ``pid``, ``start_bytes``, ``end_bytes``, ``peak_bytes``, ``growth_bytes`` of private memory, USS),
  ``worker_start_bytes`` and ``worker_growth_bytes`` (means), ``workers_growth_bytes``, ``growth_per_sample_bytes``,
  ``tracks_reads_r``, the machine's ``mem_total``, ``available_start`` / ``available_min`` / ``available_end`` and
  ``headroom`` (the lowest available over the total), ``containers`` (the dataset's large Python containers,
  ``[name, kind, count, est_bytes]``; null when not looked for: workers already running when the watch began),
  ``copy_on_read``, ``culprit`` (``{name, kind, count, est_bytes}``), ``saving_bytes`` and ``more_workers`` (what
  ``fastfeed.share`` would save, and the workers it would hold).
- ``advice``: ``{change, setting, why, predicted_samples_per_s, predicted_gain, needs}``, what runs on this machine
  first; ``needs`` is null, or what the advice needs beyond it (Ray actors with no cluster reachable from here:
  what to start; a change to the script, for ``fastfeed.share``), and such advice is never the closing run's.
  ``fastfeed.share``'s advice adds ``predicted_saving_bytes`` and ``more_workers``.
- ``whatif``: ``compute_ceiling``, ``input_ceiling``, ``input_ceiling_fastfeed``, ``closing``: each
  ``{samples_per_s, batches_per_s, batches, seconds, ...}`` or absent when not run; ``closing`` also has the
  setting, the predicted and the measured samples/s, and ``gain``: the measured rate over the recorded one, both
  once every worker has made its first batch (``gain_with_startup``: with it).
- ``command``, ``fastfeed``: what ran, and fastfeed's version.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from .._atomic import write_atomic
from . import memory
from .evidence import ms as _ms
from .timeline import Timeline
from .verdict import Verdict, diagnose

SCHEMA = "fastfeed.doctor/1"


def _fmt(value, unit: str) -> str:
    if value is None:
        return "n/a"
    return {"share": f"{value:.1%}", "x": f"{value:.2f}x", "ms": f"{value:.1f} ms", "r": f"{value:+.2f}",
            "cv": f"{value:.2f}"}.get(unit, f"{value:.3g}")  # fmt: skip


class Report:
    """What one watch recorded, and what the doctor makes of it. ``whatif`` holds the what-if runs' results."""

    def __init__(self, watch=None, timeline: Timeline | None = None, command: list | None = None,
                 sync=None) -> None:  # fmt: skip
        self._watch = watch
        self._timeline = timeline
        self.sync = sync  # a job's rank: its loop split against the other ranks' (ranks.RankSplit)
        self.whatif: dict = {}
        self.command = command if command is not None else list(sys.argv)

    def freeze(self, timeline: Timeline) -> None:
        self._timeline = timeline

    @property
    def timeline(self) -> Timeline:
        """All the records (the records so far, while the watch still runs)."""
        if self._timeline is None:
            return self._watch.timeline()
        return self._timeline

    def verdict(self) -> Verdict:
        return diagnose(self.timeline, self.whatif, self.sync)

    def to_dict(self) -> dict:
        from .._version import __version__

        v = self.verdict()
        ev = v.evidence
        primary = self.timeline.primary()
        loader = None if primary is None else {k: val for k, val in asdict(primary).items() if k != "epochs"}
        return {
            "schema": SCHEMA,
            "verdict": {"bottleneck": v.bottleneck, "cause": v.cause, "severity": v.severity, "line": v.line},
            "stall_fraction": ev["stall_fraction"],
            "steps": {k: ev[k] for k in ("batches", "epochs", "samples_per_s", "batches_per_s", "span_s", "wait_s",
                                         "step_s", "first_wait_s", "steady_stall_fraction", "wait_p50_s",
                                         "wait_p95_s", "step_p50_s", "step_p95_s", "ready_mean", "h2d_p50_s")},
            "loader": loader,
            "workers": {"busy": ev["worker_busy"], "batch_s": ev["worker_batch_s"], "cpu": ev["worker_cpu"]},
            "system": {**ev["system"], "cpus": ev["cpus"], "gpu": self.timeline.gpu, "free_cores": ev["free_cores"]},
            "questions": v.questions,
            "periodic": v.periodic,
            "dips": v.dips,
            "memory": v.memory,
            "advice": v.advice,
            "whatif": self.whatif,
            "command": self.command,
            "fastfeed": __version__,
        }  # fmt: skip

    def summary(self, d: dict | None = None) -> str:
        """The text report; its first line is the verdict. ``d``: ``to_dict()``, when the caller has it already."""
        d = d or self.to_dict()
        s, sysf = d["steps"], d["system"]
        lines = [d["verdict"]["line"]]
        ld = d["loader"]
        if ld:
            if ld["kind"] == "dali":
                lines.append(f"loader: DALILoader made at {ld['made_at']}, num_threads={ld['num_workers']}, "
                             f"prefetch_queue_depth={ld['prefetch_factor']}, batch_size={ld['batch_size']}")
            else:
                split = ld.get("worker_split")
                workers = f"num_workers={ld['num_workers']}" + (
                    f" ({split[0]} local + {split[1]} Ray actors, worker_type={ld['worker_type']})" if split else "")
                lines.append(f"loader: {ld['kind']} DataLoader made at {ld['made_at']}, {workers}, "
                             f"prefetch_factor={ld['prefetch_factor']}, batch_size={ld['batch_size']}")
        lines.append(f"measured: {s['batches']} batches in {s['epochs']} epoch(s), {s['samples_per_s']:.1f} samples/s; "
                     f"wait p50 {_ms(s['wait_p50_s'])} p95 {_ms(s['wait_p95_s'])}; step p50 {_ms(s['step_p50_s'])} "
                     f"p95 {_ms(s['step_p95_s'])}; first batches {_ms(s['first_wait_s'])}")
        w = d["workers"]
        if w["busy"] and w["batch_s"] is not None:
            lines.append("workers: busy " + " ".join(f"{b:.0%}" for b in w["busy"]) + f", {_ms(w['batch_s'])} per batch"
                         + ("" if w["cpu"] is None else f", {w['cpu']:.2f} CPU cores each"))
        lines.append(f"machine: {sysf['cpus']} CPUs {_pct(sysf.get('cpu_busy'))} busy, "
                     f"iowait {_pct(sysf.get('iowait'))}, io pressure {_pct(sysf.get('psi_io'))}, disk {_num(sysf.get('disk_read_mbps'))} MB/s; GPU "
                     + (f"{_pct(sysf.get('gpu_util'))} busy" if sysf.get("gpu") else "none (NVML unavailable)"))
        if d["periodic"]:
            p = d["periodic"]
            lines.append(f"periodic stalls: every {p['period']} batches ({p['share']:.0%} of gaps)"
                         + (f", the {p['num_workers']} workers finishing together" if p["bursts"] else ""))
        if d["dips"]:
            lines.append(f"GPU dips: {d['dips']['dips']}, {d['dips']['explained']} of them during input stalls")
        lines += memory.lines(d.get("memory"))
        lines.append("questions:")
        for i, q in enumerate(d["questions"], 1):
            lines.append(f"  {i}. {q['question']} {_fmt(q['value'], q['unit'])} ({q['how']})")
        lines.append("advice:" if d["advice"] else "advice: none; the input pipeline is not what holds this loop back")
        for a in d["advice"]:
            gain = "" if a["predicted_gain"] is None else \
                f" -> predicted {a['predicted_samples_per_s']:.1f} samples/s ({a['predicted_gain']:.2f}x)"
            lines.append(f"  - {a['change']}{gain}: {a['why']}{needs(a)}")
        if d["whatif"]:
            lines.append("what-if runs (samples/s):")
            lines.append(f"  {'measured run':34}{s['samples_per_s']:>10.1f}")
            for key, title in (("compute_ceiling", "compute ceiling (cached batch)"),
                               ("input_ceiling", "input ceiling (loader, no step)"),
                               ("input_ceiling_fastfeed", "input ceiling, fastfeed.DataLoader")):
                run = d["whatif"].get(key)
                if run:
                    lines.append(f"  {title:34}{run['samples_per_s']:>10.1f}")
            c = d["whatif"].get("closing")
            if c:
                lines.append(f"  {'with ' + c['change']:34}{c['samples_per_s']:>10.1f}  predicted "
                             f"{_num(c.get('predicted_samples_per_s'))}, measured {c['gain']:.2f}x "
                             f"(predicted {_x(c.get('predicted_gain'))})")
            for key, why in d["whatif"].get("skipped", {}).items():
                lines.append(f"  {key}: not run ({why})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def html(self, d: dict | None = None) -> str:
        """The report as one self-contained HTML page (``fastfeed.doctor.html``): the verdict, a zoomable
        timeline, the six questions, the advice and the what-ifs. ``d``: ``to_dict()``, when the caller has it."""
        from . import html

        d = d or self.to_dict()
        return html.page(d, self.summary(d), html.timeline_data(self.timeline))

    def save(self, directory, plot: bool = True, trace: bool = True, html: bool = False) -> dict:
        """Write report.json, report.txt, timeline.json, trace.json (Perfetto) and timeline.png into ``directory``,
        and with ``html``, report.html (``html()``: one self-contained page, opened offline in any browser).

        Returns the paths written; without matplotlib the PNG is skipped and ``"png"`` holds the reason.
        """
        from . import plot as plotting
        from . import trace as tracing

        d = self.to_dict()
        out, paths = write_texts(directory, d, self.summary(d), "timeline.json", self.timeline.to_dict())
        if html:
            paths["html"] = write_page(out / "report.html", self.html(d))
        if trace:
            paths["trace"] = tracing.write_trace(self.timeline, out / "trace.json")
        if plot:
            try:
                paths["png"] = plotting.timeline_png(self.timeline, out / "timeline.png", title=d["verdict"]["line"])
            except ImportError as e:
                paths["png"] = str(e)
        return paths


def write_texts(directory, d: dict, text: str, records_name: str, records: dict) -> tuple[Path, dict]:
    """Write a report's ``report.json`` (``d``), ``report.txt`` (``text``) and the records it was made from into
    ``directory`` (made if missing); returns the directory and the paths, keyed json, text and timeline."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "text": out / "report.txt", "timeline": out / records_name}
    # Readable as the PNG and the trace are: a report is made to be shared.
    write_atomic(paths["json"], json.dumps(d, indent=2, default=str), mode=0o644)
    write_atomic(paths["text"], text, "\n", mode=0o644)
    write_atomic(paths["timeline"], json.dumps(records, default=str), mode=0o644)
    return out, paths


def write_page(path, page: str) -> Path:
    """Write an HTML page (``Report.html()``, ``JobReport.html()``) to ``path``, readable as the other outputs."""
    path = Path(path)
    write_atomic(path, page, mode=0o644)
    return path


def needs(a: dict) -> str:
    """An advice's tail for what it needs beyond this machine (``needs``): what to start first; empty otherwise."""
    return f". Not measured here: it needs {a['needs']}" if a.get("needs") else ""


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _x(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"
