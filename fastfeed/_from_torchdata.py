"""States saved by torchdata's ``StatefulDataLoader`` (0.11), read as fastfeed states.

A team that moves from ``torchdata.stateful_dataloader.StatefulDataLoader`` to fastfeed's loader mid-run resumes
its checkpoints: ``DataLoader.load_state_dict`` recognises torchdata's layout (``is_torchdata_state``) and loads
``translate(state, loader)``, a fastfeed state (version 3) holding the same position.

torchdata's layout (torchdata/stateful_dataloader/stateful_dataloader.py, worker.py, sampler.py):

* ``num_workers=0``: ``_num_yielded`` (batches yielded this epoch), ``_sampler_iter_state`` (the sampler
  iterator's ``state_dict()``: torchdata's ``BatchSampler`` gives ``{"samples_yielded", "sampler_state"?,
  "sampler_iter_state"?}``, its ``RandomSampler``'s iterator ``{"yielded", "generator"}``), ``_index_sampler_state``
  (a stateful batch sampler's, or a stateful sampler's without batching), ``_sampler_iter_yielded`` (indices
  asked of it), ``dataset_state``, ``fetcher_state`` (an iterable's: ``{"dataset_iter_state", "fetcher_ended"}``),
  ``_iterator_finished``, ``_shared_seed``, ``_IterableDataset_len_called``. The state is of the moment it is
  taken.
* ``num_workers>0``: ``{"_snapshot": {"_snapshot_step", "_last_yielded_worker_id", "_main_snapshot": {the
  sampler keys above, "_num_workers", "_base_seed"}, "_worker_snapshots": {"worker_<i>": {"worker_id",
  "dataset_state", "fetcher_state"}}}, "_steps_since_snapshot", "_iterator_finished"}``. The snapshot is that of
  batch ``_snapshot_step`` (every batch with ``snapshot_every_n_steps=1``, the default); torchdata fetches the
  ``_steps_since_snapshot`` batches after it again on loading.

Before the first ``iter()`` torchdata's ``state_dict()`` starts the epoch's iterator (its RandomSampler draws the
permutation then), so a state of 0 batches is the start of that epoch: it translates to an epoch of which 0
batches were received, with torchdata's order where fastfeed's own sampler would draw another one. After an
epoch (``_iterator_finished``), it translates to a state between epochs.
"""

from __future__ import annotations

import copy
import itertools
import operator

import torch
from torch.utils.data import SequentialSampler, _DatasetKind

from . import _state

# torchdata 0.11's keys.
_SINGLE = frozenset({
    "_index_sampler_state", "_sampler_iter_state", "_sampler_iter_yielded", "_num_yielded",
    "_IterableDataset_len_called", "_shared_seed", "fetcher_state", "dataset_state", "_iterator_finished",
})  # fmt: skip
_MULTI = frozenset({"_snapshot", "_steps_since_snapshot", "_iterator_finished"})
_SNAPSHOT = frozenset({"_snapshot_step", "_last_yielded_worker_id", "_main_snapshot", "_worker_snapshots"})
_MAIN = frozenset({
    "_num_workers", "_sampler_iter_state", "_index_sampler_state", "_sampler_iter_yielded",
    "_IterableDataset_len_called", "_shared_seed", "_base_seed",
})  # fmt: skip
_WORKER = frozenset({"worker_id", "fetcher_state", "dataset_state"})
_FETCHER = frozenset({"dataset_iter_state", "fetcher_ended"})
_BATCH_ITER = frozenset({"samples_yielded"})  # torchdata's _BatchSamplerIterator: required
_BATCH_ITER_OPTIONAL = frozenset({"sampler_state", "sampler_iter_state"})
_RANDOM_ITER = frozenset({"yielded", "generator"})  # torchdata's _StatefulRandomSamplerIterator
_MARKERS = (_SINGLE | _MULTI) - {"_iterator_finished"}  # Accelerate tags fastfeed's states with that one too

_WHAT = "DataLoader.load_state_dict(): this torchdata StatefulDataLoader state"
_NO_RNGS = {"torch": None, "random": None, "numpy": None}  # a worker's RNGs: as seeded (torchdata saves none)


