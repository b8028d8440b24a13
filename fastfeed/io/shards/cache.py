"""Whole shards on local disk, bounded in bytes across every process on the machine, evicted by farthest next use.

A loader of shards knows its future: the order of an epoch (and of the next) is fixed by the seed before the
epoch starts. So when the cache is full it can evict the entry needed farthest ahead (Belady's MIN), where an LRU
cache evicts the one needed soonest once the data exceeds the cache: each epoch reads in an order the last epoch
just evicted. With the data at twice the cache, LRU downloads everything again every epoch; farthest-next-use
downloads about ``data - cache``, the least any policy can.

On disk, one directory per dataset (``<cache_dir>/<fingerprint[:16]>``, made 0700)::

    entries/<k>.tar   complete, verified shards (the index's shard number k); an entry's mtime is its last use
    tmp/<k>.<pid>.<n> downloads in progress, renamed into entries/ once whole and checked
    locks/<k>         one flock per shard: whoever holds it is the only process downloading that shard
    hits/<pid>.<id>   one process's count of hits, mapped into its memory, flocked while that process counts
    state.json        the byte accounting and the other machine-wide counters, rewritten under state.lock

Beside the datasets' directories, ``<cache_dir>/indexes/`` holds the shard indexes read from remote stores, one
per index URL, so that a machine's readers read each once (``read_once``): ``<h>.data`` the bytes, ``<h>.json``
what was read and when (or how it failed), ``<h>.lock`` the flock its reader holds.

``state.json`` changes only when bytes are reserved or freed (and when the stats are read or reset, which folds in
the counts of processes that stopped counting), always under an exclusive ``flock`` of ``state.lock``, so all
processes together keep ``entries + downloads in flight <= limit``: a download reserves its size before its first
byte, and an eviction unlinks its entry before the room is handed out.

A hit takes no lock and writes nothing shared: many processes reading thousands of cached shards an epoch would
otherwise queue on that one lock. It opens the entry, checks its size, sets the entry's mtime (the LRU clock,
read only when evicting) and adds one to its own process's counter (``stats()`` sums the counters). An eviction
unlinks the entry, so a hit's open either comes first, and its descriptor keeps the bytes, or fails, and the
shard is fetched again.

Integrity: a download goes to a private temporary file, its size and CRC-32 are checked against the index, and only
then is it renamed into ``entries/`` (atomic), under the state lock that records it and counts the download, so
that whoever sees an entry and then reads the stats finds its download counted. A process killed mid-download
leaves a temporary file and a reservation whose shard lock the kernel has released; the next process to take that
lock or to need room removes both (and accounts an entry the dead process renamed but did not record, counting it
as the download it was; reading the stats does that too). An entry is therefore always whole, whoever crashed.
(The rename is not fsynced: a power loss, unlike a crash, can leave a renamed entry whose blocks never reached the
disk; its size is checked at each use.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import math
import mmap
import os
import struct
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
# Waiting for room that another process may free: its release is not announced across processes, so the wait
# backs off from WAIT_MIN_S (room freed soon is taken soon) to WAIT_MAX_S (a long wait costs few look-ups).
WAIT_MIN_S, WAIT_MAX_S = 0.005, 0.2
WAIT_NOTICE_S = 3.0  # a read still waiting for room this long says so, long before wait_s ends it
# A remote index read this recently by a reader of this machine serves its other readers without a request: a
# job's ranks start within seconds of each other, and an index rewritten in place is seen by a job started later.
INDEX_SHARE_S = 60.0
# close(): how long background downloads get to stop between two chunks before the ones still blocked in a
# request (up to `timeout` s, which close() must not wait) are abandoned.
CLOSE_GRACE_S = 1.0
_STATE, _STATE_LOCK, _HITS_LOCK = "state.json", "state.lock", "hits.lock"
_HIT_COUNT = struct.Struct("<q")
# Temporary files' numbers, unique within the process for its life: an abandoned download outlives the close()
# that abandoned it, and must never share a name with one started after.
_NAMES = itertools.count()

NextUse = Callable[[int], float]
log = logging.getLogger("fastfeed")


def dataset_dir(cache_dir, fingerprint: str) -> Path:
    """The directory of one dataset's cache: ``<cache_dir>/<fingerprint[:16]>``."""
    return Path(cache_dir) / fingerprint[:16]


# -- a shard set's index, read once per machine ------------------------------------------------------------------

# The failures a reader of the index records for the readers that waited on it: each is what every reader would
# meet (missing, denied, or the retry budget spent against the store), so they are not asked again.
_SHARED_FAILURES = {"missing": FileNotFoundError, "denied": PermissionError, "remote": remote.RemoteError}


