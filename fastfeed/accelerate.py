"""Keeping fastfeed's loader through Hugging Face Accelerate (and so the HF Trainer).

``Accelerator.prepare(loader)`` does not wrap the loader it is given: it rebuilds one from the loader's torch
arguments, inside ``accelerate.data_loader.DataLoaderAdapter.__init__``, on torch's ``DataLoader`` (or torchdata's
``StatefulDataLoader``). Every Accelerate path that makes a loader goes through that one method: ``prepare`` in
each mode (sampler sharding, ``split_batches``, ``dispatch_batches``, iterable datasets) and ``skip_first_batches``
on a prepared loader. Accelerate offers no hook for the class it builds, so fastfeed patches that method, once,
when a ``fastfeed.DataLoader`` exists while ``accelerate.data_loader`` is imported (whichever comes first), and
``uninstall()`` restores it.

The patched ``__init__`` finds the fastfeed loader the new one is made from by what Accelerate hands over: the
original's batch sampler (or its ``sampler``, when that is a batch sampler), possibly inside Accelerate's
``BatchSamplerShard`` / ``SkipBatchSampler``, or, for iterable datasets, the original's dataset, possibly inside
``IterableDatasetShard``. It then builds ``fastfeed.DataLoader`` with Accelerate's arguments plus the original's
fastfeed ones (``worker_type``, ``device``, ``device_transform``, ``device_prefetch``, ``numa``, ``reader``, and
``"auto"`` while tuning has not settled). Loaders made from torch's own are left to Accelerate.

Accelerate asks its base loader for ``state_dict()`` before every batch it reads ahead. fastfeed's state asks the
workers where they stand, which would drain the pipeline at every batch, so for a fastfeed base the adapter only
notes how many batches had been handed out, and the state is made when it is asked for (``save_state``), as of
that many batches: the same state, taken once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
import weakref

from . import _hooks, _state
from .loader import DataLoader  # the watcher depends on the loader, never the reverse (the loader calls _hooks)

MODULE = "accelerate.data_loader"

_loaders: weakref.WeakSet = weakref.WeakSet()  # every fastfeed loader alive: the sources a rebuild can come from
_saved = None  # DataLoaderAdapter.__init__ as Accelerate wrote it, while the patch is in place
_watching = None  # the import watcher, until accelerate.data_loader is imported
_off = False  # uninstall() was called: loaders made since do not patch Accelerate again


def watch(loader) -> None:
    """Called for each fastfeed loader made (through ``fastfeed._hooks``): patch Accelerate now if it is imported,
    else when it is."""
    _loaders.add(loader)
    if _saved is not None or _watching is not None or _off:
        return
    if MODULE in sys.modules:
        install()
    else:
        _watch_import()


def installed() -> bool:
    return _saved is not None


def install() -> None:
    """Patch ``DataLoaderAdapter.__init__`` (idempotent). Imports Accelerate."""
    global _saved, _off
    _off = False
    if _saved is not None:
        return
    from accelerate.data_loader import DataLoaderAdapter

    original = _saved = DataLoaderAdapter.__dict__["__init__"]

    def __init__(adapter, dataset, use_stateful_dataloader=False, batch_sampler=None, **kwargs):
        source = _source(dataset, batch_sampler, kwargs)
        why = None if source is None else _cannot_keep(source, use_stateful_dataloader)
        if source is None or why:
            if why:
                warnings.warn(f"fastfeed: Accelerate rebuilds this fastfeed.DataLoader on its own loader class, "
                              f"because {why}", stacklevel=3)  # fmt: skip
            original(adapter, dataset, use_stateful_dataloader=use_stateful_dataloader,
                     batch_sampler=batch_sampler, **kwargs)  # fmt: skip
        else:
            adapter.use_stateful_dataloader = use_stateful_dataloader
            adapter.base_dataloader = _rebuild(source, dataset, batch_sampler, kwargs)
        if _is_fastfeed(adapter.base_dataloader):  # also one `fastfeed run` made out of torch's
            _state_on_demand(adapter)

    __init__.__wrapped__ = original
    DataLoaderAdapter.__init__ = __init__


def uninstall() -> None:
    """Restore Accelerate's ``DataLoaderAdapter.__init__``, until ``install()``; loaders already prepared keep
    what they were built as."""
    global _saved, _off
    _off = True
    _stop_watching()
    if _saved is None:
        return
    from accelerate.data_loader import DataLoaderAdapter

    DataLoaderAdapter.__init__ = _saved
    _saved = None


def _is_fastfeed(obj) -> bool:
    return isinstance(obj, DataLoader)


def _source(dataset, batch_sampler, kwargs):
    """The fastfeed loader that Accelerate is rebuilding, or None (a torch loader, or one nobody holds any more)."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard, SkipBatchSampler

    samplers = []
    for sampler in (batch_sampler, kwargs.get("sampler")):
        while sampler is not None:
            samplers.append(sampler)
            sampler = sampler.batch_sampler if isinstance(sampler, (BatchSamplerShard, SkipBatchSampler)) else None
    loaders = list(_loaders)
    for loader in loaders:
        if any(s is loader.batch_sampler or s is loader.sampler for s in samplers):
            return loader
    if samplers:
        return None
    # An iterable dataset: Accelerate hands over its dataset and the loader's arguments, no sampler.
    if isinstance(dataset, IterableDatasetShard):
        dataset = dataset.dataset
    same = [loader for loader in loaders if loader.dataset is dataset and _same_arguments(loader, kwargs)]
    return same[-1] if same else None


