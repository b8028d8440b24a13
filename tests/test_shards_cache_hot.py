"""ShardCache's bookkeeping off the hot path (issue 34): a hit takes no machine-wide lock and writes nothing shared,
close() is bounded even when a background download is stuck in a request, background failures are logged, and a
failure of the cache's own directory is reported as such, leaking nothing."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import shutil
import threading
import time
import zlib
from pathlib import Path

import pytest

from _leaks import open_fds
from _load import Within
from fastfeed.io.shards import cache as cache_module
from fastfeed.io.shards.cache import ShardCache
from fastfeed.io.shards.errors import ShardError

pytestmark = pytest.mark.fastfeed_only


@pytest.fixture(scope="module", autouse=True)
def fsspec_io_thread() -> None:
    """fsspec's event-loop thread lives as long as the process: start it before the first leak snapshot."""
    import fsspec.asyn

    fsspec.asyn.get_loop()


def _sources(root: Path, n: int, size: int = 20_000) -> list[tuple[int, str, int, int]]:
    """n local shard files of ``size`` random bytes, as an index describes them: (k, path, size, crc)."""
    root.mkdir(parents=True, exist_ok=True)
    items = []
    for k in range(n):
        data = os.urandom(size)
        (root / f"{k}.tar").write_bytes(data)
        items.append((k, str(root / f"{k}.tar"), size, zlib.crc32(data)))
    return items


def _cache_fds(cache: ShardCache) -> list[str]:
    """This process's descriptors of files in the cache's directory."""
    return [target for target in open_fds().values() if target.startswith(str(cache.directory))]


def _settled(cache: ShardCache, timeout: float = 10.0) -> None:
    """Wait until the background downloaders have finished every queued shard."""
    deadline = time.monotonic() + timeout
    while cache._queued:
        assert time.monotonic() < deadline, "the background downloads never finished"
        time.sleep(0.01)


def _close_within(cache: ShardCache, seconds: float) -> None:
    """``cache.close()`` returns within ``seconds`` (judged by ``Within``; run in a thread, so that a close that hangs
    fails the test)."""
    closer = threading.Thread(target=cache.close)
    with Within(seconds, "close()"):
        closer.start()
        closer.join(30)  # bounds only a close that hangs: how soon it returns is Within's to judge
        assert not closer.is_alive(), "close() hangs"


def test_a_hit_takes_no_machine_wide_lock_and_writes_no_state_while_a_miss_still_reserves(tmp_path):
    """With state.lock held by the test, 100 hits of a cached shard from another ShardCache (its own lock
    descriptors, as another process has) complete and leave state.json as it was; a miss, which must reserve its
    bytes, waits for the lock. The hits are counted in the machine-wide stats all the same."""
    items = _sources(tmp_path / "src", 2)
    writer = ShardCache(tmp_path / "cache", 10**6)
    reader = ShardCache(tmp_path / "cache", 10**6)
    try:
        writer.local(*items[0])
        state = writer.directory / "state.json"
        written = (os.stat(state).st_ino, os.stat(state).st_mtime_ns, state.read_bytes())
        lock = os.open(writer.directory / "state.lock", os.O_RDWR)
        fcntl.flock(lock, fcntl.LOCK_EX)
        fds, missed = [], []
        try:
            hits = threading.Thread(target=lambda: fds.extend(reader.fd(*items[0]) for _ in range(100)))
            hits.start()
            hits.join(3)
            assert not hits.is_alive() and len(fds) == 100, "a hit waited for the machine-wide lock"
            assert (os.stat(state).st_ino, os.stat(state).st_mtime_ns, state.read_bytes()) == written
            miss = threading.Thread(target=lambda: missed.append(reader.local(*items[1])))
            miss.start()
            miss.join(0.5)
            assert miss.is_alive() and not missed, "a miss reserved bytes without the lock"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
        miss.join(10)
        assert missed and Path(missed[0]).read_bytes() == Path(items[1][1]).read_bytes()
        for fd in fds:
            assert zlib.crc32(os.pread(fd, items[0][2] + 1, 0)) == items[0][3]
            os.close(fd)
        stats = writer.stats()
        assert (stats["hits"], stats["downloads"]) == (100, 2)
        writer.reset_stats()
        reader.local(*items[0])
        assert writer.stats()["hits"] == 1 and reader.stats()["hits"] == 1
    finally:
        writer.close()
        reader.close()
    assert writer.stats()["hits"] == 1  # a closed cache's count is kept, folded into the accounting


