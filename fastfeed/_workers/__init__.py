"""The loader's workers: processes (``pool``), threads (``threads``) or Ray actors (``ray/``), all running
``loop``."""

from __future__ import annotations

WORKER_TYPES = ("process", "thread")  # fastfeed.tune(worker_types=...) chooses among them
RAY = "ray"
MIXED = ("process", "ray")  # local worker processes first, Ray actors for the shortfall


def split(worker_type, num_workers) -> tuple:
    """``DataLoader(worker_type=..., num_workers=...)`` checked: ``(worker_type, num_workers, (local, remote))``.

    ``worker_type`` comes back as a string or ``MIXED``; ``num_workers`` as what torch validates (the total, or
    the value as given where it is not a pair).
    """
    if isinstance(worker_type, list):
        worker_type = tuple(worker_type)
    if isinstance(worker_type, tuple):
        if worker_type != MIXED:
            raise ValueError(f"worker_type={worker_type!r}: the one pair of worker types is {MIXED!r} (local "
                             "processes, then Ray actors for the shortfall)")  # fmt: skip
        pair = tuple(num_workers) if isinstance(num_workers, (tuple, list)) else None
        if pair is None or len(pair) != 2 or not all(type(n) is int and n >= 0 for n in pair):
            raise ValueError(f"worker_type={MIXED!r} takes num_workers=(local, remote), two ints >= 0, got "
                             f"num_workers={num_workers!r}")  # fmt: skip
        return MIXED, pair[0] + pair[1], pair
    if worker_type not in WORKER_TYPES + (RAY,):
        raise ValueError(f"worker_type must be one of {WORKER_TYPES + (RAY,)} or {MIXED!r}, got {worker_type!r}")
    if isinstance(num_workers, (tuple, list)):
        raise ValueError(f"num_workers={num_workers!r}: a (local, remote) pair goes with worker_type={MIXED!r}; "
                         f"worker_type={worker_type!r} takes one count")  # fmt: skip
    if type(num_workers) is not int:
        return worker_type, num_workers, None  # torch's check (or "auto"'s) says what is wrong
    return worker_type, num_workers, (0, num_workers) if worker_type == RAY else (num_workers, 0)


def uses_ray(worker_type) -> bool:
    return worker_type == RAY or worker_type == MIXED
