"""One rank of a torchrun job over Shards, under gloo: iterates, all-reduces once per batch as DDP does (a rank
with fewer batches would leave the others waiting), and writes what it saw as JSON.

    torchrun --nproc-per-node W tests/_shards_ranks.py DIR GLOBAL_BATCH OUT [--stop-after K] [--resume STATE]
        [--also-workers N]

``--stop-after K``: save ``loader.state_dict()`` after K batches (rank 0 writes it to OUT.state.json) and stop.
``--also-workers N``: then a fresh loader with N workers iterates the first epoch again, all-reducing as well (the
report's "also"): one launch checks two worker counts, as a rank's interpreter and process group start once.
"""

import argparse
import datetime
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _shards  # noqa: E402

from fastfeed import DataLoader  # noqa: E402
from fastfeed.io import Shards  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("global_batch", type=int)
    p.add_argument("out")
    p.add_argument("--stop-after", type=int)
    p.add_argument("--resume")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--also-workers", type=int)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.simplefilter("error")  # an index is beside the shards: nothing to warn about
    ds = Shards(a.directory, decode=_shards.as_tensor, shuffle=True, seed=11, shuffle_window=3)
    loader = DataLoader(ds, batch_size=a.global_batch // world, num_workers=a.workers)
    if a.resume:
        with open(a.resume) as f:
            loader.load_state_dict(json.load(f))
    seen, state = [], None
    first_epoch = ds.epoch
    for epoch in range(first_epoch, first_epoch + a.epochs):
        ds.set_epoch(epoch)
        batches = []
        for i, batch in enumerate(loader):
            batches.append(batch.tolist())
            total = torch.tensor([len(batch)])
            dist.all_reduce(total)  # a rank that ran out of batches would hang the others here
            if a.stop_after is not None and i + 1 == a.stop_after:
                state = loader.state_dict()
                break
        seen.append(batches)
        if state is not None:
            break
    also = None
    if a.also_workers is not None:
        again = Shards(a.directory, decode=_shards.as_tensor, shuffle=True, seed=11, shuffle_window=3)
        again.set_epoch(first_epoch)
        also = []
        for batch in DataLoader(again, batch_size=a.global_batch // world, num_workers=a.also_workers):
            also.append(batch.tolist())
            dist.all_reduce(torch.tensor([len(batch)]))
    with open(f"{a.out}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "world": world, "len": len(loader), "samples": len(ds), "epochs": seen,
                   "also": also}, f)  # fmt: skip
    if state is not None and rank == 0:
        with open(f"{a.out}.state.json", "w") as f:
            json.dump(state, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
