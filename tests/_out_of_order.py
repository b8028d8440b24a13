"""Datasets and helpers for tests/test_resume_out_of_order.py (module-level, so workers unpickle them by name), and
a torchrun job: ranks over fastfeed.io.Shards that save ``in_order=False`` states mid-epoch and resume them.

    torchrun --nproc-per-node W tests/_out_of_order.py save DIR OUT --stop-after K
    torchrun --nproc-per-node W tests/_out_of_order.py resume DIR OUT

``save``: each rank iterates epoch 0 with ``in_order=False`` (slow samples: workers finish out of order), all-reducing
once per batch as DDP does, and after K batches writes its own ``loader.state_dict()`` to ``OUT.state.<rank>.json``
and what it received to ``OUT.save.<rank>.json``. ``resume``: each rank first loads the NEXT rank's state into a
throw-away loader and writes the error that must come to ``OUT.swap.<rank>.json``, then loads its own, iterates the
rest of the epoch and the next epoch, and writes them to ``OUT.resume.<rank>.json``.
"""

from __future__ import annotations

import random
import time

import torch
import torch.utils.data as tud

DELAY = 0.005  # s, a slow sample's sleep


class SlowIndex(tud.Dataset):
    """Map-style: item i is i; every ``every``-th item (i % every == 0) sleeps ``delay`` s first."""

    def __init__(self, n: int, every: int, delay: float = DELAY):
        self.n, self.every, self.delay = n, every, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % self.every == 0:
            time.sleep(self.delay)
        return i


class SlowSharded(tud.IterableDataset):
    """Iterable, sharded by worker (``get_worker_info()``): worker w of nw yields w, w + nw, ... (ids unique across
    workers), in that order or, with ``shuffle``, permuted by the worker's own torch RNG (seeded per epoch by the
    loader, as torch seeds it). Every ``every``-th id sleeps ``delay`` s first."""

    def __init__(self, n: int, every: int, delay: float = DELAY, shuffle: bool = False):
        self.n, self.every, self.delay, self.shuffle = n, every, delay, shuffle

    def __iter__(self):
        info = tud.get_worker_info()
        w, nw = (0, 1) if info is None else (info.id, info.num_workers)
        mine = list(range(w, self.n, nw))
        if self.shuffle:
            mine = [mine[p] for p in torch.randperm(len(mine)).tolist()]
        for i in mine:
            if i % self.every == 0:
                time.sleep(self.delay)
            yield i


class RandomSlow(tud.Dataset):
    """Map-style: item i is i, after a sleep of up to ``max_delay`` s drawn at random per item (from a generator of
    its own: the workers' global RNGs are left alone). Item 0 sleeps ``first_delay`` s more: the worker holding the
    epoch's first batch is held back, so that the race of which batches come first is lost on a loaded machine too,
    where random sleeps of a few ms drown in scheduling."""

    def __init__(self, n: int, max_delay: float = 0.01, seed: int = 0, first_delay: float = 0.0):
        self.n, self.max_delay, self.seed, self.first_delay = n, max_delay, seed, first_delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        extra = self.first_delay if i == 0 else 0.0
        time.sleep(random.Random(self.seed * 1_000_003 + i).random() * self.max_delay + extra)
        return i


class SlowDecode:
    """A Shards ``decode``: the sample's number as a tensor; every ``every``-th sample sleeps ``delay`` s first."""

    def __init__(self, every: int = 5, delay: float = DELAY):
        self.every, self.delay = every, delay

    def __call__(self, sample):
        i = int(sample["txt"])
        if i % self.every == 0:
            time.sleep(self.delay)
        return torch.tensor(i)


def ids(batch) -> list[int]:
    """A batch's samples as plain ints."""
    return [int(x) for x in (batch.tolist() if hasattr(batch, "tolist") else batch)]


def flat(batches) -> list[int]:
    return [i for b in batches for i in b]


# -- the torchrun job --------------------------------------------------------------------------------------------

SEED, WINDOW, BATCH, WORKERS, EVERY = 11, 3, 10, 2, 5  # the job's Shards and loader (the test's reference uses them)


def shards(directory, decode=None, **kw):
    from fastfeed.io import Shards

    return Shards(directory, decode=decode or SlowDecode(EVERY), shuffle=True, seed=SEED, shuffle_window=WINDOW,
                  **kw)  # fmt: skip


def _job() -> None:
    import argparse
    import datetime
    import gc
    import json
    import traceback

    import torch.distributed as dist

    from fastfeed import DataLoader

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("save", "resume"))
    p.add_argument("directory")
    p.add_argument("out")
    p.add_argument("--stop-after", type=int, default=25)
    a = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()

    def loader():
        ds = shards(a.directory)
        return ds, DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, in_order=False)

    if a.mode == "save":
        ds, dl = loader()
        before, state = [], None
        for batch in dl:
            before.append(ids(batch))
            total = torch.tensor([len(batch)])
            dist.all_reduce(total)  # DDP's collective per step
            if len(before) == a.stop_after:
                state = dl.state_dict()
                break
        with open(f"{a.out}.state.{rank}.json", "w") as f:
            json.dump(state, f)
        with open(f"{a.out}.save.{rank}.json", "w") as f:
            json.dump({"rank": rank, "world": world, "epoch": ds.epoch, "before": before, "len": len(dl)}, f)
    else:
        other = (rank + 1) % world
        with open(f"{a.out}.state.{other}.json") as f:
            foreign = json.load(f)
        swap = {"from": other, "error": None, "type": None, "where": None, "yielded": None}
        ds, dl = loader()
        where = "load_state_dict"
        try:
            dl.load_state_dict(foreign)
            where = "iter"
            it = iter(dl)
            where = "next"
            swap["yielded"] = sum(len(ids(b)) for b in it)  # no error: how much it (wrongly) yielded
        except Exception as e:  # noqa: BLE001 - recorded: the test says what it had to be
            swap.update(error=str(e), type=type(e).__name__, where=where, trace=traceback.format_exc()[-2000:])
        del ds, dl
        gc.collect()
        with open(f"{a.out}.swap.{rank}.json", "w") as f:  # written now: the own resume below may fail apart
            json.dump({"rank": rank, "swap": swap}, f)
        with open(f"{a.out}.state.{rank}.json") as f:
            own = json.load(f)
        ds, dl = loader()
        dl.load_state_dict(own)
        epoch = ds.epoch
        rest = [ids(b) for b in dl]
        ds.set_epoch(epoch + 1)
        following = [ids(b) for b in dl]
        with open(f"{a.out}.resume.{rank}.json", "w") as f:
            json.dump({"rank": rank, "world": world, "epoch": epoch, "rest": rest, "next": following}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _out_of_order  # the classes by their module's name (not __main__'s), as workers unpickle them

    _out_of_order._job()
