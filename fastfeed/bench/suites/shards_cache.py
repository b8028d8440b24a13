"""The shards workload's cache part: epoch 2's downloads with the data twice the cache, against LRU's and
Belady's (simulated on fastfeed's order of shards) and the ideal, for each loader.
"""

from __future__ import annotations

import collections
import inspect
import math
from typing import Any

import numpy as np

from .shards_data import BUCKET, TAR_DIR
from .shards_trials import BATCH, WORKERS, Sides, batch_ids, trial_record


def shard_uses(ids: list[int], starts: np.ndarray) -> list[int]:
    """The shards that ``ids`` (samples in the order yielded) come from, consecutive repeats merged."""
    shards = np.searchsorted(starts, np.asarray(ids), side="right") - 1
    return [int(k) for i, k in enumerate(shards) if i == 0 or k != shards[i - 1]]


def simulate(uses: list[list[int]], sizes, capacity: int, policy: str) -> list[int]:
    """Bytes each epoch of ``uses`` downloads through a cache of whole shards of ``capacity`` bytes.

    Args:
        uses: Per epoch, the order in which shards are read (see :func:`shard_uses`).
        sizes: Bytes of each shard.
        capacity: The cache's bytes.
        policy: ``"lru"`` evicts the least recently used shard; ``"farthest"`` the one whose next use is farthest
            ahead in the whole known sequence (Belady's: the fewest downloads any cache can make on that order).

    Returns:
        Bytes downloaded in each epoch (the cache starts empty).
    """
    flat = [(e, k) for e, epoch in enumerate(uses) for k in epoch]
    nxt: list[float] = [math.inf] * len(flat)
    seen: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        k = flat[i][1]
        nxt[i] = seen.get(k, math.inf)
        seen[k] = i
    cache: collections.OrderedDict[int, float] = collections.OrderedDict()  # shard -> its next use
    held, out = 0, [0] * len(uses)
    for i, (e, k) in enumerate(flat):
        if k in cache:
            cache.move_to_end(k)
        else:
            while cache and held + sizes[k] > capacity:
                victim = next(iter(cache)) if policy == "lru" else max(cache, key=cache.__getitem__)
                held -= sizes[victim]
                del cache[victim]
            out[e] += sizes[k]
            held += sizes[k]
        cache[k] = nxt[i]
    return out


def _fastfeed_epochs(sides: Sides, seed: int, cache_bytes: int, **kwargs) -> dict:
    with trial_record("fastfeed", sides) as rec:
        loader = sides.fastfeed(seed, cache_bytes=cache_bytes, **kwargs)
        ds = loader.dataset
        uses, stats, served = [], [], []
        for e in range(2):
            ds.set_epoch(e)
            ids: list[int] = []
            for batch in loader:
                ids += batch_ids(batch)
            uses.append(shard_uses(ids, sides.data["starts"]))
            stats.append(ds.cache_stats()["downloaded_bytes"])
            served.append(sides.server.sent(TAR_DIR))
        del loader, ds
        rec.update(epoch2_bytes=stats[1] - stats[0], epoch2_served=served[1] - served[0], uses=uses)
    return rec


def cache_part(sides: Sides, loaders: list[str], seed: int = 7) -> dict:
    """Epoch 2's downloads with the data 2x the cache, for each loader that has a cache, and LRU's."""
    tar_sizes = [p.stat().st_size for p in sides.data["tar"]]
    data = sum(tar_sizes)
    cache = data // 2
    out: dict[str, Any] = {"data_bytes": data, "cache_bytes": cache, "ideal_bytes": data - cache}
    if "fastfeed" in loaders:
        # Shards needs its window and what it downloads ahead in the cache at once: at most half of it here.
        window = max(1, min(8, len(tar_sizes) // 2 // 4))
        kwargs = dict(shuffle_window=window, predownload=window)
        rec = _fastfeed_epochs(sides, seed, cache, **kwargs)
        uses = rec.pop("uses")
        out["fastfeed"] = dict(rec, policy="farthest next use", **kwargs)
        from fastfeed.io import Shards

        if "cache_policy" in inspect.signature(Shards).parameters:
            lru = _fastfeed_epochs(sides, seed, cache, cache_policy="lru", **kwargs)
            lru.pop("uses")
            out["lru"] = dict(lru, how="fastfeed's cache with cache_policy='lru', the same seed")
        else:
            out["lru"] = dict(epoch2_bytes=simulate(uses, tar_sizes, cache, "lru")[1],
                              how="LRU simulated on fastfeed's order of shards (whole shards, same cache bytes)")
        out["belady"] = dict(epoch2_bytes=simulate(uses, tar_sizes, cache, "farthest")[1],
                             how="farthest next use simulated on fastfeed's order (the least a cache of whole "
                             "shards downloads)")
    if "mosaic" in loaders:
        mds = [p.stat().st_size for p in sides.data["mds"]]
        # Mosaic's default predownload (8 batches a worker) can exceed a small cache, which then evicts shards
        # before they are read: its workers together predownload at most half the cache here.
        predownload = max(BATCH, len(sides.data["mds"]) // 2 * sides.data["samples"] // len(mds) // (2 * WORKERS))
        # Its default shuffle block (262,144 samples) spans the whole of a small dataset: every worker would read
        # samples from every shard, and a cache of half the shards would download a shard per sample or two. A
        # block of 4 shards' samples keeps its reads to a few shards at a time, as at a real dataset's scale.
        block = 4 * sides.data["samples"] // len(mds)
        with trial_record("mosaic", sides) as rec:
            rec.update(data_bytes=sum(mds), cache_bytes=sum(mds) // 2, ideal_bytes=sum(mds) - sum(mds) // 2,
                       predownload=predownload, shuffle_block_size=block,
                       policy="cache_limit (LRU), counted by the server")
            served = [sides.server.sent(BUCKET)]
            try:
                loader = sides.mosaic(seed, cache_limit=sum(mds) // 2, predownload=predownload,
                                      shuffle_block_size=block)
                for _ in range(2):
                    for batch in loader:
                        batch_ids(batch)
                    served.append(sides.server.sent(BUCKET))
                rec.update(epoch2_bytes=served[2] - served[1])
            except Exception as e:  # Mosaic's own failure is a figure of this part, not the end of the run
                rec.update(error=f"{type(e).__name__}: {e}"[:300], epoch2_bytes=None)
            finally:
                loader = None
        out["mosaic"] = rec
    if "webdataset" in loaders:
        with trial_record("webdataset", sides) as rec:
            before = sides.server.sent(TAR_DIR)
            loader = sides.webdataset(seed)
            for batch in loader:
                batch_ids(batch)
            del loader
            rec.update(epoch2_bytes=sides.server.sent(TAR_DIR) - before, policy="no cache: every epoch reads all")
        out["webdataset"] = rec
    return out

