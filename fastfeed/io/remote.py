"""Remote files (``s3://``, ``gs://``, ``http(s)://`` ...) through fsspec, the ``[remote]`` extra: the one fetch path.

Every remote read of fastfeed (``Files``' reads, version checks and listings; ``Shards``' listing, index, scan,
size look-ups and downloads) uses this module for four things, so that they cannot drift apart:

- ``is_url`` says what is remote. A ``file://`` URL is not: it names a local file, read as the path it names
  (``local_path``), with no cache, timeout or retry of its own. Readers keep its spelling in what they return.
- ``filesystem`` (or ``Filesystems``, one per protocol and per process) makes every filesystem, with connect and
  read timeouts (``client_options``): a request that sends nothing for ``timeout`` s fails, and a large body that
  is slow but moving is read to its end, as no total timeout applies.
- ``retry`` sorts failures (``classify``) and waits between attempts (``backoff``).
- ``close`` ends a filesystem's connections, through fsspec's and the clients' public API.

Filesystems are made in the process that uses them and never taken from fsspec's shared cache: a forked worker
must not reuse its parent's event loop or connection pool.

Every read of a dataset's bytes or metadata (``Files``' reads, version checks and listing; ``Shards``' listing,
index, scan, size look-ups and downloads) goes through ``retry``: one rule for what is worth another attempt and
one backoff. Stores shed load with 503 (S3's SlowDown) exactly when a thousand ranks start at once, so a transient
failure (a 5xx, 408, 429, a reset or refused connection, a timeout) is tried again after ``backoff``; a permanent
one (404 or 410: missing, 401 or 403: denied, another 4xx) raises at once, since every attempt would get the same
answer.
"""

from __future__ import annotations

import asyncio
import errno
import http
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Awaitable, Callable, TypeVar

HINT = "pip install 'fastfeed[remote]' (fsspec, plus s3fs or gcsfs for the clouds)"
_VERSION_KEYS = ("ETag", "etag", "mtime", "LastModified", "last_modified", "Last-Modified", "updated", "md5_hash")
DEFAULT_TIMEOUT_S = 60.0  # connect and read timeouts of a filesystem made without one (index writes, listings)
CLOSE_TIMEOUT_S = 5.0  # closing a client waits on the event loop at most this long
BACKOFF_S = 0.1  # the wait before the first retry; it doubles with each further one
MAX_BACKOFF_S = 2.0  # ... up to this: a store shedding load recovers in seconds, and a rank must not idle longer
# Errors of the program or the installation, not of the store: another attempt cannot change them.
_NOT_THE_STORE = (TypeError, AttributeError, NotImplementedError, ImportError, IsADirectoryError, NotADirectoryError)
# Statuses that mean "the object is not there" / "you may not read it"; other 4xx but these transient ones are
# permanent too (a bad request stays bad).
_MISSING, _DENIED, _TRANSIENT_4XX = {404, 410}, {401, 403}, {408, 425, 429}

log = logging.getLogger("fastfeed")
T = TypeVar("T")


def is_url(source: str) -> bool:
    """Whether ``source`` is remote: a URL of any protocol but ``file``. ``file:///data/x.tar`` is the local file
    ``/data/x.tar`` (fsspec's file protocol means the same), so every reader takes it exactly as that path."""
    return "://" in source and not source.startswith("file://")


def local_path(source: str) -> str:
    """The local path a ``file://`` URL names (fsspec's rule: the part after ``file://``); any other source as it
    is."""
    return source[len("file://") :] if source.startswith("file://") else source


def protocol(url: str) -> str:
    return url.split("://", 1)[0]


def client_options(proto: str, storage_options: dict | None, timeout: float | None) -> dict:
    """fsspec options for ``proto`` with ``timeout`` (None: ``DEFAULT_TIMEOUT_S``) as the connect and read
    timeouts (a request that sends nothing for that long fails), never as a total one, which would cut a large
    body that is slow but moving (aiohttp's own default is a total of 5 minutes). The user's own
    ``storage_options`` win."""
    options = dict(storage_options or {})
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S
    if proto in ("http", "https"):
        import aiohttp

        client = dict(options.get("client_kwargs") or {})
        client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout))
        options["client_kwargs"] = client
    elif proto in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        options["config_kwargs"] = config
    return options


# -- retries ------------------------------------------------------------------------------------------------------


