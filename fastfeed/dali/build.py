"""Building a DALI pipeline for this rank: sharding, seed, device, checkpoint and CPU placement.

A ``@pipeline_def`` function is called the way DALI's own examples are written: its ``shard_id``,
``num_shards`` and ``pad_last_batch`` parameters, when it declares them, receive this rank's
values, and the function passes them on to its reader. DALI's threads are started by
``Pipeline.build()`` and inherit the CPU affinity of the thread that calls it, so the build runs
on this rank's CPUs from the NUMA plan and the calling thread gets its own CPUs back after.
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager

import torch

from .. import affinity

SHARD_ARGS = ("shard_id", "num_shards", "pad_last_batch")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: ``torch.distributed`` when initialised, else torchrun's variables."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        raise ValueError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                         "are not integers (torchrun sets them to integers)") from None  # fmt: skip


def is_pipeline_def(obj) -> bool:
    return callable(obj) and getattr(obj, "_is_pipeline_def", False)


def declared(fn) -> set:
    """The parameter names of a ``@pipeline_def`` function (the function it wraps)."""
    spec = inspect.getfullargspec(inspect.unwrap(fn))
    return set(spec.args) | set(spec.kwonlyargs)


def call_args(fn, kwargs: dict, rank: int, world: int, auto_shard: bool) -> dict:
    """The arguments to call ``fn`` with: the user's, DALI's checkpointing, and this rank's shard.

    Raises:
        ValueError: sharding is needed (``world > 1``) and ``fn`` has nowhere to receive it.
    """
    names = declared(fn)
    args = dict(kwargs, enable_checkpointing=True)
    if auto_shard and world > 1:
        missing = [n for n in ("shard_id", "num_shards") if n not in names]
        if missing:
            raise ValueError(
                f"DALILoader shards the reader across the {world} ranks, but {fn.__name__}() has no "
                f"{' / '.join(missing)} parameter: declare shard_id and num_shards (and pad_last_batch) and pass them "
                "to the reader, e.g. fn.readers.file(..., shard_id=shard_id, num_shards=num_shards, "
                "pad_last_batch=pad_last_batch, name='Reader'); or pass auto_shard=False to read everything on "
                "every rank"
            )  # fmt: skip
        args.setdefault("shard_id", rank)
        args.setdefault("num_shards", world)
    if "pad_last_batch" in names:
        args.setdefault("pad_last_batch", True)
    return args


def placement(numa, device: torch.device | None, num_threads: int) -> affinity.Placement | None:
    """Where DALI's threads go: the CPUs of this rank's plan (None: leave them where they are).

    Raises:
        ValueError: ``numa`` is not "auto", "off" or a node of this machine (as ``DataLoader(numa=...)``).
    """
    affinity.check(numa)
    return affinity.placement(affinity.plan_for(numa, device, num_threads))


@contextmanager
def placed(where: affinity.Placement | None):
    """Run the body with the calling thread on ``where``'s CPUs and memory node; threads started inside inherit them."""
    if where is None or not where.cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    affinity.apply(where)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        if where.node is not None:
            from .._native import C

            C.numa_prefer_node(-1)
