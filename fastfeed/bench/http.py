"""A real HTTP file server on 127.0.0.1, with injected latency and faults.

fastfeed's storage tests and ``benchmarks/io.py`` need remote-storage behaviour without a network: files that
come back over real sockets (fsspec's HTTP filesystem as the client), each request delayed like an object store
(``latency`` ± ``jitter``), and per-path faults (5xx, truncated bodies, stalls, other statuses) to exercise
retries and timeouts. The server must cost little CPU of its own, so that a benchmark measures the client.

Design: aiohttp.web on its own event loop in one background thread. Against ``http.server``'s
ThreadingHTTPServer (a thread per connection, sendfile, keep-alive) it served ~2,500-2,950 vs ~1,650
requests/s at ~280 vs ~400-540 us of its CPU per request (~100 KB files, 32 concurrent fsspec clients in
2 processes, 2 cores), and one thread leaves the GIL to the process's other threads. Each request sleeps in
its own task, so delays overlap. ``stop()`` closes the listener and every connection, cancels stalled
requests and joins the thread.
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import posixpath
import random
import re
import stat
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

try:
    from aiohttp import web
except ImportError as _exc:  # make_files and parse_range need no aiohttp; the server does (the [remote] extra)
    web, _NO_AIOHTTP = None, _exc

LISTEN_BACKLOG = 1024  # many clients connect at once; a short backlog drops SYNs (1 s retransmits)
SHUTDOWN_GRACE_S = 0.05  # stop(): how long in-flight requests may finish before they are cancelled
RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)$")
T = TypeVar("T")


def make_files(root: str | Path, n: int, size: int, seed: int = 0) -> list[str]:
    """Write n files named f00000.bin, ... of about `size` bytes (±10%), deterministic content; relative paths."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = []
    for i in range(n):
        name = f"f{i:05d}.bin"
        (root / name).write_bytes(rng.randbytes(round(size * rng.uniform(0.9, 1.1))))
        names.append(name)
    return names


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a single `bytes=a-b`, `bytes=a-` or `bytes=-n`; None without a usable header.

    Raises ValueError when the range is well formed but unsatisfiable.
    """
    match = RANGE_RE.match(header.strip()) if header else None
    if not match or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if not first:
        return max(0, size - int(last)), size
    start, end = int(first), min(size, int(last) + 1) if last else size
    if start >= size or end <= start:
        raise ValueError(header)
    return start, end


def _pread_all(fd: int, start: int, count: int) -> bytes:
    """count bytes of fd from start (os.pread may return fewer per call)."""
    chunks = []
    while count > 0:
        chunk = os.pread(fd, count, start)
        if not chunk:
            break
        chunks.append(chunk)
        start += len(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def _file_headers(st: os.stat_result) -> dict[str, str]:
    return {
        "Content-Type": "application/octet-stream",
        "Accept-Ranges": "bytes",
        "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
        "ETag": f'"{st.st_size:x}-{st.st_mtime_ns:x}"',
    }


class FileServer:
    """Serves the files under `root` at ``url``; each request waits ``latency + uniform(-jitter, jitter)`` s.

    ``faults[relpath] = spec`` (settable while running) injects, for every GET/HEAD of that path:
    ``{"fail": k}`` the next k answer 500 (k counts down in place); ``{"truncate": True}`` a GET gets the
    full Content-Length but half the body, then the connection closes; ``{"stall": True}`` no answer until
    stop(); ``{"status": s}`` answer status s. ``requests`` counts GET and HEAD requests received, faulted
    ones included. Symlinks under root are followed; request paths that climb out of root get 404.
    """

    def __init__(self, root: str | Path, *, latency: float = 0.0, jitter: float = 0.0, seed: int = 0) -> None:
        if web is None:
            raise ImportError("fastfeed's HTTP file server needs aiohttp, which is not installed: "
                              "pip install 'fastfeed[remote]'") from _NO_AIOHTTP
        self.root = os.path.realpath(root)
        self.latency = latency
        self.jitter = jitter
        # Only the server's thread mutates a spec (a fail count); callers only assign whole specs.
        self.faults: dict[str, dict[str, Any]] = {}
        self.url = ""
        self._rng = random.Random(seed)
        self._requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def start(self) -> FileServer:
        """Bind 127.0.0.1 on a free port and serve from a background thread."""
        if self._loop is not None:
            raise RuntimeError("FileServer already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fileserver", daemon=True)
        self._thread.start()
        try:
            port = self._call(self._open())
        except BaseException:
            self._close_loop()
            raise
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        """Close the listener and every connection, cancel stalled requests, join the thread (idempotent)."""
        if self._loop is None:
            return
        try:
            self._call(self._close())
        finally:
            self._close_loop()

    def __enter__(self) -> FileServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def url_of(self, relpath: str | Path) -> str:
        return f"{self.url}/{quote(Path(relpath).as_posix().lstrip('/'))}"

    @property
    def requests(self) -> int:
        return self._requests  # written by the server's thread only; an int read is atomic

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run coro on the server's loop and wait for its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _close_loop(self) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._loop = self._thread = None

    async def _open(self) -> int:
        app = web.Application()
        app.router.add_get("/{path:.*}", self._handle)  # HEAD included
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0, backlog=LISTEN_BACKLOG).start()
        return self._runner.addresses[0][1]

    async def _close(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
        self._runner = None
        # Requests whose client already left (timed out during a stall or a delay) belong to no connection
        # that cleanup() closed: cancel them, so that no task outlives the loop.
        orphans = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in orphans:
            task.cancel()
        await asyncio.gather(*orphans, return_exceptions=True)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self._requests += 1
        relpath = request.path.lstrip("/")
        delay = self._next_delay()
        if delay:
            await asyncio.sleep(delay)
        fault = self._take_fault(relpath)
        if fault.get("stall"):
            await asyncio.get_running_loop().create_future()  # until stop() cancels this request
        status = 500 if fault.get("fail") else fault.get("status")
        if status:
            return web.Response(status=status)
        return await self._serve_file(request, relpath, truncate=bool(fault.get("truncate")))

    def _next_delay(self) -> float:
        jitter = self._rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0
        return max(0.0, self.latency + jitter)

    def _take_fault(self, relpath: str) -> dict[str, Any]:
        """The fault spec for relpath (empty if none), consuming one of a `fail` count."""
        spec = self.faults.get(relpath)
        if not spec:
            return {}
        if spec.get("fail"):
            spec["fail"] -= 1
            return {"fail": True}
        return spec

    def _open_file(self, relpath: str) -> int | None:
        """A descriptor of the regular file relpath names under root, or None (missing, outside root, not a file)."""
        normal = posixpath.normpath(relpath)
        if normal == ".." or normal.startswith(("../", "/")):
            return None
        try:
            fd = os.open(os.path.join(self.root, normal), os.O_RDONLY)
        except (OSError, ValueError):  # ValueError: an embedded NUL
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    async def _serve_file(self, request: web.Request, relpath: str, truncate: bool) -> web.StreamResponse:
        fd = self._open_file(relpath)
        if fd is None:
            return web.Response(status=404)
        try:
            st = os.fstat(fd)
            headers = _file_headers(st)
            try:
                span = parse_range(request.headers.get("Range"), st.st_size)
            except ValueError:
                return web.Response(status=416, headers={"Content-Range": f"bytes */{st.st_size}"})
            start, end = span or (0, st.st_size)
            if span:
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{st.st_size}"
            headers["Content-Length"] = str(end - start)
            status = 206 if span else 200
            if request.method == "HEAD":
                return web.Response(status=status, headers=headers)
            if truncate:
                return await self._send_truncated(request, status, headers, _pread_all(fd, start, (end - start) // 2))
            return web.Response(status=status, headers=headers, body=_pread_all(fd, start, end - start))
        finally:
            os.close(fd)

    @staticmethod
    async def _send_truncated(
        request: web.Request, status: int, headers: dict[str, str], half: bytes
    ) -> web.StreamResponse:
        """Announce the full Content-Length, send only `half`, then close the connection."""
        response = web.StreamResponse(status=status, headers=headers)
        response.force_close()
        await response.prepare(request)
        await response.write(half)
        return response
