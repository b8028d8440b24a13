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
failure (a 5xx, 408, 429, a reset or refused connection, a timeout) is tried again; a permanent one (404 or 410:
missing, 401 or 403: denied, another 4xx) raises at once, since every attempt would get the same answer.

The policy is made for that storm:

- The wait before a retry is drawn at random up to a bound that doubles from ``BACKOFF_S`` to ``MAX_BACKOFF_S``
  ("full jitter", AWS's recommendation): readers refused together do not come back together. It starts after the
  store's ``Retry-After`` when it sent one (``retry_after``).
- A request is retried until ``budget`` seconds have passed since its first failure (``DEFAULT_RETRY_BUDGET_S``,
  two minutes, by default: a start-up storm passes in seconds to a minute), and, when ``retries`` is given, at
  most that many times.
- Each store (scheme and host, or bucket) has one ``StoreRate`` per process: unbounded until the store throttles
  (503, 429), then a token bucket cut at each throttle and grown back as requests succeed (botocore's adaptive
  mode), so that a node stops hammering a store that is shedding load.
- This is the only retry layer: s3fs's own loop and botocore's retries are turned off under it (``filesystem``),
  and fsspec's HTTP has none. (gcsfs retries each request itself, up to 6 attempts in about 30 s, and offers no
  way to turn that off per filesystem: over ``gs://`` that loop runs inside each of these attempts.)
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import http
import logging
import math
import os
import random
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
# A request is retried for this long after its first failure, by default (``retry``'s ``budget``): long enough for
# a start-up storm (a job's ranks against a store shedding load) to pass, short enough that a store that is down
# is reported within minutes.
DEFAULT_RETRY_BUDGET_S = 120.0
BACKOFF_S = 0.1  # the bound of the first retry's random wait; it doubles with each further retry
MAX_BACKOFF_S = 5.0  # ... up to this: readers spread over seconds, and none idles long once the store recovers
RETRY_NOTICE_S = 10.0  # a request still retried this long after its first failure says so (once per store)
# The jitter's own source, from the OS: the module ``random`` is the user's stream (seeded alike on every rank by
# many training scripts, which would put every rank's retries back in lockstep, and saved and restored by a
# resume, which a retry must not move).
_JITTER = random.SystemRandom()
# Throttling, as opposed to failing: the store asks the client to send less (S3's 503 SlowDown, 429 elsewhere).
_THROTTLE_STATUS = {429, 503}
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                   "TooManyRequestsException", "RequestThrottled", "RequestThrottledException"}  # fmt: skip
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
        # One attempt per botocore call: ``retry`` is the one retry layer, with the budget, jitter, Retry-After
        # and rate the user set; botocore's own (legacy mode: 5 attempts) would multiply each of ours unseen.
        config.setdefault("retries", {"total_max_attempts": 1})
        options["config_kwargs"] = config
    elif proto in ("gs", "gcs"):
        import aiohttp

        # gcsfs passes requests_timeout to every aiohttp request; its default (None) means no timeout at all, not
        # the session's, so a silent store would hang a read for good.
        options.setdefault("requests_timeout", aiohttp.ClientTimeout(total=None, sock_connect=timeout,
                                                                     sock_read=timeout))  # fmt: skip
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


def _gave_up(attempts: int, last: BaseException, timeout: float | None, permanent: bool = False, *,
             spent: float | None = None, budget: float | None = None,
             asked: float | None = None) -> RemoteError:  # fmt: skip
    reason = describe(last, timeout)
    if permanent:
        text = f"was refused ({reason}); not retried, as every attempt would get the same answer"
    elif spent is None:
        text = f"failed {attempts} time(s); last: {reason}"
    elif asked is not None:
        text = (f"failed {attempts} time(s) in {spent:.0f} s; last: {reason}, and the store asked to wait {asked:g} s "
                f"more, past the retry budget of {budget:g} s: pass a larger retry_budget (seconds) to wait for it")
    else:
        text = (f"failed {attempts} time(s) in {spent:.0f} s; last: {reason}; the retry budget of {budget:g} s is "
                "spent: pass a larger retry_budget (seconds) to keep trying longer")
    return RemoteError(text, attempts=attempts, reason=reason, permanent=permanent)


def backoff(retry_number: int, retry_after: float | None = None) -> float:
    """Seconds to wait before retry ``retry_number`` (0: the first): drawn uniformly from ``[0, bound]``, the bound
    ``BACKOFF_S`` doubling with each retry up to ``MAX_BACKOFF_S`` (full jitter: readers that failed together
    spread out), after the ``retry_after`` seconds the store asked for."""
    bound = min(BACKOFF_S * 2 ** min(retry_number, 30), MAX_BACKOFF_S)
    return (retry_after or 0.0) + _JITTER.uniform(0.0, bound)


