"""How the doctor sees a script's loaders without the script changing: reversible patches on the DataLoader
classes, installed for one watch and removed after it.

- Every ``DataLoader(...)`` call (torch's, fastfeed's, a library's subclass) records where it was made.
- Every ``iter(loader)`` is adopted: a fastfeed iterator already records each batch (``fastfeed.stats``), so its
  recorder is read as it is; torch's iterator gets a recorder of the same kind, fed from its ``_next_data``.
  Each recorded batch ticks the watch, which ends the measured phase (``StopWatch``) after ``--steps``.
- For the what-if runs: ``overrides`` change the arguments of every loader built (``num_workers=4``),
  ``to_fastfeed`` builds ``fastfeed.DataLoader`` where the script asks for torch's (``fastfeed.replace``, as
  ``fastfeed run`` does), and ``cached`` makes every
  loader yield its first batch again and again (the compute ceiling: a step that never waits for input).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
import sys
import threading
import time
import weakref
from typing import Callable

import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .. import replace, stats
from .._dataset_hooks import hooks_of
from ..loader import DataLoader as FastLoader
from .blocked import Clock
from .timeline import EpochRecord, LoaderRecord, WorkerRecord
from .verdict import DALI_NAMES

log = logging.getLogger("fastfeed")
_MISSING = object()
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
                "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "reduce",
                "reduce_scatter", "reduce_scatter_tensor", "scatter")  # fmt: skip


class StopWatch(BaseException):
    """Raised from the loader once the watch has its batches: it ends a script's measured phase.

    A BaseException, as KeyboardInterrupt is, so the script's own ``except Exception`` does not swallow it.
    """


class _Epoch:
    __slots__ = ("rec", "iterator", "pids", "ready_known", "blocked")

    def __init__(self, rec: stats.Recorder, iterator, ready_known: bool) -> None:
        self.rec = rec
        self.iterator = weakref.ref(iterator) if iterator is not None else lambda: None
        self.pids: set[int] = set()
        self.ready_known = ready_known
        self.blocked: list[float] = []  # the consuming thread's sleep so far, at each return

    def record(self) -> EpochRecord:
        rec = self.rec
        workers = [WorkerRecord(list(f), list(c), list(e)) for f, c, e in zip(rec.fetch, rec.collate, rec.ends)]
        return EpochRecord(asks=list(rec.asks), returns=list(rec.returns),
                           ready=list(rec.ready) if self.ready_known else None, h2d=list(rec.h2d),
                           workers=workers, pids=sorted(self.pids),
                           blocked=self.blocked[: len(rec.asks)])  # fmt: skip


class _Seen:
    """A loader the script iterated while watched (held, for the input-ceiling what-if, until the watch ends)."""

    def __init__(self, ident: int, loader, made_at: str) -> None:
        self.loader = loader
        if _is_dali(loader):  # DALI's threads are its workers, and they persist across epochs
            self.info = LoaderRecord(
                id=ident, kind="dali", made_at=made_at, num_workers=loader.num_threads,
                prefetch_factor=loader.prefetch_queue_depth, batch_size=loader.batch_size, worker_type="dali",
                persistent_workers=True, pin_memory=False, prefetch=False,
            )  # fmt: skip
        else:
            fast = isinstance(loader, FastLoader)
            worker_type, split = worker_kind(loader)
            self.info = LoaderRecord(
                id=ident, kind="fastfeed" if fast else "torch", made_at=made_at, num_workers=loader.num_workers,
                prefetch_factor=loader.prefetch_factor, batch_size=loader.batch_size, worker_type=worker_type,
                persistent_workers=loader.persistent_workers, pin_memory=loader.pin_memory,
                prefetch=_reads_ahead(loader), worker_split=split,
            )  # fmt: skip
        self.epochs: list[_Epoch] = []

    def record(self) -> LoaderRecord:
        self.info.epochs = [e.record() for e in self.epochs if e.rec.asks]
        return self.info


def _reads_ahead(loader) -> bool:
    """Whether the loader's dataset offers the read-ahead hook (the verdict suggests one where it does not)."""
    if isinstance(loader, FastLoader):
        return loader._ff_dataset_hooks.prefetch is not None
    try:
        return hooks_of(loader.dataset).prefetch is not None
    except TypeError:  # an _ff_ hook it cannot call: torch's loader calls none, and watching must not fail the run
        return False


