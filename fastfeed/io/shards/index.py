"""The index of a shard set: each shard's size and crc32, and each sample's key and byte range.

Random access to tar shards needs one: a tar has no table of contents. ``index_shards(source)`` builds it by
reading each shard once (streaming, in parallel threads); ``write_shards`` writes it beside the shards it writes.

File format (``fastfeed-index.json`` beside the shards by default), JSON::

    {
      "format": "fastfeed-shard-index",
      "version": 1,
      "shards": [
        {
          "url": "shard-000000.tar",      # relative to the index file's directory when the shard is in it (or
                                          # below it), so a shard set moves with its index; else absolute/URL,
                                          # which a reader refuses unless told (allow_outside_urls=True)
          "size": 1048576000,             # bytes of the whole shard file
          "crc32": 3735928559,            # zlib.crc32 of the whole shard file, unsigned
          "first": 0,                     # byte offset of the first sample's first header
          "lengths": [102912, 103424],    # bytes of each sample's range, in tar order: sample i spans
                                          # [first + sum(lengths[:i]), first + sum(lengths[:i+1]))
          "keys": ["000000000", "000000001"]   # each sample's key, in the same order
        }
      ]
    }

A sample's range starts at its first member's first header (GNU long-name and pax headers included) and runs to
the next sample's; the last one ends where the tar's end-of-archive blocks begin. Lengths rather than offsets keep
the file small (a 100 KB sample's length is 6 digits, its offset in a 1 GB shard 10). Readers must reject a file
whose "format" differs or whose "version" is greater than theirs.

A reader treats the file as hostile input (``index_check``): every field is checked for its type and range before
anything is allocated from it, and a url outside the index's directory is refused unless the caller opts in.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Sequence

import numpy as np

from .. import remote
from . import index_check, sources
from .errors import ShardError
from .tar import CHUNK, Scan

FILENAME = "fastfeed-index.json"
FORMAT = "fastfeed-shard-index"
VERSION = 1


class Keys(NamedTuple):
    """Sample keys, compactly: their UTF-8 bytes end to end, and each one's length."""

    blob: bytes
    lengths: np.ndarray  # int64

    @classmethod
    def of(cls, keys: Sequence[str]) -> Keys:
        encoded = [k.encode("utf-8", "surrogateescape") for k in keys]
        return cls(b"".join(encoded), np.fromiter(map(len, encoded), np.int64, len(encoded)))

    @classmethod
    def join(cls, parts: Sequence[Keys]) -> Keys:
        return cls(b"".join(p.blob for p in parts),
                   np.concatenate([p.lengths for p in parts]) if parts else np.zeros(0, np.int64))  # fmt: skip


