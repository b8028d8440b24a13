"""Other processes' load on this process's CPUs, for tests whose scenario needs idle cores.

Whether a core is free is part of what the doctor diagnoses (input/workers against input/cpu, compute against
input/cpu, how much more workers help), so a scenario that needs idle cores measures what other processes took of
them while it ran (``OthersLoad``), and is skipped, naming that load, when they took too much
(``skip_unless_idle``): its verdict would then be about their load, not about the scenario.

Standalone on purpose (the product's own noise measure may change under the tuner's needs): it reads /proc as the
doctor's sampler does, and nothing else of fastfeed's but that parser and the process-tree listing.
"""

from __future__ import annotations

import os
import threading

import pytest

from fastfeed._procstat import CLK_TCK
from fastfeed.tuning.noise import CpuMeter

CPUS = len(os.sched_getaffinity(0))


class OthersLoad:
    """The cores other processes kept busy on this process's CPUs while a scenario ran, second by second.

    A thread reads, every 0.1 s, the busy ticks of those CPUs (/proc/stat, as the doctor's sampler reads them)
    less the ticks this process and its descendants have used, until the block ends.
    """

    def __init__(self) -> None:
        self.readings: list[tuple[float, int]] = []
        self._meter = CpuMeter()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="others-load", daemon=True)

    def _read(self) -> None:
        r = self._meter.read()  # the tuner's own reading of others' load (fastfeed.tuning.noise)
        self.readings.append((r.t, r.busy - r.own - r.children))

    def _run(self) -> None:
        while not self._done.wait(0.1):
            self._read()

    def __enter__(self) -> OthersLoad:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._read()

    def peak(self, window_s: float = 1.0) -> float:
        """The most cores other processes used over any ``window_s`` of the run, or over the whole run when it is
        shorter: a burst during one of the doctor's runs counts, not only the mean over all of them."""
        out, j = 0.0, 0
        for t0, n0 in self.readings:
            while j < len(self.readings) - 1 and self.readings[j][0] - t0 < window_s:
                j += 1
            t1, n1 = self.readings[j]
            if t1 > t0 and (t1 - t0 >= window_s or t0 == self.readings[0][0]):
                out = max(out, (n1 - n0) / CLK_TCK / (t1 - t0))
        return out


def skip_unless_idle(others: OthersLoad, cores: float, report: dict) -> None:
    """Skip the test, saying why, when other processes left the scenario fewer than ``cores`` of this process's
    CPUs in some second of its run. ``report``: the doctor's JSON report (a job's: its verdict is the job's)."""
    peak = others.peak()
    if CPUS - peak < cores:
        free = report.get("system", {}).get("free_cores")
        free = "-" if free is None else f"{free:.2f}"
        verdict = (report.get("job") or report)["verdict"]
        said = "/".join(str(x) for x in (verdict["bottleneck"], verdict["cause"]) if x)
        pytest.skip(f"the scenario needs {cores} of the {CPUS} cores to itself and other processes kept {peak:.2f} "
                    f"busy in a second of its run: the doctor measured {free} cores free and said {said}")
