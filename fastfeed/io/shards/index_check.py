"""A shard index read as hostile input: checked whole before anything is allocated from it or indexed by it.

An index is data from wherever the shards came from: a truncated upload, another tool's file, a publisher who means
harm. So every field is checked for its type and range before it is used, and every failure is a ValueError that
names the index and the field (``shards[3].lengths[7]``):

- the JSON may nest no deeper than ``MAX_DEPTH``, found by a linear scan before it is parsed (the parser recurses
  once per level, and a program that raised the recursion limit would let a deep file overflow the C stack);
- ``size``, ``crc32`` and ``first`` are integers in range (a size below 2**63, a crc32 below 2**32, ``first``
  within the size); ``lengths`` are integers, none negative, adding up from ``first`` to no more than the shard's
  size (so no sample's range reaches past the shard's end); ``keys`` are strings of at most ``MAX_KEY_BYTES``
  bytes, one for each length;
- a shard's ``url`` is a path below the index's own directory (``shard-0.tar``, ``train/shard-0.tar``), unless the
  caller opts in with ``allow_outside_urls=True``: a ``..`` part, an absolute path, ``file://`` or another host
  would let an index make the reader fetch bytes from outside the shard set.

The checks cost little next to the parse: the depth scan is a few passes of C over the bytes, and each sample's
length and key are checked in arrays of many at a time, never one Python call per sample.
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple
from urllib.parse import unquote

import numpy as np

MAX_DEPTH = 32  # a fastfeed index nests 4 deep ({"shards": [{"lengths": [...]}]}); room for fields added later
# A sample's key (a tar member's name less its ext) is a path: 4096 bytes at most on Linux. 16 times that leaves
# room for any tool's names, and none for a 100 MB one.
MAX_KEY_BYTES = 1 << 16
MAX_URL_CHARS = 1 << 16
_INT64 = (1 << 63) - 1
_CHUNK = 1 << 16  # samples whose lengths and keys are made arrays at once while parsing
_SCAN_CHUNK = 1 << 22  # bytes the scan looks at at once: its arrays stay small whatever the file holds
_REBUILD = "rebuild it with fastfeed.io.index_shards(source, dest=True)"

# The bytes the scan keeps: quotes and brackets, and the first letters of true and false (backslashes are dealt
# with first).
_NOT_SCANNED = bytes(c for c in range(256) if c not in b'"[]{}tf')
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
# A relative path whose every part is a name: no "", "." or ".." part, no backslash (a separator on Windows and
# to some HTTP servers) and no NUL. Most shard urls are one such name, and need no further look.
_NAME = r"(?!\.\.?(?:/|\Z))[^/\\\x00]+"
_BELOW = re.compile(rf"{_NAME}(?:/{_NAME})*")


class Checked(NamedTuple):
    """A shard index's arrays, every one checked (see ``ShardIndex.__init__`` for their layout)."""

    urls: list
    sizes: np.ndarray
    crcs: np.ndarray
    counts: np.ndarray
    offsets: np.ndarray
    key_blob: bytes
    key_lengths: np.ndarray


