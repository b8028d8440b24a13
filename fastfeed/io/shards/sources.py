"""Where a shard set's shards are: a list, a directory, a brace pattern, a glob, or one path or URL.

Brace patterns follow webdataset's (the ``braceexpand`` package's) rules, so a pattern that names a shard set for
webdataset names the same shards, in the same order, here: ``{a,b}`` alternatives, ``{000..099}`` ranges (zero
padded to the wider end when either end has a leading zero), ``{1..9..2}`` steps, ``{a..e}`` letter ranges, nesting,
any number of braces, ``\\{`` for a literal brace.

A ``file://`` source is the local path it names (``remote.is_url``): it is listed as that path is, and what it
names comes back spelled as it was given (``file:///data/a-*.tar`` -> ``file:///data/a-0.tar``, ...).
"""

from __future__ import annotations

import contextlib

import glob as globbing
import itertools
import os
import re

from .. import remote
from ..remote import is_url

SUFFIX = ".tar"  # what a directory's listing keeps
_GLOB = re.compile(r"[*?\[]")
_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.(-?\d+))?$")


def resolve(source, storage_options: dict | None = None, *, retries: int | None = None,
            retry_budget: float | None = None, timeout: float = 60.0) -> list[str]:  # fmt: skip
    """The shards ``source`` names, in order.

    Args:
        source: a list or tuple of paths or URLs (taken as given, in that order); a directory (local, or an fsspec
            URL of one: all its ``*.tar`` files, sorted by name); a brace pattern; a glob; or one path or URL.
        storage_options: passed to fsspec for URLs (``s3://`` credentials, ``endpoint_url`` in ``client_kwargs``).
        retries: further attempts at most at a listing that failed transiently (``fastfeed.io.remote.retry``);
            None: as many as ``retry_budget`` allows.
        retry_budget: seconds after a listing's first failure during which it is retried (None: the default,
            ``fastfeed.io.remote.DEFAULT_RETRY_BUDGET_S``).
        timeout: seconds a listing request may send nothing before the attempt fails.

    Returns:
        Local paths made absolute, URLs as given.

    Raises:
        ValueError: the source names no shards.
        FileNotFoundError: a single local path that does not exist, or a URL that is missing.
        OSError: listing a URL failed every attempt (a refused connection, a 503...), or was refused (403).
        TypeError: ``source`` is not a path, a URL or a list of them.
    """
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("shard source: the list of shards is empty")
        out = []
        for item in source:
            if not isinstance(item, (str, os.PathLike)):
                raise TypeError(f"shard source: list items must be paths or URLs, got {type(item).__name__} {item!r}")
            out.append(_absolute(os.fspath(item)))
        return out
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError("shard source must be a path, a URL, a brace pattern or a list of them; "
                        f"got {type(source).__name__}")  # fmt: skip
    source = os.fspath(source)
    if not source:
        raise ValueError("shard source is an empty string")
    if _has_braces(source):
        out = []
        for s in braceexpand(source):
            # A glob inside a pattern ("{train,val}/*.tar") is listed; a plain name is taken as given, unlisted.
            listed = _GLOB.search(s.split("://", 1)[-1])
            out.extend(resolve(s, storage_options, retries=retries, retry_budget=retry_budget, timeout=timeout)
                       if listed else [_absolute(s)])  # fmt: skip
        return out
    if is_url(source):
        return _resolve_url(source, storage_options, retries, retry_budget, timeout)
    if source != remote.local_path(source):
        # The local path's shards, spelled back as the source was: the index beside them names them so too.
        return ["file://" + p for p in resolve(remote.local_path(source), storage_options, retries=retries,
                                               retry_budget=retry_budget, timeout=timeout)]  # fmt: skip
    if _GLOB.search(source):
        found = sorted(os.path.abspath(p) for p in globbing.glob(source) if os.path.isfile(p))
        if not found:
            raise ValueError(f"shard source {source!r}: the glob matches no files")
        return found
    if os.path.isdir(source):
        found = sorted(e.path for e in os.scandir(source) if e.name.endswith(SUFFIX) and e.is_file())
        if not found:
            raise ValueError(f"shard source {source!r}: the directory holds no *{SUFFIX} files")
        return [os.path.abspath(p) for p in found]
    if not os.path.exists(source):
        raise FileNotFoundError(f"shard source {source!r}: no such file or directory")
    return [os.path.abspath(source)]


def filesystem(url: str, storage_options: dict | None = None, timeout: float | None = None):
    """``(fsspec filesystem, path)`` for ``url``: ``remote.filesystem``'s, with its connect and read timeouts
    (``timeout`` None: ``remote.DEFAULT_TIMEOUT_S``). Close it with ``release``."""
    return remote.filesystem(url, storage_options, timeout, who="fastfeed shards")


@contextlib.contextmanager
def opened(url: str, storage_options: dict | None = None, timeout: float | None = None):
    """``filesystem(url)`` for a block of code, its connections closed when the block ends (``release``)."""
    fs, path = filesystem(url, storage_options, timeout)
    try:
        yield fs, path
    finally:
        release(fs)


release = remote.close  # the name the shard modules (index, write) close their filesystems by


