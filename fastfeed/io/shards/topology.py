"""Which rank of how many this process is, and which worker of the loader's."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.utils.data import get_worker_info


def ranks(rank: int | None, world: int | None, frozen: tuple[int, int] | None) -> tuple[int, int]:
    """(rank, world size): the ones given, else torch.distributed's, else what the main process saw when it set the
    dataset up (a worker process may not have the process group), else torchrun's RANK/WORLD_SIZE, else (0, 1)."""
    if rank is not None or world is not None:
        if rank is None or world is None:
            raise ValueError("fastfeed.io.Shards: pass rank= and world_size= together (or neither: torch.distributed "
                             "or torchrun's RANK/WORLD_SIZE tell them)")  # fmt: skip
        found = (rank, world)
    elif dist.is_available() and dist.is_initialized():
        found = (dist.get_rank(), dist.get_world_size())
    elif frozen is not None:
        found = frozen
    else:
        found = (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
    if not (found[1] >= 1 and 0 <= found[0] < found[1]):
        raise ValueError(f"fastfeed.io.Shards: rank {found[0]} of world size {found[1]} is not a rank of that world")
    return found


def worker() -> tuple[int, int]:
    """(worker id, workers) of the loader iterating here; (0, 1) in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)