class ShardIndex:
    """The shards of a dataset and the byte range of every sample in them. Immutable; pickles as a few arrays.

    Attributes:
        urls: shard locations, in source order.
        sizes: ``np.int64[n]`` bytes of each shard file.
        crcs: ``np.uint32[n]`` zlib.crc32 of each whole shard file.
        counts: ``np.int64[n]`` samples in each shard.
        starts: ``np.int64[n + 1]`` global id of each shard's first sample; ``starts[-1]`` is the total.
        offsets: ``np.int64[total + n]``: shard k's sample i spans ``[offsets[starts[k] + k + i],
            offsets[starts[k] + k + i + 1])``.
    """

    def __init__(self, urls: Sequence[str], sizes, crcs, counts, offsets, keys) -> None:
        """Build from per-shard arrays (``offsets`` as in the class docstring, ``keys`` every sample's key in global
        order: a list, or ``Keys``). ``ShardIndex.from_shards`` and ``load`` are the usual ways in."""
        self.urls = list(urls)
        n = len(self.urls)
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(n)
        self.crcs = np.asarray(crcs, dtype=np.uint32).reshape(n)
        self.counts = np.asarray(counts, dtype=np.int64).reshape(n)
        self.starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.counts, out=self.starts[1:])
        total = int(self.starts[-1])
        self.offsets = np.asarray(offsets, dtype=np.int64).reshape(total + n)
        # Millions of str objects cost ~60 bytes each and pickle slowly to every worker; one bytes blob and its
        # boundaries do not, and a key is decoded only when asked for.
        keys = keys if isinstance(keys, Keys) else Keys.of(keys)
        if len(keys.lengths) != total:
            raise ValueError(f"ShardIndex: {len(keys.lengths)} keys for {total} samples")
        self._key_ends = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(keys.lengths, out=self._key_ends[1:])
        self._key_blob = keys.blob
        for name in ("sizes", "crcs", "counts", "starts", "offsets", "_key_ends"):
            getattr(self, name).flags.writeable = False

    @classmethod
    def from_shards(cls, shards: Sequence[dict]) -> ShardIndex:
        """From one dict per shard: ``url``, ``size``, ``crc32``, ``keys`` (a list, or ``Keys``) and ``offsets``
        (len(keys) + 1)."""
        offsets = [np.asarray(s["offsets"], dtype=np.int64) for s in shards]
        keys = [s["keys"] if isinstance(s["keys"], Keys) else Keys.of(s["keys"]) for s in shards]
        for s, o, k in zip(shards, offsets, keys):
            if len(o) != len(k.lengths) + 1:
                raise ValueError(f"ShardIndex: shard {s['url']} has {len(k.lengths)} keys and {len(o)} offsets")
        return cls([s["url"] for s in shards], [s["size"] for s in shards], [s["crc32"] for s in shards],
                   [len(k.lengths) for k in keys], np.concatenate(offsets) if offsets else np.zeros(0, np.int64),
                   Keys.join(keys))  # fmt: skip

    # -- queries ----------------------------------------------------------------------------------

    @property
    def n_samples(self) -> int:
        return int(self.starts[-1])

    @property
    def n_shards(self) -> int:
        return len(self.urls)

    def __len__(self) -> int:
        return self.n_samples

    def shard_of(self, sample_id: int) -> int:
        """The shard holding global sample ``sample_id``."""
        if not 0 <= sample_id < self.n_samples:
            raise IndexError(f"sample {sample_id} out of range: the index holds {self.n_samples}")
        return int(np.searchsorted(self.starts, sample_id, side="right")) - 1

    def locate(self, sample_id: int) -> tuple[int, int, int]:
        """``(shard k, start byte, end byte)`` of global sample ``sample_id``."""
        k = self.shard_of(sample_id)
        j = sample_id + k
        return k, int(self.offsets[j]), int(self.offsets[j + 1])

    def key(self, sample_id: int) -> str:
        """The key of global sample ``sample_id``."""
        if not 0 <= sample_id < self.n_samples:
            raise IndexError(f"sample {sample_id} out of range: the index holds {self.n_samples}")
        a, b = self._key_ends[sample_id], self._key_ends[sample_id + 1]
        return self._key_blob[a:b].decode("utf-8", "surrogateescape")

    @property
    def keys(self) -> list[str]:
        """Every key, in global order (built on each call: use ``key(i)`` for one)."""
        return [self.key(i) for i in range(self.n_samples)]

    def shard_keys(self, k: int) -> list[str]:
        return [self.key(i) for i in range(int(self.starts[k]), int(self.starts[k + 1]))]

    def _shard_key_bytes(self, k: int) -> Keys:
        ends = self._key_ends[int(self.starts[k]):int(self.starts[k + 1]) + 1]
        return Keys(self._key_blob[int(ends[0]):int(ends[-1])], np.diff(ends))

    def shard_offsets(self, k: int) -> np.ndarray:
        """The ``counts[k] + 1`` offsets of shard k's samples."""
        a = int(self.starts[k]) + k
        return self.offsets[a : a + int(self.counts[k]) + 1]

    def subset(self, urls: Sequence[str]) -> ShardIndex:
        """The index of these shards of this one, in this order (for a source naming part of an indexed set)."""
        where = {u: k for k, u in enumerate(self.urls)}
        missing = [u for u in urls if u not in where]
        if missing:
            raise ValueError(f"ShardIndex.subset: {len(missing)} shards are not in this index, e.g. {missing[0]}")
        ks = [where[u] for u in urls]
        return ShardIndex.from_shards([{"url": self.urls[k], "size": int(self.sizes[k]), "crc32": int(self.crcs[k]),
                                        "keys": self._shard_key_bytes(k), "offsets": self.shard_offsets(k)}
                                       for k in ks])  # fmt: skip

    @property
    def fingerprint(self) -> str:
        """sha256 (hex) of the shards' file names, sizes, sample counts and crc32s: the same shard set, wherever it
        is stored, has the same fingerprint."""
        names = [posixpath.basename(u.rstrip("/")) for u in self.urls]
        payload = json.dumps([names, self.sizes.tolist(), self.counts.tolist(), self.crcs.tolist()],
                             separators=(",", ":"))  # fmt: skip
        return hashlib.sha256(payload.encode()).hexdigest()

    def __eq__(self, other) -> bool:
        if not isinstance(other, ShardIndex):
            return NotImplemented
        return (self.urls == other.urls and self._key_blob == other._key_blob
                and all(np.array_equal(getattr(self, a), getattr(other, a))
                        for a in ("sizes", "crcs", "counts", "offsets", "_key_ends")))  # fmt: skip

    __hash__ = None

    def __repr__(self) -> str:
        return f"ShardIndex({self.n_shards} shards, {self.n_samples} samples, {int(self.sizes.sum())} bytes)"

    # -- the file ---------------------------------------------------------------------------------

    def to_json(self, base: str | None = None) -> dict:
        """The JSON document (see the module docstring); shard URLs relative to directory ``base`` where they are
        in it."""
        shards = []
        for k, url in enumerate(self.urls):
            off = self.shard_offsets(k)
            shards.append({"url": _relative(url, base), "size": int(self.sizes[k]), "crc32": int(self.crcs[k]),
                           "first": int(off[0]) if len(off) else 0, "lengths": np.diff(off).tolist(),
                           "keys": self.shard_keys(k)})  # fmt: skip
        return {"format": FORMAT, "version": VERSION, "shards": shards}

    @classmethod
    def from_json(cls, doc: dict, base: str | None = None, where: str = "index", *,
                  allow_outside_urls: bool = False) -> ShardIndex:  # fmt: skip
        """Parse a JSON document (as ``json.loads`` gives it); relative shard URLs are resolved against directory
        ``base``. Every field is checked first (``index_check``); a shard URL outside ``base`` is refused unless
        ``allow_outside_urls``. ValueError names ``where`` and the field."""
        return cls._of(index_check.check(doc, None, base, where, allow_outside_urls))

    @classmethod
    def from_bytes(cls, raw, base: str | None = None, where: str = "index", *,
                   allow_outside_urls: bool = False) -> ShardIndex:  # fmt: skip
        """Parse an index file's bytes, as ``from_json`` does its document: nesting is bounded before the JSON is
        parsed, and each shard's lists are made compact as it is (a large index never holds every key as a Python
        str: ~60 bytes each, 6 GB for 100M keys)."""
        doc, parsed = index_check.decode(raw, where)
        return cls._of(index_check.check(doc, parsed, base, where, allow_outside_urls))

    @classmethod
    def _of(cls, c: index_check.Checked) -> ShardIndex:
        return cls(c.urls, c.sizes, c.crcs, c.counts, c.offsets, Keys(c.key_blob, c.key_lengths))

    def save(self, dest: str, storage_options: dict | None = None) -> str:
        """Write the index as JSON to ``dest`` (a path or fsspec URL of the file, or of a directory to put
        ``fastfeed-index.json`` in); returns where it went. Written to a temporary name and renamed when local."""
        dest = os.fspath(dest)
        if _has_scheme(dest):
            if dest.endswith("/"):
                dest += FILENAME
            data = json.dumps(self.to_json(_dirname(dest)), separators=(",", ":")).encode()
            with sources.opened(dest, storage_options) as (fs, path):
                if _may_be_dir(fs, dest) and fs.isdir(path):
                    dest, path = dest.rstrip("/") + "/" + FILENAME, path.rstrip("/") + "/" + FILENAME
                with fs.open(path, "wb") as f:
                    f.write(data)
            return dest
        dest = os.path.abspath(dest)
        if os.path.isdir(dest):
            dest = os.path.join(dest, FILENAME)
        data = json.dumps(self.to_json(os.path.dirname(dest)), separators=(",", ":")).encode()
        tmp = f"{dest}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return dest

    @classmethod
    def load(cls, src: str, storage_options: dict | None = None, *, retries: int | None = None,
             retry_budget: float | None = None, timeout: float = 60.0, cache_dir=None,
             allow_outside_urls: bool = False) -> ShardIndex:  # fmt: skip
        """Read an index file (a path or fsspec URL, or a directory holding ``fastfeed-index.json``).

        A remote read that fails transiently (a 503, a reset, a refused connection, a timeout: no byte for
        ``timeout`` s) is retried with backoff for ``retry_budget`` seconds after its first failure (None: the
        default, ``fastfeed.io.remote.DEFAULT_RETRY_BUDGET_S``), and at most ``retries`` times when given
        (``fastfeed.io.remote.retry``); a missing file raises FileNotFoundError at once, and a read that failed for
        good OSError naming the index and the cause.

        ``cache_dir``: a directory this machine's readers share (``Shards``' cache directory): a remote index is
        then asked of its store by one of them and read from there by the others (``cache.read_once``), so a
        node's ranks make one request for it, not one each.

        The file is checked as hostile input (see ``from_bytes``): ValueError names the index and the field. A
        shard URL outside the index's directory (``../``, an absolute path, ``file://``, another host) is refused
        unless ``allow_outside_urls``.
        """
        src = os.fspath(src)
        if remote.is_url(src):
            remote.check_retry_args(retries, retry_budget, f"shard index {src}")

            def fetch() -> tuple[bytes, str]:
                """(the index's bytes, where they were read), in one GET: fsspec's open() would first ask the size
                (a HEAD), and so would s3fs's cat_file unless told to read in one request."""
                with sources.opened(src, storage_options, timeout) as (fs, path):
                    where = [src]
                    one = {"max_concurrency": 1} if {"s3", "s3a"} & set(_protocols(fs)) else {}

                    def read() -> bytes:
                        at = path
                        if src.endswith("/") or (_may_be_dir(fs, src) and fs.isdir(path)):
                            where[0], at = src.rstrip("/") + "/" + FILENAME, path.rstrip("/") + "/" + FILENAME
                        return fs.cat_file(at, **one)

                    try:
                        raw = remote.retry(read, retries, what=f"shard index {src}", timeout=timeout,
                                           budget=retry_budget, url=src)  # fmt: skip
                    except FileNotFoundError:
                        raise FileNotFoundError(f"shard index {where[0]}: not found (build one with "
                                                "fastfeed.io.index_shards)") from None  # fmt: skip
                    except PermissionError as e:
                        raise PermissionError(f"shard index {where[0]}: access denied ({remote.describe(e)}); "
                                              "check storage_options' credentials") from e  # fmt: skip
                    except remote.RemoteError as e:
                        raise e.within(f"shard index {where[0]}: reading it") from e
                return raw, where[0]

            if cache_dir is None:
                raw, src = fetch()
            else:
                from .cache import read_once

                raw, src = read_once(cache_dir, src, fetch)
        else:
            path = os.path.abspath(remote.local_path(src))
            if os.path.isdir(path):
                path = os.path.join(path, FILENAME)
            # A file:// index keeps that spelling, so that its shards' relative names resolve to file:// URLs too.
            src = path if src == remote.local_path(src) else "file://" + path
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                raise FileNotFoundError(f"shard index {src}: not found (build one with fastfeed.io.index_shards)")
        return cls.from_bytes(raw, _dirname(src), where=f"shard index {src}", allow_outside_urls=allow_outside_urls)


