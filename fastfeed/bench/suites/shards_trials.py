"""One trial of the shards workload: a fresh loader over one storage, timed, and everything it left removed.

:class:`Sides` builds each loader (fastfeed.io.Shards, webdataset, Mosaic's streaming) over HTTP or local disk;
:func:`epoch_trial` and :func:`resume_trial` time one epoch, and a run stopped at 50% then resumed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import shutil
import time
from pathlib import Path

from .. import peers
from ..accounting import process_tree, wait_for_exit
from ..trial import drop_page_cache, touch
from .shards_data import BUCKET, MDS_PREFIX, TAR_DIR, Served, decode

BATCH, WORKERS = 32, 2


def batch_ids(batch) -> list[int]:
    """The samples' indices in ``batch`` (its cls ints), after reading every tensor of it (as a step would)."""
    touch(batch)
    return batch[1].tolist()


# Mosaic's /dev/shm segments when the run began: those of another program are never removed.
SHM_KEEP: set[str] = set()


@contextlib.contextmanager
def trial_record(loader_name: str, sides: Sides):
    """Whatever a trial leaves is gone before the next: its workers (counted if any outlive it), Mosaic's /dev/shm.

    The trial must hold no reference to its loader or dataset when it ends (a Mosaic dataset still alive would have
    its segments removed under it, and its later ``__del__`` would remove the next one's).
    """
    before = set(process_tree())
    record: dict = {}
    try:
        yield record
    finally:
        gc.collect()
        record["leftover_procs"] = wait_for_exit(set(process_tree()) - before)
        if loader_name == "mosaic":
            record["shm_removed"] = len(peers.clean_shared_memory(SHM_KEEP))
        sides.drop_dirs()  # each trial's cache holds up to the whole data


class Sides:
    """How each loader is built over one storage (``http`` or ``local``), each call a fresh dataset and loader."""

    def __init__(self, data: dict, storage: str, scratch: Path, server: Served | None):
        self.data, self.storage, self.scratch, self.server = data, storage, scratch, server
        self.decode = functools.partial(decode, nbytes=data["sample_bytes"])
        self._n = 0
        self._dirs: list[Path] = []

    def fresh_dir(self, name: str) -> str:
        self._n += 1
        path = self.scratch / f"{name}-{self._n}"
        path.mkdir(parents=True)
        self._dirs.append(path)
        return str(path)

    def drop_dirs(self) -> None:
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)
        self._dirs.clear()

    def tar_sources(self) -> list[str]:
        if self.storage == "http":
            return [f"{self.server.url}/{TAR_DIR}/{p.name}" for p in self.data["tar"]]
        return [str(p) for p in self.data["tar"]]

    def fastfeed(self, seed: int, cache_bytes: int | None = None, **kwargs):
        import fastfeed
        from fastfeed.io import Shards

        if self.storage == "http":
            kwargs.update(cache_dir=self.fresh_dir("fastfeed-cache"), cache_bytes=cache_bytes)
        ds = Shards(self.tar_sources(), decode=self.decode, shuffle=True, seed=seed, **kwargs)
        return fastfeed.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)

    def webdataset(self, seed: int):
        return peers.webdataset_loader(self.tar_sources(), self.decode, batch_size=BATCH, num_workers=WORKERS,
                                       seed=seed)

    def mosaic(self, seed: int, **kwargs):
        if self.storage == "http":
            remote, local = f"s3://{BUCKET}/{MDS_PREFIX}", self.fresh_dir("mosaic-cache")
        else:
            remote, local = None, str(self.data["mds_dir"])
        return peers.mosaic_loader(remote, local, self.decode, batch_size=BATCH, num_workers=WORKERS, seed=seed,
                                   **kwargs)

    def before_epoch(self, name: str) -> None:
        if self.storage == "local":
            drop_page_cache(self.data["tar"] if name != "mosaic" else self.data["mds"])


def epoch_trial(sides: Sides, name: str, seed: int) -> dict:
    """One epoch of a fresh ``name`` loader: time to first batch and samples/s, both from building the dataset."""
    with trial_record(name, sides) as rec:
        sides.before_epoch(name)
        t0 = time.perf_counter()
        loader = getattr(sides, name)(seed)
        it = iter(loader)
        ids = batch_ids(next(it))
        t1 = time.perf_counter()
        for batch in it:
            ids += batch_ids(batch)
        t2 = time.perf_counter()
        del it, loader
        rec.update(ttfb_s=t1 - t0, seconds=t2 - t0, samples=len(ids), unique=len(set(ids)),
                   samples_per_s=len(ids) / (t2 - t0))  # fmt: skip
    return rec


def resume_trial(sides: Sides, name: str, seed: int) -> dict:
    """A run stopped at 50% of its epoch and its state taken, then a fresh loader (and an empty cache) resumed from
    it: both times to the first batch (the stopped run's is an epoch start), and whether the resumed run's first
    batch is the batch the stopped run would have yielded next."""
    with trial_record(name, sides) as rec:
        t0 = time.perf_counter()
        loader = getattr(sides, name)(seed)
        it = iter(loader)
        batch_ids(next(it))
        start = time.perf_counter() - t0
        half = max(1, sides.data["samples"] // BATCH // 2)
        for _ in range(half - 1):
            batch_ids(next(it))
        state = loader.state_dict()
        expected = batch_ids(next(it))
        del it, loader
        gc.collect()
        if name == "mosaic":
            peers.clean_shared_memory(SHM_KEEP)  # the first dataset's /dev/shm, before the second is built
        t0 = time.perf_counter()
        loader = getattr(sides, name)(seed)
        loader.load_state_dict(state)
        it = iter(loader)
        got = batch_ids(next(it))
        resume = time.perf_counter() - t0
        del it, loader
        rec.update(start_ttfb_s=start, resume_ttfb_s=resume, ratio=resume / start, at_batch=half,
                   exact=sorted(got) == sorted(expected))  # fmt: skip
    return rec