def check_retry_args(retries, retry_budget, who: str) -> None:
    """Raise ValueError, led by ``who``, for a ``retries`` or ``retry_budget`` the policy cannot use."""
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise ValueError(f"{who}: retries must be None (as many as retry_budget allows) or an int >= 0 (further "
                         f"attempts after a failure), got {retries!r}")  # fmt: skip
    if retry_budget is not None and (isinstance(retry_budget, bool) or not isinstance(retry_budget, (int, float))
                                     or not retry_budget > 0):  # fmt: skip
        raise ValueError(f"{who}: retry_budget must be None (the default, {DEFAULT_RETRY_BUDGET_S:g} s) or seconds "
                         f"> 0 (math.inf: no time limit), got {retry_budget!r}")  # fmt: skip


def retry(call: Callable[[], T], retries: int | None = None, *, what: str = "a request", final: tuple = (),
          timeout: float | None = None, wait: Callable[[float], object] = time.sleep, budget: float | None = None,
          url: str | None = None) -> T:  # fmt: skip
    """``call()``, called again after each transient failure, waiting ``backoff`` between attempts, for up to
    ``budget`` seconds after the first failure and at most ``retries`` more times (None: as many as the budget
    allows).

    Args:
        retries: further attempts at most; None: no count, only the budget.
        what: the object asked for, for the debug log line of each retry.
        final: exception types raised as they are, at once (the caller's own verdicts: a damaged shard).
        timeout: the request timeout, to say "no data for N s" when that is what ended the last attempt.
        wait: sleeps between attempts (a cache passes its stop event's ``wait``, so that closing cuts it short).
        budget: seconds after the first failure past which no retry starts (None: ``DEFAULT_RETRY_BUDGET_S``;
            ``math.inf``: no limit). A store's Retry-After longer than what is left of it ends the retries.
        url: the object's URL: its store's ``StoreRate`` in this process paces the attempts and learns from
            their answers (None, or a local path: not paced).

    Raises:
        FileNotFoundError: the object is missing (404, 410, or a local path), at once.
        PermissionError: access is denied (401, 403), at once.
        RemoteError: every attempt failed, or the store refused the request for good (another 4xx).
        ``final``'s types, and errors of the program rather than the store (TypeError...), as they are.
    """
    attempts = _Attempts(retries, budget, what, timeout, url)
    while True:
        while (pause := attempts.pace()) > 0:
            wait(pause)
        attempts.sending()
        try:
            result = call()
        except final:
            raise
        except Exception as e:  # noqa: BLE001 - sorted into retry or give up by _Attempts.failed
            delay = attempts.failed(e)
        else:
            attempts.succeeded()
            return result
        wait(delay)


async def retry_async(call: Callable[[], Awaitable[T]], retries: int | None = None, *, what: str = "a request",
                      final: tuple = (), timeout: float | None = None, budget: float | None = None,
                      url: str | None = None) -> T:  # fmt: skip
    """``retry`` for a coroutine on an event loop (the same verdicts, budget, backoff and pacing; the waits are
    awaited)."""
    attempts = _Attempts(retries, budget, what, timeout, url)
    while True:
        while (pause := attempts.pace()) > 0:
            await asyncio.sleep(pause)
        attempts.sending()
        try:
            result = await call()
        except final:
            raise
        except Exception as e:  # noqa: BLE001 - sorted into retry or give up by _Attempts.failed
            delay = attempts.failed(e)
        else:
            attempts.succeeded()
            return result
        await asyncio.sleep(delay)