def index_shards(source, *, dest=None, storage_options: dict | None = None, num_threads: int = 8,
                 progress: bool = False, retries: int | None = None, retry_budget: float | None = None,
                 timeout: float = 60.0) -> ShardIndex:  # fmt: skip
    """Index a shard set: read each shard once, streaming, ``num_threads`` shards at a time.

    Args:
        source: the shards (see ``sources.resolve``: a list, a directory, a brace pattern, a glob, a URL).
        dest: None: do not save; True: save as ``fastfeed-index.json`` in the first shard's directory; a path or
            URL: save there.
        storage_options: passed to fsspec for URLs.
        num_threads: shards read at once.
        progress: show a progress bar over shards (tqdm).
        retries: further attempts at most at a listing or a shard's read that failed transiently (a 5xx such as
            S3's 503 SlowDown, a reset or refused connection, a timeout), with jittered backoff
            (``fastfeed.io.remote.retry``); None: as many as ``retry_budget`` allows. A missing shard (404) fails
            at once.
        retry_budget: seconds a request keeps being tried after its first failure (None:
            ``remote.DEFAULT_RETRY_BUDGET_S``), the same policy as ``Shards``'.
        timeout: seconds a request may send nothing before the attempt fails.

    Returns:
        The index, its shards in source order.

    Raises:
        ShardError: a shard is missing, short or damaged, repeats a key after other samples, or could not be read
            within the retry policy.
        OSError: listing the source failed every attempt.
    """
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"index_shards: num_threads must be an int >= 1, got {num_threads!r}")
    remote.check_retry_args(retries, retry_budget, "index_shards")
    if not timeout > 0:
        raise ValueError(f"index_shards: timeout must be > 0 seconds, got {timeout!r}")
    urls = sources.resolve(source, storage_options, retries=retries, retry_budget=retry_budget, timeout=timeout)
    fs_cache: dict = {}

    def one(url: str) -> dict:
        return scan_shard(url, storage_options, fs_cache, retries=retries, retry_budget=retry_budget,
                          timeout=timeout)  # fmt: skip

    bar = _bar(progress, len(urls), "indexing shards", "shard")
    try:
        with ThreadPoolExecutor(min(num_threads, len(urls)), thread_name_prefix="fastfeed-index") as pool:
            shards = []
            for result in pool.map(one, urls):
                shards.append(result)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        for fs in fs_cache.values():
            sources.release(fs)
    index = ShardIndex.from_shards(shards)
    if dest is True:
        index.save(_dirname(urls[0]) + ("/" if _has_scheme(urls[0]) else os.sep) + FILENAME, storage_options)
    elif dest is not None and dest is not False:
        index.save(dest, storage_options)
    return index


