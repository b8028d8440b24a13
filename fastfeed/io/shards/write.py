"""``write_shards``: a map-style dataset to WebDataset tar shards and their index, at a path or fsspec URL.

Samples are encoded in parallel (a process pool, in order, a chunk of samples per task), and the main process
writes them in dataset order, so the same dataset gives the same bytes: every header has a fixed mtime, owner and
mode. A shard ends before the sample that would take it past ``shard_bytes`` (a sample is never split). Each shard
is written to a temporary name and renamed when local, streamed to its URL otherwise; the index
(``fastfeed-index.json``) comes last, from what was written, without reading the shards again.
"""

from __future__ import annotations

import collections
import io
import json
import os
import re
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from . import sources
from .index import FILENAME, ShardIndex, _bar, _has_scheme
from .tar import BLOCK, split

SHARD_BYTES = 256 << 20  # webdataset suggests 100 MB - 1 GB: large sequential reads, few files to list
MTIME = 0  # fixed header fields: the same dataset writes the same bytes
MODE = 0o444
_IMAGE_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "gif": "GIF",
                  "tif": "TIFF", "tiff": "TIFF", "ppm": "PPM"}  # fmt: skip


def write_shards(dataset, dest, *, shard_bytes: int = SHARD_BYTES, encode: Callable | None = None,
                 num_workers: int | None = None, pattern: str = "shard-%06d.tar", progress: bool = True,
                 storage_options: dict | None = None, overwrite: bool = False,
                 chunksize: int = 64) -> list[str]:  # fmt: skip
    """Write ``dataset`` into tar shards that webdataset and ``fastfeed.io.Shards`` read, with their index.

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``).
        dest: a directory (created if missing) or an fsspec URL prefix (``s3://bucket/set/``).
        shard_bytes: a shard ends before the sample that would take it past this many bytes.
        encode: ``sample -> {ext: value}``, run in the workers; None: the default encoding (below). A ``__key__``
            entry sets the sample's key (default ``%09d`` of its index). Values are encoded as below.
        num_workers: encoding processes; 0: threads in this process (for encoders that only read files);
            None: ``min(8, cpus)``.
        pattern: shard file names, ``%``-formatted with the shard's number.
        progress: a tqdm bar over samples.
        storage_options: passed to fsspec for URLs.
        overwrite: replace shards (and an index) already at ``dest``; without it, finding any is an error.
        chunksize: samples per encoding task.

    Default encoding: a dict sample is ``{ext: value}`` (entries whose name starts with ``_`` other than
    ``__key__`` are skipped); bytes as they are, str as UTF-8, int/float/bool as their ``str``, dict/list as JSON,
    a numpy array or torch tensor as ``.npy`` bytes, a PIL image in the format its ext names (``jpg``, ``png``...),
    else its own format, else PNG. An ImageFolder-like dataset (a ``samples`` list of ``(path, label)``) is written
    without decoding: ``{ext of the file: the file's bytes, "cls": label}`` (its ``transform`` and
    ``target_transform`` are not applied: the shards hold the files as they are). Exts are lowercased, as readers
    lowercase them.

    Returns:
        The shards' paths or URLs, in order.

    Raises:
        ValueError: ``dest`` already holds shards (pass ``overwrite=True``), a sample encodes to nothing, an ext
            is empty or holds a ``/``, a key cannot be split back from its member names, or two samples share a key.
        TypeError: a value the default encoding cannot write (pass ``encode=``).
    """
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < BLOCK:
        raise ValueError(f"write_shards: shard_bytes must be an int >= {BLOCK}, got {shard_bytes!r}")
    if num_workers is None:
        num_workers = min(8, os.cpu_count() or 1)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"write_shards: num_workers must be an int >= 0, got {num_workers!r}")
    if encode is not None and not callable(encode):
        raise TypeError("write_shards: encode must be callable (sample -> {ext: value}), "
                        f"got {type(encode).__name__}")  # fmt: skip
    try:
        pattern % 0
    except (TypeError, ValueError):
        raise ValueError(f"write_shards: pattern must hold one %d-style field, got {pattern!r}") from None
    if "/" in pattern or pattern == FILENAME:
        raise ValueError(f"write_shards: pattern is a file name in dest, without '/'; got {pattern!r}")
    n = len(dataset)
    if n == 0:
        raise ValueError("write_shards: the dataset is empty")
    out = _Destination(os.fspath(dest), pattern, storage_options, overwrite)
    bar = _bar(progress, n, "writing shards", "sample")
    written: list[dict] = []
    samples = _encoded(dataset, encode, num_workers, chunksize)
    shard = None
    try:
        custom_keys: set[str] = set()
        for i, (key, members) in enumerate(samples):
            if key is None:
                key = f"{i:09d}"
            else:
                if key in custom_keys:
                    raise ValueError(f"write_shards: samples share the key {key!r} (sample {i}); keys must be unique")
                custom_keys.add(key)
            data = _sample_bytes(key, members, i)
            if shard is not None and shard.size > 0 and shard.size + len(data) > shard_bytes - 2 * BLOCK:
                written.append(shard.close())
                shard = None
            if shard is None:
                shard = out.open(len(written))
            shard.add(key, data)
            if bar is not None:
                bar.update(1)
        written.append(shard.close())
        shard = None
    finally:
        if shard is not None:
            shard.abort()
        samples.close()  # ends the encoding pool now, not when an exception's traceback lets the generator go
        if bar is not None:
            bar.close()
        if shard is not None and out.fs is not None:  # failed: the upload's connections go now too
            sources.release(out.fs)
    try:
        index = ShardIndex.from_shards(written)
        index.save(out.index_location(), storage_options)
        out.remove_stale([s["url"] for s in written])
    finally:
        if out.fs is not None:
            sources.release(out.fs)
    return [s["url"] for s in written]


