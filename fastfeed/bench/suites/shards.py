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
import contextlib
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .. import extras, peers
from ..accounting import shm_left

# The suite's parts, each a module beside this one: shards_data.py (the samples, the tar shards, the HTTP server),
# shards_trials.py (each loader built over a storage, one timed trial), shards_cache.py (the cache part, its LRU
# and Belady simulations).
from .shards_cache import cache_part, shard_uses, simulate  # noqa: F401  (re-exported: shards.simulate, as before)
from .shards_data import BUCKET, MDS_PREFIX, TAR_DIR, Samples, Served, write_tar
from .shards_trials import BATCH, SHM_KEEP, WORKERS, Sides, epoch_trial, resume_trial

LOADERS = ("fastfeed", "webdataset", "mosaic")
PARTS = ("http", "local", "resume", "cache")


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
        SHM_KEEP.clear()
        SHM_KEEP.update(peers.mosaic_segments())  # another program's, alive: not ours to remove
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
                peers.clean_shared_memory(SHM_KEEP)
            shutil.rmtree(scratch, ignore_errors=True)
    result["shm_left"] = shm_left(shm_before)
    say("")
    from ..report import shards_markdown

    say(shards_markdown(result))
    return result


if __name__ == "__main__":
    main()
