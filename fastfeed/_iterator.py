"""The multi-process iterator: sampler -> workers -> ring -> user.

It keeps torch's bookkeeping (``_MultiProcessingDataLoaderIter``) line for line
where that decides *which* batch goes to *which* worker, so batches, their
order and per-worker random streams match torch. What changes is transport:
the worker claims a free slot of the loader's ring when it has a batch to
write, collates into it, and the batch comes back as views of the slot.
"""

from __future__ import annotations

import atexit
import collections
import copy
import functools
import gc
import itertools
import os
import threading
import time
import warnings
import weakref

import torch
from torch.utils.data import IterDataPipe, MapDataPipe, _DatasetKind
from torch.utils.data._utils.collate import default_collate
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter, _sharding_worker_init_fn

from . import _pinning, _state, affinity, config, stats
from ._dataset_hooks import hooks_of
from ._ring import fence, layout
from ._workers import messages as m
from ._workers.loop import SlotWriter, WorkerSpec, preload, worker_main
from ._workers.pool import STATUS_CHECK_S, Pool, WorkerDied
from ._workers.threads import ThreadPool, thread_worker_main


class _Task:
    """One batch's task, from the moment its index is taken until it is yielded."""

    __slots__ = ("wid", "index", "msg", "memory", "number")

    def __init__(self, wid: int, index, number: int):
        self.wid = wid
        self.index = index
        self.number = number  # its batch's number in the epoch (the sampler's ask), whatever order it arrives in
        self.msg = None  # the worker's answer, once received
        self.memory = None  # where its batch lies (Ring.receive), once received


def _cuda_index(stage, pin_memory_device: str) -> int:
    """The CUDA device index batches are headed for: the stage's, pin_memory_device's, or the current one."""
    if stage is not None:
        return stage.device.index if stage.device.type == "cuda" else -1
    named = torch.device(pin_memory_device or "cuda")
    if named.type != "cuda":
        return -1
    if named.index is not None:
        return named.index
    return torch.cuda.current_device() if torch.cuda.is_available() else -1


# An iterator freed by the garbage collector (no one stopped it) gives its workers this long to take Stop before
# they are killed: the collection runs in whichever thread allocated, and it must not stall that thread. An idle
# worker exits within milliseconds; one still in user code would never read Stop. One dropped by its last
# reference is stopped as torch's __del__ stops it (STATUS_CHECK_S), by the thread that dropped it.
COLLECTED_GRACE_S = 0.5
_collecting = threading.local()  # .on: this thread is running a garbage collection


def _note_collection(phase: str, info: dict) -> None:
    _collecting.on = phase == "start"


gc.callbacks.append(_note_collection)

# Iterators whose workers must be stopped, and segments unlinked, at exit.
_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for it in list(_live):
        it._shutdown_workers()


