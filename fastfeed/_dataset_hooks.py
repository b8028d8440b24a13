"""What a dataset may offer ``fastfeed.DataLoader`` beyond torch's ``Dataset``, declared and found in one place.

torch's loader tells a dataset nothing (an ``IterableDataset`` never learns the batch size, its workers' copies
never learn of a new epoch), so a dataset that needs more offers methods the loader and its workers call. Each
protocol below is one such contract, and each is optional: a dataset offers any of them, or none, and the loader
uses what it finds. ``fastfeed.io.Shards`` offers the three ``_ff_`` ones, ``fastfeed.io.Files`` the read-ahead.

Callers never look these methods up themselves: :func:`hooks_of` finds them, once per loader, iterator and
worker, and a method that is there but cannot be called fails there, naming the dataset's class and the hook,
rather than deep in a worker or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from torch.utils.data import IterableDataset


@runtime_checkable
class LoaderSetup(Protocol):
    """The loader's settings, for a dataset that splits batches itself (an ``IterableDataset`` is never told)."""

    def _ff_loader_setup(self, *, batch_size: int | None, drop_last: bool, num_workers: int,
                         prefetch_factor: int | None, epoch_starts: bool) -> None:  # fmt: skip
        """Called in the main process: when the loader is made (``epoch_starts=False``, so ``len()`` works at once)
        and at each ``iter()`` (``epoch_starts=True``), before that epoch's workers get their copies.

        The arguments are the loader's own (``prefetch_factor`` None with ``num_workers=0``). It may raise
        ``ValueError`` for settings it cannot follow; it returns nothing.
        """


@runtime_checkable
class RankPosition(Protocol):
    """A dataset whose resume position is the batches this rank received, not each worker's state: the loader
    saves this position as the state's ``"shards"`` and gives it back through ``load_state_dict``, so the epoch
    continues with any ``num_workers``."""

    def _ff_position(self, yielded: int | None, delivered: list | None = None) -> dict:
        """Called in the main process by ``DataLoader.state_dict()``. ``yielded``: the batches of this epoch the
        user received (None: between epochs). ``delivered``: with ``in_order=False``, how many batches each worker
        delivered (worker w's are the w-th, (w+n)-th, ... still to make), else None.

        Returns the dataset's state dict for that position, which the dataset's ``load_state_dict`` takes back.
        Its presence also tells the loader to keep no worker's state for this dataset.
        """


@runtime_checkable
class WorkerSync(Protocol):
    """What a persistent worker's copy of the dataset must take from the main process's at each new epoch (the
    copy was made at the first epoch and ``_ff_loader_setup``, ``set_epoch`` reached only the original). The two
    methods go together: what one gives, the other takes."""

    def _ff_worker_sync(self) -> dict:
        """Called in the main process at each epoch after the first of persistent workers, after
        ``_ff_loader_setup``. Returns a picklable dict, sent to every worker with its ``Resume``."""

    def _ff_worker_apply(self, sync: dict) -> None:
        """Called in each worker (process, thread or Ray actor) on its own copy, with the dict
        ``_ff_worker_sync`` returned, before the epoch's first task. Returns nothing."""


@runtime_checkable
class ReadAhead(Protocol):
    """The read-ahead protocol (``fastfeed.io``): a map-style dataset hears of samples before it is asked for them.
    An ``IterableDataset`` picks its own samples, so nothing announces them and its ``prefetch`` is not called."""

    def prefetch(self, indices: list) -> None:
        """Called in the process that will call ``__getitem__`` for them: in a worker, with each task's sample
        indices as soon as the task arrives, ahead of the tasks before it; with ``num_workers=0``, in the main
        process, one batch ahead. It must return at once (its reads run in the background). An exception in it is
        warned about once and read-ahead stops; loading goes on."""


@runtime_checkable
class LoaderAware(LoaderSetup, RankPosition, WorkerSync, Protocol):
    """Every ``_ff_`` hook: a dataset that keeps its own position over ranks and workers (``fastfeed.io.Shards``)."""


@dataclass(frozen=True)
class DatasetHooks:
    """A dataset's hooks, bound to it; None where it does not offer one (see the protocols above)."""

    loader_setup: Callable[..., None] | None = None  # LoaderSetup._ff_loader_setup
    position: Callable[[int | None, list | None], dict] | None = None  # RankPosition._ff_position
    worker_sync: Callable[[], dict] | None = None  # WorkerSync._ff_worker_sync
    worker_apply: Callable[[dict], None] | None = None  # WorkerSync._ff_worker_apply
    prefetch: Callable[[list], Any] | None = None  # ReadAhead.prefetch (map-style datasets only)


# Each field of DatasetHooks, the method it is, and the protocol that declares it.
_FIELDS = {
    "loader_setup": ("_ff_loader_setup", LoaderSetup),
    "position": ("_ff_position", RankPosition),
    "worker_sync": ("_ff_worker_sync", WorkerSync),
    "worker_apply": ("_ff_worker_apply", WorkerSync),
}


def hooks_of(dataset) -> DatasetHooks:
    """The hooks ``dataset`` offers, found once: call this where a loader, iterator or worker gets its dataset.

    Raises ``TypeError`` where an ``_ff_`` hook is there but not callable, or where one of ``WorkerSync``'s pair
    is there without the other (a worker's copy could not take what the main process gives).
    """
    found = {}
    for field, (name, protocol) in _FIELDS.items():
        fn = getattr(dataset, name, None)
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{type(dataset).__qualname__}.{name} is a {type(fn).__name__}, not a method: fastfeed.DataLoader "
                f"calls {name} as the dataset's {protocol.__name__} hook (see fastfeed._dataset_hooks). Make it a "
                f"method with that signature, or rename the attribute."
            )
        found[field] = fn
    if (found["worker_sync"] is None) != (found["worker_apply"] is None):
        has, lacks = ("_ff_worker_sync", "_ff_worker_apply")
        if found["worker_sync"] is None:
            has, lacks = lacks, has
        raise TypeError(
            f"{type(dataset).__qualname__} has {has} and no {lacks}: fastfeed.DataLoader sends what "
            f"_ff_worker_sync returns to each persistent worker, whose copy takes it with _ff_worker_apply "
            f"(the WorkerSync hook, see fastfeed._dataset_hooks). Define both, or neither."
        )
    # "prefetch" is a common name for other things (a dataset's own setting, say): torch's loader ignores it, so
    # only a callable one is the read-ahead hook, and a map-style dataset's alone is called.
    prefetch = None if isinstance(dataset, IterableDataset) else getattr(dataset, "prefetch", None)
    return DatasetHooks(**found, prefetch=prefetch if callable(prefetch) else None)
