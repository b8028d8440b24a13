"""Tar shards: fastfeed.io.Shards against webdataset and MosaicML Streaming, over HTTP and from local disk.

The data: --samples JPEG-like samples (a JPEG header, seeded random bytes, an end marker; ~100 KB +- 10%) with a
`cls` int (the sample's index), written once as WebDataset tar shards of about --per-shard samples
(fastfeed.io.write_shards), and converted once to Mosaic's MDS (streaming.MDSWriter, shards of the same mean bytes),
both outside the timing.
  (a) http   the shards served on 127.0.0.1 with 5 +- 5 ms per request (fastfeed/bench/http.py's FileServer, in a
             process of its own). Mosaic reads no HTTP URL, so the same server answers it as a path-style S3
             endpoint (S3_ENDPOINT_URL): the same server, the same latency per request (boto3 sends a HEAD and a
             GET per shard).
  (b) local  the same shards on local disk, each file's pages dropped before each epoch (posix_fadvise DONTNEED).
Loaders, nw=2, batch 32, shuffled, the same decode (the jpg bytes padded or cut to a --size-byte uint8 tensor,
and the cls int), every trial a fresh dataset and loader (and an empty cache where the loader has one):
  fastfeed    fastfeed.io.Shards through fastfeed.DataLoader;
  webdataset  WebDataset(shardshuffle=<shards>).shuffle(1000).map(decode).batched(32) (batching in the workers)
              through torch's DataLoader(batch_size=None);
  mosaic      StreamingDataset (shuffle, py1e) decoding in __getitem__, through its StreamingDataLoader.
Interleaved rounds after one untimed epoch of each loader (the order rotates by one each round); medians over
rounds, ratios fastfeed / peer per round.
Figures:
  - throughput: samples/s over a whole epoch, from building the dataset to the last batch;
  - time to first batch, from building the dataset;
  - resume (http): a run stopped at 50% of an epoch, its state_dict() taken, then a fresh loader that loads it:
    its time to the first batch against the stopped run's own epoch start (webdataset has no resume);
  - cache (http): with cache_bytes = data / 2, bytes downloaded in epoch 2 (after epoch 1 of the same loader),
    against the ideal (data - cache), LRU (fastfeed's cache with cache_policy="lru" where Shards takes it, else
    simulated on fastfeed's order of shards), Belady's (simulated), Mosaic's cache_limit, webdataset (no cache).
Bytes are also counted by the server (bytes of GET bodies), the same way for every loader.

Run: .venv/bin/python benchmarks/shards.py [--rounds 5] [--samples 4096] [--quick] [--loaders ...] [--parts ...]
(or fastfeed bench shards, which writes a report: ~2.5 min on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import inspect
import math
import multiprocessing
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .. import extras, peers
from ..accounting import process_tree, wait_for_exit
from ..trial import drop_page_cache, touch

BATCH, WORKERS = 32, 2
SAMPLE_BYTES = 100_000  # decode pads or cuts every jpg to this many bytes, so batches stack
JPEG_HEAD = bytes.fromhex("ffd8ffe000104a46494600010100000100010000")  # SOI and a JFIF APP0 segment
JPEG_TAIL = b"\xff\xd9"  # EOI
BUCKET, MDS_PREFIX, TAR_DIR = "bench", "mds", "tar"
LOADERS = ("fastfeed", "webdataset", "mosaic")
PARTS = ("http", "local", "resume", "cache")


# --- the data ------------------------------------------------------------------------------------------------------


def jpeg_like(index: int, size: int, seed: int = 0) -> bytes:
    """Sample ``index``'s bytes: a JPEG header, seeded random bytes, an end marker; ``size`` +- 10% in all."""
    rng = random.Random(seed * 1_000_003 + index)
    n = round(size * rng.uniform(0.9, 1.1))
    return JPEG_HEAD + rng.randbytes(n - len(JPEG_HEAD) - len(JPEG_TAIL)) + JPEG_TAIL


