"""The tuning cache: results keyed by what determines them (dataset, loader, host), in one JSON file.

A result measured for one dataset on one machine says little about another, so the key is a
fingerprint of everything that moves the answer: the dataset's type, length and sample layout,
the batch size and collate function, the worker type and fixed settings, the host's name,
usable CPUs and memory, and fastfeed's version. The fingerprint is stored next to each entry,
so the file (``~/.cache/fastfeed/tune.json`` by default) can be read and pruned by hand.

File format::

    {"fastfeed_tune_cache": 1,
     "entries": {key: {"fingerprint": {...}, "loader_kwargs": {...}, "result": {...}, "saved": ISO-8601,
                       "confirmed": ISO-8601 or null}}}

``confirmed``: when a loader last measured the cached setting against its neighbours and found it
still the best (``recheck``); null until then (entries written before it existed lack it).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import socket
import warnings
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate

from .. import config, topology
from .result import TuneResult, write_json_atomic

CACHE_FORMAT = 1
MAX_CHILDREN = 64  # a sample that is a long list: its length and first items tell its layout well enough


def fingerprint(dataset, *, batch_size, collate_fn, worker_type, space, cpus: Iterable[int] | None = None) -> dict:
    """What a tuning result depends on, as a JSON-ready dict (hash it with ``key_of``).

    Args:
        dataset: the dataset tuned; its first sample is read (``dataset[0]``, or the first item
            of an ``IterableDataset``). A failure to read it is recorded, never raised.
        batch_size: samples per batch (None when the loader does not batch).
        collate_fn: the loader's collate function (None for torch's default).
        worker_type: ``"process"`` or ``"thread"``.
        space: the fixed settings around the search, e.g. ``{"num_workers": "auto", "prefetch_factor": 2}``.
        cpus: CPUs the workers may use; defaults to those this process may use.
    """
    from .._version import __version__

    if cpus is None:
        cpus = topology.discover().allowed_cpus
    return {
        "dataset_type": _qualname(type(dataset)),
        "len": _length(dataset),
        "sample": _first_sample(dataset),
        "batch_size": batch_size,
        "collate_fn": _collate_name(collate_fn),
        "worker_type": worker_type,
        "space": space,
        "hostname": socket.gethostname(),
        "cpus": topology.format_cpus(cpus),
        "mem_total": topology.meminfo_bytes("MemTotal"),
        "fastfeed": __version__,
    }


def key_of(fp: dict) -> str:
    """A short stable key for a fingerprint: sha256 of its canonical JSON."""
    canonical = json.dumps(fp, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class Cache:
    """Tuning results in a JSON file, safe for several processes at once.

    Readers need no lock (every write replaces the file whole, by rename); writers hold an
    exclusive ``flock`` on a sibling ``.lock`` file around read-modify-write, so concurrent
    ``put``s of different keys all survive.
    """

    def __init__(self, path=None):
        self.path = os.fspath(path) if path is not None else os.path.join(config.cache_dir(), "tune.json")

    def get(self, key: str) -> dict | None:
        """The entry saved under ``key`` (fingerprint, loader_kwargs, result, saved, confirmed), or None."""
        return self._read().get(key)

    def put(self, key: str, result: TuneResult, fp: dict) -> None:
        """Save ``result`` under ``key``, replacing any entry there."""
        entry = {
            "fingerprint": fp,
            "loader_kwargs": result.loader_kwargs(),
            "result": result.as_dict(),
            "saved": _now(),
            "confirmed": None,
        }
        with self._locked():
            entries = self._read()
            entries[key] = entry
            self._write(entries)

    def confirm(self, key: str) -> bool:
        """Mark the entry under ``key`` as confirmed now (its setting measured again and still the best); returns
        False when there is no such entry (the file was cleared or replaced meanwhile)."""
        with self._locked():
            entries = self._read()
            if key not in entries:
                return False
            entries[key]["confirmed"] = _now()
            self._write(entries)
        return True

    def entries(self) -> dict[str, dict]:
        """Every entry, by key."""
        return self._read()

    def clear(self) -> int:
        """Remove every entry; returns how many there were."""
        if not os.path.exists(self.path):
            return 0
        with self._locked():
            entries = self._read()
            self._write({})
        return len(entries)

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:  # ValueError: invalid JSON or text
            return self._unreadable(f"unreadable ({e})")
        if not (isinstance(data, dict) and data.get("fastfeed_tune_cache") == CACHE_FORMAT
                and isinstance(data.get("entries"), dict)):  # fmt: skip
            return self._unreadable("not a fastfeed tuning cache")
        return data["entries"]

    def _unreadable(self, why: str) -> dict:
        warnings.warn(f"{self.path}: {why}; treated as empty, and replaced on the next save", stacklevel=4)
        return {}

    def _write(self, entries: dict) -> None:
        write_json_atomic(self.path, {"fastfeed_tune_cache": CACHE_FORMAT, "entries": entries})

    @contextlib.contextmanager
    def _locked(self):
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, mode=0o700, exist_ok=True)  # results name the host's datasets: keep them private
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the only descriptor releases the lock


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _qualname(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _length(dataset) -> int | None:
    try:
        return len(dataset)
    except Exception:  # no __len__, or one that refuses (an IterableDataset of unknown length)
        return None


def _first_sample(dataset) -> dict:
    """The layout of the first sample; the name of the exception when it cannot be read.

    Whatever a user's dataset raises here must not fail tuning: the sample only sharpens the key.
    """
    try:
        if isinstance(dataset, IterableDataset):
            it = iter(dataset)
            try:
                sample = next(it)
            finally:
                close = getattr(it, "close", None)  # a generator: run its cleanup now, not at collection
                if close is not None:
                    close()
        else:
            sample = dataset[0]
        return _layout(sample)
    except Exception as e:
        return {"error": type(e).__name__}


def _layout(x) -> dict:
    """Structure, shapes and dtypes of a sample, without its values."""
    if isinstance(x, torch.Tensor):
        return {"kind": "tensor", "shape": list(x.shape), "dtype": str(x.dtype)}
    if isinstance(x, np.ndarray):
        return {"kind": "ndarray", "shape": list(x.shape), "dtype": str(x.dtype)}
    if isinstance(x, Mapping):
        keys = sorted(x, key=str)[:MAX_CHILDREN]
        return {"kind": "mapping", "len": len(x), "items": {str(k): _layout(x[k]) for k in keys}}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return {"kind": "namedtuple", "type": _qualname(type(x)), "items": [_layout(v) for v in x[:MAX_CHILDREN]]}
    if isinstance(x, (list, tuple)):
        return {"kind": type(x).__name__, "len": len(x), "items": [_layout(v) for v in x[:MAX_CHILDREN]]}
    return {"kind": type(x).__name__}  # a scalar, str, bytes or other object: its values vary, its type does not


def _collate_name(fn) -> str | None:
    if fn is None or fn is default_collate:
        return None
    while isinstance(fn, functools.partial):
        fn = fn.func
    return _qualname(fn if hasattr(fn, "__qualname__") else type(fn))