class RemoteError(OSError):
    """A request that failed for good: every attempt failed transiently, or the store refused it in a way no
    attempt would change (``permanent``). ``attempts`` were made; ``reason`` is the last failure in words (the
    failure itself is the ``__cause__``). Callers put it in context: "shard index URL: reading it failed 4
    time(s); last: connection refused (nothing listens at 127.0.0.1:8799?)"."""

    def __init__(self, message: str, *, attempts: int = 1, reason: str = "", permanent: bool = False) -> None:
        super().__init__(message)
        self.attempts, self.reason, self.permanent = attempts, reason, permanent

    def __str__(self) -> str:
        return self.args[0]

    def within(self, context: str) -> RemoteError:
        """The same failure, its message led by ``context`` (what was being done: "shard index URL: reading it")."""
        return RemoteError(f"{context} {self}", attempts=self.attempts, reason=self.reason, permanent=self.permanent)


def _gave_up(attempts: int, last: BaseException, timeout: float | None, permanent: bool = False) -> RemoteError:
    reason = describe(last, timeout)
    if permanent:
        text = f"was refused ({reason}); not retried, as every attempt would get the same answer"
    else:
        text = f"failed {attempts} time(s); last: {reason}"
    return RemoteError(text, attempts=attempts, reason=reason, permanent=permanent)


def backoff(retry_number: int) -> float:
    """Seconds to wait before retry ``retry_number`` (0: the first)."""
    return min(BACKOFF_S * 2**retry_number, MAX_BACKOFF_S)


def retry(call: Callable[[], T], retries: int, *, what: str = "a request", final: tuple = (),
          timeout: float | None = None, wait: Callable[[float], object] = time.sleep) -> T:  # fmt: skip
    """``call()``, called again after each transient failure, up to ``retries`` more times, waiting ``backoff``.

    Args:
        what: the object asked for, for the debug log line of each retry.
        final: exception types raised as they are, at once (the caller's own verdicts: a damaged shard).
        timeout: the request timeout, to say "no data for N s" when that is what ended the last attempt.
        wait: sleeps between attempts (a cache passes its stop event's ``wait``, so that closing cuts it short).

    Raises:
        FileNotFoundError: the object is missing (404, 410, or a local path), at once.
        PermissionError: access is denied (401, 403), at once.
        RemoteError: every attempt failed, or the store refused the request for good (another 4xx).
        ``final``'s types, and errors of the program rather than the store (TypeError...), as they are.
    """
    for attempt in itertools.count():
        try:
            return call()
        except final:
            raise
        except Exception as e:  # noqa: BLE001 - sorted into retry or give up by _after
            delay = _after(e, attempt, retries, what, timeout)
        wait(delay)


async def retry_async(call: Callable[[], Awaitable[T]], retries: int, *, what: str = "a request",
                      final: tuple = (), timeout: float | None = None) -> T:  # fmt: skip
    """``retry`` for a coroutine on an event loop (the same verdicts and backoff; the waits are awaited)."""
    for attempt in itertools.count():
        try:
            return await call()
        except final:
            raise
        except Exception as e:  # noqa: BLE001 - sorted into retry or give up by _after
            delay = _after(e, attempt, retries, what, timeout)
        await asyncio.sleep(delay)


def _after(error: Exception, attempt: int, retries: int, what: str, timeout: float | None) -> float:
    """The wait before the next attempt after ``error``; or raises what ``_verdict`` says (the one rule of both
    ``retry`` and ``retry_async``)."""
    verdict = _verdict(error, attempt, retries, timeout)
    if verdict is error:
        raise error
    if verdict is not None:
        raise verdict from error
    delay = backoff(attempt)
    log.debug("fastfeed: %s: %s; attempt %d of %d in %.2f s", what, describe(error, timeout), attempt + 2,
              retries + 1, delay)  # fmt: skip
    return delay


def _verdict(error: Exception, attempt: int, retries: int, timeout: float | None) -> Exception | None:
    """None: worth another attempt (one is left); else what to raise (``error`` itself: raise it as it is)."""
    if isinstance(error, _NOT_THE_STORE):
        return error
    kind = classify(error)
    if kind == "missing":
        return error if isinstance(error, FileNotFoundError) else FileNotFoundError(describe(error, timeout))
    if kind == "denied":
        return error if isinstance(error, PermissionError) else PermissionError(describe(error, timeout))
    if kind == "rejected":
        return _gave_up(attempt + 1, error, timeout, permanent=True)
    return _gave_up(attempt + 1, error, timeout) if attempt >= retries else None


def classify(error: BaseException) -> str:
    """``"missing"``, ``"denied"``, ``"rejected"`` (another 4xx) or ``"transient"``.

    fsspec's HTTP ``info()`` (so every ``open``) reports any failed request as FileNotFoundError, with the real
    failure as its cause: a 503, a reset, a refused connection. So the cause decides, and only a 404 or 410 (or a
    FileNotFoundError with no other cause: a local path, a store client's own 404) means missing.
    """
    for e in _chain(error):
        status = _status(e)
        if status is not None:
            if status in _MISSING:
                return "missing"
            if status in _DENIED:
                return "denied"
            if 400 <= status < 500 and status not in _TRANSIENT_4XX:
                return "rejected"
            return "transient"
        if isinstance(e, PermissionError):
            return "denied"
        if isinstance(e, FileNotFoundError) and e.__cause__ is None:
            return "missing"
    return "transient"


