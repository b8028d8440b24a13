"""A process's own memory, from ``/proc/<pid>/smaps_rollup``: what the doctor samples and the tuner budgets.

RSS counts every page a process maps, shared ones included, so a forked worker that shares its parent's dataset
looks as large as the parent. What one worker alone costs the machine is its USS (unique set size): the pages
only it holds, ``Private_Clean + Private_Dirty``, plus what it has of them in swap. A worker that copies its
parent's Python objects page by page (copy-on-read: reading an object writes its reference count) shows it as
USS that grows with the samples it reads, while its RSS hardly moves.

smaps_rollup gives swap as ``Swap`` (every swapped page of the process) and ``SwapPss`` (each shared swapped
page divided among its sharers); a private page in swap counts whole in both, so ``SwapPss`` is the private
share of swap plus the sharers' fractions of shared swap: the closest to "private swap" the kernel reports, and
exact when swap holds only private pages. Kernels before 4.14 have no smaps_rollup: there the figures are None.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

_FIELDS = {"Rss:": "rss", "Pss:": "pss", "Private_Clean:": "private_clean", "Private_Dirty:": "private_dirty",
           "Swap:": "swap", "SwapPss:": "swap_pss"}  # fmt: skip


class Usage(NamedTuple):
    """One process's memory in bytes (see the module docstring)."""

    uss: int  # Private_Clean + Private_Dirty + its private swap (SwapPss)
    pss: int  # Pss + SwapPss: its proportional share of everything it maps
    rss: int


def parse_rollup(text: str) -> Usage | None:
    """The ``Usage`` in a ``/proc/<pid>/smaps_rollup`` text; None when it holds none of the fields (empty: the
    process is exiting, or it is a kernel thread)."""
    kb = dict.fromkeys(_FIELDS.values(), 0)
    found = False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        key = _FIELDS.get(name)
        if key is not None:
            try:
                kb[key] = int(rest.split()[0])
            except (IndexError, ValueError):
                continue
            found = True
    if not found:
        return None
    # Without SwapPss (it came with smaps_rollup itself, but a filtered /proc may lack it) Swap stands in.
    swap = kb["swap_pss"] if "SwapPss:" in text else kb["swap"]
    uss = kb["private_clean"] + kb["private_dirty"] + swap
    return Usage(uss=uss * 1024, pss=(kb["pss"] + swap) * 1024, rss=kb["rss"] * 1024)


def usage(pid: int) -> Usage | None:
    """``pid``'s ``Usage`` now, or None when it cannot be read (gone, not ours, no smaps_rollup)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read().decode("latin-1")
    except OSError:
        return None
    return parse_rollup(text)


def largest_uss(pids: Iterable[int]) -> int:
    """The largest USS among ``pids`` in bytes (0 when none can be read): what one more such worker costs."""
    return max((u.uss for u in map(usage, pids) if u is not None), default=0)