class _Attempts:
    """One request's attempts: what ``retry`` and ``retry_async`` share (the verdicts, the budget, the pacing)."""

    def __init__(self, retries: int | None, budget: float | None, what: str, timeout: float | None,
                 url: str | None) -> None:  # fmt: skip
        self.retries, self.what, self.timeout = retries, what, timeout
        self.budget = DEFAULT_RETRY_BUDGET_S if budget is None else budget
        self.store = store_of(url) if url is not None else None
        self.rate = rate_of(self.store) if self.store is not None else None
        self.attempt = 0
        self.first_failure: float | None = None
        self.sent = 0.0

    def pace(self) -> float:
        """0 when the next attempt may go out now (its store's rate in this process); else seconds to wait before
        asking again."""
        return self.rate.delay() if self.rate is not None else 0.0

    def sending(self) -> None:
        self.sent = time.monotonic()

    def succeeded(self) -> None:
        if self.rate is not None:
            self.rate.answered(self.sent, throttled=False)

    def failed(self, error: Exception) -> float:
        """The wait before the next attempt after ``error``; or raises what the policy says."""
        attempt, self.attempt = self.attempt, self.attempt + 1
        verdict = _verdict(error, attempt, self.retries, self.timeout)
        if verdict is error:
            raise error
        if verdict is not None:
            raise verdict from error
        now = time.monotonic()
        if self.first_failure is None:
            self.first_failure = now
        asked = retry_after(error)
        if self.rate is not None:
            self.rate.answered(self.sent, throttled=throttled(error), retry_after=asked)
        spent = now - self.first_failure
        left = self.budget - spent
        if left <= 0 or (asked is not None and asked > left):
            raise _gave_up(attempt + 1, error, self.timeout, spent=spent, budget=self.budget,
                           asked=asked if asked is not None and left > 0 else None) from error  # fmt: skip
        delay = min(backoff(attempt, asked), max(left, asked or 0.0))  # the last wait ends with the budget
        if spent >= RETRY_NOTICE_S and self.store is not None and self.store not in _NOTICED:
            _NOTICED.add(self.store)
            log.warning("fastfeed: %s has failed requests for %.0f s (last: %s); each is retried for up to %g s "
                        "(retry_budget)", self.store, spent, describe(error, self.timeout), self.budget)  # fmt: skip
        log.debug("fastfeed: %s: %s; attempt %d in %.2f s", self.what, describe(error, self.timeout), attempt + 2,
                  delay)  # fmt: skip
        return delay


def _verdict(error: Exception, attempt: int, retries: int | None, timeout: float | None) -> Exception | None:
    """None: worth another attempt, as far as the error and the count go; else what to raise (``error`` itself:
    raise it as it is)."""
    if isinstance(error, _NOT_THE_STORE):
        return error
    kind = classify(error)
    if kind == "missing":
        return error if isinstance(error, FileNotFoundError) else FileNotFoundError(describe(error, timeout))
    if kind == "denied":
        return error if isinstance(error, PermissionError) else PermissionError(describe(error, timeout))
    if kind == "rejected":
        return _gave_up(attempt + 1, error, timeout, permanent=True)
    return _gave_up(attempt + 1, error, timeout) if retries is not None and attempt >= retries else None