def describe(error: BaseException, timeout: float | None = None) -> str:
    """The failure in words a user can act on: the refused connection and where, the HTTP status, the timeout;
    else the error's type and text (of the cause, when fsspec wrapped it in a FileNotFoundError)."""
    chain = list(_chain(error))
    for e in chain:
        host, port = getattr(e, "host", None), getattr(e, "port", None)
        if _refused(e):
            where = f" (nothing listens at {host}:{port}?)" if host else ""
            return f"connection refused{where}"
        if host and isinstance(getattr(e, "os_error", None), OSError):  # aiohttp's ClientConnectorError
            return f"cannot connect to {host}:{port} ({e.os_error})"
    for e in chain:
        status = _status(e)
        if status is not None:
            return f"HTTP {status} {_phrase(e, status)}".rstrip()
    for e in chain:
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):  # distinct types before Python 3.11
            if timeout is not None:
                return f"no data for {timeout:g} s (read timeout, {type(e).__name__})"
            return f"timed out ({type(e).__name__})"
    # fsspec's FileNotFoundError(url) says only the URL: its cause says what happened.
    shown = next((e for e in chain if not (isinstance(e, FileNotFoundError) and e.__cause__ is not None)), error)
    text = str(shown)
    return f"{type(shown).__name__}: {text}" if text else type(shown).__name__


def _chain(error: BaseException | None):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__


def _status(error: BaseException) -> int | None:
    """The HTTP status a store client's error carries: aiohttp's ``status``, botocore's response metadata,
    gcsfs's ``HttpError.code``."""
    status = getattr(error, "status", None)
    if status is None:
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        elif response is not None:
            status = getattr(response, "status_code", None)
    if status is None and type(error).__name__ == "HttpError":
        status = getattr(error, "code", None)
    return status if isinstance(status, int) and 100 <= status < 600 else None


def _phrase(error: BaseException, status: int) -> str:
    """The store's words for a status: aiohttp's reason ("Service Unavailable"), botocore's error code and
    message ("SlowDown: Please reduce your request rate."), else the standard phrase."""
    message = getattr(error, "message", None)
    if isinstance(message, str) and message:
        return message
    response = getattr(error, "response", None)
    if isinstance(response, dict) and isinstance(response.get("Error"), dict):
        words = ": ".join(str(response["Error"][k]) for k in ("Code", "Message") if response["Error"].get(k))
        if words:
            return words
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""


def _refused(error: BaseException) -> bool:
    cause = getattr(error, "os_error", None)  # aiohttp's ClientConnectorError keeps the socket's error there
    return any(isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED)
               for e in (error, cause))  # fmt: skip


# -- filesystems: made and closed in one place --------------------------------------------------------------------

# Every filesystem made here and still alive, by id (fsspec filesystems of equal options compare equal, so a set
# would keep one of them).
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# In a forked child: its parent's filesystems, kept alive for the child's life (see _keep_inherited).
_INHERITED: list = []


def _keep_inherited() -> None:
    """A forked child keeps every filesystem its parent made. fsspec closes an HTTP or S3 filesystem's client in a
    finalizer when the object is collected; collected in the child (a Fetcher dropping its parent's filesystems,
    a reference cycle freed late), that finalizer would wait on the parent's event loop, which no thread runs in
    the child (a second per filesystem), then close the parent's connections from the child's copy of its loop.
    Never collected there, it never runs there; a loader's worker leaves through ``os._exit``, skipping the
    finalizers left at exit."""
    _INHERITED.extend(_LIVE.values())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_inherited)


def filesystem(url: str, storage_options: dict | None = None, timeout: float | None = None, *,
               who: str = "fastfeed") -> tuple:  # fmt: skip
    """``(fsspec filesystem, path in it)`` for ``url``, a new instance (never fsspec's shared one) with the
    timeouts of ``client_options`` (``timeout`` None: ``DEFAULT_TIMEOUT_S``). ``who`` leads the error raised
    when fsspec is not installed. Close it with ``close`` when done."""
    try:
        import fsspec.core
    except ImportError:
        raise ImportError(f"{who}: reading {url} needs fsspec: {HINT}") from None
    options = client_options(protocol(url), storage_options, timeout)
    fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    _LIVE[id(fs)] = fs
    return fs, path