def worker_kind(loader) -> tuple[str, list[int] | None]:
    """A loader's worker type as the timeline records it (a string: it goes to JSON), and its ``[local, remote]``
    split when some of its workers are Ray actors (``loader.num_workers`` is then their sum)."""
    worker_type = getattr(loader, "worker_type", "process")
    if isinstance(worker_type, (tuple, list)):  # fastfeed's mixed form, ("process", "ray")
        worker_type = "+".join(worker_type)
    split = getattr(loader, "worker_split", None)
    if "ray" not in worker_type:
        return worker_type, None
    if split is None:
        split = (0, loader.num_workers) if worker_type == "ray" else (loader.num_workers, 0)
    return worker_type, [int(split[0]), int(split[1])]


def worker_pids(it) -> list[int]:
    """The worker processes behind an iterator: torch's, fastfeed's ring (through a device stage; a mixed loader's
    local ones), or none."""
    it = getattr(it, "source", it)
    procs = getattr(it, "_workers", None)  # torch's iterator
    if procs is None:
        pool = getattr(it, "_pool", None)
        pool = getattr(pool, "local", pool)  # a mixed pool's local processes; Ray actors are no processes of ours
        procs = [getattr(w, "process", None) for w in getattr(pool, "workers", ())]
    return [p.pid for p in procs or () if p is not None and p.pid is not None]