def retry_after(error: BaseException) -> float | None:
    """The seconds the store asked the client to wait (its ``Retry-After`` header: seconds, or an HTTP date), or
    None when it sent none. aiohttp's ClientResponseError keeps the response's ``headers`` (also under fsspec's
    FileNotFoundError, as its cause); botocore's ClientError its ``response["ResponseMetadata"]["HTTPHeaders"]``
    (names in lower case; under s3fs's translated OSError, as its cause)."""
    for e in _chain(error):
        value = None
        headers = getattr(e, "headers", None)
        if headers is not None and hasattr(headers, "get"):
            value = headers.get("Retry-After")
        response = getattr(e, "response", None)
        if value is None and isinstance(response, dict):
            value = ((response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("retry-after")
        if value is not None:
            return _seconds(str(value))
    return None


def _seconds(value: str) -> float | None:
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None  # neither form: as if it had sent none
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def throttled(error: BaseException) -> bool:
    """Whether ``error`` is the store asking for fewer requests (503, 429, a throttling error code), rather than
    failing one."""
    for e in _chain(error):
        if _status(e) in _THROTTLE_STATUS:
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict) and (response.get("Error") or {}).get("Code") in _THROTTLE_CODES:
            return True
    return False


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


# -- each store's rate, per process -------------------------------------------------------------------------------


class StoreRate:
    """The rate this process sends requests to one store at (botocore's adaptive retry mode is the model).

    Unbounded until the store throttles (503, 429: it asks for fewer requests); from then on a token bucket of a
    second's requests. A throttle cuts the rate to ``BETA`` x what was being sent, once per round trip (the answers
    to requests sent before the last cut were asked at the old rate, and say nothing of the new one), and the rate
    grows back along CUBIC's curve as requests succeed: quickly towards the rate where the store last throttled,
    slowly around it, quickly again past it; never above twice the rate measured (a process that sends little
    earns no large allowance). A ``Retry-After`` pauses every request to the store for that long, and they resume
    at the bucket's pace, not in a burst.

    A request asks ``delay()`` until it is 0 (its token is taken then): a wait is never promised ahead, so a rate
    that grows back serves the requests already waiting. A process's threads and its event loop share one per
    store (``rate_of``); ``clock`` is for tests.
    """

    MIN_RATE = 0.5  # requests/s: the floor of a throttled store's rate
    BETA = 0.7  # the cut at a throttle
    SCALE = 0.4  # CUBIC's C: how fast the rate grows back
    SMOOTH = 0.8  # weight of the latest interval in the measured rate
    INTERVAL_S = 0.5  # the measured rate's interval

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self.limited = False
        self.rate = math.inf  # requests/s while limited
        self.measured = 0.0  # answers/s, smoothed
        self._tokens, self._filled = 0.0, now
        self._paused_until = now
        self._w_max, self._k, self._cut_at = 0.0, 0.0, -math.inf
        self._count, self._interval = 0, math.floor(now / self.INTERVAL_S)

    def delay(self) -> float:
        """0, taking a token for the request about to be sent; else the seconds to wait before asking again."""
        with self._lock:
            now = self._clock()
            if now < self._paused_until:
                return self._paused_until - now
            if not self.limited:
                return 0.0
            if now > self._filled:
                self._tokens = min(max(1.0, self.rate), self._tokens + (now - self._filled) * self.rate)
                self._filled = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            # Spread over a little more than the token's own wait: the requests waiting do not all ask at once.
            return (1.0 - self._tokens) / self.rate * _JITTER.uniform(1.0, 1.5)

    def answered(self, sent: float, throttled: bool, retry_after: float | None = None) -> None:
        """A request sent at ``sent`` (this clock) got its answer: ``throttled``, or not (a success, or a failure
        that is not the store asking for fewer requests)."""
        with self._lock:
            now = self._clock()
            self._measure(now)
            if throttled:
                if sent >= self._cut_at:
                    sending = self.measured or self._count / self.INTERVAL_S
                    base = min(self.rate, sending) if self.limited else sending
                    self._w_max, self._cut_at = base, now
                    self._k = (base * (1 - self.BETA) / self.SCALE) ** (1 / 3)
                    self.rate = max(base * self.BETA, self.MIN_RATE)
                    self.limited = True
                    self._tokens, self._filled = 0.0, max(self._filled, now)  # the bucket fills from the cut on
                if retry_after:
                    self._paused_until = max(self._paused_until, now + retry_after)
                    # One request goes when the pause ends (the one that was asked to wait, or another), the
                    # next at the bucket's pace: no tokens gather while paused.
                    self._tokens, self._filled = 1.0, max(self._filled, self._paused_until)
            elif self.limited:
                grown = self.SCALE * (now - self._cut_at - self._k) ** 3 + self._w_max
                self.rate = max(min(grown, 2 * self.measured), self.MIN_RATE)

    def _measure(self, now: float) -> None:
        self._count += 1
        interval = math.floor(now / self.INTERVAL_S)
        if interval > self._interval:
            current = self._count / ((interval - self._interval) * self.INTERVAL_S)
            self.measured = self.SMOOTH * current + (1 - self.SMOOTH) * self.measured
            self._count, self._interval = 0, interval


_RATES: dict[str, StoreRate] = {}
_RATES_LOCK = threading.Lock()
_NOTICED: set[str] = set()  # stores whose long retries were reported (once per process)


def store_of(url: str) -> str | None:
    """The store a URL's requests go to, as its rate is kept: ``scheme://host[:port]`` (an S3 or GCS bucket);
    None for a local path."""
    if not is_url(url):
        return None
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}"


def rate_of(store: str) -> StoreRate:
    """This process's ``StoreRate`` of ``store`` (``store_of``'s form)."""
    with _RATES_LOCK:
        rate = _RATES.get(store)
        if rate is None:
            rate = _RATES[store] = StoreRate()
        return rate


def _forget_rates() -> None:
    """A forked child's own rates: its parent's lock may have been held at the fork, and its pace is its own."""
    global _RATES_LOCK
    _RATES_LOCK = threading.Lock()
    _RATES.clear()
    _NOTICED.clear()


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
    os.register_at_fork(after_in_child=_forget_rates)


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
    if protocol(url) in ("s3", "s3a") and isinstance(getattr(fs, "retries", None), int):
        # s3fs's own loop (its class attribute: 5 attempts, 0.1 s growing by 1.7x; no constructor option) would
        # retry each of ``retry``'s attempts again, unseen: one attempt each, so that ``retry`` is the one layer.
        fs.retries = 1
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

    def glob(self, directory: str, pattern: str, retries: int | None = 0, budget: float | None = None) -> list[str]:
        """The URLs under ``directory`` that match ``pattern``, sorted; the listing is retried as reads are."""
        fs = self.fs(directory)
        where = directory.rstrip("/") + "/" + pattern
        found = retry(lambda: fs.glob(where), retries, what=f"listing {where}", timeout=self.timeout, budget=budget,
                      url=directory)  # fmt: skip
        return sorted(fs.unstrip_protocol(p) if not is_url(p) else p for p in found)


def _version(info: dict) -> list:
    marker = next((str(info[k]) for k in _VERSION_KEYS if info.get(k) is not None), None)
    return [info.get("size"), marker]
