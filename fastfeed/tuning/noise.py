"""The noise of a measurement: what other processes took of this rank's CPUs, and the CPU each side spent.

A trial's batches/s on a shared machine depends on what runs beside it: a neighbour's burst during one trial
makes that setting look slower than it is. ``CpuMeter.read()`` at a window's two edges tells, over the window
(``usage``):

- ``others_cores``: the cores other processes kept busy on this rank's CPUs (``os.sched_getaffinity(0)``): the
  busy time of those CPUs (/proc/stat), less the CPU time of this process and its descendants;
- ``own_cpu_s``: this process's CPU seconds (the training loop, the pin thread, thread workers);
- ``children_cpu_s``: its descendants' CPU seconds (process workers), those reaped meanwhile included.

Reading is a pass over /proc (``fastfeed._procstat``), no thread: it is done at window edges only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .._procstat import CLK_TCK, parse_stat, tree_cpu_s


@dataclass(frozen=True)
class Reading:
    """The counters at one moment: ``t`` (``time.monotonic()``), the CPUs' clock ticks and the tree's CPU seconds
    (see ``CpuMeter.read``)."""

    t: float
    busy: int  # clock ticks of this rank's CPUs, by any process
    own: float  # this process's CPU seconds
    children: float  # its descendants', live and reaped


@dataclass(frozen=True)
class Usage:
    """What happened between two readings (``usage``)."""

    seconds: float
    others_cores: float  # mean cores other processes kept busy on this rank's CPUs
    own_cpu_s: float
    children_cpu_s: float


class CpuMeter:
    """Readings of this rank's CPUs and of this process tree's CPU time.

    The CPUs are those this process may run on when the meter is made. The tree's CPU time is subtracted from
    theirs whichever CPUs the tree ran on: a worker pinned outside them (a NUMA plan) makes ``others_cores`` read
    low, never high, and it is kept at 0 or more.
    """

    def __init__(self) -> None:
        self.cpus = sorted(os.sched_getaffinity(0))

    def read(self) -> Reading:
        with open("/proc/stat") as f:
            busy = parse_stat(f.read(), self.cpus)[0]
        own, children = tree_cpu_s()
        return Reading(time.monotonic(), busy, own, children)


def usage(a: Reading, b: Reading) -> Usage:
    """What the CPUs did from reading ``a`` to the later reading ``b``.

    A descendant that exits between them unreaped by the tree (its parent gone first) takes its CPU time along: the
    children's CPU is then kept at 0 or more rather than read as negative.
    """
    seconds = b.t - a.t
    own = b.own - a.own
    children = max(0.0, b.children - a.children)
    others = max(0.0, (b.busy - a.busy) / CLK_TCK - own - children)
    return Usage(seconds, others / seconds if seconds > 0 else 0.0, own, children)