def _detached(batch, device):
    """A copy of ``batch`` that holds no ring slot and no worker: tensors cloned (onto ``device``)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, copy=True) if device is not None else batch.clone()
    if isinstance(batch, dict):
        return type(batch)({k: _detached(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_detached(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_detached(v, device) for v in batch)
    return batch


class _Cached:
    """An epoch of one batch, yielded ``len(loader)`` times: input that costs nothing."""

    def __init__(self, batch, n: int | None, rec: stats.Recorder) -> None:
        self._batch, self._left, self._rec = batch, n, rec

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._left or 0

    def __next__(self):
        asked = time.perf_counter()
        if self._left is not None:
            if self._left <= 0:
                raise StopIteration
            self._left -= 1
        self._rec.add(asked, 1, time.perf_counter())
        return self._batch


class Hooks:
    """The patches of one watch.

    Args:
        tick: called after each recorded batch; it raises ``StopWatch`` to end the measured phase.
        overrides: DataLoader arguments to force on every loader built (the closing-the-loop run).
        to_fastfeed: build ``fastfeed.DataLoader`` where the script builds ``torch.utils.data.DataLoader``.
        cached: every loader yields its first batch over and over (the compute ceiling).
        sleep: read, at each batch's return, how long the consuming thread has slept (``blocked``): a job's rank
            needs it to measure the sync inside its steps; one process watched alone does not pay for it.
    """

    def __init__(self, tick: Callable[[], None], overrides: dict | None = None, to_fastfeed: bool = False,
                 cached: bool = False, sleep: bool = False) -> None:  # fmt: skip
        self.tick = tick
        self.overrides = dict(overrides or {})
        self.to_fastfeed = to_fastfeed
        self.cached = cached
        self.seen: dict[int, _Seen] = {}
        self.made_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.distributed_s = 0.0
        self.affinity: dict[int, frozenset[int]] = {}  # each worker process's allowed CPUs, read while it lived
        self._batches: dict[int, object] = {}  # the compute ceiling's cached batch, per loader
        self._sleep = Clock() if sleep else None
        self._depth = threading.local()
        self._saved: list[tuple[object, str, object]] = []

    # -- patching ---------------------------------------------------------------------------

    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type)
                            else getattr(owner, name, _MISSING)))  # fmt: skip
        setattr(owner, name, value)

    def install(self) -> Hooks:
        for cls in (TorchLoader, FastLoader, *_dali_loader()):
            self._patch(cls, "__init__", self._init_hook(cls.__dict__["__init__"]))
            self._patch(cls, "__iter__", self._iter_hook(cls.__dict__["__iter__"]))
        if torch.distributed.is_available():
            for name in _COLLECTIVES:
                fn = getattr(torch.distributed, name, None)
                if fn is not None:
                    self._patch(torch.distributed, name, self._timed_collective(fn))
        return self

    def close(self) -> None:
        """Undo every patch, newest first."""
        if self._sleep is not None:
            self._sleep.close()
        while self._saved:
            owner, name, old = self._saved.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    def _outermost(self) -> bool:
        return getattr(self._depth, "n", 0) == 0

    def _nested(self, fn, *args, **kwargs):
        self._depth.n = getattr(self._depth, "n", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth.n -= 1

    def _init_hook(self, init):
        hooks = self

        @functools.wraps(init)
        def __init__(loader, *args, **kwargs):
            if not hooks._outermost():  # fastfeed's __init__ calling torch's
                return init(loader, *args, **kwargs)
            hooks.made_at[loader] = replace.caller(loader)
            target = init
            new = replace.target(type(loader))[0] if hooks.to_fastfeed else None
            if new is not None:
                # fastfeed run's mechanism: the same object becomes fastfeed's loader (or a library subclass on
                # top of it) and is built by fastfeed's __init__ with the same arguments.
                loader.__class__ = new
                target = FastLoader.__init__.__wrapped__
            if hooks.overrides and _is_dali(loader):
                kwargs = _dali_override(kwargs, hooks.overrides)
            elif hooks.overrides:
                args, kwargs = _override(args, kwargs, hooks.overrides)
            return hooks._nested(target, loader, *args, **kwargs)

        return __init__

    def _iter_hook(self, orig_iter):
        hooks = self

        @functools.wraps(orig_iter)
        def __iter__(loader):
            if not hooks._outermost():  # fastfeed's __iter__ calling torch's
                return orig_iter(loader)
            if hooks.cached:
                return hooks._cached(loader, orig_iter)
            hooks._size_dataset(loader)
            return hooks._adopt(loader, hooks._nested(orig_iter, loader))

        return __iter__

    def _timed_collective(self, fn):
        hooks = self

        @functools.wraps(fn)
        def collective(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                hooks.distributed_s += time.perf_counter() - t0

        return collective

    # -- recording --------------------------------------------------------------------------

    def _seen(self, loader) -> _Seen:
        seen = self.seen.get(id(loader))
        if seen is None or seen.loader is not loader:
            seen = self.seen[id(loader)] = _Seen(len(self.seen), loader, self.made_at.get(loader, "before the watch"))
        return seen

    def _counted(self, rec: stats.Recorder, epoch: _Epoch) -> None:
        add, tick = rec.add, self.tick

        def add_and_tick(asked: float, ready: int, returned: float) -> None:
            tick()  # past the watch's batches it raises, and the batch is neither recorded nor handed over
            add(asked, ready, returned)

        if self._sleep is not None:
            slept, blocked = self._sleep.read, epoch.blocked.append

            def add_tick_and_read(asked: float, ready: int, returned: float) -> None:
                add_and_tick(asked, ready, returned)
                blocked(slept())

            rec.add = add_tick_and_read
        else:
            rec.add = add_and_tick

    def _size_dataset(self, loader) -> None:
        """Find the dataset's large Python containers (what forked workers copy as they read), once per loader,
        before its workers are forked: walking the objects writes their reference counts, and with workers alive
        that would copy the pages into them, the very growth the doctor measures."""
        seen = self._seen(loader)
        info = seen.info
        if info.containers is not None or info.kind == "dali" or not info.local_workers:
            return
        if info.worker_type == "thread":
            info.containers = []  # threads share the one copy: nothing is copied
            return
        if getattr(loader, "_iterator", None) is not None:
            return  # persistent workers forked before the watch: walking now would copy the objects into them
        from ..sharing.find import large_containers

        try:
            info.containers = [list(c) for c in large_containers(loader.dataset)]
        except Exception as e:  # a dataset's attribute that raises when read must not fail the script
            log.debug("fastfeed doctor: the dataset's containers could not be sized (%s)", e)
            info.containers = []

    def _adopt(self, loader, it):
        """Record ``it``'s batches: through fastfeed's own recorder, or one fed from torch's ``_next_data``."""
        seen = self._seen(loader)
        rec = loader._ff_stats if isinstance(loader, FastLoader) or _is_dali(loader) else None
        if rec is not None:
            seen.epochs.append(_Epoch(rec, it, ready_known=True))
            self._counted(rec, seen.epochs[-1])
            return it
        rec = stats.Recorder(loader.num_workers, loader.prefetch_factor)
        seen.epochs.append(_Epoch(rec, it, ready_known=False))
        self._counted(rec, seen.epochs[-1])
        if isinstance(it, _BaseDataLoaderIter):
            inner = _weak_next_data(it)  # torch's __next__ calls it; an instance attribute comes first

            def _next_data():
                asked = time.perf_counter()
                data = inner()
                rec.add(asked, 0, time.perf_counter())
                return data

            it._next_data = _next_data
            return it
        return _Timed(it, rec)

    def _cached(self, loader, orig_iter):
        seen = self._seen(loader)
        batch = self._batches.get(id(loader))
        if batch is None:
            first = self._nested(orig_iter, loader)
            try:
                batch = next(iter(first))
            finally:
                del first
            device = None
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # the script trains on the GPU
                device = torch.device("cuda", torch.cuda.current_device())
            batch = self._batches[id(loader)] = _detached(batch, device)
        rec = stats.Recorder(0, None)
        seen.epochs.append(_Epoch(rec, None, ready_known=False))
        self._counted(rec, seen.epochs[-1])
        try:
            n = len(loader)
        except TypeError:
            n = None
        return _Cached(batch, n, rec)

    def pids(self) -> list[int]:
        """Worker processes of the iterators alive now (the sampler watches their CPU)."""
        out = []
        for seen in self.seen.values():
            for epoch in seen.epochs[-2:]:
                it = epoch.iterator()
                if it is not None:
                    now = worker_pids(it)
                    epoch.pids.update(now)
                    out += now
        for pid in out:
            if pid not in self.affinity:
                try:
                    self.affinity[pid] = frozenset(os.sched_getaffinity(pid))
                except OSError:  # already gone
                    pass
        return out

    def records(self) -> list[LoaderRecord]:
        return [seen.record() for seen in self.seen.values()]

    def loaders(self) -> list:
        return [seen.loader for seen in self.seen.values()]

    def release(self) -> None:
        """Drop the loaders and cached batches (their rings and memory)."""
        for seen in self.seen.values():
            seen.loader = None
        self._batches.clear()


