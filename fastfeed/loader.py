"""``fastfeed.DataLoader``: torch's DataLoader, fed through a shared-memory ring.

The class is a subclass of ``torch.utils.data.DataLoader`` and takes the same
arguments, validated by torch itself, so ``isinstance`` checks and every
torch behaviour carry over. With ``num_workers=0`` it runs torch's own
single-process iterator (subclassed only to track its position for ``state_dict``).
With workers, batches travel sampler -> workers -> ring slot -> user (see
``_iterator.py``): each batch is copied once, by the worker, into shared memory
that was allocated and touched once, and the user receives views of it.
"""

from __future__ import annotations

import copy
import weakref
from typing import TypeVar

import torch
import torch.utils.data
from torch.utils.data import IterDataPipe, MapDataPipe, _DatasetKind

from . import _from_torchdata, _hooks, _state, _state_check, affinity, stats, transfer
from ._dataset_hooks import hooks_of
from ._iterator import RingDataLoaderIter
from ._ring.ring import Ring
from ._single import SingleProcessIter
from . import _workers
from ._workers import WORKER_TYPES  # noqa: F401 (its old home; fastfeed.tune chooses among them)
from .io import gds
from .sharing import advice as share_advice
from .io.arrays import ArrayFiles
from .io import direct
from .tuning import auto as tuning_auto
from .tuning.online import TuningIter

STATE_VERSION = _state.VERSION
# What load_state_dict reads: 1 held tensors and tuples where 2 holds JSON's values; 3 has the same keys at every
# point, and a job's state keys each rank's.
STATE_VERSIONS = (1, 2, 3)