def read_once(cache_dir, url: str, fetch: Callable[[], tuple[bytes, str]],
              max_age_s: float = INDEX_SHARE_S) -> tuple[bytes, str]:  # fmt: skip
    """``fetch()``'s ``(bytes, where they were read)`` for the index at ``url``, asked of its store by one reader
    of this machine at a time and shared with the others through ``<cache_dir>/indexes/``.

    The first reader takes the index's flock and fetches; the others (ranks, threads, processes) wait on the lock
    and then read its copy, so a node makes one request for the index, not one per rank. A copy older than
    ``max_age_s`` is fetched again. A fetch that failed for good (missing, denied, or every retry spent) is
    recorded, and a reader that was waiting meanwhile raises the same error rather than starting its own retries
    over: a store refusing a whole node's ranks would otherwise be asked by each of them in turn, for minutes each.

    Raises:
        FileNotFoundError, PermissionError, remote.RemoteError: as ``fetch`` raised them, for this reader or for
            the one it waited for.
    """
    began = time.time()
    directory = Path(cache_dir) / "indexes"
    name = hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    data, meta_path = directory / f"{name}.data", directory / f"{name}.json"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock = _flock(directory / f"{name}.lock", True)
    except OSError as e:  # sharing is a saving, not a need: the cache reports its directory's faults itself
        log.debug("fastfeed shard cache: %s cannot be shared through %s (%s); reading it alone", url, directory,
                  remote.describe(e))  # fmt: skip
        return fetch()
    try:
        meta = _read_meta(meta_path, url)
        now = time.time()
        if meta.get("fetched") is not None and 0 <= now - meta["fetched"] <= max_age_s:
            with contextlib.suppress(FileNotFoundError):
                with open(data, "rb") as f:  # under the lock: the copy the record describes
                    return f.read(), meta["where"]
        failed = meta.get("failed")
        if failed is not None and failed >= began and meta.get("kind") in _SHARED_FAILURES:
            raise _shared_failure(meta, now)
        try:
            raw, where = fetch()
        except tuple(_SHARED_FAILURES.values()) as e:
            kind = next(k for k, t in _SHARED_FAILURES.items() if isinstance(e, t))
            record = {"url": url, "failed": time.time(), "kind": kind, "message": str(e)}
            if isinstance(e, remote.RemoteError):
                record.update(attempts=e.attempts, reason=e.reason, permanent=e.permanent)
            with contextlib.suppress(OSError):  # the error to report is the store's, not this record's
                write_atomic(meta_path, json.dumps(record))
            raise
        with contextlib.suppress(OSError):  # a copy that cannot be written (a full disk) only costs requests
            write_atomic(data, raw)
            write_atomic(meta_path, json.dumps({"url": url, "where": where, "fetched": time.time()}))
        return raw, where
    finally:
        ShardCache._unlock(lock)


def _read_meta(path: Path, url: str) -> dict:
    """The record of ``url``'s copy; empty when there is none, or it is unreadable or another URL's."""
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(meta, dict) or meta.get("url") != url:
        return {}
    for key in ("fetched", "failed"):
        if key in meta and not isinstance(meta[key], (int, float)):
            return {}
    if "fetched" in meta and not isinstance(meta.get("where"), str):
        return {}
    return meta


def _shared_failure(meta: dict, now: float) -> OSError:
    """The error another reader of this machine met reading the index, for a reader that waited for it."""
    ago = max(0.0, now - meta["failed"])
    message = f"{meta.get('message')} (met by another reader on this machine {ago:.0f} s ago)"
    kind = _SHARED_FAILURES[meta["kind"]]
    if kind is remote.RemoteError:
        return remote.RemoteError(message, attempts=int(meta.get("attempts") or 1), reason=str(meta.get("reason", "")),
                                  permanent=bool(meta.get("permanent")))  # fmt: skip
    return kind(message)


