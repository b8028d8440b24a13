"""Whole shards on local disk, bounded in bytes across every process on the machine, evicted by farthest next use.

A loader of shards knows its future: the order of an epoch (and of the next) is fixed by the seed before the
epoch starts. So when the cache is full it can evict the entry needed farthest ahead (Belady's MIN), where an LRU
cache evicts the one needed soonest once the data exceeds the cache: each epoch reads in an order the last epoch
just evicted. With the data at twice the cache, LRU downloads everything again every epoch; farthest-next-use
downloads about ``data - cache``, the least any policy can.

On disk, one directory per dataset (``<cache_dir>/<fingerprint[:16]>``, made 0700)::

    entries/<k>.tar   complete, verified shards (the index's shard number k)
    tmp/<k>.<pid>.<n> downloads in progress, renamed into entries/ once whole and checked
    locks/<k>         one flock per shard: whoever holds it is the only process downloading that shard
    state.json        the byte accounting, the LRU clock and the machine-wide stats, rewritten under state.lock

Every change to ``state.json`` happens under an exclusive ``flock`` of ``state.lock``, so all processes together
keep ``entries + downloads in flight <= limit``: a download reserves its size before its first byte, and an
eviction unlinks its entry before the room is handed out. A reader keeps an open descriptor, so unlinking an entry
it is reading costs it nothing (the inode lives until it closes).

Integrity: a download goes to a private temporary file, its size and CRC-32 are checked against the index, and only
then is it renamed into ``entries/`` (atomic). A process killed mid-download leaves a temporary file and a
reservation whose shard lock the kernel has released; the next process to take that lock or to need room removes
both. An entry is therefore always whole, whoever crashed. (The rename is not fsynced: a power loss, unlike a
crash, can leave a renamed entry whose blocks never reached the disk; its size is checked at each use.)
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from ..._atomic import write_atomic
from .. import remote
from .errors import ShardError
from .fetch import Cancelled, Fetcher

POLICIES = ("farthest", "lru")
COUNTERS = ("downloaded_bytes", "downloads", "hits", "evictions")
POLL_S = 0.05  # waiting for room that another process may free
WAIT_NOTICE_S = 3.0  # a read still waiting for room this long says so, long before wait_s ends it
_STATE, _STATE_LOCK = "state.json", "state.lock"

NextUse = Callable[[int], float]
log = logging.getLogger("fastfeed")


def dataset_dir(cache_dir, fingerprint: str) -> Path:
    """The directory of one dataset's cache: ``<cache_dir>/<fingerprint[:16]>``."""
    return Path(cache_dir) / fingerprint[:16]