class Samples(torch.utils.data.Dataset):
    """The bench's samples as a map-style dataset of ``{"jpg": bytes, "cls": int}`` (what write_shards takes)."""

    def __init__(self, n: int, size: int, seed: int = 0):
        self.n, self.size, self.seed = n, size, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"jpg": jpeg_like(i, self.size, self.seed), "cls": i}


def decode(sample: dict, nbytes: int = SAMPLE_BYTES) -> tuple[torch.Tensor, int]:
    """Every loader's decode: the jpg bytes padded or cut to ``nbytes`` (a uint8 tensor), and the cls int."""
    data = sample["jpg"]
    out = np.zeros(nbytes, np.uint8)
    n = min(len(data), nbytes)
    out[:n] = np.frombuffer(data, np.uint8, count=n)
    return torch.from_numpy(out), int(sample["cls"])


def write_tar(samples: Samples, dest: Path, per_shard: int) -> tuple[list[Path], np.ndarray]:
    """The samples as tar shards in ``dest`` with their index (``fastfeed.io.write_shards``, keys ``%09d``); the
    shard paths and each shard's first sample."""
    from fastfeed.io import ShardIndex, write_shards

    dest.mkdir(parents=True, exist_ok=True)
    # A shard ends before the sample that would take it past shard_bytes: ~per_shard samples, each its two members'
    # headers (512 bytes each) and the data's padding to 512.
    write_shards(samples, str(dest), shard_bytes=per_shard * (samples.size + 1536), num_workers=0, progress=False)
    index = ShardIndex.load(str(dest / "fastfeed-index.json"))
    return sorted(dest.glob("*.tar")), np.asarray(index.starts[:-1])


# --- the server ----------------------------------------------------------------------------------------------------