class _Shard:
    """What ``json.loads`` leaves in place of a shard's entry once its fields are in a ``_Parse``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<shard entry>"


_SHARD = _Shard()
_MISSING = object()


def scan(data: bytes) -> tuple[int, bool]:
    """``(depth, booleans)`` of the UTF-8 JSON text ``data``: how deep its arrays and objects nest, and whether a
    true or false may stand outside its strings (a t or an f there: true, false, or Infinity). Linear and without
    recursion; exact for valid JSON, and for invalid JSON up to its first error, which is as far as a parser gets
    before it stops."""
    if b"\\" in data:
        # An escape matters here only where it hides a quote. Escaped backslashes go first, in pairs, left to
        # right as a parser reads them; a backslash still before a quote then escapes it. (A backslash outside a
        # string is an error, and the scan is exact up to it.)
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Only quotes, brackets, t and f are kept. Two quotes side by side (an empty string, or one string's end and
    # the next one's start) change no byte's side of a string, so they go too: a file of numeric keys leaves
    # little more than its brackets.
    kept = np.frombuffer(data.translate(None, _NOT_SCANNED).replace(b'""', b""), np.uint8)
    depth = deepest = 0
    inside = booleans = False  # within a string where the part before ends; a t or f seen outside strings
    for at in range(0, len(kept), _SCAN_CHUNK):  # a part at a time: a hostile file may keep every byte
        part = kept[at : at + _SCAN_CHUNK]
        quote = part == ord('"')
        within = np.logical_xor.accumulate(quote) ^ inside  # an odd count of quotes so far: inside a string
        inside = bool(within[-1])
        steps = _STEP[part[~within & ~quote]]  # +1, -1, or 0 for the t of true and the f of false
        if len(steps):
            running = np.cumsum(steps, dtype=np.int64) + depth
            deepest, depth = max(deepest, int(running.max())), int(running[-1])
            booleans = booleans or bool((steps == 0).any())
    return deepest, booleans


def decode(raw, where: str):
    """``(doc, parse)``: the JSON of ``raw`` (bytes or str), each shard's entry replaced by a marker as it is
    parsed, its fields kept compactly in ``parse``. ValueError: not JSON, or nested deeper than ``MAX_DEPTH``."""
    try:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            raw = bytes(raw)
            encoding = json.detect_encoding(raw)
            utf8 = raw if encoding in ("utf-8", "utf-8-sig") else raw.decode(encoding, "surrogatepass").encode(
                "utf-8", "surrogatepass")  # fmt: skip
        elif isinstance(raw, str):
            utf8 = raw.encode("utf-8", "surrogatepass")
        else:
            raise TypeError(f"an index is bytes or str, not {type(raw).__name__}")
    except UnicodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    depth, booleans = scan(utf8)
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: not a fastfeed shard index: its JSON nests {depth} deep, and an index nests 4 "
                         f"(at most {MAX_DEPTH} is read); {_REBUILD}")  # fmt: skip
    # true/false in a list of lengths would pass numpy's conversion to int64 as 1/0; only a file that holds one
    # pays for checking each length's type.
    parse = _Parse(strict=booleans)
    try:
        doc = json.loads(raw, object_hook=parse.hook)
    except ValueError as e:  # JSONDecodeError, an undecodable byte, an integer of more than 4300 digits
        raise ValueError(f"{where}: not JSON ({e})") from None
    parse.finish()
    return doc, parse


class _Parse:
    """The object hook's store: each shard entry's scalar fields in lists, and every sample's length and key in
    arrays made ``_CHUNK`` samples at a time (a Python int or str per sample would be ~60 bytes, and a numpy call
    per shard would cost a million calls for a million small shards). The first sample that fails its check is
    kept in ``error`` as ``(field, sample position, value, why)``; after it nothing more is converted."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.entries = 0
        self.urls, self.sizes, self.crcs, self.firsts = [], [], [], []
        self.counts, self.key_counts = [], []
        self._lengths, self._keys = [], []
        self._lengths_at = self._keys_at = 0  # samples converted so far
        self.length_arrays, self.blobs, self.key_length_arrays = [], [], []
        self.error = None

    def hook(self, d: dict):
        lengths, keys = d.get("lengths"), d.get("keys")
        if type(lengths) is not list or type(keys) is not list:
            return d  # not a shard's entry; an entry in "shards" left so is reported by check()
        self.entries += 1
        self.urls.append(d.get("url", _MISSING))
        self.sizes.append(d.get("size", _MISSING))
        self.crcs.append(d.get("crc32", _MISSING))
        self.firsts.append(d.get("first", _MISSING))
        self.counts.append(len(lengths))
        self.key_counts.append(len(keys))
        if self.error is None:
            self._lengths += lengths
            self._keys += keys
            if len(self._lengths) >= _CHUNK or len(self._keys) >= _CHUNK:
                self._flush()
        return _SHARD

    def finish(self) -> None:
        self._flush()

    def _flush(self) -> None:
        lengths, keys = self._lengths, self._keys
        self._lengths, self._keys = [], []
        if self.error is None and lengths:
            array = self._length_array(lengths)
            if array is not None:
                self.length_arrays.append(array)
                self._lengths_at += len(lengths)
        if self.error is None and keys:
            made = self._key_arrays(keys)
            if made is not None:
                self.blobs.append(made[0])
                self.key_length_arrays.append(made[1])
                self._keys_at += len(keys)

    def _length_array(self, lengths: list):
        try:
            array = np.array(lengths)
        except (ValueError, OverflowError):  # ragged nested lists
            array = None
        ok = array is not None and array.dtype == np.int64 and array.ndim == 1
        if ok and self.strict:
            ok = set(map(type, lengths)) == {int}
        if ok and not (array < 0).any():
            return array
        for i, v in enumerate(lengths):  # the first one that is wrong, for the error
            if type(v) is not int or not 0 <= v <= _INT64:
                why = "is negative" if type(v) is int and v < 0 else (
                    "is beyond any shard's size (2**63 - 1)" if type(v) is int else
                    "is not an integer (a shard's keys must be strings and its lengths integers)")  # fmt: skip
                self.error = ("lengths", self._lengths_at + i, v, why)
                return None
        raise AssertionError("a list of lengths numpy refused holds no wrong length")

    def _key_arrays(self, keys: list):
        try:
            # One join and one encode for the lot: where every character is one byte (ASCII, or an undecodable
            # byte kept as a surrogate), each key's byte count is its length in characters.
            blob = "".join(keys).encode("utf-8", "surrogateescape")
            chars = np.fromiter(map(len, keys), np.int64, len(keys))
            if len(blob) == int(chars.sum()):
                sizes = chars
            else:
                sizes = np.fromiter((len(k.encode("utf-8", "surrogateescape")) for k in keys), np.int64, len(keys))
        except (TypeError, UnicodeError):
            blob = sizes = None
        if sizes is not None and (not len(sizes) or int(sizes.max()) <= MAX_KEY_BYTES):
            return blob, sizes
        for i, k in enumerate(keys):
            why = None
            if type(k) is not str:
                why = "is not a string (a shard's keys must be strings and its lengths integers)"
            else:
                try:
                    n = len(k.encode("utf-8", "surrogateescape"))
                except UnicodeError:
                    why = "holds a lone surrogate that no bytes encode"
                else:
                    if n > MAX_KEY_BYTES:
                        why = f"is {n} bytes long, and a key may be at most {MAX_KEY_BYTES}"
            if why is not None:
                self.error = ("keys", self._keys_at + i, k, why)
                return None
        raise AssertionError("a list of keys that failed holds no wrong key")


