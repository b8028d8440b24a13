"""Hold a dataset's large Python containers once per machine, in shared memory: ``dataset = fastfeed.share(dataset)``.

A map-style dataset that keeps its metadata as Python objects (a million dicts of file names and labels) is copied
into every forked worker page by page, because reading a Python object writes its reference count
(pytorch/pytorch#13246). ``share`` pickles each item once into a sealed shared block and reads it back per access,
so workers and the other local ranks of a torch.distributed job map one copy. See docs/guide/memory.md.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from .containers import SharedDict, SharedList, build
from .find import Container, large_containers
from .memory import attach
from .ranks import Rendezvous, fingerprint

__all__ = ["Container", "SharedDict", "SharedList", "large_containers", "share"]

_calls: Counter = Counter()  # how often each content key was shared in this process: the n-th call meets the n-th


def _kind(obj) -> str | None:
    for cls in (list, tuple, dict):
        if isinstance(obj, cls):
            return cls.__name__
    return None


def _share_container(obj, kind: str, key: str | None):
    content = key if key is not None else fingerprint(obj, kind)
    _calls[content] += 1
    rendezvous = Rendezvous.for_job(f"{content}/{_calls[content]}")
    if rendezvous is not None and not rendezvous.first():
        block = attach(rendezvous.wait())
    else:
        try:
            block = build(obj, kind == "dict", kind)
        except BaseException as e:
            if rendezvous is not None:
                rendezvous.fail(f"{type(e).__name__}: {e}")
            raise
        if rendezvous is not None:
            rendezvous.publish(block.handle())
    shared = SharedDict(block) if kind == "dict" else SharedList(block, kind)
    if len(shared) != len(obj):
        raise RuntimeError(
            f"fastfeed.share: the local rank that wrote the shared copy had {len(shared)} items, this one has "
            f"{len(obj)}: the ranks shared different containers under one key. Give each a distinct key=."
        )
    return shared


def share(obj: Any, min_bytes: int = 16 << 20, key: str | None = None) -> Any:
    """An object that behaves like ``obj`` and holds its large Python containers once, in shared memory.

    - A list, tuple or dict: a read-only shared version of it (SharedList, SharedDict), whatever its size.
    - Any other object (a dataset): a shallow copy of it whose list, tuple and dict attributes (and those of
      plain objects it holds, one level down) estimated at ``min_bytes`` or more are replaced by shared
      versions; ``obj`` itself is left unchanged. Write ``dataset = fastfeed.share(dataset)`` so that the
      originals can be freed.

    Under torch.distributed (torchrun), the local ranks of a machine map one copy: the first to arrive writes
    it, the others wait for it. They must call ``share`` on the same containers in the same order, or pass the
    same ``key`` for the same container.

    Items are unpickled on every access; writes raise TypeError.
    """
    kind = _kind(obj)
    if kind is not None:
        return _share_container(obj, kind, key)
    if isinstance(obj, (SharedList, SharedDict)):
        return obj
    found = large_containers(obj, min_bytes)
    if not found:
        return obj
    try:
        out = copy.copy(obj)
    except Exception as e:
        raise TypeError(
            f"fastfeed.share: cannot copy the {type(obj).__name__} to replace its containers "
            f"({type(e).__name__}: {e}); share its containers one by one instead: "
            "dataset.items = fastfeed.share(dataset.items)."
        ) from e
    copies = {"": out}  # attribute path of a parent -> its copy (each nested object copied once)
    for container in sorted(found, key=lambda c: c.name):
        *parents, leaf = container.name.split(".")
        holder, path = out, ""
        for part in parents:
            path = f"{path}.{part}" if path else part
            if path not in copies:
                copies[path] = copy.copy(getattr(holder, part))
                setattr(holder, part, copies[path])
            holder = copies[path]
        value = getattr(holder, leaf)
        sub = None if key is None else f"{key}/{container.name}"
        setattr(holder, leaf, _share_container(value, container.kind, sub))
    return out