def _resolve_url(source: str, storage_options: dict | None, retries: int | None, retry_budget: float | None,
                 timeout: float) -> list[str]:  # fmt: skip
    """The listing of a URL, retried as a whole as reads are (a store shedding load answers a listing with 503
    too); errors name the source and what went wrong, a refused connection included."""
    with opened(source, storage_options, timeout) as (fs, path):
        try:
            # ValueError: the listing itself says there are no shards; another attempt would say it again.
            return remote.retry(lambda: _list_url(source, fs, path), retries, what=f"listing {source}",
                                final=(ValueError,), timeout=timeout, budget=retry_budget, url=source)  # fmt: skip
        except FileNotFoundError as e:
            raise FileNotFoundError(f"shard source {source!r}: no such file or directory") from e
        except PermissionError as e:
            raise PermissionError(f"shard source {source!r}: listing it was denied ({remote.describe(e)}); "
                                  "check storage_options' credentials") from e  # fmt: skip
        except remote.RemoteError as e:
            raise e.within(f"shard source {source!r}: listing it") from e


def _list_url(source: str, fs, path: str) -> list[str]:
    # Each entry's type comes with the listing: asking isfile() of each would be a request per shard (over HTTP
    # a GET), and one that failed would silently drop the shard from the set.
    if _GLOB.search(path):
        found = sorted(p for p, info in fs.glob(path, detail=True).items() if info.get("type") == "file")
        if not found:
            raise ValueError(f"shard source {source!r}: the glob matches no files")
        static = source[: _GLOB.search(source).start()].rsplit("/", 1)[0]
        return [_as_url(fs, static, p) for p in found]
    # HTTP has no directories: asking whether a shard URL is one would download it, so a name that ends like a
    # shard is a shard, and only a URL ending in "/" is listed.
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if path.rstrip("/").endswith(SUFFIX) or ({"http", "https"} & set(protocols) and not source.endswith("/")):
        return [source]
    if fs.isdir(path):
        found = sorted(e["name"] for e in fs.ls(path, detail=True) if e["name"].endswith(SUFFIX)
                       and e.get("type") == "file")  # fmt: skip
        if not found:
            raise ValueError(f"shard source {source!r}: the directory holds no *{SUFFIX} files")
        return [_as_url(fs, source.rstrip("/"), p) for p in found]
    if not fs.exists(path):
        raise FileNotFoundError(f"shard source {source!r}: no such file or directory")
    return [source]


def _as_url(fs, prefix: str, path: str) -> str:
    """A listed path (fsspec lists them without the protocol, normalized) back as a URL spelled as the source is:
    ``prefix`` is the source's URL up to a directory, and the path's part below that directory is appended."""
    if "://" in path:
        return path
    stripped = fs._strip_protocol(prefix).rstrip("/")
    if path.startswith(stripped + "/"):
        return prefix.rstrip("/") + path[len(stripped) :]
    return fs.unstrip_protocol(path)


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


# -- brace expansion (the braceexpand package's semantics, which webdataset uses) ---------------------------------


def _has_braces(pattern: str) -> bool:
    return "{" in pattern and "}" in pattern


def braceexpand(pattern: str) -> list[str]:
    """Every string ``pattern`` expands to, in order (see the module docstring for the rules)."""
    depth, i = 0, 0
    while i < len(pattern):
        c = pattern[i]
        depth += (c == "{") - (c == "}")
        if depth < 0:
            break
        i += 2 if c == "\\" else 1
    if depth:
        raise ValueError(f"shard source {pattern!r}: unbalanced braces (write \\{{ or \\}} for a literal one)")
    return [_unescape(s) for s in _expand(pattern)]


def _unescape(s: str) -> str:
    return re.sub(r"\\(.)", r"\1", s)


def _expand(pattern: str) -> list[str]:
    """Expansions, still escaped: the first top-level brace group is expanded and the rest recursed into."""
    start = _find_open(pattern)
    if start < 0:
        return [pattern]
    end = _find_close(pattern, start)
    if end < 0:
        raise ValueError(f"shard source {_unescape(pattern)!r}: unbalanced braces (write \\{{ for a literal one)")
    head, body, tail = pattern[:start], pattern[start + 1 : end], pattern[end + 1 :]
    choices = _choices(body)
    if choices is None:  # "{x}": no comma, no range; literal braces around an expansion of x
        choices = ["{" + b + "}" for b in _expand(body)]
    tails = _expand(tail)
    return [head + c + t for c, t in itertools.product(choices, tails)]


def _find_open(s: str, start: int = 0) -> int:
    i = start
    while i < len(s):
        if s[i] == "\\":
            i += 2
            continue
        if s[i] == "{":
            return i
        i += 1
    return -1


def _find_close(s: str, start: int) -> int:
    depth, i = 0, start
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _split_top(body: str) -> list[str]:
    parts, depth, cur, i = [], 0, [], 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            cur.append(body[i : i + 2])
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _choices(body: str) -> list[str] | None:
    parts = _split_top(body)
    if len(parts) > 1:
        return [e for p in parts for e in _expand(p)]
    m = _INT_RANGE.match(body)
    if m:
        return _int_range(*m.groups())
    m = _CHAR_RANGE.match(body)
    if m:
        a, b, step = m.groups()
        step = abs(int(step)) if step else 1
        step = step or 1
        lo, hi = ord(a), ord(b)
        seq = range(lo, hi + 1, step) if lo <= hi else range(lo, hi - 1, -step)
        return [chr(c) for c in seq]
    return None


def _int_range(a: str, b: str, step: str | None) -> list[str]:
    lo, hi = int(a), int(b)
    step_n = abs(int(step)) if step else 1
    step_n = step_n or 1
    width = max(len(a), len(b)) if _padded(a) or _padded(b) else 0
    seq = range(lo, hi + 1, step_n) if lo <= hi else range(lo, hi - 1, -step_n)
    return [f"{n:0{width}d}" if width else str(n) for n in seq]


def _padded(n: str) -> bool:
    digits = n.lstrip("-")
    return len(digits) > 1 and digits.startswith("0")
