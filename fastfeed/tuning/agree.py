"""Under ``torch.distributed``, every rank ends with the result of the rank whose input is slowest.

The rule: each rank tunes on its own (its measurements include the contention of the
others), then publishes its result in the process group's key-value store under
``{tag}/rank/{rank}``. Once every rank's is there, each rank reads them all and takes the
result of the slowest one (``slowest``): in a job whose ranks meet at a collective every
step, the slowest rank's input sets the pace of all of them, and the other ranks' steps
include waiting for it inside the collective, so their measurements cannot say what it
needs. Every rank computes the decision from the same published figures, so all decide
alike; ``TuneResult.decided_by`` names the rank.

The store, not a collective, carries the results: a collective issued at a different point
on each rank (the online tuner settles after a number of batches that can differ between
ranks) would pair up with the training loop's own collectives. ``fastfeed.tune()`` waits
for the other ranks (``slowest_on_all_ranks``); the online tuner keeps its own choice,
publishes it (``publish``) and looks again (``poll``, which never blocks) until every rank's
is in.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json

import torch.distributed as dist

from .result import TuneResult

# Stall fractions this close count as equal: the measurement's noise, and the search's own threshold for a loop
# that does not wait for input at all (search.NOT_INPUT_BOUND), are of this order.
STALL_MARGIN = 0.02
# Throughputs within this share of the lowest count as equal (then the lower rank decides): the tuner's
# tolerance, within which it calls two settings equal.
RATE_MARGIN = 0.03

_counts: collections.Counter = collections.Counter()  # tunings per tag in this process


@dataclasses.dataclass(frozen=True)
class Pace:
    """How one rank's input kept up, from its tuning's measurements (see ``pace``).

    ``stall``: the share of its loop the rank spent waiting for input; ``throughput``: its
    batches/s (the loop's, input and step).
    """

    stall: float
    throughput: float


def _store():
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
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


def pace(result: TuneResult) -> Pace:
    """The figures ``slowest`` ranks a rank by: those of its first measured trial.

    The first trial is the one setting every rank measures (the search's first proposal
    depends only on its arguments), over the same stretch of the job: the only figures that
    compare ranks at equal settings. A rank's later trials follow its own search (a rank
    whose input keeps up tries fewer workers, a slow one more), so a mean over them, or the
    figures of each rank's choice, would compare different settings. (When the search
    measured that setting again, to confirm it, the trial holds both runs' windows.) Falls
    back on the choice's figures for a result without a measured trial.
    """
    first = next((t for t in result.trials if t.windows and not t.skipped), None)
    if first is None:
        return Pace(result.stall_fraction, result.throughput)
    return Pace(first.stall_fraction, first.median)


def slowest(paces: list[Pace]) -> int:
    """The index (the rank) of the slowest of ``paces``: the one whose input holds the job back.

    The rank that spent the largest share of its loop waiting for input, which works when
    ranks run in lockstep (every rank's loop rate is then the slowest's; the others wait in
    the collective, which counts as their step, not as waiting for input). Stall fractions
    within ``STALL_MARGIN`` of the largest are a tie, broken by the lower throughput (ranks
    that never meet: each ran at its own input's pace), throughputs within ``RATE_MARGIN`` of
    the lowest by the lower rank. Every step looks at the whole list, not at pairs, so the
    answer does not depend on the order the ranks are compared in.

    Raises:
        ValueError: ``paces`` is empty.
    """
    if not paces:
        raise ValueError("slowest() of no ranks")
    top = max(p.stall for p in paces)
    stalled = [r for r, p in enumerate(paces) if p.stall >= top - STALL_MARGIN]
    low = min(paces[r].throughput for r in stalled)
    return min(r for r in stalled if paces[r].throughput <= low * (1 + RATE_MARGIN))


def slowest_on_all_ranks(result: TuneResult, tag: str) -> TuneResult:
    """Publish ``result``, wait for every rank's, and return the slowest rank's (see ``slowest``).

    Without torch.distributed (or on one rank) ``result`` itself. Every rank must call it for
    the same ``tag``; each waits (``store.wait``, under the store's timeout) until all have
    published.
    """
    store = _store()
    if store is None:
        return result
    publish(result, tag)
    store.wait(_keys(tag))
    return _decide(result, tag)


def publish(result: TuneResult, tag: str) -> None:
    """Put this rank's ``result`` and its ``pace`` in the store, for the other ranks (nothing without
    torch.distributed)."""
    store = _store()
    if store is None:
        return
    p = pace(result)
    store.set(f"{tag}/rank/{dist.get_rank()}",
              json.dumps({"stall": p.stall, "throughput": p.throughput, "result": result.as_dict()}))  # fmt: skip


def poll(tag: str, own: TuneResult) -> TuneResult | None:
    """The slowest rank's result once every rank has published, else None; never blocks.

    ``own``: this rank's result, as published (returned as it is without torch.distributed).
    """
    store = _store()
    if store is None:
        return own
    if not store.check(_keys(tag)):
        return None
    return _decide(own, tag)


def _keys(tag: str) -> list[str]:
    return [f"{tag}/rank/{rank}" for rank in range(dist.get_world_size())]


def _decide(own: TuneResult, tag: str) -> TuneResult:
    """The slowest rank's result, from what every rank published (all of it is in the store).

    The figures are read back from the store for this rank too, so that every rank decides
    on the same numbers (JSON round-trips a float exactly).
    """
    store = _store()
    published = [json.loads(store.get(key)) for key in _keys(tag)]
    rank = slowest([Pace(p["stall"], p["throughput"]) for p in published])
    if rank == dist.get_rank():
        return dataclasses.replace(own, decided_by=rank)
    return dataclasses.replace(TuneResult.from_dict(published[rank]["result"]), decided_by=rank)