class ShardCache:
    """Local copies of whole shards, shared by every process on the machine that uses ``directory``.

    Args:
        directory: this dataset's cache directory (made 0700): ``for_dataset`` makes it
            ``<cache_dir>/<fingerprint[:16]>``.
        limit: bytes the directory may hold, counted across all processes (downloads in flight
            included); None: no bound.
        storage_options: passed to fsspec for remote shards (s3fs: ``{"client_kwargs": {"endpoint_url": ...}}``).
        retries: further attempts after a failed, truncated or corrupt download, with exponential backoff.
        timeout: seconds a connection may send nothing before the attempt fails (a read timeout, so a large
            download that is slow but moving is never cut).
        policy: ``"farthest"`` evicts the entry whose ``next_use`` is largest; ``"lru"`` the least recently used.
        threads: background downloaders for ``predownload``.
        wait_s: how long a download waits for room held by entries in use or downloads in flight before it fails.

    ``next_use(k) -> float`` is the caller's estimate of when shard ``k`` is next needed, as a position in its
    known order (``math.inf``: not needed again); an entry whose ``next_use`` is below ``protect`` (by default 0,
    so a negative value means "in use") is never evicted. Each process evicts by its own ``next_use``.
    """

    def __init__(self, directory, limit: int | None, *, storage_options: dict | None = None, retries: int = 3, timeout: float = 60.0,
                 policy: str = "farthest", threads: int = 4, wait_s: float = 60.0) -> None:  # fmt: skip
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"cache_bytes must be an int >= 0 (bytes the cache may hold) or None, got {limit!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0 (further attempts after a failure), got {retries!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self.directory = Path(directory)
        self.limit = limit
        self.retries = retries
        self.timeout = timeout
        self.policy = policy
        self.threads = threads
        self.wait_s = wait_s
        self._fetcher = Fetcher(storage_options, timeout)
        self._start_process()

    @classmethod
    def for_dataset(cls, cache_dir, fingerprint: str, limit: int | None, **kwargs) -> ShardCache:
        """The cache of the dataset whose ``ShardIndex.fingerprint`` is ``fingerprint``, under ``cache_dir``."""
        return cls(dataset_dir(cache_dir, fingerprint), limit, **kwargs)

    # -- processes and pickling ------------------------------------------------------------------------------

    def _start_process(self) -> None:
        """Fresh threads, locks and queue for this process (a forked child inherits its parent's, unusable)."""
        self._pid = os.getpid()
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._queued: set[int] = set()
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._ready = False
        self._names = itertools.count()

    def _process(self) -> None:
        if self._pid != os.getpid():
            self._start_process()
        if not self._ready:
            for sub in ("", "entries", "tmp", "locks"):
                (self.directory / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
            self._sweep_tmp(None)
            self._ready = True

    def __getstate__(self) -> dict:
        keep = ("directory", "limit", "retries", "timeout", "policy", "threads", "wait_s", "_fetcher")
        return {name: self.__dict__[name] for name in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._start_process()

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop the background downloads (one in progress is abandoned, its temporary file removed) and close
        this process's connections. The cache stays usable: threads and connections are made again on need."""
        if self._pid != os.getpid():
            self._start_process()
            return
        self._stop.set()
        with self._cv:
            self._queue.clear()
            self._queued.clear()
            self._cv.notify_all()
        for worker in self._workers:
            worker.join()
        self._fetcher.close()
        self._start_process()

    # -- paths and locks -------------------------------------------------------------------------------------

    def _entry(self, k: int) -> Path:
        return self.directory / "entries" / f"{k:06d}.tar"

    def _lock_path(self, k: int) -> Path:
        return self.directory / "locks" / f"{k:06d}"

    def _lock(self, k: int, block: bool = True) -> int | None:
        """An fd holding shard k's flock (an open file description of its own, so it excludes this process's
        other threads too); None when ``block`` is False and another holds it."""
        fd = os.open(self._lock_path(k), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)  # explicit: a forked child's copy of fd must not keep the lock held
        os.close(fd)

    def _sweep_tmp(self, k: int | None) -> None:
        """Remove the temporary files of shard k (all shards: None) whose downloader is gone. The caller holds
        k's lock; for None, each shard's lock is tried, and a shard being downloaded is left alone."""
        tmp = self.directory / "tmp"
        names = [n for n in os.listdir(tmp) if k is None or n.startswith(f"{k:06d}.")]
        by_shard: dict[int, list[str]] = {}
        for name in names:
            head = name.split(".", 1)[0]
            if head.isdigit():
                by_shard.setdefault(int(head), []).append(name)
        for shard, found in by_shard.items():
            fd = None if k is not None else self._lock(shard, block=False)
            if k is None and fd is None:
                continue
            try:
                for name in found:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp / name)
            finally:
                if fd is not None:
                    self._unlock(fd)

    @contextlib.contextmanager
    def _state(self, write: bool = True):
        """The accounting, under the machine-wide state lock; written back on leaving when ``write``."""
        fd = os.open(self.directory / _STATE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            state = self._read_state()
            yield state
            if write:
                write_atomic(self.directory / _STATE, json.dumps(state, separators=(",", ":")))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _read_state(self) -> dict:
        try:
            state = json.loads((self.directory / _STATE).read_bytes())
            if isinstance(state, dict) and {"entries", "reserved", "tick", "stats"} <= state.keys():
                return state
        except (FileNotFoundError, ValueError):
            pass
        # No (readable) accounting: adopt the entries on disk, which are whole by construction.
        entries = {}
        for name in os.listdir(self.directory / "entries"):
            head = name.split(".", 1)[0]
            if head.isdigit():
                with contextlib.suppress(FileNotFoundError):
                    entries[str(int(head))] = [os.stat(self.directory / "entries" / name).st_size, 0]
        used = sum(size for size, _ in entries.values())
        return {"entries": entries, "reserved": {}, "tick": 0,
                "stats": {**dict.fromkeys(COUNTERS, 0), "peak_bytes": used}}  # fmt: skip

    # -- public API ------------------------------------------------------------------------------------------

    def local(self, k: int, url: str, size: int | None, crc: int | None, next_use: NextUse | None = None,
              protect: float = 0.0) -> str:  # fmt: skip
        """The path of a complete, verified local copy of shard ``k`` (downloaded if absent).

        Only one process on the machine downloads a shard; the others wait for it and use its copy. Another
        process may evict the entry once this returns, unless the caller's ``next_use(k)`` is below ``protect``
        in that process too: to read it, prefer ``fd()``/``open()``, whose descriptor outlives an eviction.

        Args:
            k: the shard's number in the index.
            url: where it lives (local path or fsspec URL).
            size, crc: its size in bytes and zlib CRC-32 from the index, checked before the copy is used (None:
                not checked; the size is then asked of the store).
            next_use: the caller's ``next_use(k)`` (see the class); None: no knowledge (all 0).
            protect: entries whose ``next_use`` is below it are not evicted.

        Raises:
            ShardError: missing (at once), or every attempt failed or arrived short or corrupt, or the cache is too
                small to hold it beside the shards in use.
        """
        path, fd = self._get(k, url, size, crc, next_use, protect, want_fd=False)
        return path

    def fd(self, k: int, url: str, size: int | None, crc: int | None, next_use: NextUse | None = None,
           protect: float = 0.0) -> int:
        """As ``local()``, but a read-only descriptor of the copy (the caller closes it): reads through it stay
        whole even if the entry is evicted meanwhile, since it is opened before any process can evict it."""
        path, fd = self._get(k, url, size, crc, next_use, protect, want_fd=True)
        return fd

    def open(self, k: int, url: str, size: int | None, crc: int | None, next_use: NextUse | None = None,
             protect: float = 0.0):
        """``fd()`` as a binary file object."""
        return os.fdopen(self.fd(k, url, size, crc, next_use, protect), "rb")

    def predownload(self, items: Iterable[tuple[int, str, int | None, int | None]], next_use: NextUse | None = None,
                    protect: float = 0.0) -> None:  # fmt: skip
        """Download these ``(k, url, size, crc)`` in the background, in order; returns at once.

        A later ``local()``/``open()`` of one in flight waits for it. A predownload never evicts an entry needed
        sooner than itself (nor one below ``protect``); without such room it is skipped, and the shard is
        fetched when it is asked for. Failures are left for that later request to meet (and report).
        """
        self._process()
        with self._cv:
            for item in items:
                k, url, size, crc = item
                if k not in self._queued:
                    self._queued.add(k)
                    self._queue.append(((k, url, size, crc), next_use, protect))
            while len(self._workers) < min(self.threads, len(self._queue) + len(self._workers)):
                worker = threading.Thread(target=self._predownloader, name="fastfeed-shard-fetch", daemon=True)
                self._workers.append(worker)
                worker.start()
            self._cv.notify_all()

    def stats(self) -> dict:
        """Machine-wide counters since the last ``reset_stats()``: ``downloaded_bytes`` (bytes written by every
        attempt, failed ones included), ``downloads`` (shards fetched whole), ``hits`` (requests served by an entry,
        one another process downloaded included), ``evictions``; and ``used_bytes`` (entries plus downloads in
        flight now), ``peak_bytes`` (the most ``used_bytes`` has been), ``limit``."""
        self._process()
        with self._state(write=False) as state:
            used = _used(state)
            return {**{c: state["stats"][c] for c in COUNTERS}, "used_bytes": used,
                    "peak_bytes": state["stats"]["peak_bytes"], "limit": self.limit}  # fmt: skip

    def reset_stats(self) -> None:
        """Zero the counters (for every process); ``peak_bytes`` restarts from the bytes held now."""
        self._process()
        with self._state() as state:
            state["stats"] = {**dict.fromkeys(COUNTERS, 0), "peak_bytes": _used(state)}

    # -- the work --------------------------------------------------------------------------------------------

    def _get(self, k, url, size, crc, next_use, protect, want_fd, optional=False):
        self._process()
        next_use = next_use or _unknown
        hit = self._hit(k, size, want_fd, count=not optional)
        if hit is not None:
            return hit
        lock = self._lock(k)  # another process downloading k holds it: wait, then use its copy
        try:
            hit = self._hit(k, size, want_fd, count=not optional)
            if hit is not None:
                return hit
            self._sweep_tmp(k)  # whatever is there was left by a downloader that died holding this lock
            if size is None:
                size = self._size(url)
            if not self._reserve(k, url, size, next_use, protect, optional):
                return None
            return self._download(k, url, size, crc, want_fd)
        finally:
            self._unlock(lock)

    def _hit(self, k: int, size: int | None, want_fd: bool, count: bool):
        """(path, fd or None) of k's entry if whole, counted as a hit; None if absent. Under the state lock, so
        no eviction comes between the check and the open."""
        path = self._entry(k)
        with self._state() as state:
            entry = state["entries"].get(str(k))
            if entry is None:
                return None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # removed behind the cache's back
                del state["entries"][str(k)]
                return None
            actual = os.fstat(fd).st_size
            if actual != entry[0] or (size is not None and actual != size):
                os.close(fd)
                del state["entries"][str(k)]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return None
            state["tick"] += 1
            entry[1] = state["tick"]
            if count:
                state["stats"]["hits"] += 1
        if not want_fd:
            os.close(fd)
            fd = None
        return str(path), fd

    def _size(self, url: str) -> int:
        """The shard's size, asked of its store with the retries and backoff of every request
        (``fastfeed.io.remote.retry``)."""
        try:
            return remote.retry(lambda: self._fetcher.size(url), self.retries, what=f"the size of shard {url}",
                                timeout=self.timeout, wait=self._pause(url))  # fmt: skip
        except (FileNotFoundError, PermissionError, remote.RemoteError) as e:
            raise ShardError.gave_up(url, e, "asking its size") from e

    def _pause(self, url: str) -> Callable[[float], None]:
        """The wait between two attempts: cut short, ending the download, once the cache closes."""

        def pause(seconds: float) -> None:
            if self._stop.wait(seconds):
                raise Cancelled(url)

        return pause

    def _reserve(self, k, url, size, next_use, protect, optional) -> bool:
        """Room for ``size`` bytes, evicting as the policy says; waits up to ``wait_s`` for room that only
        entries in use and downloads in flight hold. False: ``optional`` and no room."""
        if self.limit is not None and size > self.limit:
            raise ShardError(url, f"the shard is {size} bytes, more than cache_bytes={self.limit}; cache_bytes "
                                  f"must be at least the largest shard (better: several)")  # fmt: skip
        started = time.monotonic()
        deadline, notice = started + self.wait_s, started + WAIT_NOTICE_S
        while True:
            with self._state() as state:
                held = self._make_room(state, k, size, next_use, protect, optional)
                if held is None:
                    state["reserved"][str(k)] = size
                    stats = state["stats"]
                    stats["peak_bytes"] = max(stats["peak_bytes"], _used(state))
                    return True
            if optional or self._stop.is_set():
                return False
            now = time.monotonic()
            if now > deadline:
                raise ShardError(url, f"cache_bytes={self.limit} is too small: this shard ({size} bytes) found no "
                                      f"room for {self.wait_s:.0f} s beside {held} bytes of shards in use or being "
                                      f"downloaded; cache_bytes must be at least {held + size}")  # fmt: skip
            if notice is not None and now > notice:
                notice = None
                log.warning("fastfeed shard cache: shard %s (%d bytes) has waited %.0f s for room in %s: "
                            "cache_bytes=%d, and %d bytes are held by shards in use or being downloaded by this "
                            "machine's readers. It waits up to %.0f s more, then fails; a larger cache_bytes "
                            "avoids the wait.", url, size, now - started, self.directory, self.limit, held,
                            deadline - now)  # fmt: skip
            time.sleep(POLL_S)

    def _make_room(self, state, k, size, next_use, protect, optional) -> int | None:
        """Evict until ``size`` more bytes fit; None once they do, else the bytes that may not be evicted (and
        nothing is evicted)."""
        self._drop_stale_reservations(state, k)
        if self.limit is None:
            return None
        need = _used(state) + size - self.limit
        if need <= 0:
            return None
        new = next_use(k) if optional else -math.inf
        candidates, kept = [], sum(state["reserved"].values())
        for key, (esize, tick) in state["entries"].items():
            use = next_use(int(key))
            if use < protect or (self.policy == "farthest" and optional and use <= new):
                kept += esize
                continue
            candidates.append(((-use, tick) if self.policy == "farthest" else (tick,), key, esize))
        candidates.sort()
        chosen, freed = [], 0
        for _, key, esize in candidates:
            if freed >= need:
                break
            chosen.append(key)
            freed += esize
        if freed < need:
            return kept
        for key in chosen:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._entry(int(key)))  # a reader's open descriptor keeps its inode
            del state["entries"][key]
            state["stats"]["evictions"] += 1
        return None

    def _drop_stale_reservations(self, state, own: int) -> None:
        """Reservations of downloaders that died: their shard lock is free. One for ``own`` is a dead process's
        too: the caller holds that lock and reserves only once there is room."""
        for key in list(state["reserved"]):
            if int(key) == own:
                del state["reserved"][key]
                continue
            fd = self._lock(int(key), block=False)
            if fd is not None:
                try:
                    del state["reserved"][key]
                    self._sweep_tmp(int(key))
                finally:
                    self._unlock(fd)

    def _download(self, k: int, url: str, size: int, crc: int | None, want_fd: bool):
        """Fetch k into a temporary file, check it, rename it into place; the reservation becomes the entry
        (or is released on failure). The caller holds k's lock and its reservation. A failed, short or corrupt
        download is tried again as every request is (``fastfeed.io.remote.retry``)."""
        received, done = [0], None

        def attempt() -> Path:
            tmp = self.directory / "tmp" / f"{k:06d}.{os.getpid()}.{next(self._names)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except OSError as e:  # the cache's own directory, not the store: say so, and do not retry
                raise ShardError(url, f"cannot write a temporary copy in {tmp.parent} ({remote.describe(e)})") from e
            try:
                try:
                    nbytes, got = self._fetcher.copy(url, fd, size, self._stop)
                finally:
                    received[0] += os.fstat(fd).st_size
                    os.close(fd)
                if nbytes != size:
                    raise _Damaged(f"{nbytes} bytes arrived, the index says {size}")
                if crc is not None and got != crc:
                    raise _Damaged(f"CRC-32 {got:08x}, the index says {int(crc):08x}")
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            return tmp

        try:
            try:
                tmp = remote.retry(attempt, self.retries, what=f"shard {url}", final=(Cancelled, ShardError),
                                   timeout=self.timeout, wait=self._pause(url))  # fmt: skip
            except (FileNotFoundError, PermissionError, remote.RemoteError) as e:
                raise ShardError.gave_up(url, e, "download") from e
            done = self._place(k, url, tmp, want_fd)
        finally:
            with self._state() as state:
                state["reserved"].pop(str(k), None)
                stats = state["stats"]
                stats["downloaded_bytes"] += received[0]
                if done is not None:
                    state["tick"] += 1
                    state["entries"][str(k)] = [size, state["tick"]]
                    stats["downloads"] += 1
        return done

    def _place(self, k: int, url: str, tmp: Path, want_fd: bool) -> tuple[str, int | None]:
        """Rename a checked download into ``entries/``: (its path, a descriptor of it when ``want_fd``). A local
        failure here is the cache directory's (removed or made read-only meanwhile), never the store's."""
        entry, reader = self._entry(k), None
        try:
            if want_fd:
                reader = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            os.rename(tmp, entry)
        except OSError as e:
            if reader is not None:
                os.close(reader)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise ShardError(url, f"the downloaded copy could not be moved into {entry.parent} ({remote.describe(e)}): "
                                  "was the cache directory removed or made read-only?") from e  # fmt: skip
        return str(entry), reader

    def _predownloader(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop.is_set():
                    self._cv.wait()
                if self._stop.is_set():
                    return
                item, next_use, protect = self._queue.popleft()
            try:
                self._get(*item, next_use, protect, want_fd=False, optional=True)
            except Exception:  # noqa: BLE001 - the shard's own request meets the failure again and reports it
                pass
            finally:
                with self._cv:
                    self._queued.discard(item[0])


class _Damaged(ValueError):
    """A download arrived short or with the wrong checksum."""


def _unknown(k: int) -> float:
    return 0.0


def _used(state: dict) -> int:
    return sum(size for size, _ in state["entries"].values()) + sum(state["reserved"].values())