def scan_shard(url: str, storage_options: dict | None = None, fs_cache: dict | None = None, *,
               retries: int | None = None, retry_budget: float | None = None, timeout: float = 60.0) -> dict:  # fmt: skip
    """One shard's entry (``url``, ``size``, ``crc32``, ``keys``, ``offsets``), from one streaming read; a read
    that fails transiently is started again from the shard's first byte, within the retry policy of
    ``remote.retry`` (``retries``, ``retry_budget``), paced by its store's rate."""
    fs = None
    if remote.is_url(url):
        fs_key = url.split("://", 1)[0]
        cache = fs_cache if fs_cache is not None else {}
        if fs_key not in cache:
            cache[fs_key] = sources.filesystem(url, storage_options, timeout)[0]
        fs = cache[fs_key]
    last_key = [None]  # the sample being read when the last attempt failed, for the error

    def scan() -> dict:
        last_key[0] = None
        if fs is not None:
            f = fs.open(fs._strip_protocol(url), "rb", block_size=CHUNK)
        else:
            f = open(remote.local_path(url), "rb", buffering=0)
        with f:
            scan = Scan(f, url)
            keys, offsets = [], []
            for key, at in scan.samples():
                keys.append(key)
                offsets.append(at)
                last_key[0] = key
        offsets.append(scan.end)
        return {"url": url, "size": scan.size, "crc32": scan.crc, "keys": keys, "offsets": offsets}

    try:
        # ShardError: the bytes arrived and are not a valid shard; reading them again would not change that.
        return remote.retry(scan, retries, what=f"shard {url}", final=(ShardError,), timeout=timeout,
                            budget=retry_budget, url=url if fs is not None else None)  # fmt: skip
    except (FileNotFoundError, PermissionError, remote.RemoteError) as e:
        raise ShardError.gave_up(url, e, "read", last_key[0]) from e
    except ShardError:
        raise
    except OSError as e:  # a local path that is not a file (IsADirectoryError...)
        raise ShardError(url, f"could not be read ({remote.describe(e)})") from e
    finally:
        if fs is not None and fs_cache is None:  # this call's own filesystem; a caller's cache is closed by it
            sources.release(fs)


