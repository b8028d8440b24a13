"""Cache hits under contention: PROCS processes each read every shard of a fully cached epoch through
``ShardCache.fd`` (as ``fastfeed.io.Shards``' readers do: a descriptor, one pread of the shard, its CRC-32), and
the share of their time spent in the cache's calls is reported, with the calls' latency.

    python scripts/bench_cache_hits.py [--procs 16] [--shards 1000] [--size 65536] [--dir DIR]

The shards are local files, copied into the cache by a first pass, so that every measured call is a hit and the
cache's own bookkeeping is all that is measured. To measure another checkout's cache (the code before a change),
run this file with ``PYTHONPATH=<that checkout>``: the line "cache code:" says which one ran.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

from fastfeed.io.shards import cache as cache_module
from fastfeed.io.shards.cache import ShardCache

START_DELAY_S = 1.0  # all readers start together, after every process is up


def _make(root: Path, n: int, size: int) -> list[tuple[int, str, int, int]]:
    (root / "src").mkdir(parents=True)
    items = []
    for k in range(n):
        data = os.urandom(size)
        path = root / "src" / f"{k:06d}.tar"
        path.write_bytes(data)
        items.append((k, str(path), size, zlib.crc32(data)))
    return items


def _read_epoch(cache: ShardCache, items: list, seed: int, start: float, out) -> None:
    """One reader: every shard once, in its own order. Puts (wall seconds in cache calls, wall seconds in all, CPU
    seconds in cache calls, CPU seconds in all, each call's wall seconds)."""
    order = random.Random(seed).sample(range(len(items)), len(items))
    position = {k: p for p, k in enumerate(order)}
    next_use = position.__getitem__
    calls, cpu = [], 0.0
    time.sleep(max(0.0, start - time.time()))
    began, began_cpu = time.perf_counter(), time.thread_time()
    for k in order:
        # The CPU clock is a system call, where a process is often switched out: kept outside the wall clock's span.
        c0 = time.thread_time()
        t0 = time.perf_counter()
        fd = cache.fd(*items[k], next_use)
        calls.append(time.perf_counter() - t0)
        cpu += time.thread_time() - c0
        try:
            data = os.pread(fd, items[k][2], 0)
        finally:
            os.close(fd)
        if zlib.crc32(data) != items[k][3]:
            raise SystemExit(f"shard {k} read back wrong")
    out.put((sum(calls), time.perf_counter() - began, cpu, time.thread_time() - began_cpu, calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=16)
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--size", type=int, default=65536, help="bytes per shard")
    parser.add_argument("--dir", help="where to write the shards and the cache (default: a new temporary directory)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fastfeed-cache-hits-", dir=args.dir))
    try:
        items = _make(root, args.shards, args.size)
        cache = ShardCache(root / "cache", None)
        for item in items:
            cache.local(*item)
        cache.reset_stats()
        cache.close()
        fork = multiprocessing.get_context("fork")
        out = fork.Queue()
        start = time.time() + START_DELAY_S
        procs = [fork.Process(target=_read_epoch, args=(cache, items, seed, start, out)) for seed in range(args.procs)]
        for p in procs:
            p.start()
        results = [out.get(timeout=3600) for _ in procs]
        wall = time.time() - start
        for p in procs:
            p.join()
        in_cache = sum(r[0] for r in results)
        total = sum(r[1] for r in results)
        cpu_in_cache = sum(r[2] for r in results)
        cpu_total = sum(r[3] for r in results)
        calls = sorted(c for r in results for c in r[4])
        hits = cache.stats()["hits"]
        cache.close()
        print(f"cache code: {cache_module.__file__}")
        print(f"{args.procs} processes x {args.shards} cached shards of {args.size} bytes, on {os.cpu_count()} CPUs")
        print(f"time in cache calls / total: {in_cache:.2f} s / {total:.2f} s = {100 * in_cache / total:.1f} %")
        print(f"CPU time in cache calls / total: {cpu_in_cache:.2f} s / {cpu_total:.2f} s = "
              f"{100 * cpu_in_cache / cpu_total:.1f} %")
        print(f"per call: mean {1e6 * statistics.fmean(calls):.0f} us, median {1e6 * calls[len(calls) // 2]:.0f} us, "
              f"p99 {1e6 * calls[int(len(calls) * 0.99)]:.0f} us, max {1e3 * calls[-1]:.1f} ms")
        print(f"epoch wall time: {wall:.2f} s ({len(calls) / wall:.0f} shard reads/s, all processes); "
              f"hits counted: {hits}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
