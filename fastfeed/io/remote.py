"""Remote files (``s3://``, ``gs://``, ``http(s)://`` ...) through fsspec, the ``[remote]`` extra.

One filesystem object per protocol and per process: a forked worker must not reuse its parent's event loop or
connection pool, so instances are made in the process that uses them and never taken from fsspec's shared cache.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future

HINT = "pip install 'fastfeed[remote]' (fsspec, plus s3fs or gcsfs for the clouds)"
_VERSION_KEYS = ("ETag", "etag", "mtime", "LastModified", "last_modified", "Last-Modified", "updated", "md5_hash")


def is_url(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


def protocol(url: str) -> str:
    return url.split("://", 1)[0]


class Remote:
    """fsspec access with a timeout on every request, so a server that never answers gives an error, not a hang."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._pid = None
        self._fs: dict[str, object] = {}

    def __getstate__(self) -> dict:
        return {"timeout": self.timeout, "_pid": None, "_fs": {}}

    def fs(self, url: str):
        if self._pid != os.getpid():
            self._pid, self._fs = os.getpid(), {}
        proto = protocol(url)
        fs = self._fs.get(proto)
        if fs is None:
            try:
                import fsspec
            except ImportError:
                raise ImportError(f"fastfeed.io.Files: reading {url} needs fsspec: {HINT}") from None
            kwargs = {}
            if proto in ("http", "https"):
                import aiohttp

                kwargs["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=self.timeout)}
            fs = self._fs[proto] = fsspec.filesystem(proto, skip_instance_cache=True, **kwargs)
        return fs

    def read(self, url: str) -> bytes:
        return self.fs(url).cat_file(url)

    def version(self, url: str) -> list:
        """The source's size and whatever change marker its store gives (ETag, modification time)."""
        try:
            return _version(self.fs(url).info(url))
        except FileNotFoundError as e:
            raise _transient(e, url) from e

    def submit(self, url: str, load) -> Future | None:
        """Run coroutine ``load(fs, url)`` on the filesystem's own event loop, when it has one (HTTP, S3, GCS):
        hundreds of reads in flight cost no thread each. None for a filesystem without async support."""
        fs = self.fs(url)
        if not getattr(fs, "async_impl", False):
            return None
        return asyncio.run_coroutine_threadsafe(load(fs, url), fs.loop)

    @staticmethod
    async def version_async(fs, url: str) -> list:
        try:
            return _version(await fs._info(url))
        except FileNotFoundError as e:
            raise _transient(e, url) from e

    def glob(self, directory: str, pattern: str) -> list[str]:
        fs = self.fs(directory)
        found = fs.glob(directory.rstrip("/") + "/" + pattern)
        return sorted(fs.unstrip_protocol(p) if not is_url(p) else p for p in found)


def _version(info: dict) -> list:
    marker = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), None)
    return [info.get("size"), marker]


def _transient(error: FileNotFoundError, url: str) -> Exception:
    """fsspec's ``info()`` reports any failed request as FileNotFoundError; only a 404 means a missing file,
    anything else (a 500, a reset) is worth retrying."""
    cause = error.__cause__
    status = getattr(cause, "status", 404)
    return error if cause is None or status == 404 else OSError(f"{url}: {cause!r}")