def is_torchdata_state(state) -> bool:
    """Whether ``state`` has torchdata ``StatefulDataLoader.state_dict()``'s layout (and not fastfeed's)."""
    return isinstance(state, dict) and "version" not in state and any(key in state for key in _MARKERS)


class _Saved:
    """torchdata's state, read and checked: the same fields for one process and for workers."""

    def __init__(self, state: dict):
        if not isinstance(state, dict):
            raise ValueError(f"{_WHAT} is a {type(state).__name__}, not a dict")
        self.finished = _flag(state, "_iterator_finished", "the state")
        if "_snapshot" in state or "_steps_since_snapshot" in state:
            _keys(state, _MULTI, (), "the state (num_workers>0)")
            snap = state["_snapshot"]
            _keys(snap, _SNAPSHOT, (), "'_snapshot'")
            main, where = snap["_main_snapshot"], "'_snapshot' '_main_snapshot'"
            _keys(main, _MAIN, (), where)
            self.step = _count(snap, "_snapshot_step", "'_snapshot'")
            self.behind = _count(state, "_steps_since_snapshot", "the state")
            self.num_workers = _count(main, "_num_workers", where)
            if self.num_workers < 1:
                raise ValueError(f"{_WHAT} has '_snapshot' (saved with workers) and '_num_workers' "
                                 f"{self.num_workers}")  # fmt: skip
            self.last_worker = _count(snap, "_last_yielded_worker_id", "'_snapshot'")
            if self.last_worker >= self.num_workers:
                raise ValueError(f"{_WHAT} has '_last_yielded_worker_id' {self.last_worker} with "
                                 f"{self.num_workers} workers")  # fmt: skip
            self.base_seed = main["_base_seed"]
            if not isinstance(self.base_seed, int):
                raise ValueError(f"{_WHAT} has '_base_seed' {self.base_seed!r}, not an int")
            self.workers = _worker_snapshots(snap["_worker_snapshots"], self.num_workers)
            self.dataset_state = self.fetcher_state = None
        else:
            main, where = state, "the state (num_workers=0)"
            _keys(state, _SINGLE, (), where)
            self.step = _count(state, "_num_yielded", where)
            self.behind = 0
            self.num_workers = 0
            self.last_worker = None
            self.base_seed = None
            self.workers = None
            self.dataset_state = state["dataset_state"]
            self.fetcher_state = _fetcher(state["fetcher_state"], "'fetcher_state'")
        self.index_sampler_state = main["_index_sampler_state"]
        self.sampler_iter_state = main["_sampler_iter_state"]
        self.sampler_asked = _count(main, "_sampler_iter_yielded", where)

    @property
    def received(self) -> int:
        """Batches of this epoch the user received."""
        return self.step + self.behind

    def iterable(self) -> bool:
        """Whether it was saved over an IterableDataset."""
        # torchdata saves a fetcher state for an iterable's fetcher always, and for a map-style one never.
        fetchers = [self.fetcher_state] if self.workers is None else [w[1] for w in self.workers]
        return any(f is not None for f in fetchers)


