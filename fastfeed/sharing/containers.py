"""Read-only lists, tuples and dicts whose items live once, pickled, in a shared block.

Layout of a block: the pickles of every item, back to back, then an int64 array of offsets (item ``i`` is
``data[offsets[i]:offsets[i + 1]]``), and, for a dict, its keys' stable hashes sorted with the entry each names.
A dict's entry ``i`` is its key's pickle at ``offsets[2i]`` followed by its value's at ``offsets[2i + 1]``.

Nothing here is a Python object per item: reading an item touches no shared refcount, so forked workers copy
nothing, and every access pays an unpickle instead.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Mapping, Sequence

import numpy as np

from .memory import Block, Handle, Writer, attach

_HEADER = struct.Struct("<8sQQQQ")  # magic, count, offsets at, hashes at (0: none), data at
_MAGIC = b"ffshare1"

_WHY = (
    "its items live once in shared memory, for every worker and rank, so a write here could reach no other "
    "process. Copy it into a private {kind} ({kind}(x)) to change it, or change the original before calling "
    "fastfeed.share."
)


def _readonly(kind: str, what: str):
    def refuse(self, *args, **kwargs):
        raise TypeError(f"fastfeed.share: cannot {what}: this {kind} is shared read-only: " + _WHY.format(kind=kind))

    return refuse


def _canonical(key) -> bytes:
    """Bytes equal for keys that a dict treats as equal (1, 1.0, True), in every process.

    Python's own hash() of str is seeded per process, so it cannot index a table shared by spawned workers
    and other ranks.
    """
    if isinstance(key, str):
        return b"s" + key.encode("utf-8", "surrogatepass")
    if isinstance(key, (bytes, bytearray)):
        return b"b" + bytes(key)
    if isinstance(key, (bool, int)) or (isinstance(key, float) and key.is_integer()):
        return b"i" + str(int(key)).encode()
    if isinstance(key, float):
        return b"f" + repr(key).encode()
    if isinstance(key, tuple):
        return b"t(" + b",".join(_canonical(k) for k in key) + b")"
    return b"p" + pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)


def _hash(key) -> int:
    return int.from_bytes(hashlib.blake2b(_canonical(key), digest_size=8).digest(), "little") >> 1  # fits int64


def build(items, is_dict: bool, label: str) -> Block:
    """Pickle ``items`` (a sequence, or a dict's items) into a new sealed block."""
    writer = Writer(label)
    count = len(items)
    offsets = np.empty(2 * count + 1 if is_dict else count + 1, dtype=np.int64)
    dumps, proto = pickle.dumps, pickle.HIGHEST_PROTOCOL
    data_at = writer.write(b"\0" * _HEADER.size) + _HEADER.size  # the header, filled in last
    pos = 0
    if is_dict:
        hashes = np.empty(count, dtype=np.int64)
        for i, (k, v) in enumerate(items.items()):
            offsets[2 * i] = writer.write(dumps(k, proto)) - data_at
            offsets[2 * i + 1] = writer.write(dumps(v, proto)) - data_at
            hashes[i] = _hash(k)
            pos = i + 1
    else:
        for i, item in enumerate(items):
            offsets[i] = writer.write(dumps(item, proto)) - data_at
            pos = i + 1
    if pos != count:
        raise RuntimeError(f"fastfeed.share: the container changed size while it was being shared ({count} -> {pos})")
    offsets[-1] = writer.size - data_at
    writer.write(b"\0" * (-writer.size % 8))  # int64 arrays start 8-aligned
    offsets_at = writer.write(offsets.tobytes())
    hashes_at = 0
    if is_dict:
        order = np.argsort(hashes, kind="stable")
        hashes_at = writer.write(np.stack([hashes[order], order.astype(np.int64)]).tobytes())
    writer.flush()
    os.pwrite(writer.fd, _HEADER.pack(_MAGIC, count, offsets_at, hashes_at, data_at), 0)
    return writer.seal()


class _Shared:
    """What SharedList and SharedDict have in common: the block, its offsets, pickling by handle."""

    __slots__ = ("_block", "_data", "_offsets", "_count", "__weakref__")

    def _open(self, block: Block, is_dict: bool) -> int:
        """Map the block's header and offsets; returns where its hash table starts (0: none)."""
        magic, count, offsets_at, hashes_at, data_at = _HEADER.unpack_from(block.view, 0)
        if magic != _MAGIC:
            raise RuntimeError("fastfeed.share: the shared block is not one fastfeed.share wrote (bad header)")
        self._block = block
        self._count = count
        self._data = block.view[data_at:offsets_at]
        n = 2 * count + 1 if is_dict else count + 1
        # Python ints, not numpy scalars, per access: tolist() once would be a million int objects again.
        self._offsets = np.frombuffer(block.map, dtype=np.int64, count=n, offset=offsets_at)
        return hashes_at

    def _load(self, j: int):
        start, end = self._offsets[j : j + 2]
        return pickle.loads(self._data[start:end])

    def __len__(self) -> int:
        return self._count

    @property
    def handle(self) -> Handle:
        return self._block.handle()

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory it maps."""
        return self._block.size


class SharedList(_Shared, Sequence):
    """A read-only list (or tuple) held once in shared memory: indexing, slices, iteration, ``in``, ``==``."""

    __slots__ = ("_kind",)

    def __init__(self, block: Block, kind: str = "list"):
        self._open(block, False)
        self._kind = kind

    def __getitem__(self, index):
        if isinstance(index, slice):
            out = [self._load(i) for i in range(*index.indices(self._count))]
            return tuple(out) if self._kind == "tuple" else out
        try:
            i = index.__index__()
        except AttributeError:
            raise TypeError(f"{self._kind} indices must be integers or slices, not {type(index).__name__}") from None
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"{self._kind} index out of range")
        return self._load(i)

    def __iter__(self):
        for i in range(self._count):
            yield self._load(i)

    def __eq__(self, other):
        if isinstance(other, SharedList):
            return self._kind == other._kind and len(self) == len(other) and all(a == b for a, b in zip(self, other))
        if isinstance(other, (list, tuple)):
            same_kind = isinstance(other, list) == (self._kind == "list")
            return same_kind and len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self):
        if self._kind == "list":
            raise TypeError("unhashable type: 'list' (a fastfeed.share list)")
        return hash(tuple(self))

    def __repr__(self):
        return f"<fastfeed.share {self._kind} of {self._count} items, {self.nbytes} bytes shared>"

    def copy(self):
        """A private, writable copy (a plain list or tuple)."""
        return list(self) if self._kind == "list" else tuple(self)

    def __reduce__(self):
        return _attach_list, (self.handle, self._kind)

    __setitem__ = _readonly("list", "assign an item")
    __delitem__ = _readonly("list", "delete an item")
    __iadd__ = _readonly("list", "extend it (+=)")
    __imul__ = _readonly("list", "repeat it (*=)")
    append = _readonly("list", "append to it")
    extend = _readonly("list", "extend it")
    insert = _readonly("list", "insert into it")
    pop = _readonly("list", "pop from it")
    remove = _readonly("list", "remove from it")
    clear = _readonly("list", "clear it")
    sort = _readonly("list", "sort it in place")
    reverse = _readonly("list", "reverse it in place")


class SharedDict(_Shared, Mapping):
    """A read-only dict held once in shared memory; keys are found through stable hashes kept in the block."""

    __slots__ = ("_hashes", "_order")

    def __init__(self, block: Block):
        hashes_at = self._open(block, True)
        table = np.frombuffer(block.map, dtype=np.int64, count=2 * self._count, offset=hashes_at)
        self._hashes, self._order = table[: self._count], table[self._count :]

    def _key(self, i: int):
        return self._load(2 * i)

    def _find(self, key) -> int:
        h = _hash(key)
        at = int(np.searchsorted(self._hashes, h))
        while at < self._count and self._hashes[at] == h:
            i = int(self._order[at])
            if self._key(i) == key:
                return i
            at += 1
        return -1

    def __getitem__(self, key):
        i = self._find(key)
        if i < 0:
            raise KeyError(key)
        return self._load(2 * i + 1)

    def __contains__(self, key) -> bool:
        return self._find(key) >= 0

    def get(self, key, default=None):
        i = self._find(key)
        return default if i < 0 else self._load(2 * i + 1)

    def __iter__(self):
        for i in range(self._count):
            yield self._key(i)

    def items(self):
        return _Items(self)

    def values(self):
        return _Values(self)

    def __eq__(self, other):
        if isinstance(other, (dict, SharedDict)):
            return len(self) == len(other) and all(k in other and other[k] == v for k, v in self.items())
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return f"<fastfeed.share dict of {self._count} items, {self.nbytes} bytes shared>"

    def copy(self) -> dict:
        """A private, writable copy (a plain dict)."""
        return dict(self.items())

    def __reduce__(self):
        return _attach_dict, (self.handle,)

    __setitem__ = _readonly("dict", "set an item")
    __delitem__ = _readonly("dict", "delete an item")
    __ior__ = _readonly("dict", "update it (|=)")
    update = _readonly("dict", "update it")
    setdefault = _readonly("dict", "setdefault on it")
    pop = _readonly("dict", "pop from it")
    popitem = _readonly("dict", "pop from it")
    clear = _readonly("dict", "clear it")


class _View:
    """A view over a shared dict's entries, in order."""

    def __init__(self, d: SharedDict):
        self._d = d

    def __len__(self):
        return len(self._d)


class _Items(_View):
    """A dict's items in order, each entry unpickled once (Mapping's view would look every key up again)."""

    def __iter__(self):
        d = self._d
        for i in range(len(d)):
            yield d._load(2 * i), d._load(2 * i + 1)

    def __contains__(self, item):
        key, value = item
        return key in self._d and self._d[key] == value


class _Values(_View):
    def __iter__(self):
        d = self._d
        for i in range(len(d)):
            yield d._load(2 * i + 1)

    def __contains__(self, value):
        return any(v == value for v in self)


def _attach_list(handle: Handle, kind: str) -> SharedList:
    return SharedList(attach(handle), kind)


def _attach_dict(handle: Handle) -> SharedDict:
    return SharedDict(attach(handle))