def _weak_next_data(it) -> Callable[[], object]:
    """``it._next_data`` as a callable that holds ``it`` weakly.

    The doctor's wrapper is stored on the iterator: through a bound method it would hold the iterator, a cycle, and
    an iterator the script drops would then stop its workers only when the garbage collector next runs (inside
    whatever the process does then, where torch's shutdown can wait out its 5 s join timeout) instead of at once,
    in torch's ``__del__``. torch's ``__next__``, which calls it, holds the iterator alive meanwhile.
    """
    inner = it._next_data
    if getattr(inner, "__self__", None) is not it:  # already an instance attribute: called as it is
        return inner
    method = weakref.WeakMethod(inner)
    return lambda: method()()


class _Timed:
    """A proxy that records an iterator with no ``_next_data`` of its own (a device stage with stats off)."""

    def __init__(self, it, rec: stats.Recorder) -> None:
        self._it, self._rec = it, rec

    def __iter__(self):
        return self

    def __next__(self):
        asked = time.perf_counter()
        data = next(self._it)
        self._rec.add(asked, 0, time.perf_counter())
        return data

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)


_TORCH_ARGS = inspect.signature(TorchLoader.__init__)


def _dali_loader() -> tuple:
    """fastfeed's DALI loader class, when DALI is installed (importing it costs about a second, once)."""
    if importlib.util.find_spec("nvidia.dali") is None:
        return ()
    try:
        from ..dali.loader import DALILoader
    except ImportError:  # a broken DALI install: its loaders cannot be made either
        return ()
    return (DALILoader,)


def _is_dali(loader) -> bool:
    dali = sys.modules.get("fastfeed.dali.loader")
    return dali is not None and isinstance(loader, dali.DALILoader)


def _dali_override(kwargs: dict, overrides: dict) -> dict:
    """A DALILoader's arguments with the DataLoader overrides that have a DALI meaning (threads, queue depth)."""
    return {**kwargs, **{DALI_NAMES[k]: v for k, v in overrides.items() if k in DALI_NAMES}}


def _override(args: tuple, kwargs: dict, overrides: dict) -> tuple[tuple, dict]:
    """A DataLoader call's arguments with ``overrides`` in force, bound by torch's signature (which every
    subclass passes on); arguments only a subclass knows, such as fastfeed's ``worker_type``, pass as given, or as
    overridden."""
    own = {k: v for k, v in kwargs.items() if k not in _TORCH_ARGS.parameters}
    bound = _TORCH_ARGS.bind(None, *args, **{k: v for k, v in kwargs.items() if k not in own})
    bound.arguments.update({k: v for k, v in overrides.items() if k in _TORCH_ARGS.parameters})
    own.update({k: v for k, v in overrides.items() if k not in _TORCH_ARGS.parameters})  # BoundArguments drops them
    if bound.arguments.get("num_workers") == 0:  # torch refuses these without workers
        bound.arguments.pop("prefetch_factor", None)
        bound.arguments.pop("persistent_workers", None)
    return bound.args[1:], {**bound.kwargs, **own}

