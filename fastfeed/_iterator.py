"""The multi-process iterator: sampler -> workers -> ring -> user.

It keeps torch's bookkeeping (``_MultiProcessingDataLoaderIter``) line for line
where that decides *which* batch goes to *which* worker, so batches, their
order and per-worker random streams match torch. What changes is transport:
a task carries a free ring slot, the worker collates into it, and the batch
comes back as views of the slot.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import weakref

import torch
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data._utils.collate import default_collate
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter, _sharding_worker_init_fn

from ._ring import layout, segments
from ._ring.ring import Ring
from ._workers import messages as m
from ._workers.loop import worker_main
from ._workers.pool import Pool, WorkerDied

# Iterators whose workers must be stopped, and segments unlinked, at exit.
_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for it in list(_live):
        it._shutdown_workers()


class RingDataLoaderIter(_BaseDataLoaderIter):
    def __init__(self, loader) -> None:
        self._shutdown = True  # until workers exist, there is nothing to shut down
        super().__init__(loader)
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = getattr(loader, "in_order", True)  # torch < 2.6 has no in_order
        context = loader.multiprocessing_context or torch.multiprocessing
        init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            init_fn = functools.partial(_sharding_worker_init_fn, init_fn, self._world_size, self._rank)
        use_slot_collate = self._collate_fn is default_collate

        # One slot per task in flight: the same batches torch keeps alive, so
        # memory stays at torch's. The batch being handed over borrows the slot
        # of the next task until the user lets go of the previous batch.
        self._ring = Ring(self._num_workers * self._prefetch_factor)
        parent = os.getpid()

        def args_for(wid):
            return (
                wid, self._num_workers, self._dataset_kind, self._dataset, self._auto_collation,
                self._collate_fn, use_slot_collate, self._drop_last, self._base_seed, init_fn,
                self._shared_seed, self._ring.prefix, parent,
            )  # fmt: skip

        self._pool = Pool(context, self._num_workers, worker_main, args_for)
        self._shutdown = False
        _live.add(self)
        self._reset(loader, first_iter=True)

    # -- epoch bookkeeping (torch's, plus a slot per task) -----------------------

    def _reset(self, loader, first_iter=False) -> None:
        super()._reset(loader, first_iter)
        if not first_iter:
            for wid in range(self._num_workers):
                self._pool.send(wid, m.Resume(self._shared_seed))
            for wid in range(self._num_workers):
                self._drain_until_ack(wid)
            self._forget_tasks()  # only now: workers may have been writing into those slots
        self._send_idx = 0
        self._rcvd_idx = 0
        # idx -> [worker_id, slot, message or None]; message set once received
        self._task_info: dict[int, list] = {}
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        self._sampler_done = False
        self._starved = False  # the last task could not be sent for want of a slot
        self._fill()

    def _drain_until_ack(self, wid) -> None:
        # Results of last epoch's unfinished tasks arrive before the ack; drop them.
        while True:
            msg = self._pool.recv(wid, None)
            if type(msg) is m.ResumeAck:
                return
            if type(msg) is m.Done and msg.overflow:
                segments.unlink(msg.overflow)

    def _forget_tasks(self) -> None:
        """Return the slots of tasks that will never be yielded."""
        for _, slot, msg in self._task_info.values():
            self._ring.release(slot)
            if type(msg) is m.Done and msg.overflow:
                segments.unlink(msg.overflow)
        self._task_info = {}

    def _fill(self) -> None:
        """Send tasks until the prefetch window or the free slots run out."""
        while self._tasks_outstanding < self._prefetch_factor * self._num_workers:
            if not self._try_put_index():
                return

    def _try_put_index(self) -> bool:
        if self._sampler_done:
            return False
        slot = None
        if self._ring.sized:
            slot = self._ring.acquire()
            self._starved = slot is None
            if slot is None:
                return False  # every slot is lent out: the window is full
        try:
            index = self._next_index()
        except StopIteration:
            self._sampler_done = True
            self._ring.release(slot)
            return False
        max_tasks = self._prefetch_factor * self._num_workers
        for _ in range(self._num_workers):  # torch's choice of the next active worker
            wid = next(self._worker_queue_idx_cycle)
            if self._workers_status[wid]:
                if self._in_order:
                    break
                if self._workers_num_tasks[wid] < max_tasks // sum(self._workers_status):
                    break
        else:
            self._ring.release(slot)
            return False
        self._pool.send(wid, m.Task(self._send_idx, index, None if slot is None else slot.ref()))
        self._task_info[self._send_idx] = [wid, slot, None]
        self._workers_num_tasks[wid] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1
        return True

    # -- receiving ----------------------------------------------------------------

    def _next_data(self):
        if self._shutdown:
            raise StopIteration
        try:
            return self._next_batch()
        except (KeyboardInterrupt, WorkerDied):
            self._shutdown_workers()
            raise

    def _next_batch(self):
        while True:
            self._fill()
            if self._tasks_outstanding == 0 and self._starved:
                # Nothing in flight and no free slot: the user holds them all.
                self._ring.grow()
                self._fill()
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx)
                if info:
                    if info[2] is not None or self._workers_status[info[0]]:
                        break
                    self._ring.release(info[1])
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration

            info = self._task_info[self._rcvd_idx]
            if info[2] is not None:
                del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
                return self._process(info)

            msg = self._get_data(info[0])
            self._tasks_outstanding -= 1
            if type(msg) is m.IterEnd:
                if self._persistent_workers:
                    self._workers_status[msg.worker_id] = False
                else:
                    self._pool.retire(msg.worker_id)
                    self._workers_status[msg.worker_id] = False
                self._ring.release(self._task_info[msg.idx][1])
                self._task_info[msg.idx][1] = None
                continue
            got = self._task_info[msg.idx]
            got[2] = msg
            if msg.idx != self._rcvd_idx:
                if not self._in_order:
                    del self._task_info[msg.idx]
                    return self._process(got)
                continue
            del self._task_info[msg.idx]
            self._rcvd_idx += 1
            return self._process(got)

    def _get_data(self, wid):
        if self._in_order:
            # Each worker answers its tasks in order, so the next message from
            # the owner of the wanted batch is that batch.
            return self._pool.recv(wid, self._timeout)
        return self._pool.recv_any(self._timeout)

    def _process(self, info):
        wid, slot, msg = info
        self._workers_num_tasks[wid] -= 1
        if type(msg) is m.Done:
            self._ring.note_batch(msg.nbytes)  # before _fill, so new tasks get slots
        self._fill()
        if type(msg) is m.Failed:
            self._ring.release(slot)
            msg.error.reraise()
        data = self._materialize(msg, slot)
        if self._pin_memory:
            # With an accelerator, pin as torch does (a copy, in this thread);
            # registering the slots themselves is the pinned-staging stage's job.
            data = pin_memory(data, self._pin_memory_device)
        return data

    def _materialize(self, msg: m.Done, slot):
        if msg.overflow:
            self._ring.release(slot)
            seg = segments.attach(msg.overflow)
            segments.unlink(msg.overflow)  # mapped now; the name is no longer needed
            base = torch.frombuffer(seg, dtype=torch.uint8)
        elif msg.nbytes:
            base = self._ring.lend(slot)
        else:
            self._ring.release(slot)
            base = None
        return layout.unpack(msg.payload, msg.leaves, base)

    # -- shutdown -------------------------------------------------------------------

    def _shutdown_workers(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        _live.discard(self)
        try:
            self._pool.stop()
        finally:
            self._forget_tasks()
            self._ring.close()

    def __del__(self) -> None:
        self._shutdown_workers()

