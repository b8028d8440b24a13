"""A local cache of source files that admits until full and never evicts.

When the dataset is larger than the cache, an LRU cache (the page cache's policy) thrashes: every epoch reads
everything again in the same order, so each entry is evicted just before it is needed. Keeping the first
``limit`` bytes admitted and serving them from then on (CoorDL's MinIO policy) makes that share of every later
epoch a local read.

Each entry is one file, written to a temporary name and renamed into place, so readers never see half an entry
and concurrent writers (workers, ranks) of the same source simply replace each other's identical copy. An entry
starts with a header line naming its source, its size, the source's version (size and modification time, or
ETag) and when that version was last checked; an entry whose version no longer matches is refetched, and one
whose body is not the size its header says is ignored. Checking a local source's version is a ``stat``, done on
every read; checking a remote one is a request, as slow as the read it saves, so a remote entry is trusted for
``max_age`` seconds after it was fetched or last checked (as an HTTP cache trusts ``max-age``). The bytes
admitted are counted in a shared file under ``flock``, so all processes together stay within the limit.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from .._atomic import write_atomic

MAGIC = b"FFC1 "
_USAGE = ".usage"


class Cache:
    """``directory`` on local disk or tmpfs (made 0700 if missing); ``limit``: bytes to admit, None: no limit."""

    def __init__(self, directory, limit: int | None) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"cache_bytes must be >= 0 (bytes to admit), got {limit}")
        self.directory = Path(directory)
        self.limit = limit
        self._full = False  # this process saw the limit reached: stop trying to admit

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_full": False}

    def _path(self, source: str) -> Path:
        return self.directory / hashlib.sha256(source.encode()).hexdigest()[:40]

    def get(self, source: str, version=None, max_age: float = 0.0) -> bytes | None:
        """The cached bytes of ``source`` at ``version``, or None (absent, stale, or damaged).

        ``version`` None: the entry's own version is taken if it was checked less than ``max_age`` seconds ago.
        """
        try:
            with open(self._path(source), "rb") as f:
                header = f.readline()
                body = f.read()
        except FileNotFoundError:
            return None
        if not header.startswith(MAGIC):
            return None
        try:
            meta = json.loads(header[len(MAGIC):])
        except ValueError:
            return None
        if meta.get("source") != source or meta.get("bytes") != len(body):
            return None
        if version is None:
            fresh = time.time() - meta.get("checked", 0) < max_age
            return body if fresh else None
        return body if meta.get("version") == version else None

    def put(self, source: str, version, data: bytes, admit: bool = True) -> bool:
        """Admit ``data`` if the limit allows; returns whether it was written. ``admit=False``: rewrite an entry
        already admitted (its version was just checked), which counts nothing."""
        if admit and (self._full or not self._admit(len(data))):
            return False
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        meta = {"source": source, "version": version, "bytes": len(data), "checked": time.time()}
        write_atomic(self._path(source), MAGIC, json.dumps(meta), "\n", data)
        return True

    def _admit(self, nbytes: int) -> bool:
        if self.limit is None:
            return True
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.directory / _USAGE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            used = int(os.pread(fd, 32, 0).strip() or 0)
            if used + nbytes > self.limit:
                self._full = True
                return False
            text = str(used + nbytes).encode().ljust(32)
            os.pwrite(fd, text, 0)
            return True
        finally:
            os.close(fd)  # releases the lock

    def used(self) -> int:
        """Bytes admitted so far (by every process)."""
        try:
            return int((self.directory / _USAGE).read_bytes().strip() or 0)
        except FileNotFoundError:
            return 0