def check(doc, parse: _Parse | None, base: str | None, where: str, allow_outside_urls: bool) -> Checked:
    """The checked arrays of index document ``doc`` (parsed by ``decode``, whose ``parse`` holds its shards' fields;
    None: ``doc`` is plain JSON data, its shard entries dicts). Relative urls resolve against directory ``base``.

    Raises:
        ValueError: naming ``where`` and the field that is wrong.
    """
    from .index import FORMAT, VERSION

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not a fastfeed shard index (its \"format\" is not {FORMAT!r})")
    version = doc.get("version")
    if type(version) is not int or not 1 <= version <= VERSION:
        raise ValueError(f"{where}: shard index version {_show(version)}; this fastfeed reads up to {VERSION}: "
                         "upgrade fastfeed or rebuild the index with index_shards")  # fmt: skip
    shards = doc.get("shards", _MISSING)
    if type(shards) is not list:
        raise _damaged(where, "shards", shards, "must be a list of the shards' entries")
    if parse is None:
        parse = _Parse()
        shards = [parse.hook(s) if type(s) is dict else s for s in shards]
        parse.finish()
    n = len(shards)
    k = next((k for k, s in enumerate(shards) if s is not _SHARD), None)  # by identity: == may be any object's
    if k is not None:
        s = shards[k]
        if type(s) is not dict:
            why = f"a shard's entry must be an object, not {type(s).__name__}"
        else:
            why = (f"a shard's keys and lengths must be lists, not {_kind(s.get('keys', _MISSING))} and "
                   f"{_kind(s.get('lengths', _MISSING))}")  # fmt: skip
        raise ValueError(f"{where}: damaged shard index at shards[{k}]: {why}; {_REBUILD}")
    if parse.entries != n:  # an object with "keys" and "lengths" lists elsewhere was taken for a shard's entry
        raise ValueError(f"{where}: damaged shard index: {parse.entries - n} object(s) with \"keys\" and \"lengths\" "
                         f"lists outside \"shards\" (or nested in an entry); {_REBUILD}")  # fmt: skip

    counts = np.array(parse.counts, np.int64).reshape(n)
    key_counts = np.array(parse.key_counts, np.int64).reshape(n)
    differ = np.flatnonzero(counts != key_counts)
    if len(differ):
        k = int(differ[0])
        raise ValueError(f"{where}: damaged shard index at shards[{k}]: {counts[k]} lengths and {key_counts[k]} "
                         f"keys; each sample has one of each: {_REBUILD}")  # fmt: skip
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    if parse.error is not None:
        field, at, value, why = parse.error
        k = int(np.searchsorted(starts, at, side="right")) - 1
        raise _damaged(where, f"shards[{k}].{field}[{at - int(starts[k])}]", value, why)

    sizes = _scalars(parse.sizes, where, "size", 0, _INT64)
    crcs = _scalars(parse.crcs, where, "crc32", 0, (1 << 32) - 1).astype(np.uint32)
    firsts = _scalars(parse.firsts, where, "first", 0, _INT64)
    beyond = np.flatnonzero(firsts > sizes)
    if len(beyond):
        k = int(beyond[0])
        raise _damaged(where, f"shards[{k}].first", int(firsts[k]), f"is beyond the shard's size {sizes[k]}")
    urls = _urls(parse.urls, base, where, allow_outside_urls)

    total = int(starts[-1])
    # Each joined whole and its parts let go at once: holding both would double the index's peak.
    parts, parse.length_arrays = parse.length_arrays, []
    lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    parts, parse.key_length_arrays = parse.key_length_arrays, []
    key_lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    parts, parse.blobs = parse.blobs, []
    key_blob = b"".join(parts)
    del parts
    assert len(lengths) == len(key_lengths) == total  # the counts agree, and every sample was converted
    offsets = _offsets(lengths, counts, starts, sizes, firsts, where)
    return Checked(urls, sizes, crcs, counts, offsets, key_blob, key_lengths)


