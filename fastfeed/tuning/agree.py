"""Under ``torch.distributed``, every rank ends with rank 0's tuning result.

The rule: each rank tunes on its own (its measurements include the contention of the
others), then rank 0 publishes its result in the process group's key-value store and the
other ranks take it. The store, not a collective, carries it: a collective issued at a
different point on each rank (the online tuner settles after a number of batches that can
differ between ranks) would pair up with the training loop's own collectives. A rank that
finishes before rank 0 keeps its own choice and polls (``poll``) until rank 0's appears.
"""

from __future__ import annotations

import collections
import hashlib
import json

import torch.distributed as dist

from .result import TuneResult

_counts: collections.Counter = collections.Counter()  # tunings per tag in this process


def _store():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def tag_for(kind: str, dataset, loader_kwargs: dict) -> str:
    """A key that names the same tuning on every rank: what is tuned, and how many times before.

    Ranks build their loaders in the same order, so the n-th tuning of a kind of dataset
    and batch size is the same one everywhere.
    """
    what = json.dumps([kind, type(dataset).__qualname__, loader_kwargs.get("batch_size", 1)])
    base = hashlib.sha256(what.encode()).hexdigest()[:16]
    _counts[base] += 1
    return f"fastfeed/tune/{base}/{_counts[base]}"


def same_on_all_ranks(result: TuneResult, tag: str) -> TuneResult:
    """Rank 0 publishes ``result``; every other rank waits for it and returns it instead of its own."""
    store = _store()
    if store is None or dist.get_rank() == 0:
        publish(result, tag)
        return result
    store.wait([tag])
    return TuneResult.from_dict(json.loads(store.get(tag)))


def publish(result: TuneResult, tag: str) -> None:
    """Rank 0's result, for ``poll`` on the other ranks (nothing without torch.distributed)."""
    store = _store()
    if store is not None and dist.get_rank() == 0:
        store.set(tag, json.dumps(result.as_dict()))


def is_leader() -> bool:
    """Whether this rank's choice is the one every rank takes."""
    return _store() is None or dist.get_rank() == 0


def poll(tag: str) -> TuneResult | None:
    """Rank 0's result if it has been published (never blocks)."""
    store = _store()
    if store is None or not store.check([tag]):
        return None
    return TuneResult.from_dict(json.loads(store.get(tag)))
