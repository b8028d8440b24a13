"""Remote files (``s3://``, ``gs://``, ``http(s)://`` ...) through fsspec, the ``[remote]`` extra.

One filesystem object per protocol and per process: a forked worker must not reuse its parent's event loop or
connection pool, so instances are made in the process that uses them and never taken from fsspec's shared cache.

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
import time
from concurrent.futures import Future
from typing import Awaitable, Callable, TypeVar

HINT = "pip install 'fastfeed[remote]' (fsspec, plus s3fs or gcsfs for the clouds)"
_VERSION_KEYS = ("ETag", "etag", "mtime", "LastModified", "last_modified", "Last-Modified", "updated", "md5_hash")
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
    return "://" in source and not source.startswith("file://")


def protocol(url: str) -> str:
    return url.split("://", 1)[0]


def client_options(proto: str, storage_options: dict | None, timeout: float | None) -> dict:
    """fsspec options for ``proto`` with ``timeout`` as the connect and read timeouts (a request that sends
    nothing for that long fails), never as a total one, which would cut a large body that is slow but moving.
    The user's own ``storage_options`` win."""
    options = dict(storage_options or {})
    if timeout is None:
        return options
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


# -- Files' filesystems -------------------------------------------------------------------------------------------


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
        found = retry(lambda: fs.glob(where), retries, what=f"listing {where}")  # no timeout=: Files' is a total one
        return sorted(fs.unstrip_protocol(p) if not is_url(p) else p for p in found)


def _version(info: dict) -> list:
    marker = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), None)
    return [info.get("size"), marker]