def _same_arguments(loader, kwargs) -> bool:
    return all(getattr(loader, k) is v or getattr(loader, k) == v for k, v in kwargs.items()
               if k in ("num_workers", "collate_fn", "worker_init_fn", "prefetch_factor", "persistent_workers"))


def _cannot_keep(source, stateful: bool) -> str | None:
    """Why Accelerate's mode needs its own loader class for ``source``, or None."""
    if not stateful:
        return None
    from torch.utils.data import IterableDataset

    if source.worker_type == "thread" and isinstance(source.dataset, IterableDataset) and source.num_workers:
        return ("use_stateful_dataloader saves the loader's position, and worker threads share one iterable "
                "dataset whose per-worker position cannot be saved. Use worker_type='process' to keep fastfeed.")
    return None


def _rebuild(source, dataset, batch_sampler, kwargs):
    """fastfeed's loader with Accelerate's arguments and ``source``'s own."""
    ours = dict(source._ff_made, worker_type=source.worker_type, numa=source.numa, reader=source.reader)
    auto = source._ff_auto
    if auto is not None and source._ff_tuner is not None:  # not settled: the new loader tunes too
        kwargs = dict(kwargs, num_workers=auto.num_workers, prefetch_factor=auto.prefetch_factor)
    return DataLoader(dataset, batch_sampler=batch_sampler, **kwargs, **ours)


def _state_on_demand(adapter) -> None:
    """The adapter's per-batch ``_update_state_dict`` notes a position; ``state_dict()`` makes the state then.

    Instance attributes, so Accelerate's classes are not touched further.
    """
    from accelerate.data_loader import DataLoaderDispatcher
    from accelerate.state import PartialState

    base = adapter.base_dataloader
    dispatcher = isinstance(adapter, DataLoaderDispatcher)
    # How far Accelerate reads ahead of what its user has: one batch, or a dispatcher's next round of batches.
    processes = PartialState().num_processes if dispatcher else 1
    base._ff_lookahead = 2 * processes if dispatcher else 1
    mark = {"it": None, "handed": 0, "finished": False}

    def _update_state_dict():
        it, handed = base._handed()
        if dispatcher and not adapter.split_batches and not adapter.end_of_dataloader:
            handed -= processes - 1  # noted before the last read of a round whose batches the user has not had
        mark.update(it=None if it is None else weakref.ref(it), handed=handed, finished=adapter.end_of_dataloader)

    def state_dict():
        it, handed = base._handed()
        noted = None if mark["it"] is None else mark["it"]()
        state = _state.for_job(base._state_before(handed - mark["handed"] if noted is it and it is not None else 0))
        state["_iterator_finished"] = mark["finished"]  # as Accelerate tags its own
        return state

    adapter._update_state_dict = _update_state_dict
    adapter.state_dict = state_dict


class _Watch(importlib.abc.MetaPathFinder):
    """Patches Accelerate right after ``accelerate.data_loader`` is imported, for loaders made before it was."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        _stop_watching()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            install()

        spec.loader.exec_module = exec_module
        return spec


def _watch_import() -> None:
    global _watching
    _watching = _Watch()
    sys.meta_path.insert(0, _watching)


def _stop_watching() -> None:
    global _watching
    if _watching is not None and _watching in sys.meta_path:
        sys.meta_path.remove(_watching)
    _watching = None


_hooks.on_loader_made(watch)