class RingDataLoaderIter(_BaseDataLoaderIter):
    def __init__(self, loader, ring_for, resume: dict | None = None, stage=None, indices=None,
                 base_seed: int | None = None) -> None:  # fmt: skip
        """Args:
        ring_for: ``ring_for(quiet, pin, numa_node, device)``, the loader's ring (see ``Ring``).
        resume: a ``DataLoader.state_dict()`` to start from, or None.
        stage: the device stage's plan, or None.
        indices: batch indices to take instead of the sampler's (an online tuner's share
            of one epoch's sampler, ``tuning.online``), or None.
        base_seed: the workers' base seed, drawn by an earlier iterator of the same epoch;
            None draws one, as torch does.
        """
        self._shutdown = True  # until workers exist, there is nothing to shut down
        self._dataset_hooks = hooks_of(loader.dataset)  # before torch's __init__, which calls _reset
        # A process forked while this iterator lives (a torch worker, a user's fork) has a copy of it; the workers
        # and segments are the parent's, and dropping the copy there must not touch them.
        self._owner = os.getpid()
        self._generator = loader.generator
        self._resume = resume
        self._indices = indices
        self._finished = False
        self._task_info = {}  # each _reset makes its own; a first one that fails may not get that far
        if resume:
            base_seed = resume["base_seed"]
        keep = _state.sampler_rngs(self._generator) if base_seed is not None else None
        super().__init__(loader)
        if base_seed is not None:  # the original's seed, and no draw the user would see
            _state.restore_sampler_rngs(keep, self._generator)
            self._base_seed = base_seed
        self._stats = stats.recorder(self._num_workers, loader.prefetch_factor)  # see fastfeed.stats
        self._timed = True  # False under a device stage: the consumer asks the stage, which times
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = getattr(loader, "in_order", True)  # torch < 2.6 has no in_order
        context = loader.multiprocessing_context or torch.multiprocessing
        init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            init_fn = functools.partial(_sharding_worker_init_fn, init_fn, self._world_size, self._rank)
        use_slot_collate = self._collate_fn is default_collate

        # Tasks never wait for a slot: workers claim one only when they write, so the
        # ring holds the batches that exist, as torch's memory does. A loop that keeps
        # no batch needs one per task in flight, the `held` a device stage keeps (copies
        # ahead, and one whose copy may still be running) and the two a `for` loop
        # holds while it asks for the next. Workers keep a state snapshot for as many.
        # A wrapper that reads ahead of its own consumer (Accelerate's, see fastfeed.accelerate) holds as many more.
        held = (stage.ahead + 1 if stage else 0) + loader._ff_lookahead
        quiet = self._num_workers * self._prefetch_factor + held + 2
        self._staged = stage is not None
        self._keep_ended = self._staged or loader._ff_lookahead > 0  # states from before a worker's end are asked
        self._yield_log = collections.deque(maxlen=held)  # (worker, last tasks) before each yield
        sampler = _state.sampler_of(loader)  # a stateful sampler's states after each task's draw, while in flight
        self._sampler_log = None if sampler is None else _state.SamplerLog(sampler, quiet + 2)
        cuda_slots = stage.device.type == "cuda" if stage else self._pin_memory_device == "cuda"
        device = _cuda_index(stage, self._pin_memory_device)
        # Workers, their memory and the ring go on the GPU's NUMA node (loader.numa_plan).
        where = affinity.placement(loader.numa_plan)
        pin = self._pin_slots(cuda_slots, device)
        self._ring = ring_for(quiet, pin, None if where is None else where.node, device)
        # Without a device stage the user copies from pinned slots: each is rewritten only after those copies ran.
        # A stage keeps each CPU batch until its own copy's event completed, which is the same guarantee.
        self._ring.fence = fence.fence_for(device) if pin and not self._staged else None
        spec = WorkerSpec(
            self._num_workers, self._dataset_kind, self._dataset, self._auto_collation, self._collate_fn,
            use_slot_collate, self._drop_last, self._base_seed, init_fn, self._shared_seed, self._ring.prefix,
            self._ring.control.name, history=quiet, placement=where, timed=self._stats is not None,
        )  # fmt: skip
        self._threads = loader.worker_type == "thread"
        if self._threads and resume and resume.get("dataset") is not None:  # the one object the threads share
            loader.dataset.load_state_dict(copy.deepcopy(resume["dataset"]))
        dump_s = config.hang_dump_s()
        local, remote = loader.worker_split
        if self._threads:
            ring = self._ring  # not self: the threads must not keep this iterator alive
            self._pool = ThreadPool(
                self._num_workers, thread_worker_main,
                lambda wid: (wid, spec, ring.control, lambda claimed: ring.segment(claimed.slot_id)), dump_s,
            )  # fmt: skip
        elif remote:
            self._pool = self._ray_pool(loader, spec, context, local, remote, dump_s)
        else:
            preload()
            parent = os.getpid()
            try:
                # Built here, not in a helper: torch's pickle warning names this frame's caller (Pool's stacklevel
                # counts the frames).
                self._pool = Pool(
                    context, self._num_workers, worker_main,
                    lambda wid: (wid, spec, parent, self._worker_resume(wid)), dump_s,
                )  # fmt: skip
            except BaseException:
                self._ring.in_use = False  # the workers that started are stopped: none writes into it
                raise
        # Not __del__: an iterator freed by gc in a cycle (a kept exception's frame) is freed with its pool, whose
        # pipes' own __del__ may run first and close descriptors whose numbers the stop would then write to and
        # close. A finalizer runs before any __del__ of the cycle, and it holds the pool and ring, which keeps
        # them out of the cycle's garbage until it has stopped the workers.
        self._workers_finalizer = weakref.finalize(self, _stop, self._owner, self._pool, self._ring)
        self._workers_finalizer.atexit = False  # _shutdown_all stops it at exit, before multiprocessing's handler
        self._shutdown = False
        _live.add(self)
        if self._stats is not None:
            kind = "thread" if self._threads else "process"
            self._stats.paths.update({w: kind for w in range(local if remote else self._num_workers)})
            if remote:  # the actors' paths are known as each starts: the pool fills the recorder's own dict
                actors = getattr(self._pool, "remote", self._pool)
                self._stats.paths.update(actors.paths)
                actors.paths = self._stats.paths
        # Only once every worker is forked, as torch: the epoch's first draw builds the sampler's whole order
        # (RandomSampler: len(dataset) Python ints), and a worker forked after it would keep a private copy of
        # every page of it, page by page as this process hands the indices out and writes their reference counts.
        try:
            self._reset(loader, first_iter=True)
        except BaseException:
            self._shutdown_workers()  # none is left running for an iterator its caller never gets
            raise

    def _ray_pool(self, loader, spec, context, local: int, remote: int, dump_s: float):
        """Ray actors for workers ``local ..``, and worker processes for the first ``local`` (the mixed form)."""
        from ._workers.ray import connect as ray_connect, pool as ray_pool

        ring = self._ring
        try:
            ray = ray_connect.connect()
            if loader._ff_ray_spare is None:
                loader._ff_ray_spare = ray_pool.Spare()
            writer = SlotWriter(ring.control, lambda claimed: ring.segment(claimed.slot_id), ring.numa_node)
            replay = next(iter(self._index_sampler)) if self._dataset_kind == _DatasetKind.Iterable else None
            resumes = [self._worker_resume(w) for w in range(local, local + remote)]
            actors = ray_pool.RayPool(ray, remote, local, spec._replace(placement=None), resumes, writer,
                                      loader.ray_options, loader._ff_ray_spare, dump_s, replay, self._unrecoverable())
        except BaseException:
            ring.in_use = False  # no worker of this iterator writes into it
            raise
        if not local:
            return actors
        preload()
        parent = os.getpid()
        try:
            procs = Pool(context, local, worker_main, lambda wid: (wid, spec, parent, self._worker_resume(wid)), dump_s)
        except BaseException:
            actors.stop()
            ring.in_use = False
            raise
        return ray_pool.MixedPool(procs, actors)

    def _unrecoverable(self) -> str | None:
        """Why a lost Ray actor's position could not be rebuilt in a later epoch of persistent workers, or None.

        A replacement gets the dataset as it was shipped; an IterableDataset that keeps its position in itself
        across epochs (and cannot save it: no ``state_dict``) has moved on from that copy in the lost actor.
        """
        if self._dataset_kind != _DatasetKind.Iterable or not self._persistent_workers:
            return None
        if _state.is_stateful(self._dataset):
            return None
        return (f"its {type(self._dataset).__name__} (an IterableDataset without state_dict()/load_state_dict()) "
                "had iterated in that actor since the first epoch of persistent workers, and a new actor gets the "
                "dataset as first shipped; give the dataset state_dict()/load_state_dict(), or use "
                "persistent_workers=False (each epoch ships the dataset anew)")

    def _pin_slots(self, wanted: bool, device: int) -> bool:
        """Whether to register the ring with CUDA, under ``device`` (else pin_memory copies, as torch does)."""
        if not (wanted and (self._pin_memory or self._staged)):
            return False
        why_not = _pinning.enable(device)
        if why_not:
            warnings.warn(f"fastfeed cannot pin its ring with cudaHostRegister ({why_not}); "
                          "batches are pinned by copying instead, as torch does", stacklevel=4)  # fmt: skip
        return not why_not

    def _worker_resume(self, wid: int):
        saved = self._resume and self._resume["workers"] and self._resume["workers"][wid]
        if not saved:
            return None
        replay_index = None
        if self._dataset_kind == _DatasetKind.Iterable:
            replay_index = next(iter(self._index_sampler))  # what a task of an iterable asks for
        return dict(saved, mid_epoch=self._resume["mid_epoch"], replay_index=replay_index)

    # -- epoch bookkeeping (torch's) ----------------------------------------------

    def _reset(self, loader, first_iter=False) -> None:
        super()._reset(loader, first_iter)
        if self._indices is not None:
            self._sampler_iter = self._indices
        log = self._sampler_log
        self._sampler_iter = _state.Drawn(self._sampler_iter, on_draw=None if log is None else log.drew)
        if not first_iter:
            # A persistent worker's dataset is a copy from the first epoch: one that asks to (fastfeed.io.Shards,
            # whose set_epoch is called here) gets the main process's epoch and position with the new epoch.
            sync = self._dataset_hooks.worker_sync
            sync = sync() if sync is not None else None
            for wid in range(self._num_workers):
                self._pool.send(wid, m.Resume(self._shared_seed, sync))
            for wid in range(self._num_workers):
                self._drain_until_ack(wid)
            self._forget_tasks()  # only now: workers may have been writing into those slots
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_info: dict[int, _Task] = {}  # tasks not yet yielded, by batch index
        self._held: set[int] = set()  # of those, the ones answered
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        self._last_task: list[int | None] = [None] * self._num_workers  # the last task of each seen
        # Batches delivered, by number in the epoch: every one below _frontier, and those in _ahead above it
        # (in_order=False delivers out of order); per worker, how many it delivered (its own come in order).
        self._frontier = 0
        self._ahead: set[int] = set()
        self._delivered = [0] * self._num_workers
        self._due = None  # the rest of an epoch given explicitly (a torchdata state's), instead of the sampler's
        self._finished = False
        resume, self._resume = (self._resume if first_iter else None), None
        if self._sampler_log is not None:
            self._sampler_log.states = {}  # taken at this epoch's first draw
        if resume and resume["mid_epoch"]:
            self._fast_forward(loader, resume)
            return
        if resume and resume.get("sampler_state") is not None and self._sampler_log is not None:
            sampler_iter = _state.resume_sampler(loader, resume["sampler_state"], True)
            self._sampler_iter = _state.Drawn(sampler_iter, on_draw=self._sampler_log.drew)
            self._sampler_log.start(resume["sampler_state"])
        self._sampler_rng = _state.sampler_rngs(self._generator)
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _fast_forward(self, loader, resume: dict) -> None:
        """Continue an epoch after the batches the user had received, without fetching them."""
        keep = _state.sampler_rngs(self._generator)
        self._sampler_rng = resume["sampler_rng"]
        yielded = resume["yielded"]
        # Out of order (in_order=False), the batches delivered are every one below the frontier and those ahead
        # of it; the others are asked again, and only they are made.
        ahead = set(resume.get("received_ahead") or ())
        frontier = yielded - len(ahead)
        asked = resume.get("asked", yielded)
        if resume.get("due") is not None:  # an explicit rest of the epoch (a torchdata state's): its batches only
            due = resume["due"] if self._auto_collation else [batch[0] for batch in resume["due"]]
            self._sampler_iter = _state.Drawn(iter(due))
            self._sampler_iter.replay(frontier, asked, drop=ahead)
        elif resume.get("sampler_state") is not None and self._sampler_log is not None:
            # A stateful sampler continues from its own state after the frontier's batches, as torchdata resumes
            # it; those delivered ahead of the frontier are asked again, not handed out.
            sampler_iter = _state.resume_sampler(loader, resume["sampler_state"], frontier == 0)
            self._sampler_iter = _state.Drawn(sampler_iter, frontier, ahead, self._sampler_log.drew)
            self._sampler_log.start(resume["sampler_state"], frontier)
        else:
            # The same order, of which the batches seen are skipped. No sampler RNGs: the state was saved before
            # the sampler's first ask (a single process's, just after iter()), which draws from the RNGs as loaded.
            if self._sampler_rng is None:
                self._sampler_rng = keep
            _state.restore_sampler_rngs(self._sampler_rng, self._generator)
            self._sampler_iter.replay(frontier, asked, drop=ahead,
                                      constant=self._dataset_kind == _DatasetKind.Iterable)  # fmt: skip
            if self._sampler_log is not None:  # (a state of version 1: the sampler's own state was not saved)
                self._sampler_log.start(None, frontier)
        self._due = resume.get("due")
        self._frontier, self._ahead = frontier, ahead
        self._num_yielded = yielded
        for wid, saved in enumerate(resume["workers"] or ()):  # None: thread workers, stateless
            self._workers_status[wid] = bool(saved) and not saved["state"]["ended"]
            if saved:
                self._last_task[wid] = m.RESTORED
        for _ in range(resume["next_worker"]):
            next(self._worker_queue_idx_cycle)
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()
        _state.restore_sampler_rngs(keep, self._generator)

    def _next_index(self):
        log = self._sampler_log
        if log is not None and not log.states:
            log.start()  # its state before this epoch's first ask (each ask notes the state after it: Drawn)
        return super()._next_index()

    def state_dict(self, held_back: int = 0) -> dict:
        """This epoch's position and each worker's state (see ``DataLoader.state_dict``).

        ``held_back``: the last batches yielded that a device stage has not handed to the
        user yet; the state is the one from before them.
        """
        mid_epoch = not self._finished or held_back > 0
        last_task, frontier, ahead = self._last_task, self._frontier, self._ahead
        if held_back:
            next_worker, (last_task, frontier, ahead, _) = self._yield_log[-held_back]
        workers = dataset = None
        if self._threads:
            # Worker threads draw from the process's RNGs: they have no state of their
            # own to save, and an iterable's position lies in iterators nobody can save.
            if mid_epoch and (self._dataset_kind == _DatasetKind.Iterable or _state.is_stateful(self._dataset)):
                what = "an IterableDataset" if self._dataset_kind == _DatasetKind.Iterable else "a stateful dataset"
                raise ValueError(
                    f"DataLoader.state_dict() mid-epoch needs worker_type='process' for {what}: "
                    "worker threads share one dataset object, whose per-worker position cannot be saved"
                )
            if _state.is_stateful(self._dataset):  # between epochs: the one shared object's state
                dataset = _state.dataset_positions(self._dataset, None)[0]
        elif mid_epoch or self._persistent_workers:
            if self._shutdown:
                raise RuntimeError("DataLoader.state_dict(): this iterator's workers were shut down")
            workers = self._worker_states(last_task)
        if not held_back:
            waiting = [i for i, task in self._task_info.items() if self._workers_status[task.wid]]
            next_worker = self._task_info[min(waiting)].wid if waiting and mid_epoch else 0
        map_style = self._dataset_kind == _DatasetKind.Map
        # A map-style epoch's batches delivered (a batch whose error was raised to the user counts: it is not
        # made again): every one below the frontier and those past it.
        yielded = frontier + len(ahead) if map_style else self._num_yielded - held_back
        log = self._sampler_log
        sampler_state = None
        if log is not None:  # its state after the frontier's batches: those past it are asked again on resuming
            sampler_state = log.after(frontier) if log.states else copy.deepcopy(log.sampler.state_dict())
        # A map-style epoch's batches delivered past the frontier (in_order=False) are named; an iterable's
        # position is each worker's own, after the last batch it delivered (a worker's batches come in its order).
        return {
            "mid_epoch": mid_epoch,
            "yielded": yielded,
            "sampler_rng": self._sampler_rng,
            "sampler_state": sampler_state,
            "base_seed": self._base_seed,
            "dataset": dataset,
            "dataset_iter": None,  # per worker
            "num_workers": self._num_workers,
            "asked": self._sampler_iter.asked,
            "next_worker": next_worker,
            "workers": workers,
            "received_ahead": sorted(ahead) if map_style and mid_epoch else [],
            "due": self._due if mid_epoch else None,
        }

    def delivered(self, held_back: int = 0) -> list[int]:
        """Batches each worker delivered this epoch, as of ``held_back`` yields ago."""
        return list(self._yield_log[-held_back][1][3]) if held_back else list(self._delivered)

    def _worker_states(self, last_task: list) -> list:
        """Ask each live worker for its state after ``last_task[worker]``, the last of its tasks the user saw.

        A worker answers after the tasks it was sent before the request; their answers
        are kept for when their turn comes.
        """
        # With a device stage or a wrapper reading ahead, a worker whose iterable ended stays alive until the
        # epoch ends: the batches it made before that may still be held back.
        keep = self._persistent_workers or self._keep_ended
        asked = [wid for wid in range(self._num_workers) if self._workers_status[wid] or keep]
        for wid in asked:
            self._pool.send(wid, m.StateRequest(last_task[wid]))
        states = [None] * self._num_workers
        for wid in asked:
            while True:
                msg = self._pool.recv(wid, self._timeout)
                if type(msg) is m.StateReply:
                    states[wid] = {"state": msg.state, "epoch_start": msg.epoch_start}
                    break
                self._receive(msg)
        return states

    def _drain_until_ack(self, wid) -> None:
        # Results of last epoch's unfinished tasks arrive before the ack; drop them.
        while True:
            msg = self._pool.recv(wid, None)
            if type(msg) is m.ResumeAck:
                return
            if type(msg) is m.Done:
                self._ring.release(self._ring.receive(msg.slot_id, msg.made))

    def _forget_tasks(self) -> None:
        """Settle the tasks that will never be yielded."""
        for task in self._task_info.values():
            self._discard(task)
        self._task_info = {}
        self._held = set()

    def _discard(self, task: _Task) -> None:
        """Settle a task whose batch is not returned: its slot goes back."""
        if task.memory is not None:
            self._ring.release(task.memory)
            task.memory = None

    def _try_put_index(self) -> None:
        """torch's: take the next index and assign it a worker, at the same moments torch does.

        Consuming the sampler and choosing the worker here, exactly when torch
        does, keeps the batches, their workers and any random draws the sampler
        makes identical to torch's. Nothing waits for a slot: the worker claims
        one when it writes.
        """
        max_tasks = self._prefetch_factor * self._num_workers
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):  # find the next active worker, if any
            wid = next(self._worker_queue_idx_cycle)
            if self._workers_status[wid]:
                if self._in_order:
                    break
                if self._workers_num_tasks[wid] < max_tasks // sum(self._workers_status):
                    break
        else:
            return  # as torch: no worker can take it, and the index is dropped
        self._pool.send(wid, m.Task(self._send_idx, index))
        self._task_info[self._send_idx] = _Task(wid, index, self._sampler_iter.last)
        self._workers_num_tasks[wid] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    # -- receiving ----------------------------------------------------------------

    def _next_data(self):
        if self._shutdown:
            raise StopIteration
        self._ring.poll()  # slots whose copies have run go back before workers look for one
        try:
            rec = self._stats
            if rec is None or not self._timed:
                return self._next_batch()
            received, blocked = self._ready_count(), self._pool.blocked
            asked = time.perf_counter()
            data = self._next_batch()
            # Ready: the batches received and not yet yielded, or at least the one taken if it was waiting.
            rec.add(asked, received or int(self._pool.blocked == blocked), time.perf_counter())
            return data
        except StopIteration:
            self._finished = True
            raise
        except KeyboardInterrupt:
            # Ctrl-C: a worker stuck in user code would never read Stop; do not wait for it.
            self._shutdown_workers(grace=1.0)
            raise
        except WorkerDied:
            self._shutdown_workers()
            raise

    def _next_batch(self):
        while True:
            while self._rcvd_idx < self._send_idx:
                task = self._task_info.get(self._rcvd_idx)
                if task:
                    if task.msg is not None or self._workers_status[task.wid]:
                        break
                    self._settle(task.number)
                    self._discard(task)
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers and not self._staged:
                    self._shutdown_workers(idle=True)  # a device stage calls end_epoch() once it is done
                raise StopIteration

            task = self._task_info[self._rcvd_idx]
            if task.msg is not None:
                del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
                return self._process(task)

            if not self._in_order and self._held:
                # Answers received while the state was asked for: each worker's come before its later ones, so
                # that a worker's batches are delivered in its order (its state after the last one delivered is
                # then its position).
                return self._process(self._task_info.pop(min(self._held)))
            msg = self._get_data(task.wid)
            got = self._receive(msg)
            if got is None:
                continue
            if msg.idx != self._rcvd_idx:
                if not self._in_order:
                    del self._task_info[msg.idx]
                    return self._process(got)
                continue
            del self._task_info[msg.idx]
            self._rcvd_idx += 1
            return self._process(got)

    def _receive(self, msg):
        """Record a worker's answer; an IterEnd takes effect at once. Returns the task, or None."""
        self._tasks_outstanding -= 1
        got = self._task_info[msg.idx]
        got.msg = msg
        self._held.add(msg.idx)
        if type(msg) is m.Done:
            if msg.nbytes:
                got.memory = self._ring.receive(msg.slot_id, msg.made)
            if self._stats is not None:
                self._stats.worker(msg.worker_id, msg.fetch_s, msg.collate_s, msg.done_at)
        if type(msg) is m.IterEnd:
            self._workers_status[msg.worker_id] = False
            self._last_task[msg.worker_id] = msg.idx
            if not (self._persistent_workers or self._keep_ended):
                self._pool.retire(msg.worker_id)
            self._settle(got.number)
            self._held.discard(msg.idx)
            self._discard(self._task_info.pop(msg.idx))
            self._try_put_index()
            return None
        return got

    def _settle(self, number: int) -> None:
        """Batch ``number`` of the epoch is delivered, or will never be (its worker's iterable ended)."""
        self._ahead.add(number)
        while self._frontier in self._ahead:
            self._ahead.discard(self._frontier)
            self._frontier += 1

    def _ready_count(self) -> int:
        """Batches received from the workers and not yet yielded (tasks known, less those unanswered)."""
        return len(self._task_info) - self._tasks_outstanding

    def _batch_ready(self) -> bool:
        """Whether the next batch is here already, so taking it cannot wait (device lookahead)."""
        if self._shutdown or not self._in_order:
            return False
        task = self._task_info.get(self._rcvd_idx)
        if task is None:
            return False  # settling skipped tasks might wait: not now
        return task.msg is not None or self._pool.ready(task.wid)

    def end_epoch(self) -> None:
        """The device stage has handed over this epoch's last batch."""
        if not self._persistent_workers:
            self._shutdown_workers()

    def _get_data(self, wid):
        if self._in_order:
            # Each worker answers its tasks in order, so the next message from
            # the owner of the wanted batch is that batch.
            return self._pool.recv(wid, self._timeout)
        return self._pool.recv_any(self._timeout)

    def _process(self, task: _Task):
        msg = task.msg
        self._held.discard(msg.idx)
        self._workers_num_tasks[task.wid] -= 1
        before = None
        if self._yield_log.maxlen:
            before = (list(self._last_task), self._frontier, frozenset(self._ahead), list(self._delivered))
        self._last_task[task.wid] = msg.idx
        self._delivered[task.wid] += 1
        self._settle(task.number)
        self._try_put_index()
        if type(msg) is m.Failed:
            self._discard(task)
            msg.error.reraise()
        if before is not None:  # what state_dict() needs while a device stage holds this batch
            self._yield_log.append((task.wid, before))
        memory, task.memory = task.memory, None
        data = layout.unpack(msg.payload, msg.leaves, None if memory is None else self._ring.lend(memory))
        if self._pin_memory:
            # With an accelerator, pin as torch does (a copy, in this thread);
            # registering the slots themselves is the pinned-staging stage's job.
            data = pin_memory(data, self._pin_memory_device)
        return data

    # -- shutdown -------------------------------------------------------------------

    def _shutdown_workers(self, grace: float = STATUS_CHECK_S, idle: bool = False) -> None:
        """Stop the workers; ``idle``: every task they were sent has been answered."""
        if self._shutdown or os.getpid() != self._owner:
            return
        self._shutdown = True
        _live.discard(self)
        if self._workers_finalizer.detach() is not None:  # else gc's finalizer has stopped them
            _stop(self._owner, self._pool, self._ring, grace, idle, self._forget_tasks)


