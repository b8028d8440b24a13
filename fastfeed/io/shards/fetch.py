"""Copying one whole shard from where it lives (a local path or any fsspec URL) into an open local file.

A shard is large (often hundreds of MB), so it streams in chunks, never whole in memory, and its CRC-32 is computed
as the bytes pass. A request that stops sending ends by a *read* timeout (no byte for ``timeout`` s), never by a
total one, which would cut a large download that is merely slow.

Filesystems, their timeouts and their closing are ``fastfeed.io.remote``'s (``Filesystems``), as for every remote
read: each process makes its own, since a forked worker must not use its parent's event loop or connection pool.
A ``file://`` URL is the local file it names (``remote.local_path``).
"""

from __future__ import annotations

import os
import threading
import zlib

from .. import remote
from ..remote import is_url, local_path, protocol

CHUNK = 1 << 20  # bytes per read: large enough that a chunk's cost is the network's, not Python's
# Bytes per request from an object store read by ranges (S3, GCS): each read of CHUNK would otherwise be a request
# of its own, a 256 MB shard 256 of them, which a store shedding load counts against its rate. One range of this
# many bytes is held in memory per download.
RANGE_BYTES = 8 << 20


class Cancelled(Exception):
    """The cache closed while this download ran."""


class Fetcher:
    """Streams shards to local files; ``storage_options`` go to fsspec (s3fs: ``client_kwargs={"endpoint_url": ...}``);
    ``timeout``: seconds a connection may stay silent before the request fails."""

    def __init__(self, storage_options: dict | None, timeout: float) -> None:
        self.storage_options = dict(storage_options or {})
        self.timeout = timeout
        self._filesystems = remote.Filesystems(self.storage_options, timeout, who="fastfeed.io.Shards")

    def __getstate__(self) -> dict:
        return {"storage_options": self.storage_options, "timeout": self.timeout}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["storage_options"], state["timeout"])

    def fs(self, url: str):
        """This process's filesystem for ``url``'s protocol."""
        return self._filesystems.get(url)

    def size(self, url: str) -> int:
        """The shard's size in bytes, asked of its store (FileNotFoundError when it is missing)."""
        if not is_url(url):
            return os.stat(local_path(url)).st_size
        return int(self.fs(url).info(url)["size"])

    def copy(self, url: str, fd: int, size: int | None, stop: threading.Event | None = None) -> tuple[int, int]:
        """Write the shard's bytes to ``fd`` from its current position; returns (bytes, CRC-32).

        Raises FileNotFoundError for a missing shard, ``Cancelled`` once ``stop`` is set, and whatever the store
        raises for a failed request (a 5xx, a reset, a read timeout, a body shorter than announced).
        """
        nbytes, crc = 0, 0
        with self._open(url, size) as f:
            while True:
                if stop is not None and stop.is_set():
                    raise Cancelled(url)
                chunk = f.read(CHUNK)
                if not chunk:
                    return nbytes, crc
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
                nbytes += len(chunk)
                crc = zlib.crc32(chunk, crc)

    def _open(self, url: str, size: int | None):
        if not is_url(url):
            return open(local_path(url), "rb", buffering=0)
        fs = self.fs(url)
        if protocol(url) in ("http", "https"):
            # block_size=0: one streamed GET (not a ranged request per block); a known size spares the HEAD.
            return fs.open(url, "rb", block_size=0, size=size)
        from fsspec.spec import AbstractBufferedFile  # the [remote] extra: here only for a URL

        # Read ahead by RANGE_BYTES: one ranged request per range, the reads of CHUNK served from it.
        f = fs.open(url, "rb", block_size=RANGE_BYTES, cache_type="readahead", **({"size": size} if size else {}))
        if size and isinstance(f, AbstractBufferedFile):
            # The size the index gives: s3fs would otherwise ask the object's details (a HEAD) at the first read,
            # for an ETag to pin the ranges to; the CRC-32 checks the bytes that arrive instead.
            f.details = {"name": f.path, "size": size, "type": "file"}
        return f

    def close(self) -> None:
        """Close this process's connection pools (the filesystems are made anew on next use)."""
        self._filesystems.close()