def close(fs) -> None:
    """Close ``fs``'s connections now, in this process; ``fs`` is not to be used after. Never raises: it runs in
    ``finally`` blocks, after the error that matters.

    Public API only: an async filesystem's ``set_session()`` (fsspec's HTTP and s3fs alike) returns the client it
    uses, an aiohttp ``ClientSession`` or an aiobotocore client, whose ``close()`` ends its connection pool; both
    run on the filesystem's own event loop. A filesystem another process made (a forked child's copy of its
    parent's) raises RuntimeError on ``fs.loop``: its connections are its maker's to close.
    """
    if not getattr(fs, "async_impl", False) or not hasattr(fs, "set_session"):
        return  # local, memory...: nothing pooled
    if getattr(fs, "session", True) is None:
        return  # s3fs before its first request: no client yet, and set_session() would look for credentials
    if sys.is_finalizing():
        return  # the event loop's thread may be gone: fsspec's own finalizer closes the sockets
    try:
        from fsspec.asyn import sync

        loop = fs.loop
        client = sync(loop, fs.set_session, timeout=CLOSE_TIMEOUT_S)
        sync(loop, client.close, timeout=CLOSE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - a filesystem that cannot be closed here is left to its finalizer
        log.debug("fastfeed: closing %s: %s", type(fs).__name__, describe(e))


class Filesystems:
    """This process's filesystems, one per protocol, made by ``filesystem`` on first use and closed together by
    ``close``. A forked child makes its own (its parent's event loop and connections are not its to use); pickled,
    only the options travel."""

    def __init__(self, storage_options: dict | None = None, timeout: float | None = None, *,
                 who: str = "fastfeed") -> None:  # fmt: skip
        self.storage_options = dict(storage_options or {})
        self.timeout = timeout
        self.who = who
        self._pid = None
        self._made: dict[str, object] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"storage_options": self.storage_options, "timeout": self.timeout, "who": self.who}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["storage_options"], state["timeout"], who=state["who"])

    def get(self, url: str):
        """This process's filesystem for ``url``'s protocol."""
        if self._pid != os.getpid():  # a forked child: its parent's filesystems (and lock) are not its own
            self._pid, self._made, self._lock = os.getpid(), {}, threading.Lock()
        proto = protocol(url)
        with self._lock:
            fs = self._made.get(proto)
            if fs is None:
                fs = self._made[proto] = filesystem(url, self.storage_options, self.timeout, who=self.who)[0]
        return fs

    def close(self) -> None:
        """Close this process's connections; the filesystems are made anew on next use."""
        if self._pid != os.getpid():
            return
        with self._lock:
            made, self._made = self._made, {}
        for fs in made.values():
            close(fs)


# -- Files' filesystems -------------------------------------------------------------------------------------------


class Remote:
    """fsspec access for ``Files``: connect and read timeouts on every request (``client_options``), so a server
    that stops sending gives an error, not a hang, and a large file that arrives slowly but steadily is read
    whole."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._filesystems = Filesystems(None, timeout, who="fastfeed.io.Files")

    def fs(self, url: str):
        return self._filesystems.get(url)

    def close(self) -> None:
        """Close this process's connections (made anew on next use)."""
        self._filesystems.close()

    def read(self, url: str) -> bytes:
        return self.fs(url).cat_file(url)

    def version(self, url: str) -> list:
        """The source's size and whatever change marker its store gives (ETag, modification time). A failure is
        raised as fsspec gives it (a FileNotFoundError even for a 503): ``retry`` sorts it by its cause."""
        return _version(self.fs(url).info(url))

    def submit(self, url: str, load) -> Future | None:
        """Run coroutine ``load(fs, url)`` on the filesystem's own event loop, when it has one (HTTP, S3, GCS):
        hundreds of reads in flight cost no thread each. None for a filesystem without async support."""
        fs = self.fs(url)
        if not getattr(fs, "async_impl", False):
            return None
        return asyncio.run_coroutine_threadsafe(load(fs, url), fs.loop)

    @staticmethod
    async def version_async(fs, url: str) -> list:
        return _version(await fs._info(url))

    def glob(self, directory: str, pattern: str, retries: int = 0) -> list[str]:
        """The URLs under ``directory`` that match ``pattern``, sorted; the listing is retried as reads are."""
        fs = self.fs(directory)
        where = directory.rstrip("/") + "/" + pattern
        found = retry(lambda: fs.glob(where), retries, what=f"listing {where}", timeout=self.timeout)
        return sorted(fs.unstrip_protocol(p) if not is_url(p) else p for p in found)


def _version(info: dict) -> list:
    marker = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), None)
    return [info.get("size"), marker]
