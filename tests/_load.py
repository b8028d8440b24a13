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
import time

import pytest

from fastfeed._procstat import CLK_TCK
from fastfeed.tuning.noise import CpuMeter

CPUS = len(os.sched_getaffinity(0))


def load_stretch() -> float:
    """How many times slower than on an idle machine a test may run now: the runnable processes per core (other work
    beside the suite, or its own xdist workers), from 1 to 4. Guards against hangs (their limits, a subprocess's
    timeout, a tuning deadline) stretch by it; no assertion does."""
    return min(4.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


class OthersLoad:
    """The cores other processes kept busy on this process's CPUs while a scenario ran, second by second.

    A thread reads, every 0.1 s, the busy time of those CPUs (/proc/stat, as the doctor's sampler reads them)
    less the CPU time this process and its descendants have used, until the block ends.
    """

    def __init__(self) -> None:
        self.readings: list[tuple[float, float]] = []  # (t, core-seconds of others so far)
        self._meter = CpuMeter()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="others-load", daemon=True)

    def _read(self) -> None:
        r = self._meter.read()  # the tuner's own reading of others' load (fastfeed.tuning.noise)
        self.readings.append((r.t, r.busy / CLK_TCK - r.own - r.children))

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

    def mean(self) -> float:
        """The cores other processes kept busy on average over the whole run."""
        (t0, n0), (t1, n1) = self.readings[0], self.readings[-1]
        # The CPUs' busy time is in ticks: over a block of a few ticks, busy less the tree's can dip below 0.
        return max(0.0, (n1 - n0) / (t1 - t0)) if t1 > t0 else 0.0

    def peak(self, window_s: float = 1.0) -> float:
        """The most cores other processes used over any ``window_s`` of the run, or over the whole run when it is
        shorter: a burst during one of the doctor's runs counts, not only the mean over all of them."""
        out, j = 0.0, 0
        for t0, n0 in self.readings:
            while j < len(self.readings) - 1 and self.readings[j][0] - t0 < window_s:
                j += 1
            t1, n1 = self.readings[j]
            if t1 > t0 and (t1 - t0 >= window_s or t0 == self.readings[0][0]):
                out = max(out, (n1 - n0) / (t1 - t0))
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


IDLE_OTHERS = 0.5  # cores: less than this on average taken by other processes counts as the cores being the test's


def skip_if_others_held(others: OthersLoad, overrun: str) -> None:
    """For a figure past an idle machine's bound (``overrun`` says which and by how much): skip the test, naming
    other processes' load, when they held ``IDLE_OTHERS`` cores or more on average while it was measured, since the
    figure is then theirs as much as the code's. Otherwise return, and the caller's own assertion fails it."""
    mean = others.mean()
    if mean >= IDLE_OTHERS:
        pytest.skip(f"{overrun}, while other processes kept {mean:.2f} of the {CPUS} cores busy on average: the bound "
                    "is an idle machine's")


class Within:
    """``with Within(5, "the killed worker's error"):`` -- the block must end within ``bound_s`` seconds, a bound
    that holds on an idle machine; when it ran longer while other processes held this process's cores, the test is
    skipped, naming their load, since the time measured is then theirs as much as the code's.

    For promptness checks (an error raised at once, not after a timeout; a process gone within seconds): what a
    load-free measure cannot say. The bound fails the test when the cores were this test's own (other processes
    below ``IDLE_OTHERS`` cores on average while the block ran), so a regression still fails on a quiet machine.
    ``seconds``: how long the block took, for further checks of the test's own.
    """

    def __init__(self, bound_s: float, what: str) -> None:
        self.bound_s, self.what = bound_s, what
        self.seconds = 0.0
        self._others = OthersLoad()

    def __enter__(self) -> Within:
        self._others.__enter__()
        self._t0 = time.monotonic()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.seconds = time.monotonic() - self._t0
        self._others.__exit__(exc_type, exc, tb)
        if exc_type is not None or self.seconds < self.bound_s:
            return
        overrun = f"{self.what} took {self.seconds:.1f} s, over its {self.bound_s:g} s bound"
        skip_if_others_held(self._others, overrun)
        raise AssertionError(f"{overrun} (other processes kept {self._others.mean():.2f} of the {CPUS} cores busy on "
                             "average)")