def _scalars(values: list, where: str, field: str, low: int, high: int) -> np.ndarray:
    """``values`` (one per shard) as int64, each an int in [low, high], else ValueError naming the first that
    is not."""
    if not values or set(map(type, values)) == {int}:
        try:
            array = np.array(values, np.int64)
        except OverflowError:
            array = None
        if array is not None and not ((array < low) | (array > high)).any():
            return array
    for k, v in enumerate(values):
        if v is _MISSING:
            raise ValueError(f"{where}: damaged shard index at shards[{k}]: no \"{field}\"; {_REBUILD}")
        if type(v) is not int:
            raise _damaged(where, f"shards[{k}].{field}", v, "is not an integer")
        if not low <= v <= high:
            raise _damaged(where, f"shards[{k}].{field}", v, f"is out of range (from {low} to {high})")
    raise AssertionError(f"{field}: numpy refused values that are all in range")


def _offsets(lengths, counts, starts, sizes, firsts, where: str) -> np.ndarray:
    """Each shard's ``first`` followed by its samples' ends, laid out as ``ShardIndex.offsets``, once every length
    is known to stay within its shard; ValueError naming the first sample that ends past its shard's size."""
    n = len(counts)
    room = sizes - firsts  # bytes from a shard's first sample to its end: no sample may end past it
    over = np.flatnonzero(lengths > np.repeat(room, counts))
    if len(over):
        _past_the_end(lengths, starts, sizes, firsts, int(np.searchsorted(starts, over[0], side="right")) - 1,
                      where)  # fmt: skip
    # Ends within each shard, from one running sum: int64 arithmetic wraps past 2**63, and a difference of two
    # wrapped sums is exact wherever the true difference fits, which it does in every shard where even its count
    # times its size stays below 2**62. The rare shard (a hostile count, or sizes near 2**63) is summed exactly.
    ends = np.cumsum(lengths)
    before = np.zeros(n, np.int64)  # the running sum before each shard's first sample
    has = counts > 0
    before[has] = ends[starts[:-1][has]] - lengths[starts[:-1][has]]
    last = np.zeros(n, np.int64)
    last[has] = ends[starts[1:][has] - 1]
    spans = last - before
    exact = counts.astype(np.float64) * np.maximum(sizes, 1).astype(np.float64) < 2.0**62
    for k in np.flatnonzero(~exact):
        k = int(k)
        if sum(lengths[starts[k] : starts[k + 1]].tolist()) > int(room[k]):
            _past_the_end(lengths, starts, sizes, firsts, k, where)
    bad = np.flatnonzero(exact & (spans > room))
    if len(bad):
        _past_the_end(lengths, starts, sizes, firsts, int(bad[0]), where)
    offsets = np.empty(int(starts[-1]) + n, np.int64)
    heads = starts[:-1] + np.arange(n)  # where each shard's run of offsets begins: its first
    is_head = np.zeros(len(offsets), bool)
    is_head[heads] = True
    offsets[heads] = firsts
    ends += np.repeat(firsts - before, counts)
    offsets[~is_head] = ends
    return offsets