def _keys(d, required, optional, where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{_WHAT}: {where} is a {type(d).__name__}, not a dict (torchdata 0.11's layout)")
    missing = sorted(set(required) - d.keys())
    unknown = sorted(d.keys() - set(required) - set(optional), key=str)
    if unknown:
        raise ValueError(f"{_WHAT}: {where} has key(s) {unknown} that torchdata 0.11's layout does not "
                         f"(it has {sorted(set(required) | set(optional))})")  # fmt: skip
    if missing:
        raise ValueError(f"{_WHAT}: {where} lacks key(s) {missing} of torchdata 0.11's layout")


def _count(d: dict, key: str, where: str) -> int:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{_WHAT}: {where}'s {key!r} is {value!r}, not a count")
    return value


def _flag(d: dict, key: str, where: str) -> bool:
    if key not in d:
        raise ValueError(f"{_WHAT}: {where} lacks the key {key!r} of torchdata 0.11's layout")
    if not isinstance(d[key], bool):
        raise ValueError(f"{_WHAT}: {where}'s {key!r} is {d[key]!r}, not a bool")
    return d[key]


def _fetcher(fetcher, where: str):
    """An iterable's fetcher state ``{"dataset_iter_state", "fetcher_ended"}``, checked (None for map-style)."""
    if fetcher is None:
        return None
    _keys(fetcher, _FETCHER, (), where)
    _flag(fetcher, "fetcher_ended", where)
    return fetcher


def _worker_snapshots(snaps, num_workers: int) -> list:
    """``[(dataset_state, fetcher_state)]`` per worker."""
    where = "'_snapshot' '_worker_snapshots'"
    if not isinstance(snaps, dict):
        raise ValueError(f"{_WHAT}: {where} is a {type(snaps).__name__}, not a dict")
    names = [f"worker_{w}" for w in range(num_workers)]
    missing = [n for n in names if n not in snaps]
    unknown = sorted(set(snaps) - set(names), key=str)
    if unknown:
        raise ValueError(f"{_WHAT}: {where} has {unknown}, and it was saved with {num_workers} workers "
                         f"({names})")  # fmt: skip
    if missing:
        raise ValueError(f"{_WHAT}: {where} lacks the snapshot of {missing} (it was saved with {num_workers} "
                         "workers)")  # fmt: skip
    out = []
    for w, name in enumerate(names):
        snap = snaps[name]
        _keys(snap, _WORKER, (), f"{where} {name!r}")
        if snap["worker_id"] != w:
            raise ValueError(f"{_WHAT}: {where} {name!r} says 'worker_id' {snap['worker_id']!r}")
        out.append((snap["dataset_state"], _fetcher(snap["fetcher_state"], f"{where} {name!r} 'fetcher_state'")))
    return out


# -- the translation --------------------------------------------------------------------------------------------


def translate(state: dict, loader) -> dict:
    """A fastfeed state (version 3) of ``loader`` at the position torchdata's ``state`` saved.

    Raises ``ValueError`` naming what it cannot read or what cannot continue with this loader.
    """
    rng = _state._rngs_out(_state.main_rngs(loader.generator))  # before anything here draws: loading undoes it
    state = copy.deepcopy(state)  # the user's states in it go into the loader's, which must not share them
    saved = _Saved(state)
    iterable = loader._dataset_kind == _DatasetKind.Iterable
    was_iterable = saved.iterable()
    if was_iterable != iterable:
        kinds = ("an IterableDataset", "a map-style dataset")
        raise ValueError(f"{_WHAT} was saved over {kinds[not was_iterable]}, and this loader's "
                         f"{type(loader.dataset).__name__} is {kinds[not iterable]}")  # fmt: skip
    mid = not saved.finished
    out = dict.fromkeys(_state.KEYS)  # every key of a fastfeed state; those not set here are None
    out.update(version=_state.VERSION, epochs=loader._ff_epochs + (1 if mid else 0), rng=rng, mid_epoch=mid,
               yielded=0, sampler_rng=dict(_state.NO_SAMPLER_RNG), base_seed=saved.base_seed,
               num_workers=saved.num_workers, asked=0, next_worker=0, received_ahead=())
    if iterable:
        _iterable(saved, loader, out)
    else:
        _map(saved, loader, out)
    return out


def _map(saved: _Saved, loader, out: dict) -> None:
    """A map-style dataset: the epoch's position is the sampler's, and a stateful dataset's state is its own."""
    sampler = _state.sampler_of(loader)
    if sampler is not None:
        _stateful_sampler(saved, loader, sampler, out)
    else:
        theirs = _their_sampler_state(saved)
        if theirs is not None:
            raise ValueError(
                f"{_WHAT} holds a stateful sampler's state ({theirs!r}), and this loader's sampler "
                f"({_name(loader.sampler)}, batch sampler {_name(loader._index_sampler)}) has no "
                "state_dict()/load_state_dict(): build the loader with the sampler the state was saved with"
            )
        if out["mid_epoch"]:
            out["due"] = _due(saved, loader)
    if saved.workers is None:
        out["dataset"] = saved.dataset_state
        return
    if any(ds is not None for ds, _ in saved.workers) and (out["mid_epoch"] or loader.persistent_workers):
        # The workers' own dataset states (their copies of the dataset, as torchdata restores them).
        if saved.behind:
            raise ValueError(_behind(saved, "the workers' dataset states"))
        counts = _batches(saved.received, saved.num_workers)
        out["workers"] = tuple(_worker(ds, None, counts[w] if out["mid_epoch"] else 0, False)
                               for w, (ds, _) in enumerate(saved.workers))  # fmt: skip
    if out["mid_epoch"]:
        out["next_worker"] = _next_worker(saved)


def _their_sampler_state(saved: _Saved):
    """The state torchdata saved of a stateful sampler (or batch sampler), or None."""
    if saved.index_sampler_state is not None:
        return saved.index_sampler_state
    it = saved.sampler_iter_state
    if isinstance(it, dict) and "samples_yielded" in it:
        return it.get("sampler_state")
    return None


def _stateful_sampler(saved: _Saved, loader, sampler, out: dict) -> None:
    """A sampler with state_dict()/load_state_dict(): fastfeed loads its state and continues, as torchdata does."""
    name = _name(sampler)
    if sampler is loader._index_sampler:  # a stateful batch sampler, or a stateful sampler without batching
        state, it_state = saved.index_sampler_state, saved.sampler_iter_state
        where = "'_index_sampler_state'"
    else:  # torchdata's BatchSampler over the sampler: its iterator's state holds the sampler's
        it = saved.sampler_iter_state
        if it is None:
            raise ValueError(f"{_WHAT} holds no sampler iterator state ('_sampler_iter_state' is None), and this "
                             f"loader batches its {name}, a stateful sampler, as torchdata's BatchSampler saves "
                             "it; build the loader with the sampler the state was saved with")  # fmt: skip
        _keys(it, _BATCH_ITER, _BATCH_ITER_OPTIONAL, "'_sampler_iter_state'")
        state, it_state = it.get("sampler_state"), it.get("sampler_iter_state")
        where = "'_sampler_iter_state' 'sampler_state'"
    if state is None:
        raise ValueError(f"{_WHAT} holds no state of this loader's {name} ({where} is None or absent): it was "
                         "saved with a sampler without state_dict(); build the loader with that sampler")  # fmt: skip
    if it_state is not None and not _same(it_state, state):
        raise ValueError(
            f"{_WHAT} holds a state of the {name}'s iterator ({it_state!r}) besides the sampler's own: fastfeed "
            "restores a stateful sampler from its state_dict() alone (loaded before iter(sampler))"
        )
    if out["mid_epoch"]:
        if saved.behind:
            raise ValueError(_behind(saved, f"the {name}'s state"))
        out["sampler_state"] = state
        out["yielded"] = out["asked"] = saved.received
    elif not saved.behind:
        out["sampler_state"] = state
    # else: the sampler's state is from batches before the epoch's end; torchdata's next epoch is a fresh
    # iter(sampler) after replaying them. The sampler starts the next epoch as it is.


def _due(saved: _Saved, loader) -> tuple:
    """The batches (tuples of sample indices) torchdata had still to deliver this epoch, in its order."""
    it = saved.sampler_iter_state
    index_sampler = loader._index_sampler
    auto = loader._auto_collation
    if isinstance(it, dict) and "samples_yielded" in it:  # torchdata's BatchSampler over a sampler
        _keys(it, _BATCH_ITER, _BATCH_ITER_OPTIONAL, "'_sampler_iter_state'")
        inner = it.get("sampler_iter_state")
        if not auto or not all(hasattr(index_sampler, a) for a in ("sampler", "batch_size", "drop_last")):
            raise ValueError(f"{_WHAT} was saved by a loader that batched its sampler (torchdata's BatchSampler), "
                             f"and this one's index sampler is {_name(index_sampler)}: build the loader with "
                             "batch_size as the state was saved with")  # fmt: skip
        samples = _count(it, "samples_yielded", "'_sampler_iter_state'")
        if inner is not None:
            order = _random_order(inner, loader, index_sampler.sampler, "'_sampler_iter_state' 'sampler_iter_state'")
            if inner["yielded"] != samples:
                raise ValueError(f"{_WHAT}: '_sampler_iter_state' says 'samples_yielded' {samples} and its "
                                 f"sampler's iterator 'yielded' {inner['yielded']}")  # fmt: skip
            rest = iter(order[samples:])
        else:
            rest = itertools.islice(iter(index_sampler.sampler), samples, None)  # torchdata's own fast-forward
        size, drop_last = index_sampler.batch_size, index_sampler.drop_last
        batches = []
        while True:
            batch = list(itertools.islice(rest, size))
            if not batch or (drop_last and len(batch) < size):
                break
            batches.append(batch)
    elif isinstance(it, dict) and set(it) == _RANDOM_ITER:  # torchdata's RandomSampler, not batched
        if auto:
            raise ValueError(f"{_WHAT} was saved by a loader that did not batch (batch_size=None), and this one "
                             f"batches with {_name(index_sampler)}: build it with batch_size=None")  # fmt: skip
        order = _random_order(it, loader, index_sampler, "'_sampler_iter_state'")
        batches = [[i] for i in order[it["yielded"]:]]
    elif it is None:  # a sampler without state: torchdata skips the indices asked of a fresh iter()
        rest = itertools.islice(iter(index_sampler), saved.sampler_asked, None)
        batches = [list(b) for b in rest] if auto else [[i] for i in rest]
    else:
        raise ValueError(f"{_WHAT}: '_sampler_iter_state' is {it!r}, a layout this fastfeed does not know "
                         "(torchdata 0.11's BatchSampler and RandomSampler iterators are known)")  # fmt: skip
    batches = batches[saved.behind:]  # torchdata fetches these again on loading: they were delivered
    try:
        return tuple(tuple(operator.index(i) for i in b) for b in batches)
    except TypeError as e:
        raise ValueError(f"{_WHAT}: this loader's sampler gives indices that are not ints ({e}); fastfeed resumes "
                         "such an epoch only from its own states") from None  # fmt: skip


def _random_order(it: dict, loader, sampler, where: str) -> list:
    """torchdata RandomSampler's order for the epoch, recomputed from the generator state its iterator saved."""
    _keys(it, _RANDOM_ITER, (), where)
    _count(it, "yielded", where)
    if isinstance(sampler, SequentialSampler):
        raise ValueError(f"{_WHAT} was saved with a shuffled sampler (torchdata's RandomSampler), and this loader's "
                         "sampler is a SequentialSampler: build it with shuffle=True")  # fmt: skip
    state = it["generator"]
    try:
        state = state if isinstance(state, torch.Tensor) else torch.tensor(list(state), dtype=torch.uint8)
        generator = torch.Generator()
        generator.set_state(state.to(torch.uint8))
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{_WHAT}: {where} 'generator' is not a torch.Generator state ({e})") from None
    source = getattr(sampler, "data_source", loader.dataset)
    n = len(source)
    replacement = bool(getattr(sampler, "replacement", False))
    num_samples = getattr(sampler, "num_samples", n)
    order: list = []
    while len(order) < num_samples:  # as torchdata's _StatefulRandomSamplerIterator draws
        if replacement:
            order += torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator).tolist()
        else:
            order += torch.randperm(n, generator=generator).tolist()
    return order[:num_samples]


def _iterable(saved: _Saved, loader, out: dict) -> None:
    """An IterableDataset: positions are the dataset's (or its iterator's), per worker."""
    if saved.workers is None:
        fetcher = saved.fetcher_state or {"dataset_iter_state": None}
        out["dataset"], out["dataset_iter"] = saved.dataset_state, fetcher["dataset_iter_state"]
        if out["mid_epoch"] and fetcher.get("fetcher_ended"):
            # Its iterator ended (the last batch was short): torchdata's epoch ends at its next batch, the dataset
            # untouched. Nothing is due: the epoch ends, and the next one starts from the dataset's state.
            out["due"] = ()
        elif out["mid_epoch"]:
            out["yielded"] = out["asked"] = saved.received
            out["sampler_rng"] = _current_sampler_rngs(loader)
        return
    states = [(ds, f["dataset_iter_state"] if f else None, bool(f and f["fetcher_ended"])) for ds, f in saved.workers]
    stateful = any(ds is not None or it is not None for ds, it, _ in states)
    if not out["mid_epoch"]:
        if stateful and loader.persistent_workers:  # persistent workers start the next epoch from their datasets
            if saved.behind:
                raise ValueError(_behind(saved, "the workers' dataset states"))
            out["workers"] = tuple(_worker(ds, it, 0, False) for ds, it, _ in states)
        return
    n, nw = saved.received, saved.num_workers
    if stateful and saved.behind:
        raise ValueError(_behind(saved, "the workers' dataset states"))
    ended = [e for _, _, e in states]
    counts = _batches(n, nw)
    if not stateful:
        if any(ended):
            raise ValueError(
                f"{_WHAT} is of an IterableDataset without state_dict()/load_state_dict() whose worker(s) "
                f"{[w for w in range(nw) if ended[w]]} had ended: the state does not say how many batches each "
                "worker made, which fastfeed needs to fast-forward each worker. Give the dataset "
                "state_dict()/load_state_dict(), or resume from a state saved between epochs."
            )
        expected = (saved.step - 1) % nw
        if saved.last_worker != expected:
            raise ValueError(f"{_WHAT} says batch {saved.step} came from worker {saved.last_worker}, and with "
                             f"{nw} workers taking turns it came from worker {expected}: the dataset or loader "
                             "is not the one it was saved with")  # fmt: skip
    elif any(ended) and n:
        # Which batches the ended workers made is not saved: a live worker is counted as having made some
        # (fastfeed restarts an iterable from scratch only where a worker made none, and its state is its own).
        counts = [c if ended[w] else max(c, 1) for w, c in enumerate(counts)]
    out["workers"] = tuple(_worker(ds, it, 0 if e and not stateful else counts[w], e)
                           for w, (ds, it, e) in enumerate(states))  # fmt: skip
    out["yielded"] = out["asked"] = n
    out["next_worker"] = _next_worker(saved)
    out["sampler_rng"] = _current_sampler_rngs(loader)


def _next_worker(saved: _Saved) -> int:
    """The worker whose batch comes next: the one after the snapshot's last, and after the batches since (taken in
    turns: there they are the batches of a map-style epoch, or of an iterable none of whose workers ended)."""
    return (saved.last_worker + 1 + saved.behind) % saved.num_workers


def _batches(n: int, nw: int) -> list:
    """Batches each worker made of the first ``n`` of an epoch, the workers taking turns (none ended)."""
    return [n // nw + (1 if w < n % nw else 0) for w in range(nw)]


def _worker(dataset_state, iter_state, batches: int, ended: bool) -> dict:
    state = dict(_NO_RNGS, dataset=dataset_state, dataset_iter=iter_state, batches=batches, ended=ended)
    return {"state": state, "epoch_start": dict(_NO_RNGS)}


def _current_sampler_rngs(loader) -> dict:
    """The sampler's RNGs as they are (restoring them changes nothing): an iterable's sampler draws nothing, and
    the epoch's first ``yielded`` asks are replayed from them."""
    return _state._rngs_out(_state.sampler_rngs(loader.generator))


def _behind(saved: _Saved, what: str) -> str:
    return (f"{_WHAT} holds {what} as of batch {saved.step}, {saved.behind} batches before the state was taken "
            f"(saved with snapshot_every_n_steps>1); torchdata fetches those batches again on loading, and fastfeed "
            "restores a state only as of the last batch received. Save it with snapshot_every_n_steps=1 (the "
            "default), or between epochs.")  # fmt: skip


def _same(a, b) -> bool:
    """``a == b`` for states that may hold tensors (whose ``==`` is elementwise)."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


def _name(obj) -> str:
    return type(obj).__name__