def _bar(progress: bool, total: int, desc: str, unit: str):
    if not progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit)


def _may_be_dir(fs, url: str) -> bool:
    """Whether asking if ``url`` is a directory is worth a request: not for a ``.json`` name (the index beside a
    shard set is one, so a start-up asks nothing but its GET), and never over HTTP, where it would download the
    file to look for links in it."""
    return not url.endswith(".json") and not {"http", "https"} & set(_protocols(fs))


def _protocols(fs) -> tuple:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _has_scheme(s: str) -> bool:
    # How a location is joined and split: by "/" when it has a scheme, file:// included (which remote.is_url does
    # not call remote, since it is read locally), else as an OS path.
    return "://" in s


def _dirname(location: str) -> str:
    if _has_scheme(location):
        return location.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(location))


def _relative(url: str, base: str | None) -> str:
    """``url`` relative to directory ``base`` when it is inside it, else as it is. A local path and a ``file://``
    URL are compared as the paths they name, so that every index fastfeed writes of shards beside it names them
    relatively, as a reader accepts without ``allow_outside_urls``."""
    if base is None:
        return url
    if _has_scheme(url) and _has_scheme(base) and not (url.startswith("file://") or base.startswith("file://")):
        prefix = base.rstrip("/") + "/"
        return url[len(prefix) :] if url.startswith(prefix) else url
    if (_has_scheme(url) and not url.startswith("file://")) or (_has_scheme(base) and not base.startswith("file://")):
        return url  # one local, one remote
    rel = os.path.relpath(os.path.abspath(remote.local_path(url)), os.path.abspath(remote.local_path(base)))
    return url if rel == os.curdir or rel.split(os.sep)[0] == os.pardir else rel.replace(os.sep, "/")