def _past_the_end(lengths, starts, sizes, firsts, k: int, where: str):
    """Raise naming shard k's first sample that ends past the shard's size."""
    at = int(firsts[k])
    size = int(sizes[k])
    for i, n in enumerate(lengths[starts[k] : starts[k + 1]].tolist()):
        at += n
        if at > size:
            if n > size:
                raise _damaged(where, f"shards[{k}].lengths[{i}]", n, f"is beyond the shard's size {size}")
            raise _damaged(where, f"shards[{k}].lengths[{i}]", n, f"ends sample {i} at byte {at}, beyond the "
                           f"shard's size {size}")  # fmt: skip
    raise AssertionError(f"shard {k}'s samples all end within it")


def _urls(urls: list, base: str | None, where: str, allow: bool) -> list:
    """Each shard's url resolved against ``base``; ValueError for one that is not a string, or, unless ``allow``,
    one outside ``base`` (see ``resolve_url``)."""
    prefix = None if base is None else base.rstrip("/") + "/"
    escaped = _escaped(base)
    if prefix is not None and urls:
        # The usual case, every url a relative path of names (as _BELOW matches), checked for a million urls at
        # once: joined by NULs (which no url may hold), and again with "/" around each, so that every part of
        # every url stands between two slashes, where an empty, "." or ".." part is a plain substring.
        try:
            joined = "\x00".join(urls)
        except TypeError:  # one is not a string: the loop below names it
            joined = None
        if (joined is not None and joined.count("\x00") == len(urls) - 1 and "\\" not in joined
                and not (escaped and "%" in joined) and max(map(len, urls)) <= MAX_URL_CHARS):  # fmt: skip
            slashed = "/" + joined.replace("\x00", "/") + "/"
            if "//" not in slashed and "/./" not in slashed and "/../" not in slashed:
                return (prefix + joined.replace("\x00", "\x00" + prefix)).split("\x00")
    out = []
    for k, url in enumerate(urls):
        if type(url) is not str or not url or len(url) > MAX_URL_CHARS:
            if url is _MISSING:
                raise ValueError(f"{where}: damaged shard index at shards[{k}]: no \"url\"; {_REBUILD}")
            why = ("is not a string" if type(url) is not str else "is empty" if not url else
                   f"is {len(url)} characters long, and a url may be at most {MAX_URL_CHARS}")  # fmt: skip
            raise _damaged(where, f"shards[{k}].url", url, why)
        if prefix is not None and _BELOW.fullmatch(url) and not (escaped and "%" in url):
            out.append(prefix + url)  # the usual case: a name below the index's directory
            continue
        resolved = resolve_url(url, base)
        if resolved is None:
            if not allow:
                raise ValueError(
                    f"{where}: shards[{k}].url {_show(url)} is outside the index's directory {base}: fastfeed reads "
                    f"only shards below an index's own directory unless told to. If you trust this index, pass "
                    f"allow_outside_urls=True (to Shards or ShardIndex.load); else {_REBUILD} beside the shards."
                )
            resolved = _joined(url, base)
        out.append(resolved)
    return out