class ShardCache:
    """Local copies of whole shards, shared by every process on the machine that uses ``directory``.

    Args:
        directory: this dataset's cache directory (made 0700): ``for_dataset`` makes it
            ``<cache_dir>/<fingerprint[:16]>``.
        limit: bytes the directory may hold, counted across all processes (downloads in flight
            included); None: no bound.
        storage_options: passed to fsspec for remote shards (s3fs: ``{"client_kwargs": {"endpoint_url": ...}}``).
        retries: further attempts at most after a failed, truncated or corrupt download or size look-up (None: as
            many as ``retry_budget`` allows), with the backoff of every request (``fastfeed.io.remote.retry``).
        retry_budget: seconds after a request's first failure during which it is retried (None: the default,
            ``fastfeed.io.remote.DEFAULT_RETRY_BUDGET_S``).
        timeout: seconds a connection may send nothing before the attempt fails (a read timeout, so a large
            download that is slow but moving is never cut).
        policy: ``"farthest"`` evicts the entry whose ``next_use`` is largest; ``"lru"`` the least recently used.
        threads: background downloaders for ``predownload``.
        wait_s: how long a download waits for room held by entries in use or downloads in flight before it fails.

    ``next_use(k) -> float`` is the caller's estimate of when shard ``k`` is next needed, as a position in its
    known order (``math.inf``: not needed again); an entry whose ``next_use`` is below ``protect`` (by default 0,
    so a negative value means "in use") is never evicted. Each process evicts by its own ``next_use``.
    """

    def __init__(self, directory, limit: int | None, *, storage_options: dict | None = None,
                 retries: int | None = None, retry_budget: float | None = None, timeout: float = 60.0,
                 policy: str = "farthest", threads: int = 4, wait_s: float = 60.0) -> None:  # fmt: skip
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"cache_bytes must be an int >= 0 (bytes the cache may hold) or None, got {limit!r}")
        remote.check_retry_args(retries, retry_budget, "fastfeed shard cache")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self.directory = Path(directory)
        self.limit = limit
        self.storage_options = storage_options
        self.retries = retries
        self.retry_budget = retry_budget
        self.timeout = timeout
        self.policy = policy
        self.threads = threads
        self.wait_s = wait_s
        self._fetcher = Fetcher(storage_options, timeout)
        self._warned: set[int] = set()
        self._start_process()

    @classmethod
    def for_dataset(cls, cache_dir, fingerprint: str, limit: int | None, **kwargs) -> ShardCache:
        """The cache of the dataset whose ``ShardIndex.fingerprint`` is ``fingerprint``, under ``cache_dir``."""
        return cls(dataset_dir(cache_dir, fingerprint), limit, **kwargs)

    # -- processes and pickling ------------------------------------------------------------------------------

    def _start_process(self) -> None:
        """Fresh threads, locks, queue and hit counter for this process (a forked child inherits its parent's,
        unusable; close() ends its own)."""
        counter = self.__dict__.get("_counter")
        if counter is not None and counter.pid != os.getpid():
            counter.close()  # the parent's: its own copy of the mapping keeps the parent's lock
        self._pid = os.getpid()
        self._entries = f"{self.directory}{os.sep}entries{os.sep}"
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._queued: set[int] = set()
        self._jobs: set[_Job] = set()
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._room = threading.Condition()
        self._counter: _HitCounter | None = None
        self._counter_lock = threading.Lock()
        self._ready = False

    def _process(self) -> None:
        if self._pid != os.getpid():
            self._start_process()
        if not self._ready:
            for sub in ("", "entries", "tmp", "locks", "hits"):
                (self.directory / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
            self._sweep_tmp(None)
            with self._state(block=False) as state:  # a busy lock is left to the next look: never wait here
                if state is not None:
                    self._sum_hits(state)
            self._ready = True

    def __getstate__(self) -> dict:
        keep = ("directory", "limit", "storage_options", "retries", "retry_budget", "timeout", "policy", "threads",
                "wait_s", "_fetcher")  # fmt: skip
        return {name: self.__dict__[name] for name in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._warned = set()
        self._start_process()

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop the background downloads and close this process's connections, within about CLOSE_GRACE_S.

        A download that does not stop in that time (blocked in a request to a silent store, which only its
        ``timeout`` would end) is abandoned: its temporary file is removed, its reservation and its shard's lock
        are released, and its descriptors are pointed at /dev/null, so the thread, once its request returns, writes
        nothing into the cache and leaves. Its connections are left to it, and go with it (closing them under a
        pending read would block that read for good): this process's next downloads use new ones. The cache stays
        usable: threads and connections are made again on need."""
        if self._pid != os.getpid():
            self._start_process()
            return
        self._stop.set()
        with self._cv:
            self._queue.clear()
            self._queued.clear()
            self._cv.notify_all()
        with self._room:
            self._room.notify_all()
        deadline = time.monotonic() + CLOSE_GRACE_S
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        stuck = [worker for worker in self._workers if worker.is_alive()]
        if stuck:
            with self._cv:
                jobs = list(self._jobs)
            for job in jobs:
                self._abandon(job, deadline + CLOSE_GRACE_S)
            self._fetcher = Fetcher(self.storage_options, self.timeout)
            log.debug("fastfeed shard cache: close() abandoned %d download(s) still waiting on their store",
                      len(stuck))  # fmt: skip
        else:
            self._fetcher.close()
        with self._counter_lock:
            if self._counter is not None:
                self._counter.close()
                self._counter = None
        self._start_process()

    # -- paths and locks -------------------------------------------------------------------------------------

    def _entry(self, k: int) -> Path:
        return Path(self._entry_name(k))

    def _entry_name(self, k: int) -> str:
        return f"{self._entries}{k:06d}.tar"  # a str: a hit costs about as much as making a Path

    def _lock_path(self, k: int) -> Path:
        return self.directory / "locks" / f"{k:06d}"

    def _lock(self, k: int, block: bool = True) -> int | None:
        """An fd holding shard k's flock (an open file description of its own, so it excludes this process's
        other threads too); None when ``block`` is False and another holds it."""
        return _flock(self._lock_path(k), block)

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
    def _state(self, block: bool = True):
        """The accounting, under the machine-wide state lock, written back on leaving if it changed. Yields
        None, holding nothing, when ``block`` is False and another process holds the lock."""
        fd = _flock(self.directory / _STATE_LOCK, block)
        if fd is None:
            yield None
            return
        try:
            raw, state = self._read_state()
            yield state
            text = json.dumps(state, separators=(",", ":"))
            if text != raw:
                write_atomic(self.directory / _STATE, text)
        finally:
            self._unlock(fd)

    def _read_state(self) -> tuple[str | None, dict]:
        """(the text of state.json, or None where there is none to keep; the accounting)."""
        try:
            raw = (self.directory / _STATE).read_text()
            state = json.loads(raw)
            if isinstance(state, dict) and {"entries", "reserved", "stats"} <= state.keys():
                if "tick" in state:  # written by a version that kept the LRU clock here: [size, tick] per entry
                    del state["tick"]
                    state["entries"] = {key: value[0] for key, value in state["entries"].items()}
                for name in (*COUNTERS, "peak_bytes"):
                    state["stats"].setdefault(name, 0)
                return raw, state
        except (FileNotFoundError, ValueError, TypeError, IndexError, AttributeError):
            pass
        # No (readable) accounting: adopt the entries on disk, which are whole by construction.
        entries = {}
        for name in os.listdir(self.directory / "entries"):
            head = name.split(".", 1)[0]
            if head.isdigit():
                with contextlib.suppress(FileNotFoundError):
                    entries[str(int(head))] = os.stat(self.directory / "entries" / name).st_size
        return None, {"entries": entries, "reserved": {},
                      "stats": {**dict.fromkeys(COUNTERS, 0), "peak_bytes": sum(entries.values())}}  # fmt: skip

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
                small to hold it beside the shards in use, or the cache directory failed (removed, read-only).
        """
        path, fd = self._get(k, url, size, crc, next_use, protect, want_fd=False)
        return path

    def fd(self, k: int, url: str, size: int | None, crc: int | None, next_use: NextUse | None = None,
           protect: float = 0.0) -> int:
        """As ``local()``, but a read-only descriptor of the copy (the caller closes it): reads through it stay
        whole even if the entry is evicted meanwhile (an eviction unlinks the entry, and the descriptor keeps its
        bytes)."""
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
        fetched when it is asked for; one that another process is downloading is left to that process. A failure
        is logged (a warning on the "fastfeed" logger, once per shard) and left for that later request to meet.
        """
        self._process()
        with self._cv:
            for item in items:
                k, url, size, crc = item
                if k not in self._queued:
                    self._queued.add(k)
                    self._queue.append(((k, url, size, crc), next_use, protect))
            while len(self._workers) < min(self.threads, len(self._queue) + len(self._workers)):
                worker = threading.Thread(target=self._predownloader, name="fastfeed-shard-fetch", daemon=True,
                                          args=(self._cv, self._queue, self._queued, self._jobs, self._stop))
                self._workers.append(worker)
                worker.start()
            self._cv.notify_all()

    def stats(self) -> dict:
        """Machine-wide counters since the last ``reset_stats()``: ``downloaded_bytes`` (bytes written by every
        attempt, failed ones included), ``downloads`` (shards fetched whole), ``hits`` (requests served by an entry,
        one another process downloaded included), ``evictions``; and ``used_bytes`` (entries plus downloads in
        flight now), ``peak_bytes`` (the most ``used_bytes`` has been), ``limit``."""
        self._process()
        with self._state() as state:
            self._drop_stale_reservations(state, placed_only=True)
            live = self._sum_hits(state)
            counted = {**state["stats"], "hits": state["stats"]["hits"] + live}
            return {**{c: counted[c] for c in COUNTERS}, "used_bytes": _used(state),
                    "peak_bytes": counted["peak_bytes"], "limit": self.limit}  # fmt: skip

    def reset_stats(self) -> None:
        """Zero the counters (for every process); ``peak_bytes`` restarts from the bytes held now."""
        self._process()
        with self._state() as state:
            live = self._sum_hits(state)
            # Live processes' counters are theirs to write: the recorded hits start below zero by what they hold.
            state["stats"] = {**dict.fromkeys(COUNTERS, 0), "hits": -live, "peak_bytes": _used(state)}

    # -- the work --------------------------------------------------------------------------------------------

    def _get(self, k, url, size, crc, next_use, protect, want_fd, optional=False, job=None):
        """(path, fd or None) of k's entry, downloaded if absent; None for an ``optional`` request (a
        predownload) that finds no room, or another process downloading k. A failure of the cache's own
        directory is a ShardError that names the local path, never one that reads as the store's."""
        try:
            self._process()
            hit = self._hit(k, size, want_fd, count=not optional)
            if hit is not None:
                return hit
            if job is None:
                job = _Job(k, self._stop, self._fetcher)
            with job.guard:
                if job.abandoned:
                    raise Cancelled(url)
                return self._miss(job, url, size, crc, next_use or _unknown, protect, want_fd, optional)
        except (ShardError, Cancelled):
            raise
        except OSError as e:  # the store's failures are ShardErrors by now: this one is the local directory's
            self._ready = False  # make the directories again at the next request, should they be gone
            where = e.filename or self.directory
            raise ShardError(url, f"the local cache failed at {where} ({remote.describe(e)}): was {self.directory}, "
                                  "or part of it, removed or made read-only?") from e  # fmt: skip

    def _miss(self, job, url, size, crc, next_use, protect, want_fd, optional):
        job.lock_fd = self._lock(job.k, block=not optional)  # another process downloading k holds it
        if job.lock_fd is None:
            return None
        try:
            hit = self._hit(job.k, size, want_fd, count=not optional)  # it downloaded k while this one waited
            if hit is not None:
                return hit
            self._sweep_tmp(job.k)  # whatever is there was left by a downloader that died holding this lock
            if size is None:
                size = self._size(job, url)
            if not self._reserve(job, url, size, next_use, protect, optional):
                return None
            return self._download(job, url, size, crc, want_fd)
        finally:
            job.unlock()

    def _hit(self, k: int, size: int | None, want_fd: bool, count: bool):
        """(path, fd or None) of k's entry if whole, counted as a hit; None if absent (or not as the index says:
        the miss that follows replaces it, under k's lock). Touches only the entry itself."""
        path = self._entry_name(k)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            expected = size if size is not None else self._recorded_size(k)
            if st.st_size != expected:
                os.close(fd)
                return None
            with contextlib.suppress(OSError):  # a read-only copy still serves; only its LRU clock stands still
                os.utime(fd, ns=(st.st_atime_ns, time.time_ns()))
            if count:
                self._count_hit()
        except BaseException:
            os.close(fd)
            raise
        if not want_fd:
            os.close(fd)
            fd = None
        return path, fd

    def _recorded_size(self, k: int) -> int | None:
        """The size the accounting holds for entry k, read without its lock (state.json is replaced whole, never
        written in place); None when it holds none."""
        try:
            entry = json.loads((self.directory / _STATE).read_bytes())["entries"].get(str(k))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        return entry[0] if isinstance(entry, list) else entry

    def _count_hit(self) -> None:
        with self._counter_lock:
            if self._counter is None:
                self._counter = _HitCounter(self.directory)
            self._counter.add()

    def _sum_hits(self, state: dict) -> int:
        """Fold the counters of processes that stopped counting into ``state``; returns the live ones' sum."""
        with _locked(self.directory / _HITS_LOCK):
            live = 0
            for name in os.listdir(self.directory / "hits"):
                path = self.directory / "hits" / name
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    count = _HIT_COUNT.unpack(os.pread(fd, _HIT_COUNT.size, 0).ljust(_HIT_COUNT.size, b"\0"))[0]
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        live += count
                        continue
                    state["stats"]["hits"] += count
                    os.unlink(path)
                finally:
                    os.close(fd)
            return live

    def _size(self, job, url: str) -> int:
        """The shard's size, asked of its store with the retries and backoff of every request
        (``fastfeed.io.remote.retry``)."""

        def ask() -> int:
            with job.unguarded(url):
                return job.fetcher.size(url)

        try:
            return remote.retry(ask, self.retries, what=f"the size of shard {url}", final=(Cancelled,),
                                timeout=self.timeout, wait=self._pause(job.stop, url), budget=self.retry_budget,
                                url=url)  # fmt: skip
        except (FileNotFoundError, PermissionError, remote.RemoteError) as e:
            raise ShardError.gave_up(url, e, "asking its size") from e

    @staticmethod
    def _pause(stop: threading.Event, url: str) -> Callable[[float], None]:
        """The wait between two attempts: cut short, ending the download, once the cache closes."""

        def pause(seconds: float) -> None:
            if stop.wait(seconds):
                raise Cancelled(url)

        return pause

    def _reserve(self, job, url, size, next_use, protect, optional) -> bool:
        """Room for ``size`` bytes, evicting as the policy says; waits up to ``wait_s`` for room that only
        entries in use and downloads in flight hold. False: ``optional`` and no room."""
        if self.limit is not None and size > self.limit:
            raise ShardError(url, f"the shard is {size} bytes, more than cache_bytes={self.limit}; cache_bytes "
                                  f"must be at least the largest shard (better: several)")  # fmt: skip
        started = time.monotonic()
        deadline, notice = started + self.wait_s, started + WAIT_NOTICE_S
        delay = WAIT_MIN_S
        while True:
            with self._state() as state:
                self._replace(state, job.k)
                held = self._make_room(state, job.k, size, next_use, protect, optional)
                if held is None:
                    state["reserved"][str(job.k)] = size
                    job.reserved = True
                    stats = state["stats"]
                    stats["peak_bytes"] = max(stats["peak_bytes"], _used(state))
                    return True
            if optional:
                return False
            if job.stop.is_set():
                raise Cancelled(url)
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
            room = self._room
            with room:
                freed_here = not job.stop.is_set() and room.wait(min(delay, max(deadline - now, 0.0)))
            delay = WAIT_MIN_S if freed_here else min(2 * delay, WAIT_MAX_S)

    def _replace(self, state, k: int) -> None:
        """k is about to be downloaded by the caller, who holds its lock and found no usable entry: what the
        accounting or the directory still hold of k (a dead downloader's reservation, an entry gone, or not as the
        index says) goes."""
        state["reserved"].pop(str(k), None)
        state["entries"].pop(str(k), None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._entry(k))

    def _make_room(self, state, k, size, next_use, protect, optional) -> int | None:
        """Evict until ``size`` more bytes fit; None once they do, else the bytes that may not be evicted (and
        nothing is evicted)."""
        self._drop_stale_reservations(state)
        if self.limit is None:
            return None
        need = _used(state) + size - self.limit
        if need <= 0:
            return None
        new = next_use(k) if optional else -math.inf
        candidates, kept = [], sum(state["reserved"].values())
        for key, esize in state["entries"].items():
            use = next_use(int(key))
            if use < protect or (self.policy == "farthest" and optional and use <= new):
                kept += esize
                continue
            candidates.append((-use if self.policy == "farthest" else 0.0, key, esize))
        chosen = self._victims(candidates, need)
        if chosen is None:
            return kept
        for key in chosen:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._entry(int(key)))  # a reader's open descriptor keeps its inode
            del state["entries"][key]
            state["stats"]["evictions"] += 1
        return None

    def _victims(self, candidates: list, need: int) -> list[str] | None:
        """The keys to evict from ``(rank, key, size)``: the lowest ranks first, the least recently used first
        among equal ranks; None if all of them together free less than ``need``. Only the entries of the rank
        where the choice stops are asked their last use (one stat each), for LRU all of them."""
        if sum(esize for _, _, esize in candidates) < need:
            return None
        candidates.sort(key=lambda c: c[0])
        chosen, freed = [], 0
        for _, group in itertools.groupby(candidates, key=lambda c: c[0]):
            group = list(group)
            if freed + sum(esize for _, _, esize in group) > need:
                group.sort(key=lambda c: (self._last_use(c[1]), c[1]))
            for _, key, esize in group:
                if freed >= need:
                    return chosen
                chosen.append(key)
                freed += esize
        return chosen

    def _last_use(self, key: str) -> int:
        try:
            return os.stat(self._entry(int(key))).st_mtime_ns
        except FileNotFoundError:
            return -1  # gone behind the cache's back: its accounting is the first to go

    def _drop_stale_reservations(self, state, placed_only: bool = False) -> None:
        """Reservations of downloaders that died (their shard lock is free), with their temporary files; an entry
        such a downloader renamed into place without recording it is accounted instead, and counted as the
        download it was: a reservation's shard has no entry until its downloader renames a whole, checked copy
        into place (``_replace``). ``placed_only``: only the reservations beside such an entry (the stats count
        every download; a dead downloader's room is taken back when room is needed)."""
        for key in list(state["reserved"]):
            if placed_only and not os.path.exists(self._entry(int(key))):
                continue
            fd = self._lock(int(key), block=False)
            if fd is not None:
                try:
                    del state["reserved"][key]
                    self._sweep_tmp(int(key))
                    if key not in state["entries"]:
                        with contextlib.suppress(FileNotFoundError):
                            state["entries"][key] = os.stat(self._entry(int(key))).st_size
                            state["stats"]["downloads"] += 1
                            state["stats"]["downloaded_bytes"] += state["entries"][key]
                finally:
                    self._unlock(fd)

    def _download(self, job, url: str, size: int, crc: int | None, want_fd: bool):
        """Fetch k into a temporary file, check it, rename it into place; the reservation becomes the entry
        (or is released on failure). The caller holds k's lock and its reservation. A failed, short or corrupt
        download is tried again as every request is (``fastfeed.io.remote.retry``)."""
        k = job.k

        def attempt() -> Path:
            tmp = self.directory / "tmp" / f"{k:06d}.{os.getpid()}.{next(_NAMES)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except OSError as e:  # the cache's own directory, not the store: say so, and do not retry
                raise ShardError(url, f"cannot write a temporary copy in {tmp.parent} ({remote.describe(e)})") from e
            job.tmp, job.tmp_fd = tmp, fd
            try:
                try:
                    with job.unguarded(url):
                        nbytes, got = job.fetcher.copy(url, fd, size, job.stop)
                finally:
                    job.received += os.fstat(fd).st_size
                    job.tmp_fd = None
                    os.close(fd)
                if nbytes != size:
                    raise _Damaged(f"{nbytes} bytes arrived, the index says {size}")
                if crc is not None and got != crc:
                    raise _Damaged(f"CRC-32 {got:08x}, the index says {int(crc):08x}")
            except BaseException:
                if not job.abandoned:  # an abandoned one's name may be another download's by now
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
                job.tmp = None
                raise
            return tmp

        placed = None
        try:
            try:
                tmp = remote.retry(attempt, self.retries, what=f"shard {url}", final=(Cancelled, ShardError),
                                   timeout=self.timeout, wait=self._pause(job.stop, url), budget=self.retry_budget,
                                   url=url)  # fmt: skip
            except (FileNotFoundError, PermissionError, remote.RemoteError) as e:
                raise ShardError.gave_up(url, e, "download") from e
            placed = self._settle(job, size, place=lambda: self._place(k, url, tmp, want_fd))
        except BaseException:
            if not job.abandoned:  # close() settled an abandoned one's accounts
                with contextlib.suppress(OSError):  # the first failure is the one to report
                    self._settle(job, size)
            raise
        finally:
            job.tmp = None
        return placed

    def _place(self, k: int, url: str, tmp: Path, want_fd: bool) -> tuple[str, int | None]:
        """Rename a checked download into ``entries/``: (its path, a descriptor of it when ``want_fd``). A local
        failure here is the cache directory's (removed or made read-only meanwhile), never the store's."""
        entry, reader = self._entry(k), None
        with contextlib.suppress(OSError):  # its last use starts now, on the clock every hit sets
            now = time.time_ns()
            os.utime(tmp, ns=(now, now))
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

    def _settle(self, job, size: int, place: Callable[[], tuple[str, int | None]] | None = None):
        """The download's reservation becomes its entry, put in place by ``place()`` (whose result is returned),
        or is released (``place`` None); its bytes are counted.

        The entry is renamed into place under the state lock that counts it, not before: readers use an entry the
        moment it appears, without that lock, so one placed first could be read, its epoch end and the stats be
        read before the download was counted (one short), or for good if this process exited meanwhile (a
        loader's worker leaves by os._exit, under its predownload threads). Now whoever sees the entry and then
        asks for the stats waits on this lock for the count; a process that dies between the rename and the
        write leaves its reservation beside the entry, which the next look at the stats counts
        (``_drop_stale_reservations``)."""
        placed = None
        try:
            with self._state() as state:
                if place is not None:
                    placed = place()
                state["reserved"].pop(str(job.k), None)
                stats = state["stats"]
                stats["downloaded_bytes"] += job.received
                if placed is not None:
                    state["entries"][str(job.k)] = size
                    stats["downloads"] += 1
        except BaseException:
            if placed is not None:  # in place but not recorded (the state could not be written): not an entry
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(placed[0])
                if placed[1] is not None:
                    os.close(placed[1])
            raise
        job.reserved, job.received = False, 0
        with self._room:
            self._room.notify_all()  # this process's readers waiting for room look again now
        return placed

    def _abandon(self, job, deadline: float) -> None:
        """Take back what a download that close() could not stop holds (see close()). Its thread is blocked in a
        request, outside its guard; once that returns it finds the job abandoned and only closes its descriptors."""
        if not job.guard.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.warning("fastfeed shard cache: close() could not abandon the download of shard %d in %s", job.k,
                        self.directory)  # fmt: skip
            return
        try:
            if job.done:
                return
            job.abandoned = True
            if job.tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(job.tmp)
            if job.tmp_fd is not None:
                job.received += os.fstat(job.tmp_fd).st_size
            if job.reserved:  # before the shard's lock goes: the next holder's reservation of k must not be popped
                with contextlib.suppress(OSError):
                    self._settle(job, 0)
            job.revoke()
        finally:
            job.guard.release()

    def _predownloader(self, cv, queue, queued, jobs, stop) -> None:
        """One background downloader of this generation (until close()): its queue, jobs and stop event are the
        ones it started with, so that one abandoned by close() never serves the next."""
        while True:
            with cv:
                while not queue and not stop.is_set():
                    cv.wait()
                if stop.is_set():
                    return
                item, next_use, protect = queue.popleft()
                job = _Job(item[0], stop, self._fetcher)
                jobs.add(job)
            try:
                self._get(*item, next_use, protect, want_fd=False, optional=True, job=job)
            except Cancelled:
                pass
            except Exception as e:  # noqa: BLE001 - logged here; the shard's own request meets it again
                if not job.abandoned and item[0] not in self._warned:
                    self._warned.add(item[0])
                    log.warning("fastfeed shard cache: downloading shard %s in the background failed (%s); a read "
                                "of it will try again", item[1], getattr(e, "detail", None) or e)  # fmt: skip
            finally:
                with cv:
                    queued.discard(item[0])
                    jobs.discard(job)