# -- encoding -------------------------------------------------------------------------------------


def _encoded(dataset, encode, num_workers: int, chunksize: int) -> Iterator[tuple[str | None, list]]:
    """``(key or None, [(ext, bytes)])`` of every sample, in order. Chunks are submitted a bounded window ahead of
    the writer (``Pool.imap`` would encode the whole dataset into memory when writing is the slower part, as an
    upload often is)."""
    n = len(dataset)
    chunks = [(a, min(a + chunksize, n)) for a in range(0, n, chunksize)]
    if num_workers == 0:
        threads = min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(threads, thread_name_prefix="fastfeed-write") as pool:
            try:
                yield from _in_order(chunks, 2 * threads, lambda c: pool.submit(_encode_range, dataset, encode, c),
                                     lambda fut: fut.result())  # fmt: skip
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        return
    import multiprocessing

    workers = min(num_workers, len(chunks))
    pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(dataset, encode))
    try:
        yield from _in_order(chunks, 2 * workers, lambda c: pool.apply_async(_encode_task, (c,)),
                             lambda res: res.get())  # fmt: skip
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _in_order(chunks: list, window: int, submit, result) -> Iterator:
    pending = collections.deque(submit(c) for c in chunks[:window])
    for j in range(len(chunks)):
        if j + window < len(chunks):
            pending.append(submit(chunks[j + window]))
        yield from result(pending.popleft())


_WORKER: tuple = ()


def _init_worker(dataset, encode) -> None:
    global _WORKER
    _WORKER = (dataset, encode)


def _encode_task(chunk: tuple[int, int]) -> list:
    return _encode_range(*_WORKER, chunk)


def _encode_range(dataset, encode, chunk: tuple[int, int]) -> list:
    return [_encode_one(dataset, encode, i) for i in range(*chunk)]


def _encode_one(dataset, encode, i: int) -> tuple[str | None, list]:
    if encode is None:
        item = _folder_item(dataset, i)
        if item is not None:
            return None, item
        sample = dataset[i]
    else:
        sample = encode(dataset[i])
    if not isinstance(sample, dict):
        raise TypeError(f"write_shards: sample {i} is a {type(sample).__name__}, not a dict of {{ext: value}}; "
                        "pass encode= to turn it into one")  # fmt: skip
    key = sample.get("__key__")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"write_shards: sample {i}'s __key__ must be a str, got {type(key).__name__}")
    members = [(str(ext), _value_bytes(v, str(ext), i)) for ext, v in sample.items() if not str(ext).startswith("_")]
    return key, members


def _folder_item(dataset, i: int) -> list | None:
    """An ImageFolder-like dataset's sample i, as the file's own bytes and its label, or None for another kind."""
    samples = getattr(dataset, "samples", None)
    if samples is None:
        return None
    try:
        item = samples[i]
    except (TypeError, IndexError, KeyError):
        return None
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], (str, os.PathLike))):
        return None
    path, label = item
    if isinstance(label, bool) or not hasattr(label, "__index__"):  # int or numpy int: a class id
        return None
    path = os.fspath(path)
    ext = path.rsplit(".", 1)[1] if "." in os.path.basename(path) else "bin"
    with open(path, "rb") as f:
        data = f.read()
    return [(ext, data), ("cls", str(int(label)).encode())]


def _value_bytes(value, ext: str, i: int) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bool, int, float)):
        return str(value).encode()
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value).encode()
    mod = type(value).__module__.split(".", 1)[0]
    if mod == "torch":
        value = value.detach().cpu().numpy()
        mod = "numpy"
    if mod == "numpy":
        import numpy as np

        if isinstance(value, np.generic):
            return str(value.item()).encode()
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    if mod == "PIL":
        fmt = _IMAGE_FORMATS.get(ext.rsplit(".", 1)[-1].lower()) or getattr(value, "format", None) or "PNG"
        buf = io.BytesIO()
        value.save(buf, format=fmt)
        return buf.getvalue()
    raise TypeError(f"write_shards: sample {i}'s {ext!r} is a {type(value).__name__}, which the default encoding "
                    "cannot write; pass encode= returning bytes for it")  # fmt: skip


# -- tar ------------------------------------------------------------------------------------------