def resolve_url(url: str, base: str | None) -> str | None:
    """Where shard ``url`` of an index in directory ``base`` is, if it is below ``base``; None if it is elsewhere
    (a ``..`` part, an absolute path or URL outside ``base``, another host), or if ``base`` is None and it is not
    a relative path. "." and empty parts are dropped; a backslash or NUL counts as elsewhere."""
    if "\x00" in url or "\\" in url:
        return None
    if "://" in url or url.startswith("/"):  # absolute: below base if it starts with it
        if base is None:
            return None
        if "://" in url and "://" in base and not (url.startswith("file://") or base.startswith("file://")):
            prefix = base.rstrip("/") + "/"
            rest = url[len(prefix) :] if url.startswith(prefix) else None
        else:  # local paths, file:// or not, compared as the paths they name
            path, root = _local(url), _local(base)
            if path is None or root is None:
                return None
            prefix = root.rstrip("/") + "/"
            rest = path[len(prefix) :] if path.startswith(prefix) else None
        if rest is None or _parts(rest, _escaped(base)) is None:
            return None
        return url
    parts = _parts(url, _escaped(base))
    if parts is None:
        return None
    return "/".join(parts) if base is None else base.rstrip("/") + "/" + "/".join(parts)


def _parts(rel: str, escaped: bool) -> list | None:
    """The names of relative path ``rel``, "." and empty parts dropped; None if it has a ".." part (read as an
    HTTP server reads it, percent escapes decoded, where ``escaped``) or no name at all."""
    if ".." in rel.split("/") or (escaped and ".." in unquote(rel).replace("\\", "/").split("/")):
        return None
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    return parts or None


def _escaped(base: str | None) -> bool:
    """Whether names below ``base`` are read with percent escapes decoded ("%2e%2e" is ".." to an HTTP server,
    and object stores are asked over HTTP); a local path's names are taken as they are."""
    return base is not None and "://" in base and not base.startswith("file://")


def _local(location: str) -> str | None:
    if location.startswith("file://"):
        return location[len("file://") :]
    return None if "://" in location else location


def _joined(url: str, base: str | None) -> str:
    """``url`` resolved against ``base`` as any location is, inside it or not (for ``allow_outside_urls``)."""
    if "://" in url or base is None or os.path.isabs(url):
        return url
    if "://" in base:
        return base.rstrip("/") + "/" + url
    return os.path.normpath(os.path.join(base, url))


def _kind(value) -> str:
    return "missing" if value is _MISSING else type(value).__name__


def _damaged(where: str, field: str, value, why: str) -> ValueError:
    return ValueError(f"{where}: damaged shard index at {field}: {_show(value)} {why}; {_REBUILD}")


def _show(value) -> str:
    """A value for an error message, cut short: a hostile one may be 100 MB."""
    if value is _MISSING:
        return "(missing)"
    if isinstance(value, str) and len(value) > 80:
        return f"{value[:60]!r}... ({len(value)} characters)"
    text = repr(value) if not isinstance(value, (dict, list)) else f"{type(value).__name__} of {len(value)}"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
