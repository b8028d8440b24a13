"""One rank of a torchrun job saving and loading fastfeed loaders with ``torch.distributed.checkpoint`` (DCP),
under gloo on CPU; also the module-level datasets that tests/test_dcp.py's workers unpickle.

    torchrun --nproc-per-node W tests/_dcp_job.py MODE OUT SHARD_DIR

Each part of a mode writes ``OUT/<part>.<rank>.json``: the batches this rank saw, or the error it met (a part's
exception is recorded and the job goes on with the next part, so that one failure does not hide the others).

MODE (the launches in the order tests/test_dcp.py makes them):

``save4`` (4 ranks)
    ``shards4``: fastfeed.io.Shards at batch 2 (global batch 8), ``dcp.save`` after 3 batches into OUT/ckpt_shards4.
``save2`` (2 ranks)
    ``sampler_ref``: a DistributedSampler loader (num_workers=2, ``torch.manual_seed(1000 + rank)``), two epochs
    uninterrupted; ``sampler_save``: the same loader made again, ``dcp.save`` after K batches into OUT/ckpt_sampler.
    ``shards2``: Shards at batch 4, ``dcp.save`` after 3 batches into OUT/ckpt_shards2. (Each Shards part seeds
    ``1000 + rank`` before saving, ``5000 + rank`` before loading, and records the training loop's next two
    ``torch.rand`` draws after ``dcp.save`` / ``dcp.load``.)
    ``shards4to2``: a fresh Shards loader at batch 4 ``dcp.load``s OUT/ckpt_shards4 (saved on 4 ranks), then the
    rest of its epoch and the next one.
``load2`` (2 ranks)
    ``sampler_load``: a fresh DistributedSampler loader (another seed) ``dcp.load``s OUT/ckpt_sampler, then the
    rest of epoch 0 and epoch 1. ``shards2to2``: a fresh Shards loader at batch 4 loads OUT/ckpt_shards2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import torch.utils.data as tud

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

SAMPLER_N = 40  # DistributedSampler over 2 ranks: 20 each, batches of 3 (the last of 2)
SAMPLER_BATCH = 3
SAMPLER_SEED = 17  # DistributedSampler's own seed (the same on every rank, as it must be)
SAMPLER_STOP = 3  # batches before the save
SHARDS_SEED = 11
SHARDS_GLOBAL_BATCH = 8
SHARDS_STOP = 3


class IndexRand(tud.Dataset):
    """Map-style: item i is ``(i, torch.rand(1))``, the random value drawn where the item is made (a worker, or the
    main process with num_workers=0), so a resumed run must have that process's RNG back bit for bit."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i, torch.rand(1)


def as_lists(batch) -> list:
    """A batch of IndexRand as ``[[indices], [random values]]`` (floats: float32 values, exact in JSON)."""
    if isinstance(batch, (list, tuple)):
        return [batch[0].tolist(), batch[1].flatten().tolist()]
    return batch.tolist()  # Shards: a tensor of sample numbers


# -- the parts ----------------------------------------------------------------------------------------------------


def _sampler_loader(rank: int, world: int, seed: int):
    from fastfeed import DataLoader

    torch.manual_seed(seed)
    ds = IndexRand(SAMPLER_N)
    sampler = tud.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=SAMPLER_SEED)
    return DataLoader(ds, batch_size=SAMPLER_BATCH, sampler=sampler, num_workers=2), sampler


def sampler_ref(a, rank, world):
    loader, sampler = _sampler_loader(rank, world, 1000 + rank)
    epochs = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        epochs.append([as_lists(b) for b in loader])
    return {"epochs": epochs}


def sampler_save(a, rank, world):
    import torch.distributed.checkpoint as dcp

    loader, sampler = _sampler_loader(rank, world, 1000 + rank)
    sampler.set_epoch(0)
    seen = []
    for batch in loader:
        seen.append(as_lists(batch))
        if len(seen) == SAMPLER_STOP:
            dcp.save({"loader": loader}, checkpoint_id=os.path.join(a.out, "ckpt_sampler"))
            break
    return {"before": seen}


def sampler_load(a, rank, world):
    import torch.distributed.checkpoint as dcp

    loader, sampler = _sampler_loader(rank, world, 5000 + rank)  # another seed: the checkpoint must set them
    dcp.load({"loader": loader}, checkpoint_id=os.path.join(a.out, "ckpt_sampler"))
    epochs = []
    for epoch in (0, 1):  # the user's loop resumes the epoch it was in
        sampler.set_epoch(epoch)
        epochs.append([as_lists(b) for b in loader])
    return {"epochs": epochs}


def _shards_loader(a, world: int, workers: int):
    import _shards

    from fastfeed import DataLoader
    from fastfeed.io import Shards

    ds = Shards(a.shard_dir, decode=_shards.as_tensor, shuffle=True, seed=SHARDS_SEED, shuffle_window=3)
    return DataLoader(ds, batch_size=SHARDS_GLOBAL_BATCH // world, num_workers=workers), ds


def _shards_save(a, world, name, workers):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(1000 + dist.get_rank())
    loader, ds = _shards_loader(a, world, workers)
    ds.set_epoch(0)
    seen = []
    for batch in loader:
        seen.append(as_lists(batch))
        if len(seen) == SHARDS_STOP:
            dcp.save({"loader": loader}, checkpoint_id=os.path.join(a.out, name))
            break
    return {"before": seen, "user_draws": torch.rand(2).tolist()}  # the training loop's next draws


def _shards_load(a, world, name, workers):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(5000 + dist.get_rank())
    loader, ds = _shards_loader(a, world, workers)
    dcp.load({"loader": loader}, checkpoint_id=os.path.join(a.out, name))
    user_draws = torch.rand(2).tolist()  # as this rank's were after the save (the loader puts its RNGs back)
    first = ds.epoch
    epochs = []
    for epoch in (first, first + 1):
        ds.set_epoch(epoch)
        epochs.append([as_lists(b) for b in loader])
    return {"first_epoch": first, "epochs": epochs, "user_draws": user_draws}


def shards4(a, rank, world):
    return _shards_save(a, world, "ckpt_shards4", workers=1)


def shards2(a, rank, world):
    return _shards_save(a, world, "ckpt_shards2", workers=2)


def shards4to2(a, rank, world):
    return _shards_load(a, world, "ckpt_shards4", workers=2)


def shards2to2(a, rank, world):
    return _shards_load(a, world, "ckpt_shards2", workers=2)


MODES = {
    "save4": [shards4],
    "save2": [sampler_ref, sampler_save, shards2, shards4to2],
    "load2": [sampler_load, shards2to2],
}


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("out")
    p.add_argument("shard_dir")
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    for part in MODES[a.mode]:
        try:
            report = dict(part(a, rank, world), ok=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - recorded for the test; the next part runs
            report = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        report.update(rank=rank, world=world)
        with open(os.path.join(a.out, f"{part.__name__}.{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
