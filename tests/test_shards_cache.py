"""fastfeed.io.shards.cache.ShardCache: whole shards cached on local disk, against real servers on 127.0.0.1 (the
HTTP file server of fastfeed/bench/http.py with latency and faults, moto's S3 server) and real processes (fork)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import math
import multiprocessing
import os
import pickle
import random
import signal
import threading
import time
import zlib
from pathlib import Path

import pytest
from aiohttp import web

from fastfeed.bench.http import FileServer, make_files
from fastfeed.io.shards.cache import ShardCache, dataset_dir
from fastfeed.io.shards.errors import ShardError

from _load import Within
from _s3 import s3_server  # noqa: F401 - a fixture

pytestmark = pytest.mark.fastfeed_only
FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module", autouse=True)
def fsspec_io_thread() -> None:
    """fsspec's event-loop thread lives as long as the process: start it before the first leak snapshot."""
    import fsspec.asyn

    fsspec.asyn.get_loop()


class Faults(FileServer):
    """The file server, whose ``{"truncate": k}`` truncates only the next k answers (``True``: all), and whose
    ``{"dribble": s}`` sends a file in 8 parts with s seconds of silence after each: slow, but never stalled."""

    async def _handle(self, request):
        spec = self.faults.get(request.path.lstrip("/")) or {}
        if "dribble" not in spec:
            return await super()._handle(request)
        self._requests += 1
        data = (Path(self.root) / request.path.lstrip("/")).read_bytes()
        response = web.StreamResponse(headers={"Content-Length": str(len(data))})
        await response.prepare(request)
        step = -(-len(data) // 8)
        for start in range(0, len(data), step):
            await response.write(data[start: start + step])
            await asyncio.sleep(spec["dribble"])
        await response.write_eof()
        return response

    def _take_fault(self, relpath):
        spec = self.faults.get(relpath)
        if spec and isinstance(spec.get("truncate"), int) and spec["truncate"] is not True:
            if spec["truncate"] <= 0:
                return {}
            spec["truncate"] -= 1
            return {"truncate": True}
        return super()._take_fault(relpath)


class Shards:
    """n files served over HTTP, with what an index knows of each: (k, url, size, crc)."""

    def __init__(self, root: Path, server: FileServer, names: list[str]) -> None:
        self.root, self.server, self.names = root, server, names
        self.data = [(root / name).read_bytes() for name in names]

    def item(self, k: int) -> tuple[int, str, int, int]:
        return k, self.server.url_of(self.names[k]), len(self.data[k]), zlib.crc32(self.data[k])

    @property
    def total(self) -> int:
        return sum(map(len, self.data))


@pytest.fixture
def shards(tmp_path):
    """Factory: n shards of about size bytes behind a Faults server (started with the given latency)."""
    servers = []

    def make(n=8, size=20_000, latency=0.0, jitter=0.0):
        root = tmp_path / f"www{len(servers)}"
        names = make_files(root, n, size, seed=len(servers))
        server = Faults(root, latency=latency, jitter=jitter).start()
        servers.append(server)
        return Shards(root, server, names)

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def caches():
    """Factory of ShardCaches that are closed (threads joined, connections closed) at teardown."""
    made = []

    def make(directory, limit, **kwargs):
        kwargs.setdefault("timeout", 5.0)
        fingerprint = kwargs.pop("fingerprint", None)
        cache = (ShardCache(directory, limit, **kwargs) if fingerprint is None
                 else ShardCache.for_dataset(directory, fingerprint, limit, **kwargs))  # fmt: skip
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


def _bytes_on_disk(directory: Path) -> int:
    """Bytes of the entries and the downloads in progress, as the directory shows them now."""
    total = 0
    for sub in ("entries", "tmp"):
        for entry in os.scandir(directory / sub):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
    return total


class Order:
    """A known access order; ``next_use(k)`` at the current position (-1: the shard being read)."""

    def __init__(self, sequence: list[int]) -> None:
        self.sequence = sequence
        self.at = 0
        self.uses: dict[int, list[int]] = {}
        for position, k in enumerate(sequence):
            self.uses.setdefault(k, []).append(position)

    def next_use(self, k: int) -> float:
        later = [p for p in self.uses.get(k, []) if p >= self.at]
        if not later:
            return math.inf
        return -1.0 if later[0] == self.at else float(later[0])


def test_a_shard_is_downloaded_once_checked_and_then_served_from_disk(shards, caches, tmp_path):
    """The first request downloads the whole shard into a 0700 directory; the next is a local hit with no
    request, and stats() counts both."""
    site = shards(n=2)
    cache = caches(tmp_path / "cache", 10**6, fingerprint="ab" * 32)
    path = cache.local(*site.item(0))
    assert Path(path).read_bytes() == site.data[0]
    assert cache.directory == dataset_dir(tmp_path / "cache", "ab" * 32) == tmp_path / "cache" / ("ab" * 8)
    assert os.stat(cache.directory).st_mode & 0o777 == 0o700
    before = site.server.requests
    with cache.open(*site.item(0)) as f:
        assert f.read() == site.data[0]
    assert site.server.requests == before == 1
    stats = cache.stats()
    assert (stats["downloads"], stats["hits"], stats["downloaded_bytes"]) == (1, 1, len(site.data[0]))
    cache.reset_stats()
    assert cache.stats()["downloads"] == 0 and cache.stats()["used_bytes"] == len(site.data[0])


@pytest.mark.parametrize("order", ["same", "shuffled"])
def test_farthest_next_use_downloads_about_data_minus_cache_in_epoch_2_where_lru_downloads_more(
        shards, caches, tmp_path, order):  # fmt: skip
    """Data at 2x the cache, two epochs: evicting the farthest next use downloads at most (data - cache) x 1.1 in
    epoch 2; LRU, measured the same way, downloads more (everything again when the order repeats)."""
    n = 24
    site = shards(n=n, size=20_000)
    limit = site.total // 2
    rng = random.Random(3)
    epochs = [list(range(n)), list(range(n))]
    if order == "shuffled":
        for epoch in epochs:
            rng.shuffle(epoch)
    epoch2 = {}
    for policy in ("farthest", "lru"):
        cache = caches(tmp_path / policy, limit, policy=policy)
        known = Order(epochs[0] + epochs[1])
        for position, k in enumerate(known.sequence):
            if position == n:
                cache.reset_stats()
            known.at = position
            with cache.open(*site.item(k), known.next_use) as f:
                assert zlib.crc32(f.read()) == site.item(k)[3]
            assert _bytes_on_disk(cache.directory) <= limit
        epoch2[policy] = cache.stats()["downloaded_bytes"]
    assert epoch2["farthest"] <= (site.total - limit) * 1.1
    assert epoch2["lru"] > epoch2["farthest"] * 1.2
    if order == "same":
        assert epoch2["lru"] == site.total


def _fetch_one(cache, item, start, out):
    time.sleep(max(0.0, start - time.time()))  # all at once (a Barrier's semaphore would outlive the test)
    with cache.open(*item) as f:
        out.put(zlib.crc32(f.read()))


def test_processes_asking_for_one_shard_at_once_download_it_once(shards, caches, tmp_path):
    """Four processes ask for the same shard at the same moment: one request reaches the server, one download is
    counted, and all four read the whole shard."""
    site = shards(n=1, latency=0.3)
    cache = caches(tmp_path / "cache", 10**6)
    start, out = time.time() + 1.0, FORK.Queue()
    procs = [FORK.Process(target=_fetch_one, args=(cache, site.item(0), start, out)) for _ in range(4)]
    for p in procs:
        p.start()
    crcs = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    out.close()
    out.join_thread()
    assert crcs == [site.item(0)[3]] * 4
    assert site.server.requests == 1
    stats = cache.stats()
    assert (stats["downloads"], stats["hits"]) == (1, 3)


@pytest.mark.parametrize("fault", [{"truncate": 2}, {"fail": 3}])
def test_a_truncated_or_failed_download_is_retried_and_arrives_whole(shards, caches, tmp_path, fault):
    """Fewer truncated bodies or 500s than attempts: the shard arrives whole, downloaded once."""
    site = shards(n=1)
    site.server.faults[site.names[0]] = dict(fault)
    cache = caches(tmp_path / "cache", 10**6, retries=3)
    assert Path(cache.local(*site.item(0))).read_bytes() == site.data[0]
    stats = cache.stats()
    assert stats["downloads"] == 1 and site.server.requests == 1 + next(iter(fault.values()))
    assert stats["downloaded_bytes"] >= len(site.data[0])  # the whole, plus what the failed attempts wrote
    assert os.listdir(cache.directory / "tmp") == []


@pytest.mark.parametrize("fault, detail, requests", [
    ({"truncate": True}, "failed 3 time.*Not enough data", 3),
    ({"fail": 100}, "failed 3 time.*500", 3),
    ({"stall": True}, "failed 3 time.*no data for 0.5 s", 3),
    ({"status": 404}, "not found", 1),
])  # fmt: skip
def test_a_download_that_keeps_failing_raises_a_shard_error_naming_the_shard(shards, caches, tmp_path, fault,
                                                                            detail, requests):  # fmt: skip
    """Always truncated, always 500, a server that never answers (ended by the read timeout) and a 404 (at
    once, no retry) each end in ShardError naming the shard's URL, with nothing left in the cache."""
    site = shards(n=1)
    site.server.faults[site.names[0]] = fault
    cache = caches(tmp_path / "cache", 10**6, retries=2, timeout=0.5)
    with pytest.raises(ShardError, match=detail) as caught:
        cache.local(*site.item(0))
    assert caught.value.shard == site.item(0)[1] and site.item(0)[1] in str(caught.value)
    # Ended, and the 404 at once, told by counts rather than by a time that other processes' load stretches: the
    # requests made (3: retries=2, then no more; the 404's 1) and, in ``detail``, the attempts the error counts and
    # the 0.5 s read timeout that ended the stalled ones.
    assert site.server.requests == requests
    assert os.listdir(cache.directory / "entries") == os.listdir(cache.directory / "tmp") == []
    assert cache.stats()["used_bytes"] == 0


def test_a_slow_download_is_not_cut_by_the_read_timeout(shards, caches, tmp_path):
    """A body that takes 8 x 0.2 s to arrive, never silent for the 0.5 s read timeout, arrives whole in one
    request: the timeout bounds silence, not the download."""
    site = shards(n=1)
    site.server.faults[site.names[0]] = {"dribble": 0.2}
    cache = caches(tmp_path / "cache", 10**6, retries=0, timeout=0.5)
    t0 = time.monotonic()
    assert Path(cache.local(*site.item(0))).read_bytes() == site.data[0]
    assert time.monotonic() - t0 > 2 * 0.5 and site.server.requests == 1


def test_a_corrupt_download_is_never_admitted(shards, caches, tmp_path):
    """Bytes whose CRC-32 is not the index's are retried, then refused with a ShardError; no entry appears."""
    site = shards(n=1)
    k, url, size, crc = site.item(0)
    cache = caches(tmp_path / "cache", 10**6, retries=1)
    with pytest.raises(ShardError, match="failed 2 time.*CRC-32"):
        cache.local(k, url, size, crc ^ 1)
    assert site.server.requests == 2 and os.listdir(cache.directory / "entries") == []
    assert Path(cache.local(k, url, size, crc)).read_bytes() == site.data[0]


def _download_and_hang(cache, item, partial):
    if partial:  # the body arrives half, then the connection goes silent (the child is killed meanwhile)
        def half_then_hang(url, fd, size, stop=None):
            data = Path(partial).read_bytes()
            os.write(fd, data[: len(data) // 2])
            time.sleep(60)

        cache._fetcher.copy = half_then_hang
    cache.local(*item)


@pytest.mark.parametrize("partial", [False, True])
def test_a_download_killed_midway_leaves_nothing_that_is_later_read_as_whole(shards, caches, tmp_path, partial):
    """A process killed (SIGKILL) mid-download, while the server stalls or after half the body, leaves no entry;
    its temporary file and its reservation are cleared by the next process, which downloads the shard whole."""
    site = shards(n=1)
    item = site.item(0)
    if not partial:
        site.server.faults[site.names[0]] = {"stall": True}
    cache = caches(tmp_path / "cache", 2 * item[2] - 1)
    child = FORK.Process(target=_download_and_hang, args=(cache, item, partial and site.root / site.names[0]))
    child.start()
    tmp = cache.directory / "tmp"
    deadline = time.monotonic() + 20
    while not (tmp.is_dir() and os.listdir(tmp) and (not partial or _bytes_on_disk(cache.directory) > 0)):
        assert time.monotonic() < deadline, "the child never started its download"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    site.server.faults.clear()
    assert os.listdir(cache.directory / "entries") == []
    assert cache.stats()["used_bytes"] == item[2]  # the dead child's reservation, until someone needs the room
    fresh = caches(cache.directory, cache.limit)
    fresh.stats()  # a new process's first use sweeps temporary files whose downloader is dead
    assert os.listdir(tmp) == []
    assert Path(fresh.local(*item)).read_bytes() == site.data[0]
    assert fresh.stats()["used_bytes"] == item[2]  # the room the dead child reserved came back


def _flock_waiters(path: Path) -> int:
    """Requests blocked now on the flock of ``path``, by any process or thread (Linux's /proc/locks marks a
    blocked request "->" and names the file as major:minor:inode)."""
    st = os.stat(path)
    name = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return sum(1 for line in Path("/proc/locks").read_text().splitlines()
               if "->" in line.split() and name in line.split())  # fmt: skip


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="sees a blocked flock through Linux's /proc/locks")
def test_an_entry_appears_only_once_its_download_is_counted(shards, caches, tmp_path):
    """A download ends while another process holds the state lock (reading the stats): its entry must not appear
    before the download is counted. A loader's worker reads a shard as soon as its entry appears, so an entry
    placed before its count let the epoch end, and cache_stats() answer, one download short (and for good when
    the worker that placed it exited first). Here the downloader is held at the lock, where it counts; the entry
    is looked for then, deterministically, with no race left to chance."""
    site = shards(n=1)
    item = site.item(0)
    cache = caches(tmp_path / "cache", None)
    cache.stats()  # makes the directory and its state.lock
    lock_path = cache.directory / "state.lock"
    real_copy, held = cache._fetcher.copy, []

    def copy_then_take_the_state_lock(url, fd, size, stop=None):
        got = real_copy(url, fd, size, stop)
        # An open file description of its own: its flock excludes the downloader as another process's would.
        lock = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
        fcntl.flock(lock, fcntl.LOCK_EX)
        held.append(lock)
        return got

    cache._fetcher.copy = copy_then_take_the_state_lock
    downloader = threading.Thread(target=cache.local, args=item)
    downloader.start()
    try:
        deadline = time.monotonic() + 20
        while not (held and _flock_waiters(lock_path)):  # the whole, checked download waits to be counted
            assert time.monotonic() < deadline and downloader.is_alive(), "the download never reached its count"
            time.sleep(0.01)
        visible = os.listdir(cache.directory / "entries")
        counted = json.loads((cache.directory / "state.json").read_text())["stats"]["downloads"]
    finally:
        if held:
            os.close(held[0])  # releases the lock
        downloader.join(20)
    assert (visible, counted) == ([], 0), "the entry could be read before its download was counted"
    stats = cache.stats()
    assert stats["downloads"] == 1 and stats["used_bytes"] == item[2]
    assert os.listdir(cache.directory / "entries") == ["000000.tar"]


def _download_and_exit_once_placed(cache, item):
    """Download ``item``, and leave the process by os._exit the moment its entry is renamed into place, as a
    loader's worker leaves (multiprocessing ends a worker by os._exit) under a predownload thread still at work."""
    real_rename, entries = os.rename, str(cache.directory / "entries")

    def rename(src, dst, *args, **kwargs):
        real_rename(src, dst, *args, **kwargs)
        if os.path.dirname(os.fspath(dst)) == entries:
            os._exit(0)

    os.rename = rename  # this forked child's own os module
    cache.local(*item)
    os._exit(3)  # never: the rename above ends the process


def test_a_download_whose_process_exits_right_after_placing_it_is_counted_once(shards, caches, tmp_path):
    """A process that renamed a whole, checked download into place and exited before recording it: the next
    stats() (of any process) finds the dead downloader's reservation beside the entry and counts the download,
    once, with its bytes; the entry then serves hits. Counted only when the room was next needed, it used to be
    accounted as an entry but never as a download: cache_stats() stayed one download short."""
    site = shards(n=1)
    item = site.item(0)
    cache = caches(tmp_path / "cache", None)
    child = FORK.Process(target=_download_and_exit_once_placed, args=(cache, item))
    child.start()
    child.join(30)
    assert child.exitcode == 0, "the child did not exit at the rename of its entry"
    assert os.listdir(cache.directory / "entries") == ["000000.tar"]
    stats = cache.stats()
    assert (stats["downloads"], stats["downloaded_bytes"], stats["used_bytes"]) == (1, item[2], item[2])
    assert Path(cache.local(*item)).read_bytes() == site.data[0]
    stats = cache.stats()
    assert (stats["downloads"], stats["hits"], stats["used_bytes"]) == (1, 1, item[2])
    assert site.server.requests == 1


def _read_sequence(cache, site_items, sequence, out):
    """Read every shard of sequence through the cache (predownloading 2 ahead); report crc mismatches and the
    most bytes the directory held just after each admission."""
    known = Order(sequence)
    bad, peak = 0, 0
    for position, k in enumerate(sequence):
        known.at = position
        ahead = [site_items[j] for j in sequence[position + 1: position + 3]]
        cache.predownload(ahead, known.next_use)
        with cache.open(*site_items[k], known.next_use) as f:
            peak = max(peak, _bytes_on_disk(cache.directory))
            time.sleep(0.002)  # read while the other process evicts: the descriptor keeps the bytes
            bad += zlib.crc32(f.read()) != site_items[k][3]
    cache.close()
    out.put((bad, peak))


def test_the_byte_limit_holds_across_two_processes(shards, caches, tmp_path):
    """Two processes reading different orders of 16 shards through a cache of about 4 of them, with
    predownloads in flight: the directory never holds more than the limit (watched throughout and checked at
    every admission), evictions happen, and every read is whole."""
    site = shards(n=16, size=30_000, latency=0.02, jitter=0.01)
    items = [site.item(k) for k in range(16)]
    limit = int(site.total / 16 * 4.5)
    cache = caches(tmp_path / "cache", limit)
    cache.stats()  # makes the directory, for the watcher
    seen, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            seen[0] = max(seen[0], _bytes_on_disk(cache.directory))

    watcher = threading.Thread(target=watch)
    watcher.start()
    out = FORK.Queue()
    orders = [random.Random(seed).sample(range(16), 16) * 2 for seed in (1, 2)]
    procs = [FORK.Process(target=_read_sequence, args=(cache, items, order, out)) for order in orders]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(10)
    finally:
        stop.set()
        watcher.join()
        out.close()
        out.join_thread()
    assert [bad for bad, _ in results] == [0, 0]
    assert max(peak for _, peak in results) <= limit and seen[0] <= limit
    stats = cache.stats()
    assert stats["peak_bytes"] <= limit and stats["evictions"] > 0 and seen[0] > limit // 2


def test_an_entry_evicted_while_read_or_before_local_is_safe(shards, caches, tmp_path):
    """A reader's open file stays whole when another cache evicts its entry; local() of an entry removed after
    it was admitted downloads it again instead of failing."""
    site = shards(n=3)
    limit = len(site.data[0]) + len(site.data[1]) + len(site.data[2]) - 1
    a = caches(tmp_path / "cache", limit)
    b = caches(tmp_path / "cache", limit)
    reader = a.open(*site.item(0))
    b.local(*site.item(1))
    b.local(*site.item(2), lambda k: 0.0 if k == 2 else (9.0 if k == 0 else 1.0))  # evicts 0: farthest
    assert not Path(a._entry(0)).exists() and b.stats()["evictions"] == 1
    with reader:
        assert reader.read() == site.data[0]
    os.unlink(a._entry(1))  # gone between admission and use
    assert Path(a.local(*site.item(1))).read_bytes() == site.data[1]
    assert a.stats()["downloads"] == 4


def test_protected_entries_are_kept_and_a_cache_too_small_says_how_big_it_must_be(shards, caches, tmp_path):
    """With every entry in use (next_use < 0) the next download waits, then fails naming the cache_bytes it
    needs; a shard larger than the whole cache fails at once."""
    site = shards(n=3)
    sizes = [len(d) for d in site.data]
    cache = caches(tmp_path / "cache", sizes[0] + sizes[1], wait_s=0.3)
    in_use = lambda k: -1.0  # noqa: E731
    cache.local(*site.item(0), in_use)
    cache.local(*site.item(1), in_use)
    with pytest.raises(ShardError, match=rf"cache_bytes={sizes[0] + sizes[1]} is too small.*at least "
                                         rf"{sum(sizes)}"):  # fmt: skip
        cache.local(*site.item(2), in_use)
    assert sorted(os.listdir(cache.directory / "entries")) == ["000000.tar", "000001.tar"]
    tiny = caches(tmp_path / "tiny", sizes[0] - 1)
    with pytest.raises(ShardError, match="more than cache_bytes"):
        tiny.local(*site.item(0))


def test_predownload_returns_at_once_and_a_request_for_a_shard_in_flight_waits_for_it(shards, caches, tmp_path):
    """predownload() of 3 slow shards returns at once; local() of the first, already in flight, waits for that
    download instead of starting another: 3 requests in all."""
    site = shards(n=3, latency=0.4)
    cache = caches(tmp_path / "cache", 10**6, threads=3)
    with Within(0.1, "predownload() of 3 shards at 0.4 s"):
        cache.predownload([site.item(k) for k in range(3)], lambda k: float(k))
    time.sleep(0.1)
    assert Path(cache.local(*site.item(0))).read_bytes() == site.data[0]
    for k in (1, 2):
        assert Path(cache.local(*site.item(k))).read_bytes() == site.data[k]
    # local() of the first waited for its download in flight rather than starting another: told by the requests
    # counted (one a shard), not by a time taken, which other processes' load stretches.
    assert site.server.requests == 3 and cache.stats()["downloads"] == 3


def _use_pickled(blob, item, out):
    cache = pickle.loads(blob)
    cache.predownload([item])
    with cache.open(*item) as f:
        out.put(zlib.crc32(f.read()))
    cache.close()


def test_a_pickled_cache_works_in_a_forked_worker_with_its_own_threads(shards, caches, tmp_path):
    """A cache whose parent has predownload threads running is pickled to a forked process, which makes its own
    threads and connections and reads the shard."""
    site = shards(n=2, latency=0.2)
    cache = caches(tmp_path / "cache", 10**6)
    cache.predownload([site.item(0)])
    out = FORK.Queue()
    child = FORK.Process(target=_use_pickled, args=(pickle.dumps(cache), site.item(1), out))
    child.start()
    assert out.get(timeout=30) == site.item(1)[3]
    child.join(10)
    out.close()
    out.join_thread()
    assert Path(cache.local(*site.item(0))).read_bytes() == site.data[0]
    assert cache.stats()["downloads"] == 2


def test_shards_in_s3_are_cached_through_s3fs(s3_server, caches, tmp_path):  # noqa: F811
    """Against moto's S3 server: a shard downloads whole through s3fs, a wrong CRC is refused after its retries,
    and a missing key fails at once with a ShardError naming it."""
    data = [random.Random(k).randbytes(50_000 + k) for k in range(2)]
    bucket = s3_server.bucket({f"shards/{k}.tar": d for k, d in enumerate(data)})
    cache = caches(tmp_path / "cache", 10**6, storage_options=s3_server.storage_options, retries=1)
    urls = [f"s3://{bucket}/shards/{k}.tar" for k in range(2)]
    with cache.open(0, urls[0], len(data[0]), zlib.crc32(data[0])) as f:
        assert f.read() == data[0]
    with pytest.raises(ShardError, match="CRC-32"):
        cache.local(1, urls[1], len(data[1]), zlib.crc32(data[1]) ^ 1)
    missing = f"s3://{bucket}/shards/9.tar"
    with Within(5, "a missing key's error"), pytest.raises(ShardError, match="not found") as caught:
        cache.local(9, missing, 100, 0)
    assert caught.value.shard == missing
    stats = cache.stats()
    assert stats["downloads"] == 1 and stats["used_bytes"] == len(data[0])


def test_a_read_waiting_for_room_says_so_within_seconds_and_goes_on_once_room_is_freed(shards, caches, tmp_path):
    """Every entry in use: the next read logs, within WAIT_NOTICE_S, what it waits for (its shard, cache_bytes,
    the bytes held); once the entries are no longer in use it takes the room and returns the shard."""
    import logging

    from fastfeed.io.shards import cache as cache_module

    assert cache_module.WAIT_NOTICE_S <= 5
    site = shards(n=3)
    limit = len(site.data[0]) + len(site.data[1])
    cache = caches(tmp_path / "cache", limit, wait_s=60)
    held = threading.Event()
    held.set()
    next_use = lambda k: -1.0 if held.is_set() or k == 2 else math.inf  # noqa: E731
    cache.local(*site.item(0), next_use)
    cache.local(*site.item(1), next_use)
    noticed, records = threading.Event(), []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
            noticed.set()

    handler = Catch(logging.WARNING)
    logging.getLogger("fastfeed").addHandler(handler)
    out = []
    reader = threading.Thread(target=lambda: out.append(cache.local(*site.item(2), next_use)))
    try:
        with Within(cache_module.WAIT_NOTICE_S + 5, "the notice of a read waiting for room"):
            reader.start()
            assert noticed.wait(30), "no notice"  # bounds only a test gone wrong: how soon is Within's to judge
        assert not out
        assert site.item(2)[1] in records[0] and f"cache_bytes={limit}" in records[0] and f"{limit} bytes are held" \
            in records[0]  # fmt: skip
    finally:
        held.clear()  # the entries are no longer in use, whatever the verdict: the reader takes the room and ends
        reader.join(30)
        logging.getLogger("fastfeed").removeHandler(handler)
    assert out and Path(out[0]).read_bytes() == site.data[2]


def _room(tmp_path, sizes, next_use, need, *, policy="farthest", optional_use=None, ages=None):
    """One eviction choice, made by ``ShardCache._make_room`` on given accounting (no server, no download): entries
    ``sizes`` (k -> bytes) in a cache holding exactly their sum, a new shard of ``need`` bytes, ``next_use(k)`` as a
    dict, and entry files whose mtimes put them in ``ages`` order (oldest first; default: by k). ``optional_use``:
    the new shard's next use when it is a predownload (which evicts only entries needed later than it). Returns
    (the entries left, the bytes held back when no room could be made)."""
    cache = ShardCache(tmp_path / f"c{len(list(tmp_path.iterdir()))}", sum(sizes.values()), policy=policy)
    try:
        (cache.directory / "entries").mkdir(parents=True)
        for age, k in enumerate(ages or sorted(sizes)):
            cache._entry(k).write_bytes(b"x" * sizes[k])
            os.utime(cache._entry(k), ns=(10**18 + age * 10**9,) * 2)
        state = {"entries": {str(k): s for k, s in sizes.items()}, "reserved": {}, "stats": {"evictions": 0}}
        uses = dict(next_use)
        if optional_use is not None:
            uses[99] = optional_use
        held = cache._make_room(state, 99, need, lambda k: uses[k], 0, optional_use is not None)
        left = sorted(int(k) for k in state["entries"])
        assert sorted(int(p.stem) for p in (cache.directory / "entries").iterdir()) == left  # evicted: unlinked
        assert state["stats"]["evictions"] == len(sizes) - len(left)
        return left, held
    finally:
        cache.close()


def test_the_eviction_choice_is_the_farthest_next_use_then_the_least_recently_used_and_no_more(tmp_path):
    """The choice itself, exactly, where the two-epoch download counts above only bound its effect: the entry
    needed farthest ahead goes first (never one in use), then the next farthest, and only as many as make room;
    among entries needed equally far the least recently used goes; LRU orders by last use alone. Guards against
    the farthest rank inverted (nearest use evicted), ties broken most-recently-used first, and one eviction too
    many when the room freed is exactly the room needed."""
    sizes = {0: 30, 1: 30, 2: 20, 3: 20}
    uses = {0: 5.0, 1: math.inf, 2: 3.0, 3: -1.0}  # 3 is being read
    assert _room(tmp_path, sizes, uses, 25) == ([0, 2, 3], None)  # 1, never needed again, alone
    assert _room(tmp_path, sizes, uses, 30) == ([0, 2, 3], None)  # exactly 1's bytes: still 1 alone
    assert _room(tmp_path, sizes, uses, 35) == ([2, 3], None)  # then 0 (use 5) before 2 (use 3)
    assert _room(tmp_path, sizes, uses, 81) == ([0, 1, 2, 3], 20)  # 3 is in use: 80 can go, not 81
    ties = {0: 7.0, 1: 7.0, 2: 7.0, 3: 2.0}
    assert _room(tmp_path, sizes, ties, 15, ages=[1, 2, 0, 3]) == ([0, 2, 3], None)  # 1 used least recently
    assert _room(tmp_path, sizes, ties, 35, ages=[2, 0, 1, 3]) == ([1, 3], None)  # 2 (20), then 0 (30)
    # LRU: by last use alone (0 goes though 1 is never needed again), and never an entry being read (3)
    assert _room(tmp_path, sizes, uses, 15, policy="lru", ages=[0, 2, 3, 1]) == ([1, 2, 3], None)
    assert _room(tmp_path, sizes, uses, 15, policy="lru", ages=[3, 2, 0, 1]) == ([0, 1, 3], None)


def test_a_predownload_evicts_only_entries_needed_later_than_the_shard_it_fetches(tmp_path):
    """A predownload of a shard needed at position 4 may evict entries needed after 4 (the farthest first), never
    one needed at 4 or sooner: when those needed later free too little, nothing is evicted and the bytes kept are
    reported. Guards against a predownload evicting an entry needed as soon as the shard it fetches (``<=``
    loosened to ``<``), which trades one download for another."""
    sizes = {0: 30, 1: 30, 2: 20, 3: 20}
    uses = {0: 5.0, 1: math.inf, 2: 4.0, 3: -1.0}
    assert _room(tmp_path, sizes, uses, 45, optional_use=4.0) == ([2, 3], None)
    assert _room(tmp_path, sizes, uses, 65, optional_use=4.0) == ([0, 1, 2, 3], 40)  # 2 (at 4) and 3 (in use)
    assert _room(tmp_path, sizes, uses, 25, optional_use=math.inf) == ([0, 1, 2, 3], 100)  # a shard never needed