class _Job:
    """One request's hold on the cache beyond its entry: its shard's lock, its reservation, its temporary file.

    The thread doing the request holds ``guard`` except while it waits on its store (``unguarded``), so close()
    can take the guard and revoke a job whose thread is stuck in a request: it points the job's descriptors at
    /dev/null (the numbers stay the thread's, to close, so none is reused under it) and marks it abandoned.
    """

    def __init__(self, k: int, stop: threading.Event, fetcher: Fetcher) -> None:
        self.k, self.stop, self.fetcher = k, stop, fetcher
        self.guard = threading.Lock()
        self.abandoned = self.done = self.reserved = False
        self.lock_fd: int | None = None
        self.tmp: Path | None = None
        self.tmp_fd: int | None = None
        self.received = 0

    @contextlib.contextmanager
    def unguarded(self, url: str):
        self.guard.release()
        try:
            yield
        finally:
            self.guard.acquire()
            if self.abandoned:
                raise Cancelled(url)

    def unlock(self) -> None:
        fd, self.lock_fd = self.lock_fd, None
        self.done = True
        if fd is not None:
            if not self.abandoned:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def revoke(self) -> None:
        """(Under ``guard``.) Release the shard's lock and detach the descriptors from the cache's files."""
        if self.lock_fd is not None:
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            for fd in (self.lock_fd, self.tmp_fd):
                if fd is not None:
                    os.dup2(null, fd, inheritable=False)
        finally:
            os.close(null)


