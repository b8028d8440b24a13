"""``fastfeed.io.Files``: a map-style dataset of files or URLs, read ahead of need and optionally cached locally.

torch's loader has only ``num_workers`` reads in flight: with 2 workers and 5 ms per request that is about 400
files/s whatever the bandwidth. fastfeed's workers know the samples of the tasks they hold, and pass them to
``prefetch`` (the read-ahead protocol, see ``fastfeed.io``), so ``readahead`` reads per worker run in background
threads while earlier batches decode; ``__getitem__`` then takes the bytes that are already there. On a local disk
the kernel's own read-ahead is enough once asked (``posix_fadvise(WILLNEED)``), and reader threads would only add
cost; on network filesystems (NFS, Lustre, FUSE...) and for remote URLs, reads run in flight.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import glob as globbing
import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Sequence

from torch.utils.data import Dataset

from . import mounts
from . import remote
from .cache import Cache
from .remote import Remote, is_url, local_path

_FINAL = (FileNotFoundError, PermissionError, IsADirectoryError)  # retrying will not make these readable


class Files(Dataset):
    """Sample ``i`` is ``decode(bytes of sources[i])``, or the bytes when ``decode`` is None.

    Args:
        sources: a list of paths or URLs (kept as given: a list of millions starts at once), or a
            ``(directory, pattern)`` pair, listed (sorted) the first time it is needed; ``**`` recurses.
        decode: bytes -> sample, run in the worker that asked for the sample.
        readahead: reads in flight per worker (per process with ``num_workers=0``); 0: no read-ahead.
        cache_dir: a local directory (disk or tmpfs) to keep copies in; see ``fastfeed.io.cache``.
        cache_bytes: bytes to admit into the cache, all processes together; then it stops admitting and never
            evicts. None: no limit.
        revalidate_s: a cached remote file is served without asking its store for this long after it was fetched
            or last checked; then its version (size, ETag or modification time) is checked again, and a changed
            file is fetched anew. Local files are checked (a ``stat``) on every read.
        retries: further attempts at most after a read or a listing that failed transiently (a 5xx such as S3's
            503 SlowDown, 429, a reset or refused connection, a timeout); None (default): as many as
            ``retry_budget`` allows. Each waits a random time up to a bound doubling from 0.1 s to 5 s, after the
            store's Retry-After (``fastfeed.io.remote.retry``, as for ``Shards``). A missing file (404) or a
            denied one (403) fails at once.
        retry_budget: seconds after a request's first failure during which it is retried; None (default): 120 s
            (``fastfeed.io.remote.DEFAULT_RETRY_BUDGET_S``); ``math.inf``: no limit.
        timeout: seconds a remote request may send nothing (the connection, or the next bytes of a body) before
            it counts as failed; a large file that arrives slowly but steadily is read whole.

    A ``file://`` URL is the local file it names (``fastfeed.io.remote.is_url``), in ``sources`` and as the
    directory of a pattern alike; a pattern's matches keep that spelling.
    """

    def __init__(self, sources, decode: Callable[[bytes], object] | None = None, *, readahead: int = 16,
                 cache_dir=None, cache_bytes: int | None = None, retries: int | None = None,
                 retry_budget: float | None = None, timeout: float = 60.0,
                 revalidate_s: float = 600.0) -> None:  # fmt: skip
        if isinstance(readahead, bool) or not isinstance(readahead, int) or readahead < 0:
            raise ValueError(f"Files: readahead must be an int >= 0, got {readahead!r}")
        remote.check_retry_args(retries, retry_budget, "Files")
        if decode is not None and not callable(decode):
            raise TypeError(f"Files: decode must be callable (bytes -> sample) or None, got {type(decode).__name__}")
        if isinstance(sources, (str, bytes, os.PathLike)):
            raise TypeError("Files: sources must be a list of paths or URLs, or a (directory, pattern) pair; "
                            f"got the single {type(sources).__name__} {sources!r}")  # fmt: skip
        self._pattern = None
        if isinstance(sources, tuple) and len(sources) == 2 and all(isinstance(s, (str, os.PathLike)) for s in sources):
            self._pattern, self._sources = (os.fspath(sources[0]), os.fspath(sources[1])), None
        else:
            self._sources = sources
        self.decode = decode
        self.readahead = readahead
        self.retries = retries
        self.retry_budget = retry_budget
        self.cache = None if cache_dir is None else Cache(cache_dir, cache_bytes)
        self.revalidate_s = revalidate_s
        self.remote = Remote(timeout)
        self._local = None  # this process's readers and reads in flight (see _here)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_local": None}

    # -- the sources ------------------------------------------------------------------------------

    @property
    def sources(self) -> Sequence:
        if self._sources is None:
            directory, pattern = self._pattern
            if is_url(directory):
                try:
                    self._sources = self.remote.glob(directory, pattern, self.retries, self.retry_budget)
                except remote.RemoteError as e:
                    raise e.within(f"fastfeed.io.Files: listing {pattern!r} in {directory}") from e
            else:
                found = globbing.glob(os.path.join(local_path(directory), pattern), recursive=True)
                spelling = "" if directory == local_path(directory) else "file://"
                self._sources = sorted(spelling + p for p in found if os.path.isfile(p))
            if not self._sources:
                raise FileNotFoundError(f"Files: no file matches {pattern!r} in {directory}")
        return self._sources

    def __len__(self) -> int:
        return len(self.sources)

    def source(self, index: int) -> str:
        return os.fspath(self.sources[index])

    # -- reading ----------------------------------------------------------------------------------

    def __getitem__(self, index: int):
        local = self._here()
        pending = local.pending.pop(index, None)
        data = pending.result() if pending is not None else self._load(index)
        return data if self.decode is None else self.decode(data)

    def prefetch(self, indices) -> None:
        """Start reading ``indices`` in the background and return at once (the read-ahead protocol)."""
        if not self.readahead:
            return
        local = self._here()
        for index in indices:
            if index in local.pending:
                continue
            source = self.source(index)
            if is_url(source):
                future = self.remote.submit(source, functools.partial(self._load_async, local, index))
            elif self.cache is None and not mounts.is_network(local_path(source)):
                _advise(local_path(source))  # a local disk: the kernel reads ahead by itself, once asked
                continue
            else:
                future = None
            local.pending[index] = future or local.readers.submit(self._load, index)
        while len(local.pending) > local.max_pending:  # reads nobody asked for (an epoch dropped mid-way)
            _, stale = local.pending.popitem(last=False)
            stale.cancel()

    def _load(self, index: int) -> bytes:
        """The bytes of sample ``index``, retried with backoff; errors name the source and the index."""
        source = self.source(index)
        try:
            return remote.retry(lambda: self._read(source), self.retries, what=source, timeout=self.remote.timeout,
                                budget=self.retry_budget, url=source)  # fmt: skip
        except _FINAL as e:
            raise _unreadable(e, index, source) from e
        except remote.RemoteError as e:
            raise _gave_up(e, index, source) from e

    async def _load_async(self, local: _Local, index: int, fs, source: str) -> bytes:
        """``_load`` on an async filesystem's event loop, ``readahead`` at a time per process (the same retries
        and errors; only the waits are awaited)."""
        async with local.limit():
            try:
                return await remote.retry_async(lambda: self._read_async(fs, source), self.retries, what=source,
                                                timeout=self.remote.timeout, budget=self.retry_budget,
                                                url=source)  # fmt: skip
            except _FINAL as e:
                raise _unreadable(e, index, source) from e
            except remote.RemoteError as e:
                raise _gave_up(e, index, source) from e

    def _cached(self, source: str, version, remote: bool) -> bytes | None:
        """The cache's copy of ``source`` at ``version`` (a remote entry's check is recorded), or None."""
        hit = self.cache.get(source, version)
        if hit is not None and remote:
            self.cache.put(source, version, hit, admit=False)  # checked now
        return hit

    async def _read_async(self, fs, source: str) -> bytes:
        version = None
        if self.cache is not None:
            hit = self.cache.get(source, max_age=self.revalidate_s)
            if hit is not None:
                return hit
            version = await self.remote.version_async(fs, source)
            hit = self._cached(source, version, remote=True)
            if hit is not None:
                return hit
        data = await fs._cat_file(source)
        if self.cache is not None:
            self.cache.put(source, version, data)
        return data

    def _read(self, source: str) -> bytes:
        remote = is_url(source)
        version = None
        if self.cache is not None:
            hit = self.cache.get(source, max_age=self.revalidate_s) if remote else None
            if hit is not None:
                return hit
            version = self.remote.version(source) if remote else _local_version(local_path(source))
            hit = self._cached(source, version, remote)
            if hit is not None:
                return hit
        data = self.remote.read(source) if remote else _read_local(local_path(source))
        if self.cache is not None:
            self.cache.put(source, version, data)
        return data

    def _here(self) -> _Local:
        """This process's readers: a forked worker starts its own, as the parent's threads are not in it."""
        local = self._local
        if local is None or local.pid != os.getpid():
            local = self._local = _Local(self.readahead)
        return local

    def close(self) -> None:
        """Stop the reader threads (they are daemons: a process that exits needs no call) and close this process's
        connections; both are made again on need."""
        if self._local is not None and self._local.pid == os.getpid():
            self._local.readers.close()
        self._local = None
        self.remote.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def _unreadable(error: OSError, index: int, source: str) -> OSError:
    return type(error)(f"fastfeed.io.Files: sample {index}: cannot read {source}: {error}")


def _gave_up(error: remote.RemoteError, index: int, source: str) -> remote.RemoteError:
    return error.within(f"fastfeed.io.Files: sample {index}: reading {source}")


def _advise(path: str) -> None:
    """Ask the kernel to start reading ``path`` into the page cache, and return at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # __getitem__ will say what is wrong
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def _local_version(path: str) -> list:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _read_local(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise") and size:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)  # one request for the whole file
        chunks, got = [], 0
        while got < size:
            chunk = os.pread(fd, size - got, got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    if got != size:
        raise OSError(f"short read: {got} of {size} bytes (the file changed while it was read)")
    return b"".join(chunks)


class _Local:
    """One process's reader threads, its cap on async reads, and its reads in flight."""

    def __init__(self, threads: int) -> None:
        self.pid = os.getpid()
        self.pending: collections.OrderedDict[int, Future] = collections.OrderedDict()
        self.max_pending = max(256, 8 * threads)
        self.readers = _Readers(threads)
        self._threads = threads
        self._limit = None

    def limit(self) -> asyncio.Semaphore:
        """The semaphore that keeps ``readahead`` async reads in flight (made on the event loop that uses it)."""
        if self._limit is None:
            self._limit = asyncio.Semaphore(self._threads)
        return self._limit


class _Readers:
    """Daemon threads running reads, so that a worker exiting mid-epoch never waits for one."""

    def __init__(self, threads: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"ff_readahead_{i}", daemon=True)
                         for i in range(threads)]  # fmt: skip
        for t in self._threads:
            t.start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (handed to whoever takes the sample)
                future.set_exception(e)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
