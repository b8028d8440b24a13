"""Find the large Python containers a dataset holds: the ones that forked workers copy page by page.

A forked worker shares its parent's memory until it writes to it, and merely reading a Python object writes its
reference count (and, for containers, the garbage collector's links). So every list, tuple or dict of a million
small objects that ``__getitem__`` walks ends up copied into every worker: memory grows as workers x ranks
(pytorch/pytorch#13246). numpy arrays and tensors do not have the problem (their data is one buffer that reading
never writes), so they are skipped.

The estimate is cheap by design (the loader calls it at start, the doctor on a live dataset): up to ``SAMPLE``
items, spread over the container, are sized with ``sys.getsizeof`` two levels deep, and the mean is scaled to the
container's length.
"""

from __future__ import annotations

import itertools
import sys
import types
from typing import Any, NamedTuple

SAMPLE = 1000  # items sized per container: enough for a stable mean, cheap on a 1M-item list (a few ms)

_CONTAINERS = {list: "list", tuple: "tuple", dict: "dict"}
# What is never walked into for attributes: code, classes and modules hold no per-dataset metadata worth naming.
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class Container(NamedTuple):
    """A large Python container found on an object."""

    name: str  # the attribute path from the object given, e.g. "items" or "meta.records" ("" for the object itself)
    kind: str  # "list", "tuple" or "dict"
    count: int  # its number of items
    est_bytes: int  # estimated bytes of it and the Python objects it holds


def _is_array(value: Any) -> bool:
    # numpy arrays, tensors and anything exposing a buffer as an array: their data is not refcounted per item.
    if hasattr(value, "__array_interface__") or hasattr(value, "__cuda_array_interface__"):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _kind(value: Any) -> str | None:
    for cls, kind in _CONTAINERS.items():
        if isinstance(value, cls):
            return kind
    return None


def _size(value: Any, depth: int, seen: dict) -> int:
    """Bytes of ``value`` and, ``depth`` levels down, what it holds; each object counted once per sample.

    ``seen`` maps the id of every object met to its size: an object met again (an interned key, a shared
    label string, a small int) is shared between items, not one copy per item, so it is not scaled up.
    """
    key = id(value)
    if key in seen:
        seen[key][1] += 1
        return 0
    if _is_array(value):
        return 0  # its buffer does not copy on read; only the small header would
    own = sys.getsizeof(value)
    seen[key] = [own, 1]
    total = own
    if depth > 0:
        if isinstance(value, dict):
            for k, v in itertools.islice(value.items(), 64):
                total += _size(k, depth - 1, seen) + _size(v, depth - 1, seen)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for v in itertools.islice(value, 64):
                total += _size(v, depth - 1, seen)
        elif hasattr(value, "__dict__") and not isinstance(value, _OPAQUE):
            total += _size(vars(value), depth - 1, seen)
    return total


def estimate(container: list | tuple | dict) -> int:
    """Estimated bytes of ``container`` and the Python objects in it (a sample of ``SAMPLE`` items, scaled)."""
    count = len(container)
    own = sys.getsizeof(container)
    if count == 0:
        return own
    if isinstance(container, dict):
        # Iterating a dict to spread the sample would cost O(n); its first items are as good a sample as any
        # for metadata built in one loop.
        sample = list(itertools.islice(container.items(), SAMPLE))
    else:
        step = max(1, count // SAMPLE)
        sample = [container[i] for i in range(0, count, step)][:SAMPLE]
    seen: dict = {}
    # Each sampled item (a dict, a tuple, a key-value pair) sized with what it holds, two levels down.
    for item in sample:
        if isinstance(container, dict):
            _size(item[0], 2, seen)
            _size(item[1], 2, seen)
        else:
            _size(item, 2, seen)
    unique = sum(size for size, hits in seen.values() if hits == 1)
    shared = sum(size for size, hits in seen.values() if hits > 1)
    # Objects met once per sample are per-item and scale with the length; those met again are shared (their
    # one copy counted once).
    return own + int(unique * count / len(sample)) + shared


def _walk(obj: Any, prefix: str, depth: int, found: list, visited: set) -> None:
    try:
        attributes = vars(obj)
    except TypeError:
        return  # no __dict__ (slots, builtins): nothing we can name
    for name, value in list(attributes.items()):
        try:
            if id(value) in visited or _is_array(value):
                continue
            visited.add(id(value))
            path = f"{prefix}{name}"
            kind = _kind(value)
            if kind is not None:
                found.append((path, kind, value))
            elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, _OPAQUE):
                _walk(value, path + ".", depth - 1, found, visited)
        except Exception:  # a proxy's __getattr__ may raise anything when probed: such an attribute is not judged
            continue


def large_containers(obj: Any, min_bytes: int = 16 << 20) -> list[Container]:
    """The list, tuple and dict attributes of ``obj`` whose Python objects come to ``min_bytes`` or more.

    Walks ``vars(obj)`` and, one level down, the attributes of plain objects it holds (``meta.records``).
    numpy arrays and tensors are skipped: they do not copy on read. When ``obj`` is itself a list, tuple or
    dict, it is the one container considered, named ``""``.

    Returns:
        The containers found, largest estimate first.
    """
    kind = _kind(obj)
    if kind is not None:
        candidates = [("", kind, obj)]
    else:
        candidates = []
        _walk(obj, "", 1, candidates, {id(obj)})
    found = []
    for path, kind, value in candidates:
        est = estimate(value)
        if est >= min_bytes:
            found.append(Container(path, kind, len(value), est))
    found.sort(key=lambda c: c.est_bytes, reverse=True)
    return found
