"""Putting workers where the plan says: their CPUs and their memory's NUMA node.

``fastfeed.topology`` decides (pure, testable on fake sysfs trees); this module acts, on
the calling process or thread only. On Linux both calls are per thread, so a worker
thread places itself without moving the training loop.
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import torch

from . import topology
from ._native import C

NUMA_CHOICES = ("auto", "off")


class Placement(NamedTuple):
    """What each worker is given: the CPUs it may run on, and the node its memory prefers."""

    cpus: frozenset
    node: int | None


def check(numa) -> None:
    """Validate ``DataLoader(numa=...)`` at construction."""
    if numa in NUMA_CHOICES:
        return
    if isinstance(numa, bool) or not isinstance(numa, int) or numa < 0:
        raise ValueError(f"numa must be 'auto', 'off' or a NUMA node number, got {numa!r}")
    nodes = topology.discover().nodes
    if numa not in nodes:
        raise ValueError(f"numa={numa}: this machine's NUMA nodes are {sorted(nodes)}")


def _env_int(key: str, default: int) -> int:
    raw = os.environ.get(key, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not an integer (torchrun sets it to one)") from None


def plan_for(numa, device: torch.device | None, num_workers: int) -> topology.Plan | None:
    """The plan for this rank's loader, or None when placement is off.

    ``"auto"`` places only when a CUDA device is targeted (``device``): the GPU's node is the
    one that matters. Local rank and world size come from torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``.
    """
    if numa == "off" or (numa == "auto" and (device is None or device.type != "cuda")):
        return None
    rank = _env_int("LOCAL_RANK", 0)
    world = _env_int("LOCAL_WORLD_SIZE", 1)
    node = None if numa == "auto" else numa
    return topology.plan(device, local_rank=rank, local_world_size=world, num_workers=num_workers, node=node)


def placement(plan: topology.Plan | None) -> Placement | None:
    if plan is None:
        return None
    # Empty worker CPUs: the plan found nothing to bind to, so affinity is left alone.
    return Placement(frozenset(plan.worker_cpus), plan.node if plan.mempolicy == "preferred" else None)


def apply(where: Placement | None) -> None:
    """Move the calling thread to ``where``: CPU affinity, then preferred memory node."""
    if where is None:
        return
    try:
        if where.cpus:
            os.sched_setaffinity(0, where.cpus)
        if where.node is not None:
            C.numa_prefer_node(where.node)
    except OSError as e:  # the cpuset shrank since the plan was made, say: run unplaced
        warnings.warn(f"fastfeed could not place a DataLoader worker on CPUs {topology.format_cpus(where.cpus)}"
                      f" / node {where.node}: {e}", RuntimeWarning, stacklevel=2)  # fmt: skip