def _stop(owner: int, pool, ring, grace: float | None = None, idle: bool = False, forget_tasks=None) -> None:
    """Stop an iterator's workers and settle its ring: once, from ``_shutdown_workers`` or as its finalizer.

    Args:
        owner: the process the workers are children of; in any other (a fork's copy), nothing is done.
        pool: the workers.
        ring: the loader's ring they write into.
        grace: seconds a worker has to take Stop and exit before it is killed; None (the finalizer):
            ``COLLECTED_GRACE_S`` inside a garbage collection, else ``STATUS_CHECK_S``.
        idle: every task the workers were sent has been answered.
        forget_tasks: releases the slots of the iterator's unyielded tasks (a finalizer has no iterator left:
            ``Ring.recover`` frees every claimed slot that nothing views).
    """
    if os.getpid() != owner:
        return
    if grace is None and pool.on_own_thread():
        # Collected on one of the pool's own threads (a Ray link's reader, maybe inside its receiver's lock): a
        # stop from there would wait on that very thread, so a thread of its own stops the workers.
        threading.Thread(target=_stop, args=(owner, pool, ring, COLLECTED_GRACE_S), name="ff_collected_stop",
                         daemon=True).start()  # fmt: skip
        return
    if grace is None:
        grace = COLLECTED_GRACE_S if getattr(_collecting, "on", False) else STATUS_CHECK_S
    try:
        pool.stop(grace, idle)
    finally:
        if forget_tasks is not None:
            forget_tasks()
        if pool.all_gone:  # nothing writes into the ring now: the next epoch may have it
            ring.recover()
            ring.in_use = False
        else:
            ring.close()