def _sample_bytes(key: str, members: list, i: int) -> bytes:
    """The tar members of one sample (headers, data, padding), checked to read back as this key and these exts."""
    if not members:
        raise ValueError(f"write_shards: sample {i} (key {key!r}) encodes to nothing: no member to write")
    parts, exts = [], set()
    for ext, data in members:
        ext_l = ext.lower()
        if not ext_l or "/" in ext_l:
            raise ValueError(f"write_shards: sample {i} (key {key!r}) has ext {ext!r}: an ext must be non-empty "
                             "and hold no '/'")  # fmt: skip
        if ext_l in exts:
            raise ValueError(f"write_shards: sample {i} (key {key!r}) has ext {ext_l!r} twice (exts are lowercased)")
        exts.add(ext_l)
        name = f"{key}.{ext_l}"
        if split(name) != (key, ext_l):
            raise ValueError(f"write_shards: sample {i}'s key {key!r} does not read back from the member name "
                             f"{name!r} (a key's last part must be non-empty and hold no '.', and must not be "
                             "__meta__)")  # fmt: skip
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), MTIME, MODE
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        parts.append(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
        parts.append(data)
        pad = -len(data) % BLOCK
        if pad:
            parts.append(bytes(pad))
    return b"".join(parts)


class _Destination:
    def __init__(self, dest: str, pattern: str, storage_options: dict | None, overwrite: bool) -> None:
        self.dest, self.pattern, self.storage_options = dest, pattern, storage_options
        self.remote = _has_scheme(dest)
        glob = re.sub(r"%[-+ #0]*\d*d", "*", pattern.replace("*", "[*]"))
        if self.remote:
            self.fs, path = sources.filesystem(dest, storage_options)
            self.root = path.rstrip("/")
            self.prefix = dest.rstrip("/")
            self.fs.makedirs(self.root, exist_ok=True)
            found = self.fs.glob(f"{self.root}/{glob}") + self.fs.glob(f"{self.root}/{FILENAME}")
        else:
            self.fs, self.root = None, os.path.abspath(dest)
            self.prefix = self.root
            if os.path.exists(self.root) and not os.path.isdir(self.root):
                raise ValueError(f"write_shards: dest {dest!r} is a file, not a directory")
            os.makedirs(self.root, exist_ok=True)
            import glob as globbing

            found = globbing.glob(os.path.join(globbing.escape(self.root), glob))
            found += [p for p in [os.path.join(self.root, FILENAME)] if os.path.exists(p)]
        if found and not overwrite:
            raise ValueError(f"write_shards: dest {dest!r} already holds shards or an index "
                             f"({os.path.basename(sorted(found)[0])} among {len(found)}); pass overwrite=True to "
                             "replace them, or choose an empty dest")  # fmt: skip
        self.stale = sorted(found)  # replaced files that this run does not rewrite are removed at the end

    def location(self, k: int) -> str:
        return f"{self.prefix}/{self.pattern % k}" if self.remote else os.path.join(self.root, self.pattern % k)

    def index_location(self) -> str:
        return f"{self.prefix}/{FILENAME}" if self.remote else os.path.join(self.root, FILENAME)

    def remove_stale(self, written: list[str]) -> None:
        """With overwrite, the old shards this run did not replace: a directory listing would find them."""
        keep = {os.path.basename(u) for u in written} | {FILENAME}
        for path in self.stale:
            if os.path.basename(path.rstrip("/")) not in keep:
                if self.remote:
                    self.fs.rm(path)
                else:
                    os.unlink(path)

    def open(self, k: int) -> _ShardFile:
        url = self.location(k)
        if self.remote:
            path = f"{self.root}/{self.pattern % k}"
            return _ShardFile(url, self.fs.open(path, "wb"), None, (self.fs, path))
        tmp = f"{url}.tmp{os.getpid()}"
        return _ShardFile(url, open(tmp, "wb"), tmp, None)


class _ShardFile:
    def __init__(self, url: str, f, tmp: str | None, remote: tuple | None) -> None:
        self.url, self.f, self.tmp, self.remote = url, f, tmp, remote
        self.size = 0
        self.crc = 0
        self.keys: list[str] = []
        self.offsets: list[int] = []

    def add(self, key: str, data: bytes) -> None:
        self.keys.append(key)
        self.offsets.append(self.size)
        self.f.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)

    def close(self) -> dict:
        end = self.size
        tail = bytes(2 * BLOCK)  # tar's end of archive
        self.f.write(tail)
        self.crc = zlib.crc32(tail, self.crc)
        self.size += len(tail)
        self.f.close()
        if self.tmp is not None:
            os.replace(self.tmp, self.url)
        return {"url": self.url, "size": self.size, "crc32": self.crc, "keys": self.keys,
                "offsets": self.offsets + [end]}  # fmt: skip

    def abort(self) -> None:
        """Leave no partial shard: a local temp file is removed, an upload discarded (or deleted once made)."""
        try:
            discard = getattr(self.f, "discard", None) if self.remote is not None else None
            if discard is not None:
                discard()
            else:
                self.f.close()
        finally:
            if self.tmp is not None and os.path.exists(self.tmp):
                os.unlink(self.tmp)
            if self.remote is not None:
                fs, path = self.remote
                if fs.exists(path):
                    fs.rm(path)