def _serve(root: str, latency: float, jitter: float, conn) -> None:
    from ..http import FileServer

    class Counting(FileServer):
        """Counts the bytes of GET bodies sent, by the first directory of the path (tar/, bench/)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.sent: collections.Counter = collections.Counter()

        async def _serve_file(self, request, relpath, truncate):
            response = await super()._serve_file(request, relpath, truncate)
            if relpath.startswith(BUCKET + "/"):
                # Mosaic downloads index.json in the main process and its forked workers inherit that boto3
                # client, keep-alive socket and all: two workers then share one socket, and one reads the other's
                # answer (a shard file of wrong bytes: Mosaic's IndexError "not present in the shard") or waits for
                # boto3's 60 s read timeout. Closing each S3 answer's connection costs a connect on 127.0.0.1.
                response.force_close()
            if request.method == "GET" and response.status in (200, 206):
                self.sent[relpath.split("/", 1)[0]] += int(response.headers.get("Content-Length", 0))
            return response

    with Counting(root, latency=latency, jitter=jitter) as server:
        conn.send(server.url)
        while conn.recv() == "bytes":
            conn.send(dict(server.sent))


class Served:
    """The file server in a process of its own (its threads never compete for the loaders' GIL), and its counts."""

    def __init__(self, root: Path, latency: float, jitter: float):
        self._conn, theirs = multiprocessing.Pipe()
        self._proc = multiprocessing.get_context("fork").Process(target=_serve, args=(str(root), latency, jitter,
                                                                                       theirs))  # fmt: skip
        self._proc.start()
        self.url = self._conn.recv()

    def sent(self, prefix: str) -> int:
        """Bytes of GET bodies sent so far under ``prefix``."""
        self._conn.send("bytes")
        return self._conn.recv().get(prefix, 0)

    def close(self) -> None:
        self._conn.send("stop")
        self._proc.join(10)


# --- one trial ------------------------------------------------------------------------------------------------------


def _ids(batch) -> list[int]:
    touch(batch)
    return batch[1].tolist()


# Mosaic's /dev/shm segments when the run began: those of another program are never removed.
_SHM_KEEP: set[str] = set()


@contextlib.contextmanager
def _trial(loader_name: str, sides: Sides):
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
            record["shm_removed"] = len(peers.clean_shared_memory(_SHM_KEEP))
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
    with _trial(name, sides) as rec:
        sides.before_epoch(name)
        t0 = time.perf_counter()
        loader = getattr(sides, name)(seed)
        it = iter(loader)
        ids = _ids(next(it))
        t1 = time.perf_counter()
        for batch in it:
            ids += _ids(batch)
        t2 = time.perf_counter()
        del it, loader
        rec.update(ttfb_s=t1 - t0, seconds=t2 - t0, samples=len(ids), unique=len(set(ids)),
                   samples_per_s=len(ids) / (t2 - t0))  # fmt: skip
    return rec


def resume_trial(sides: Sides, name: str, seed: int) -> dict:
    """A run stopped at 50% of its epoch and its state taken, then a fresh loader (and an empty cache) resumed from
    it: both times to the first batch (the stopped run's is an epoch start), and whether the resumed run's first
    batch is the batch the stopped run would have yielded next."""
    with _trial(name, sides) as rec:
        t0 = time.perf_counter()
        loader = getattr(sides, name)(seed)
        it = iter(loader)
        _ids(next(it))
        start = time.perf_counter() - t0
        half = max(1, sides.data["samples"] // BATCH // 2)
        for _ in range(half - 1):
            _ids(next(it))
        state = loader.state_dict()
        expected = _ids(next(it))
        del it, loader
        gc.collect()
        if name == "mosaic":
            peers.clean_shared_memory(_SHM_KEEP)  # the first dataset's /dev/shm, before the second is built
        t0 = time.perf_counter()
        loader = getattr(sides, name)(seed)
        loader.load_state_dict(state)
        it = iter(loader)
        got = _ids(next(it))
        resume = time.perf_counter() - t0
        del it, loader
        rec.update(start_ttfb_s=start, resume_ttfb_s=resume, ratio=resume / start, at_batch=half,
                   exact=sorted(got) == sorted(expected))  # fmt: skip
    return rec


# --- the cache ------------------------------------------------------------------------------------------------------


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
    with _trial("fastfeed", sides) as rec:
        loader = sides.fastfeed(seed, cache_bytes=cache_bytes, **kwargs)
        ds = loader.dataset
        uses, stats, served = [], [], []
        for e in range(2):
            ds.set_epoch(e)
            ids: list[int] = []
            for batch in loader:
                ids += _ids(batch)
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
        with _trial("mosaic", sides) as rec:
            rec.update(data_bytes=sum(mds), cache_bytes=sum(mds) // 2, ideal_bytes=sum(mds) - sum(mds) // 2,
                       predownload=predownload, shuffle_block_size=block,
                       policy="cache_limit (LRU), counted by the server")
            served = [sides.server.sent(BUCKET)]
            try:
                loader = sides.mosaic(seed, cache_limit=sum(mds) // 2, predownload=predownload,
                                      shuffle_block_size=block)
                for _ in range(2):
                    for batch in loader:
                        _ids(batch)
                    served.append(sides.server.sent(BUCKET))
                rec.update(epoch2_bytes=served[2] - served[1])
            except Exception as e:  # Mosaic's own failure is a figure of this part, not the end of the run
                rec.update(error=f"{type(e).__name__}: {e}"[:300], epoch2_bytes=None)
            finally:
                loader = None
        out["mosaic"] = rec
    if "webdataset" in loaders:
        with _trial("webdataset", sides) as rec:
            before = sides.server.sent(TAR_DIR)
            loader = sides.webdataset(seed)
            for batch in loader:
                _ids(batch)
            del loader
            rec.update(epoch2_bytes=sides.server.sent(TAR_DIR) - before, policy="no cache: every epoch reads all")
        out["webdataset"] = rec
    return out


# --- the run --------------------------------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def storage_part(sides: Sides, loaders: list[str], rounds: int, say: Callable = print, prime: bool = True) -> dict:
    """Interleaved epochs of every loader over one storage; medians and fastfeed / peer ratios per round.

    ``prime``: one untimed epoch of each loader first, as the runner's comparisons have (the first trial of a run
    paid its one-time costs: fastfeed's first HTTP epoch ran at less than half the speed of the next ones).
    """
    primed = {name: epoch_trial(sides, name, seed=99) for name in (loaders if prime else [])}
    for name, rec in primed.items():
        say(f"  shards {sides.storage} untimed: {name:10} {rec['samples_per_s']:8.0f} samples/s, first batch "
            f"{rec['ttfb_s'] * 1e3:6.0f} ms")
    runs: dict[str, list[dict]] = {n: [] for n in loaders}
    for r in range(rounds):
        order = loaders[r % len(loaders):] + loaders[:r % len(loaders)]
        for name in order:
            rec = epoch_trial(sides, name, seed=100 + r)
            runs[name].append(dict(rec, round=r))
            say(f"  shards {sides.storage} round {r + 1}: {name:10} {rec['samples_per_s']:8.0f} samples/s, first "
                f"batch {rec['ttfb_s'] * 1e3:6.0f} ms")
    mean_bytes = sides.data["bytes"] / sides.data["samples"]
    out: dict[str, Any] = {"loaders": {}, "vs": {}, "primed": primed}
    for name, recs in runs.items():
        tput = statistics.median(x["samples_per_s"] for x in recs)
        out["loaders"][name] = {"samples_per_s": tput, "mb_per_s": tput * mean_bytes / 1e6,
                                "ttfb_s": statistics.median(x["ttfb_s"] for x in recs), "rounds": recs}
    if "fastfeed" in runs:
        for peer in (n for n in loaders if n != "fastfeed"):
            pairs = list(zip(runs["fastfeed"], runs[peer]))
            out["vs"][peer] = {"throughput": _stats([f["samples_per_s"] / p["samples_per_s"] for f, p in pairs]),
                               "ttfb": _stats([f["ttfb_s"] / p["ttfb_s"] for f, p in pairs])}
    return out


def resume_part(sides: Sides, loaders: list[str], rounds: int, say: Callable = print) -> dict:
    out: dict[str, Any] = {}
    able = [n for n in loaders if n != "webdataset"]
    runs: dict[str, list[dict]] = {n: [] for n in able}
    for r in range(rounds):
        for name in able[r % len(able):] + able[:r % len(able)] if able else []:
            rec = resume_trial(sides, name, seed=200 + r)
            runs[name].append(dict(rec, round=r))
            say(f"  shards resume round {r + 1}: {name:10} epoch start {rec['start_ttfb_s'] * 1e3:6.0f} ms, resumed "
                f"at batch {rec['at_batch']} {rec['resume_ttfb_s'] * 1e3:6.0f} ms")
    for name, recs in runs.items():
        out[name] = {"start_ttfb_s": statistics.median(x["start_ttfb_s"] for x in recs),
                     "resume_ttfb_s": statistics.median(x["resume_ttfb_s"] for x in recs),
                     "ratio": _stats([x["ratio"] for x in recs]), "exact": all(x["exact"] for x in recs),
                     "rounds": recs}  # fmt: skip
    if "webdataset" in loaders:
        out["webdataset"] = "no resume"
    return out


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--per-shard", type=int, default=32, help="samples per tar shard (~3.3 MB at 100 KB)")
    p.add_argument("--size", type=int, default=100_000)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--jitter-ms", type=float, default=5.0)
    p.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=LOADERS)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--quick", action="store_true", help="1 round of 1,536 samples of ~25 KB in shards of 64")
    args = p.parse_args(argv)
    if args.quick:
        # Small bytes but not few shards: the cache part needs the data in 24 shards or more (Shards protects its
        # window, what it downloads ahead, and the shards of workers a few batches behind).
        args.rounds, args.samples, args.size, args.per_shard = 1, 1536, 25_000, 64
    return args


def _available(loaders: list[str], say: Callable) -> tuple[list[str], dict]:
    skipped = {}
    for name in loaders:
        why = None if name == "fastfeed" else peers.missing(name)
        if why:
            skipped[name] = why
            say(f"# shards {name}: skipped, it {why}")
    return [n for n in loaders if n not in skipped], skipped


def main(argv=None) -> dict:
    args = _parse(argv)
    say = print
    loaders, skipped = _available(args.loaders, say)
    parts = list(args.parts)
    why = extras.missing(extras.HTTP)
    if why and set(parts) & {"http", "resume", "cache"}:
        say(f"# shards http, resume, cache: skipped, each {why}")
        parts = [x for x in parts if x == "local"]
    result: dict[str, Any] = {"workload": "shards", "skipped": skipped}
    if "mosaic" in loaders:
        peers.clean_shared_memory()  # what a crashed Mosaic run left would stall this one (Mosaic's advice)
        _SHM_KEEP.clear()
        _SHM_KEEP.update(peers.mosaic_segments())  # another program's, alive: not ours to remove
    shm_before = set(os.listdir("/dev/shm"))
    with tempfile.TemporaryDirectory(prefix="fastfeed-shards-") as tmp:
        root = Path(tmp) / "served"
        samples = Samples(args.samples, args.size)
        t0 = time.perf_counter()
        tar, starts = write_tar(samples, root / TAR_DIR, args.per_shard)
        data = {"tar": tar, "starts": starts, "samples": args.samples, "sample_bytes": args.size,
                "bytes": sum(len(samples[i]["jpg"]) for i in range(len(samples)))}  # fmt: skip
        if "mosaic" in loaders:
            mds_dir = root / BUCKET / MDS_PREFIX
            tar_mean = sum(p.stat().st_size for p in tar) / len(tar)
            peers.write_mds((samples[i] for i in range(len(samples))), str(mds_dir), size_limit=int(tar_mean))
            data.update(mds_dir=mds_dir, mds=sorted(mds_dir.glob("*.mds")))
        say(f"# shards: {args.samples} samples of ~{args.size / 1e3:.0f} KB, {len(tar)} tar shards"
            + (f", {len(data['mds'])} MDS shards" if "mds" in data else "")
            + f", written in {time.perf_counter() - t0:.1f} s; loaders {', '.join(loaders)}, nw={WORKERS}, "
            f"batch {BATCH}, {args.rounds} rounds")
        result["params"] = dict(samples=args.samples, per_shard=args.per_shard, size=args.size,
                                tar_shards=len(tar), mds_shards=len(data.get("mds", [])),
                                data_bytes=sum(p.stat().st_size for p in tar), rounds=args.rounds,
                                latency_ms=args.latency_ms, jitter_ms=args.jitter_ms, batch_size=BATCH,
                                num_workers=WORKERS, sample_bytes=data["sample_bytes"], quick=args.quick,
                                loaders=loaders, webdataset_batching=".batched(32) in the workers, DataLoader("
                                "batch_size=None)", mosaic_endpoint="the same FileServer as a path-style S3 "
                                "endpoint (S3_ENDPOINT_URL), the same latency per request")  # fmt: skip
        scratch = Path(tmp) / "scratch"
        try:
            if set(parts) & {"http", "resume", "cache"}:
                server = Served(root, args.latency_ms / 1e3, args.jitter_ms / 1e3)
                try:
                    with peers.s3_environment(server.url) if "mosaic" in loaders else contextlib.nullcontext():
                        sides = Sides(data, "http", scratch, server)
                        if "http" in parts:
                            say(f"(a) http: {args.latency_ms} +- {args.jitter_ms} ms per request")
                            result["http"] = storage_part(sides, loaders, args.rounds, say, prime=not args.quick)
                        if "resume" in parts:
                            say("(resume) http: at 50% of an epoch, against the epoch start")
                            result["resume"] = resume_part(sides, loaders, args.rounds, say)
                        if "cache" in parts:
                            say("(cache) http: data 2x the cache, epoch 2's downloads")
                            result["cache"] = cache_part(sides, loaders)
                finally:
                    server.close()
            if "local" in parts:
                say("(b) local: page cache dropped before each epoch")
                result["local"] = storage_part(Sides(data, "local", scratch, None), loaders, args.rounds, say,
                                               prime=not args.quick)
        finally:
            if "mosaic" in loaders:
                gc.collect()
                peers.clean_shared_memory(_SHM_KEEP)
            shutil.rmtree(scratch, ignore_errors=True)
    result["shm_left"] = sorted(set(os.listdir("/dev/shm")) - shm_before)
    say("")
    from ..report import shards_markdown

    say(shards_markdown(result))
    return result


if __name__ == "__main__":
    main()