def test_lru_evicts_by_the_last_hit_from_any_instance(tmp_path):
    """The LRU clock lives in the entries themselves: a hit on entry 0 from another ShardCache (no accounting
    written) makes entry 1 the least recently used, which the next download evicts."""
    items = _sources(tmp_path / "src", 3)
    a = ShardCache(tmp_path / "cache", 2 * items[0][2], policy="lru")
    b = ShardCache(tmp_path / "cache", 2 * items[0][2], policy="lru")
    try:
        a.local(*items[0])
        a.local(*items[1])
        b.local(*items[0])
        a.local(*items[2])
        assert sorted(os.listdir(a.directory / "entries")) == ["000000.tar", "000002.tar"]
    finally:
        a.close()
        b.close()


def test_close_abandons_a_download_stuck_in_a_request_within_seconds_leaving_nothing(tmp_path, caplog):
    """A background download whose request stops sending (half the shard written, then silence that only the
    60 s read timeout would end): close() returns within seconds, with no temporary file, no descriptor of the
    cache's files, no reservation and the shard's lock free (another cache downloads it at once). Once its request
    returns, the abandoned thread writes nothing into the cache and leaves, closing what it held; nothing is
    logged as a failure."""
    items = _sources(tmp_path / "src", 1, size=200_000)
    cache = ShardCache(tmp_path / "cache", 10**6, timeout=60.0)
    other = ShardCache(tmp_path / "cache", 10**6)
    cache.stats()
    before = open_fds()
    sent, resume = threading.Event(), threading.Event()

    def stalled(url, fd, size, stop=None):
        data = Path(url).read_bytes()
        os.write(fd, data[: size // 2])
        sent.set()
        resume.wait(30)  # a read that nothing answers: `stop` is only looked at between two chunks
        os.write(fd, data[size // 2:])
        return size, zlib.crc32(data)

    cache._fetcher.copy = stalled
    caplog.set_level(logging.WARNING, logger="fastfeed")
    try:
        cache.predownload([items[0]])
        assert sent.wait(10)
        workers = list(cache._workers)
        _close_within(cache, 3)
        assert os.listdir(cache.directory / "tmp") == [] and os.listdir(cache.directory / "entries") == []
        assert _cache_fds(cache) == []
        assert other.stats()["used_bytes"] == 0
        with Within(2, "another cache's download of the abandoned shard"):
            assert Path(other.local(*items[0])).read_bytes() == Path(items[0][1]).read_bytes()
    finally:
        resume.set()
    for worker in workers:
        worker.join(10)
        assert not worker.is_alive()
    assert os.listdir(cache.directory / "tmp") == []
    assert Path(cache._entry(0)).read_bytes() == Path(items[0][1]).read_bytes()
    stats = other.stats()
    assert stats["downloads"] == 1 and stats["used_bytes"] == items[0][2]
    other.close()
    assert open_fds() == before
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_background_download_that_fails_is_logged_once_with_its_url(tmp_path, caplog):
    """A predownload whose every attempt arrives corrupt logs one warning naming the shard's URL, and only one
    however often the shard is asked for in the background; the temporary files are gone."""
    (k, path, size, crc), = _sources(tmp_path / "src", 1)
    cache = ShardCache(tmp_path / "cache", 10**6, retries=1)
    caplog.set_level(logging.WARNING, logger="fastfeed")
    try:
        for _ in range(3):
            cache.predownload([(k, path, size, crc ^ 1)])
            _settled(cache)
        warned = [r for r in caplog.records if r.name == "fastfeed" and r.levelno == logging.WARNING]
        assert len(warned) == 1 and path in warned[0].getMessage() and "CRC-32" in warned[0].getMessage()
        assert os.listdir(cache.directory / "tmp") == [] and cache.stats()["used_bytes"] == 0
    finally:
        cache.close()


def _fail_rename(monkeypatch, cache):
    def rename(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(os, "rename", rename)
    return cache.directory / "entries"


def _remove_tmp(monkeypatch, cache):
    shutil.rmtree(cache.directory / "tmp")
    return cache.directory / "tmp"


def _fail_accounting_after_rename(monkeypatch, cache):
    """The disk fills just as the download is in place: the write of the accounting that records it fails."""
    real = cache_module.write_atomic

    def write_atomic(path, *chunks, **kwargs):
        if cache._entry(0).exists():
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *chunks, **kwargs)

    monkeypatch.setattr(cache_module, "write_atomic", write_atomic)
    return cache.directory / "state.json"


@pytest.mark.parametrize("fault", [_fail_rename, _remove_tmp, _fail_accounting_after_rename])
def test_a_local_failure_names_the_local_path_and_leaks_no_descriptor(tmp_path, monkeypatch, fault):
    """A download that cannot be moved into entries/, a tmp/ removed under the cache, the accounting that cannot
    be written once the copy is in place: fd() raises a ShardError naming the cache's own path (not a store's "not
    found"), no descriptor stays open, no temporary file stays; the next request, once the fault is gone, works."""
    (k, path, size, crc), = _sources(tmp_path / "src", 1)
    cache = ShardCache(tmp_path / "cache", 10**6)
    try:
        cache.stats()
        before = open_fds()
        with monkeypatch.context() as patch:
            where = fault(patch, cache)
            with pytest.raises(ShardError) as caught:
                cache.fd(k, path, size, crc)
        assert caught.value.shard == path and str(where) in caught.value.detail
        assert "not found" not in caught.value.detail
        assert open_fds() == before
        assert not list((cache.directory / "tmp").glob("*"))  # (a tmp/ removed stays removed until the next request)
        fd = cache.fd(k, path, size, crc)
        try:
            assert zlib.crc32(os.pread(fd, size + 1, 0)) == crc
        finally:
            os.close(fd)
        assert cache.stats()["used_bytes"] == size
    finally:
        cache.close()


class _Stalls:
    """An HTTP server that sends half of a shard's body, then nothing until it is stopped."""

    def __init__(self, root: Path) -> None:
        from aiohttp import web

        from fastfeed.bench.http import FileServer

        class Server(FileServer):
            async def _handle(self, request):
                data = (Path(self.root) / request.path.lstrip("/")).read_bytes()
                response = web.StreamResponse(headers={"Content-Length": str(len(data))})
                await response.prepare(request)
                await response.write(data[: len(data) // 2])
                await asyncio.get_running_loop().create_future()  # until stop() cancels this request

        self.server = Server(root).start()


def test_close_abandons_an_http_download_whose_server_went_silent(tmp_path):
    """The same over HTTP, with fastfeed's own fetcher blocked in a read: close() returns within seconds, leaving
    no temporary file, descriptor of the cache's files or reservation; once the server goes, the abandoned thread
    leaves too, and so do its connection's descriptors."""
    pytest.importorskip("aiohttp")
    items = _sources(tmp_path / "www", 1, size=3_000_000)
    cache = ShardCache(tmp_path / "cache", 10**7, timeout=60.0)
    cache.stats()
    before = {fd: t for fd, t in open_fds().items() if not t.startswith("socket:")}
    stalls = _Stalls(tmp_path / "www")
    try:
        k, _, size, crc = items[0]
        cache.predownload([(k, stalls.server.url_of("0.tar"), size, crc)])
        deadline = time.monotonic() + 10
        while not any(os.path.getsize(p) >= size // 2 for p in (cache.directory / "tmp").glob("*")):
            assert time.monotonic() < deadline, "the first half never arrived"
            time.sleep(0.01)
        workers = list(cache._workers)
        _close_within(cache, 3)
        assert os.listdir(cache.directory / "tmp") == [] and _cache_fds(cache) == []
        assert cache.stats()["used_bytes"] == 0
    finally:
        stalls.server.stop()
    for worker in workers:
        worker.join(10)
        assert not worker.is_alive()
    assert {fd: t for fd, t in open_fds().items() if not t.startswith("socket:")} == before
    assert os.listdir(cache.directory / "tmp") == os.listdir(cache.directory / "entries") == []