_T_co = TypeVar("_T_co", covariant=True)  # what the loader yields, as torch's DataLoader[_T_co]


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """A drop-in replacement for ``torch.utils.data.DataLoader``.

    Args:
        *args, **kwargs: exactly torch's (``dataset``, ``batch_size``, ``shuffle``,
            ``sampler``, ``batch_sampler``, ``num_workers``, ``collate_fn``,
            ``pin_memory``, ``drop_last``, ``timeout``, ``worker_init_fn``,
            ``multiprocessing_context``, ``generator``, ``prefetch_factor``,
            ``persistent_workers``, ``pin_memory_device``, ``in_order``).
        worker_type: ``"process"`` (torch's model) or ``"thread"``: the
            ``num_workers`` workers are threads of this process, for datasets whose
            work releases the GIL (image decoding, native readers) or free-threaded
            Python. Same batches, order and errors; threads share the process's global
            RNGs and the one dataset object (see ``fastfeed._workers.threads``). ``"ray"``: the
            workers are actors of a running Ray cluster (``ray_options``: their actor options, e.g.
            ``num_cpus``, ``resources``, ``scheduling_strategy``), with process workers' semantics;
            a lost actor or node is replaced and its batches redone. ``("process", "ray")`` with
            ``num_workers=(local, remote)``: local processes and Ray actors in one loader (see
            ``fastfeed._workers.ray.pool``).
        device: ``None`` (CPU batches, as torch), ``"cuda"``/``"cuda:N"`` or ``"cpu"``. With
            a CUDA device, batches arrive on it: copied from the pinned ring slots with
            ``non_blocking=True`` on a dedicated stream, and your current stream waits for
            the copy (the host does not). Non-tensor leaves pass through unchanged.
        device_transform: a callable applied to each batch on the device, on the copy
            stream, before you see it (e.g. ``fastfeed.transforms.ImageNormalize``: PCIe
            then carries uint8, 4x fewer bytes than float32). With ``reader="gds"``, on the
            read stream, once the batch is read.
        device_prefetch: batches copied ahead of the one you are given, when they are
            ready (default 1; with ``num_workers=0`` there is no lookahead). With
            ``reader="gds"``: batches read ahead by the reader thread.
        numa: where workers run. ``"auto"`` (default): when a CUDA device is targeted
            (``device="cuda"``, or ``pin_memory=True`` with CUDA), workers run on CPUs of the
            GPU's NUMA node, split with the other local ranks (torchrun's ``LOCAL_RANK``,
            ``LOCAL_WORLD_SIZE``), prefer that node's memory, and the ring's memory is
            bound there. A node number forces that node; ``"off"`` places nothing. The
            plan is ``loader.numa_plan`` once iteration starts (see ``fastfeed info``).

    Batches from worker processes are views of reused shared-memory slots. A
    slot is recycled only once no tensor views it, so holding on to batches is
    safe; holding on to many of them makes the ring grow (with one
    ``RingGrowthWarning``) rather than deadlock.
    """

    def __init__(
        self, *args, worker_type: str = "process", device=None, device_transform=None, device_prefetch: int = 1,
        numa="auto", reader=None, ray_options=None, **kwargs,
    ):  # fmt: skip
        """``num_workers`` and ``prefetch_factor`` also take ``"auto"``: see ``fastfeed.tuning.auto``.

        ``reader`` (an ``ArrayFiles`` dataset only): ``"gds"`` reads each batch from disk straight into the
        ``device`` with kvikio (GPUDirect Storage), in a reader thread ``device_prefetch`` batches ahead, into a
        small pool of device buffers; ``device_transform`` runs on the read stream, and your stream waits for
        the read (the host does not); kvikio's thread pool gets this rank's CPUs (``num_workers`` is moot, see
        ``fastfeed.io.direct``). ``"posix"`` reads with ``pread`` in the workers, into the ring, copied to the
        device on the side stream. ``"auto"`` takes GDS where kvikio, libcuda and a GPU are present (``fastfeed
        info`` says which). None: the usual path.
        """
        args, worker_type, split = _split_workers(args, kwargs, worker_type)
        if ray_options is not None and not _workers.uses_ray(worker_type):
            raise ValueError(f"ray_options are Ray's actor options, and worker_type={worker_type!r} starts no actors: "
                             "pass worker_type='ray' (or ('process', 'ray')), or leave ray_options unset")  # fmt: skip
        if ray_options is not None and not isinstance(ray_options, dict):
            raise ValueError(f"ray_options must be a dict of Ray actor options (num_cpus, resources, "
                             f"scheduling_strategy, ...), got {type(ray_options).__name__}")  # fmt: skip
        args, auto = tuning_auto.take(args, kwargs)
        if auto is not None and _workers.uses_ray(worker_type):
            raise ValueError("num_workers/prefetch_factor='auto' tune local workers; with Ray actors give the counts "
                             "(fastfeed.tune(..., remote=...) measures how many actors pay)")  # fmt: skip
        # Before torch's __init__, whose worker-count check counts local workers only (see below).
        self.worker_type = worker_type
        self._ff_local = split[0] if worker_type == _workers.MIXED else None  # the mixed form's local processes
        super().__init__(*args, **kwargs)
        self._ff_dataset_hooks = hooks_of(self.dataset)  # torch's loader forbids replacing its dataset from here on
        self._ff_stage = transfer.plan(device, device_transform, device_prefetch)
        self._ff_made = {"device": device, "device_transform": device_transform, "device_prefetch": device_prefetch}
        self._ff_auto = auto
        affinity.check(numa)
        self.numa = numa
        self.numa_plan = None  # made when the first workers start
        self.device = None if self._ff_stage is None else self._ff_stage.device
        if worker_type == "thread":
            if self.multiprocessing_context is not None:
                raise ValueError(
                    "multiprocessing_context applies to worker processes; worker_type='thread' starts threads. "
                    "Pass one or the other."
                )
            if isinstance(self.dataset, (IterDataPipe, MapDataPipe)):
                raise ValueError(
                    "worker_type='thread' does not support DataPipes (sharding and seeding change the one "
                    "shared graph); use worker_type='process'"
                )
        if worker_type == _workers.RAY and self.multiprocessing_context is not None:
            raise ValueError("multiprocessing_context applies to worker processes; worker_type='ray' starts Ray "
                             "actors. Pass one or the other.")  # fmt: skip
        self.ray_options = ray_options
        self.reader = _reader(reader, self.dataset, self.device)
        if self.reader == "gds":
            self._read_direct()
        if auto is not None:
            tuning_auto.start(self, auto)
        _set_up_dataset(self, epoch_starts=False)
        _hooks.loader_made(self)  # fastfeed.accelerate's watcher, among others, registers there

    def _read_direct(self) -> None:
        """GDS: batches are read into device memory by the iterator's reader thread, so there are no workers."""
        self.reader = "gds"
        self.num_workers = 0

    tune_result = None  # with num_workers="auto": the TuneResult chosen (from the cache, or once tuned)
    _ff_tuner = None  # with "auto" on a cache miss: the online tuner, until it settles
    _ff_epochs = 0  # iterations started (epochs)
    _ff_last = None  # weak reference to the latest iterator
    _ff_staged = None  # weak reference to the latest device stage over it
    _ff_copier = None  # the device stage's streams, made once
    _ff_planned = False  # numa_plan was made
    _ff_resume = None  # the state the next iterator starts from (load_state_dict's, decoded)
    _ff_kept = None  # the latest iterator, kept: dropped mid-epoch (a `break`), state_dict() still gives its position
    _ff_ring = None  # the ring of batch slots, kept across epochs
    _ff_stats = None  # the latest iterator's stats.Recorder
    _ff_lookahead = 0  # batches a wrapper around this loader reads ahead of its consumer (fastfeed.accelerate)
    _ff_gds_threads = None  # reader="gds": kvikio's threads, this rank's CPUs (the NUMA plan's share)
    _ff_ray_spare = None  # Ray actors kept between epochs (fastfeed._workers.ray.pool.Spare)

    @property
    def worker_split(self) -> tuple[int, int]:
        """``(local workers, Ray actors)``: ``(num_workers, 0)`` for processes or threads, ``(0, num_workers)`` for
        ``worker_type="ray"``, the pair given for ``("process", "ray")``."""
        if self.worker_type == _workers.MIXED:
            return self._ff_local, self.num_workers - self._ff_local
        return (0, self.num_workers) if self.worker_type == _workers.RAY else (self.num_workers, 0)

    def stats(self) -> stats.Stats:
        """What the latest iterator measured: throughput, stall fraction, waits, steps, workers' load.

        See ``fastfeed.stats``. Empty (0 batches) before the first ``iter()`` or with
        ``FASTFEED_STATS=0``.
        """
        return stats.Stats.of(self._ff_stats)

    def _get_iterator(self):
        resume, self._ff_resume = self._ff_resume, None
        if resume is not None and resume.get("shards") is not None:
            resume = None  # the dataset took its position (load_state_dict): this epoch starts there, unreplayed
        if self._ff_tuner is not None:
            # A loaded state's epoch goes on tuning from its position (TuningIter refuses one it cannot follow)
            return TuningIter(self, self._ff_tuner, resume if resume is not None and _restores(resume) else None)
        if self.reader == "gds":  # read into device memory by a reader thread, under torch's single-process machinery
            if self._ff_gds_threads is None:
                from .tuning.offline import rank_cpus

                self._ff_gds_threads = rank_cpus({"device": self.device, "numa": self.numa})
            stage = self._ff_stage
            ahead, transform = (1, None) if stage is None else (stage.ahead, stage.transform)
            return direct.GdsIter(self, resume, direct.device_for(self.device), ahead, transform,
                                  self._ff_gds_threads)  # fmt: skip
        if self.num_workers == 0:
            return SingleProcessIter(self, resume)  # torch's single-process iterator, plus a state
        self.check_worker_number_rationality()
        if not self._ff_planned:
            self._ff_planned = True
            self.numa_plan = affinity.plan_for(self.numa, self._cuda_target(), self.num_workers)
            if self.worker_type != "thread":  # threads share one copy of the dataset: nothing to copy on read
                # Points at the user's loop: this frame < torch's __iter__ < fastfeed's __iter__ < the loop.
                share_advice.warn_if_copied(self.dataset, self.num_workers, stacklevel=4)
        return RingDataLoaderIter(self, self._ring_for, resume, self._ff_stage)

    def check_worker_number_rationality(self):
        # A count the tuner chose by measuring, above the cores or not, needs no warning about it.
        if self.tune_result is not None and self.num_workers == self.tune_result.num_workers:
            return
        local = self.worker_split[0] if _workers.uses_ray(getattr(self, "worker_type", None)) else None
        if local is None:
            super().check_worker_number_rationality()
            return
        # Ray actors run on the cluster's CPUs: only the local processes count against this machine's cores.
        total = self.num_workers
        self.num_workers = local
        try:
            super().check_worker_number_rationality()
        finally:
            self.num_workers = total

    def _ring_for(self, quiet: int, pin: bool, numa_node: int | None, device: int = -1) -> Ring:
        """The ring of batch slots for a new iterator: the last one, unless another iterator still writes into it.

        Kept from one epoch to the next, so a new epoch's workers (``persistent_workers=False``
        starts new ones) write into memory that is already allocated, touched, pinned and
        on its NUMA node. It goes when the loader does.
        """
        ring = self._ff_ring
        if ring is None or not ring.fits(pin, numa_node, device):
            ring = self._ff_ring = Ring(quiet, pin, numa_node, device)
        else:
            ring.set_quiet(quiet)
        ring.in_use = True
        return ring

    def _cuda_target(self):
        """The CUDA device batches are headed for, if any: its NUMA node is where workers belong."""
        if self._ff_stage is not None:
            return self._ff_stage.device
        if self.pin_memory and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def __iter__(self):
        staged = self._ff_staged() if self._ff_staged is not None else None
        if staged is not None:
            staged.close()  # a new epoch: copies of the last one's unseen batches are moot
        tuner = self._ff_tuner
        if tuner is not None and tuner.result is not None and tuner.agreed:
            self._ff_tuner = tuner = None  # settled, and every rank agrees
        # The last epoch's iterator goes first (unless the caller holds it): its workers and ring are free then.
        self._ff_kept = None
        _set_up_dataset(self, epoch_starts=True)
        # While tuning, each epoch is a TuningIter: torch's persistent-workers path would keep it.
        it = self._get_iterator() if tuner is not None else super().__iter__()
        self._ff_epochs += 1
        self._ff_last = weakref.ref(it)
        self._ff_kept = [it]
        if it._stats is not None and it._stats is self._ff_stats:  # persistent workers: a new epoch
            paths = it._stats.paths  # the workers are the same, and a Ray pool keeps filling this one
            it._stats = stats.recorder(it._num_workers, self.prefetch_factor if it._num_workers else None)
            if it._stats is not None:
                it._stats.paths = paths
        self._ff_stats = it._stats
        # GDS batches are read onto the device, device_transform and device_prefetch applied by the reader thread.
        if self._ff_stage is None or self.reader == "gds":
            return it
        if self._ff_copier is None:
            self._ff_copier = transfer.copier_for(self._ff_stage)
        it._timed = False  # the consumer asks the device stage, which times
        if self.num_workers == 0:  # loading ahead would run in this thread: no lookahead
            staged = transfer.DeviceIter(it, self._ff_copier, 0, lambda: False, stats=it._stats)
        else:
            staged = transfer.DeviceIter(it, self._ff_copier, self._ff_stage.ahead, it._batch_ready, it.end_epoch,
                                         stats=it._stats)  # fmt: skip
        self._ff_staged = weakref.ref(staged)
        if self._ff_kept is not None:
            self._ff_kept.append(staged)
        return staged

    def state_dict(self) -> dict:
        """Where this loader stands, so that a new process can continue from here.

        Taken after the user received batch k of an epoch, ``load_state_dict`` on a
        loader built with the same arguments makes its next ``iter()`` yield batches
        k+1.. of that epoch, bit-identical to an uninterrupted run, and later epochs as
        they would have been. That holds inside the loop and after it: after a ``break``
        the state is still that of batch k (the loader keeps its latest iterator, and
        with it the workers, until the next ``iter()``, as torchdata's
        ``StatefulDataLoader`` does). Taken between epochs (before the first ``iter()``,
        or after an epoch's iterator ended), the next ``iter()`` starts the next epoch,
        with the dataset's and sampler's own states as they were. Between
        ``load_state_dict()`` and the next ``iter()``, the loaded state is the state.

        The state is JSON's values only: ``json.dumps`` takes it, and so do
        ``torch.save`` / ``torch.load(weights_only=True)``. ``load_state_dict`` takes
        it back from either (and states of versions 1, which held tensors, and 2, and
        states saved by torchdata's ``StatefulDataLoader``). It has the same keys at
        every point, so that ``torch.distributed.checkpoint`` can load it into a fresh
        loader's; in an initialised process group of several ranks it is
        ``{"version": 3, "world_size": W, "ranks": {"<rank>": <this>}}``::

            {
              "version": 3,
              "epochs": int,          # iter() calls so far, this one included
              "rng": {                # the main process's RNGs now (restored by load_state_dict)
                "torch": str,         # torch.get_rng_state()'s bytes, base64
                "random": [3, [int] * 625, float | None],    # random.getstate()
                "numpy": [str, str, int, int, float] | None, # numpy's: name, its uint32 keys (base64), pos, gauss
                "generator": str | None},                    # loader.generator's state, base64
              "mid_epoch": bool,      # False: between epochs
              "yielded": int,         # k, batches the user received this epoch
              "sampler_rng": {"torch": str | None, "generator": str | None},
                                      # what the sampler drew from, just before its first index (None: not yet)
              "sampler_state": object, # a stateful sampler's state_dict() after batch k (else None)
              "base_seed": int,       # the epoch iterator's worker base seed
              "dataset": object,      # a stateful dataset's state_dict() (num_workers=0, worker threads)
              "shards": object,       # a fastfeed.io.Shards dataset's position (its own format), else absent
              "dataset_iter": object, # ... and the iterator's, where iter(dataset) is stateful (num_workers=0)
              "num_workers": int,
              "asked": int,           # indices asked of the sampler this epoch (some for tasks in flight)
              "next_worker": int,     # the worker whose task comes next (round robin)
              "received_ahead": [int], # in_order=False: batches received past the first yielded - len(this)
              "due": [[int]] | None,  # the epoch's remaining batches' indices, where its order is not the
                                      # sampler's (a torchdata state's)
              "workers": None | (     # a tuple (one value for DCP); None with num_workers=0 or between
                                      # non-persistent epochs
                None                  # a worker whose iterable ended and that has exited
                | {"state": {"torch", "random", "numpy",   # its RNGs after its last task seen, as "rng"'s
                             "dataset", "dataset_iter",    # its stateful dataset's (iterator's) state_dict()
                             "batches": int,               # batches it made this epoch
                             "ended": bool},               # its iterable ended
                   "epoch_start": {"torch", "random", "numpy"}}  # its RNGs at the epoch's start
              ),
            }

        Samplers with ``state_dict()`` and ``load_state_dict()`` (torchdata's ``Stateful``)
        are saved and restored with them, as torchdata does. Other samplers are replayed
        from ``sampler_rng``: their order must depend only on the torch RNG / ``generator``
        state at the epoch's first index (RandomSampler, SequentialSampler,
        DistributedSampler after the same ``set_epoch``, ...). A dataset (map-style or
        iterable) with ``state_dict()`` and ``load_state_dict()`` is restored with them, in
        each worker: its state is loaded before ``iter(dataset)``, and the state of an
        iterator that is itself stateful (``__iter__`` returning ``self``) after it. An
        IterableDataset without them is fast-forwarded by reading (and dropping) the
        batches already produced.

        A loader with another ``num_workers`` resumes a map-style dataset's epoch exactly
        (positions are the sampler's; the workers' random streams start afresh from the
        epoch's base seed). Where positions are the workers' own (an IterableDataset's
        shards mid-epoch, a stateful dataset's per-worker state), ``load_state_dict``
        raises ``ValueError`` instead. With ``in_order=False`` the state names the
        batches delivered (``yielded`` and ``received_ahead``), and a resume makes each
        of the others once. Calling it with workers waits for the tasks they hold.
        """
        return _state.for_job(self._state_before(0))

    def _latest(self) -> tuple[object, int]:
        """The latest epoch's iterator, and the batches it yielded that its device stage has not handed on yet."""
        it = self._ff_last() if self._ff_last is not None else None
        staged = self._ff_staged() if self._ff_staged is not None else None
        return it, staged.held_back if staged is not None and staged.source is it else 0

    def _handed(self) -> tuple[object, int]:
        """The latest epoch's iterator and how many batches it has handed to whoever iterates this loader."""
        it, held_back = self._latest()
        return it, 0 if it is None else it._num_yielded - held_back

    def _state_before(self, behind: int) -> dict:
        """``state_dict()`` as of ``behind`` batches ago (at most ``_ff_lookahead``): the state a wrapper that
        reads ahead of its consumer saves, without draining the workers at every batch as calling
        ``state_dict()`` then would."""
        rng = _state.main_rngs(self.generator)
        if self._ff_resume is not None:  # loaded, and no iterator has started from it yet
            return _state.encode(dict(self._ff_resume, version=STATE_VERSION, rng=rng))
        it, held_back = self._latest()
        held_back += behind
        state = {"version": STATE_VERSION, "epochs": self._ff_epochs, "rng": rng}
        if self._ff_dataset_hooks.position is not None:
            return _state.encode(dict(state, **self._dataset_position(it, held_back)))
        if it is not None and (not it._finished or held_back or (self.persistent_workers and self.num_workers > 0)):
            state.update(it.state_dict(held_back))
        else:
            state.update(self._between_epochs())
        return _state.encode(state)

    def _dataset_position(self, it, held_back: int) -> dict:
        """The state of a dataset whose position is the rank's batches received (``fastfeed.io.Shards``): no
        worker's state enters it, so it continues with any ``num_workers`` (and, for Shards, any world size)."""
        mid_epoch = it is not None and (not it._finished or held_back > 0)
        yielded = it._num_yielded - held_back if mid_epoch else None
        # Out of order, the batches received are not the epoch's first: each worker's delivered count says which.
        delivered = it.delivered(held_back) if mid_epoch and not getattr(it, "_in_order", True) else None
        return dict(self._between_epochs(own_state=False), mid_epoch=mid_epoch, yielded=yielded or 0,
                    shards=self._ff_dataset_hooks.position(yielded, delivered))  # fmt: skip

    def _between_epochs(self, own_state: bool = True) -> dict:
        """The position between epochs: the sampler's state, and the dataset's where this process iterates it
        (``own_state=False``: not asked for, the dataset's position is kept elsewhere)."""
        sampler = _state.sampler_of(self)
        here = own_state and (self.num_workers == 0 or self.worker_type == "thread")  # else workers iterate copies
        dataset = _state.dataset_positions(self.dataset, None)[0] if here else None
        return {
            "mid_epoch": False, "yielded": 0, "sampler_rng": None,
            "sampler_state": None if sampler is None else copy.deepcopy(sampler.state_dict()),
            "base_seed": None, "dataset": dataset, "dataset_iter": None, "num_workers": self.num_workers,
            "asked": 0, "next_worker": 0, "workers": None,
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from ``state_dict`` (made by ``state_dict()``, or read back from JSON or ``torch.load``) at the
        next ``iter()``.

        Restores the global RNGs (torch, random, numpy) and ``generator`` to what they
        were at ``state_dict()``, so a training loop's own random stream continues too.
        Raises ``ValueError`` where the state cannot continue with this loader's
        ``num_workers`` (see ``state_dict``), and, naming the field, where it is damaged:
        truncated, of another version, or holding a value no state holds (a count of
        -3 or 10**18, a string for an RNG state, ...). The state is checked whole before
        anything changes, so a refused one leaves the loader and the RNGs as they were.
        """
        what = "DataLoader.load_state_dict"
        if not isinstance(state_dict, dict):
            raise ValueError(f"{what}: the state is a {type(state_dict).__name__}; expected the dict state_dict() "
                             "returned")  # fmt: skip
        global_position = self._ff_dataset_hooks.position is not None
        given, state_dict = state_dict, _state.own_of(state_dict, global_position, self._sampler_position)
        root = "state"  # how messages name it; in a job's state, the rank's state own_of chose
        if state_dict is not given:
            root = next(f"state['ranks'][{k!r}]" for k, v in given["ranks"].items() if v is state_dict)
        translated = _from_torchdata.is_torchdata_state(state_dict)
        if translated:  # a run switching from torchdata's loader
            _state_check.check_torchdata(state_dict, what)
            state_dict = _from_torchdata.translate(state_dict, self)
        # The whole state is checked before anything is taken from it (nothing here has changed yet): a damaged
        # or hostile one ends in a ValueError naming its field (see _state_check).
        _state_check.check_loader_state(state_dict, self, what, STATE_VERSIONS, translated, root)
        state = _state.decode(state_dict)
        tuning_auto.resumed(self)  # before _fit_workers, which leaves a state alone while a tuner runs
        if state.get("shards") is not None:  # (the check made sure the dataset is one that keeps it)
            self.dataset.load_state_dict(state["shards"])  # the dataset checks its order and global batch
        else:
            state = self._fit_workers(state)
        if self._iterator is not None:  # persistent workers: start afresh from the state
            self._iterator._shutdown_workers()
            self._iterator = None
        self._ff_kept = self._ff_last = self._ff_staged = None  # the loaded state is the state now
        _state.restore_main_rngs(state["rng"], self.generator)
        self._ff_epochs = state["epochs"] - (1 if state["mid_epoch"] else 0)
        self._ff_resume = state

    def _sampler_position(self, state: dict) -> bool:
        """Whether a saved state's position is its sampler's alone (see ``_state.own_of``): a map-style dataset
        without state of its own, delivered in order."""
        if self._dataset_kind != _DatasetKind.Map or state.get("received_ahead"):
            return False
        return not _holds_dataset_state(state)

    def _fit_workers(self, state: dict) -> dict:
        """``state`` for this loader's ``num_workers``, or ValueError where positions are per worker."""
        saved = state.get("num_workers")
        if saved is None and state["workers"] is not None:  # version 1 said it only there
            saved = len(state["workers"])
        ours = self.num_workers
        if saved is None or saved == ours or self._ff_tuner is not None:
            return state
        stateful = _holds_dataset_state(state)
        iterable = self._dataset_kind == _DatasetKind.Iterable
        if stateful or (iterable and state["mid_epoch"]):
            why = ("the dataset's own state was saved per worker" if stateful else
                   "an IterableDataset's position mid-epoch is each worker's, in its own shard")  # fmt: skip
            raise ValueError(
                f"DataLoader.load_state_dict(): this state was saved with num_workers={saved} and this loader has "
                f"num_workers={ours}; {why}, so it cannot continue with another count. Build the loader with "
                f"num_workers={saved} to resume, or save the state between epochs (with persistent_workers=False)."
            )
        # Positions are the sampler's: the epoch continues where it was, its workers' random streams start afresh.
        return dict(state, num_workers=ours, workers=None, next_worker=0)


def _split_workers(args: tuple, kwargs: dict, worker_type) -> tuple:
    """``worker_type`` and ``num_workers`` checked together; a ``(local, remote)`` pair becomes torch's total."""
    positional = len(args) > tuning_auto.NUM_WORKERS_INDEX
    nw = args[tuning_auto.NUM_WORKERS_INDEX] if positional else kwargs.get("num_workers", 0)
    worker_type, total, split = _workers.split(worker_type, nw)
    if total is not nw:
        if positional:
            args = (*args[: tuning_auto.NUM_WORKERS_INDEX], total, *args[tuning_auto.NUM_WORKERS_INDEX + 1:])
        else:
            kwargs["num_workers"] = total
    return args, worker_type, split


def _holds_dataset_state(state: dict) -> bool:
    """Whether a saved state holds a dataset's (or its iterator's) own state, the main process's or a worker's."""
    # Asked of a rank's state before it is checked (which rank's state to load depends on it): parts that are not
    # what a state holds count as holding none, and the state chosen is checked whole after.
    workers = state.get("workers")
    own = [state] + [w.get("state") for w in workers if isinstance(w, dict)] if isinstance(workers, (list, tuple)) \
        else [state]
    return any(isinstance(s, dict) and (s.get("dataset") is not None or s.get("dataset_iter") is not None)
               for s in own)  # fmt: skip


def _set_up_dataset(loader, epoch_starts: bool) -> None:
    """Tell a dataset that asks (``fastfeed.io.Shards``) the loader's batch size, ``drop_last`` and workers, when
    the loader is made and before each epoch's workers get it: torch's loader gives an IterableDataset no way to
    know them."""
    setup = loader._ff_dataset_hooks.loader_setup
    if setup is not None:
        setup(batch_size=loader.batch_size, drop_last=loader.drop_last, num_workers=loader.num_workers,
              prefetch_factor=loader.prefetch_factor, epoch_starts=epoch_starts)


def _restores(state: dict) -> bool:
    """Whether a loaded state has a position to restore (else the next iter() is a plain new epoch)."""
    return bool(state["mid_epoch"] or state["workers"] is not None or state.get("sampler_state") is not None
                or state.get("dataset") is not None or state.get("shards") is not None)  # fmt: skip


def _reader(reader, dataset, device) -> str | None:
    """``DataLoader(reader=...)`` checked and resolved to "gds" or "posix" (None: not asked for)."""
    if reader is None:
        return None
    if not isinstance(dataset, ArrayFiles):
        raise ValueError(f"reader={reader!r} reads fastfeed.io.ArrayFiles datasets, and this dataset is a "
                         f"{type(dataset).__name__}: leave reader unset")  # fmt: skip
    on_gpu = device is not None and device.type == "cuda"
    if reader == "auto" and not on_gpu:
        return "posix"  # GDS reads into GPU memory: nothing to gain without device="cuda"
    choice = gds.choose(reader)
    if choice == "gds" and not on_gpu:
        raise ValueError("reader='gds' reads batches straight into GPU memory: pass device='cuda' as well")
    return choice