class _HitCounter:
    """This process's hits, machine-wide readable without a lock: a file in ``hits/`` mapped into its memory, so
    a hit adds one with no system call. The file stays flocked while this process counts into it; a file whose
    lock is free (closed, or its process gone) is folded into ``state.json`` by whoever next reads the stats. The
    one descriptor kept is the mapping's own, which holds the lock."""

    def __init__(self, directory: Path) -> None:
        self.pid = os.getpid()
        self.count = 0
        path = directory / "hits" / f"{self.pid}.{os.urandom(4).hex()}"
        with _locked(directory / _HITS_LOCK):  # no reader may fold the file between its creation and its lock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.ftruncate(fd, _HIT_COUNT.size)
                self.map = mmap.mmap(fd, _HIT_COUNT.size)  # holds a duplicate of fd, and so the lock
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise
            os.close(fd)

    def add(self) -> None:
        self.count += 1
        _HIT_COUNT.pack_into(self.map, 0, self.count)

    def close(self) -> None:
        """Stop counting into the file: the count stays there, to be folded, and the lock goes with the mapping's
        descriptor once no forked child holds a copy of it either."""
        self.map.close()


class _Damaged(ValueError):
    """A download arrived short or with the wrong checksum."""


def _flock(path: Path, block: bool) -> int | None:
    """An fd of ``path`` (made if absent) holding its exclusive flock; None when ``block`` is False and another
    holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _locked(path: Path):
    fd = _flock(path, True)
    try:
        yield
    finally:
        ShardCache._unlock(fd)


def _unknown(k: int) -> float:
    return 0.0


def _used(state: dict) -> int:
    return sum(state["entries"].values()) + sum(state["reserved"].values())
