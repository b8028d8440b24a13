"""A check's lines, figures and verdicts (``Check``), and the JSON report that keeps them (``Report``)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPORT_NAME = "gpu_check.json"
MODULE = "fastfeed.bench.suites.gpu"  # what ``python -m`` runs: scripts/gpu_check.sh, and the check's own children


class Skip(Exception):
    """A check that cannot run here (no second GPU, no kvikio): said so, and not a failure."""


@dataclass
class Check:
    """One check's lines, figures and verdicts, as printed and as the JSON report keeps them."""

    id: str
    title: str
    dry_run: bool
    status: str = "ok"  # ok, FAIL, skipped, error; a dry run's check that ran and did not fail: dry-run
    lines: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    verdicts: list = field(default_factory=list)
    seconds: float = 0.0

    def figure(self, name: str, value, unit: str = "") -> None:
        self.figures[name] = {"value": value, "unit": unit}

    def verdict(self, name: str, ok: bool, shown: str, *, faithful_fake: bool = False) -> str:
        """Record whether ``name`` held; returns its tag for the line. A dry run judges only what its fake models
        faithfully (``faithful_fake``); the rest is shown, not judged."""
        judged = not self.dry_run or faithful_fake
        self.verdicts.append({"name": name, "ok": bool(ok), "judged": judged, "shown": shown})
        if judged and not ok:
            self.status = "FAIL"
        if not judged:
            return f"{shown}: {'holds' if ok else 'misses'} on the fake (not judged: dry run)"
        return f"{shown}: {'ok' if ok else 'FAIL'}"

    def line(self, label: str, text: str) -> None:
        self.lines.append(f"{label:<34} {text}")
        print(f"{'[dry run] ' if self.dry_run else ''}{label:<34} {text}", flush=True)


class Report:
    """The JSON report, rewritten after each check so that a run stopped early still leaves one."""

    def __init__(self, out: Path, dry_run: bool, argv: list[str]):
        self.path = out / REPORT_NAME
        self.started = time.perf_counter()
        self.data = {
            "dry_run": dry_run,
            "note": ("DRY RUN: every check ran on the CPU against fakes; no figure here was measured on a GPU, "
                     "and only the race checks' checksums were judged") if dry_run else "",  # fmt: skip
            "command": [sys.executable, "-m", MODULE, *argv],
            "machine": {},
            "tests": None,
            "checks": [],
            "failed": [],
            "exit_code": None,
            "elapsed_s": 0.0,
        }
        out.mkdir(parents=True, exist_ok=True)

    def add(self, check: Check) -> None:
        self.data["checks"].append(asdict(check))
        if check.status in ("FAIL", "error"):
            self.data["failed"].append(check.id)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)
