"""The worker process: fetch a batch, collate it straight into a slot, report.

This mirrors torch's ``_worker_loop`` step for step (seeding, worker info,
init errors, IterableDataset exhaustion, persistent-worker resume), so user
code sees the same worker environment; only the transport differs.
"""

from __future__ import annotations

import faulthandler
import os
import random
import select

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _DatasetKind
from torch.utils.data._utils import signal_handling
from torch.utils.data._utils import worker as torch_worker

from .._ring import layout, segments
from . import messages as m
from .pool import DUMP_SIGNAL

PARENT_CHECK_S = 5.0  # how often an idle worker checks that its parent lives


class SlotWriter:
    """Maps the slots this worker is lent, once each, and writes batches into them."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.mapped: dict[int, tuple[str, torch.Tensor]] = {}

    def _base(self, ref: m.SlotRef) -> torch.Tensor:
        hit = self.mapped.get(ref.slot_id)
        if hit is None or hit[0] != ref.name:  # new slot, or the ring regrew it
            seg = segments.attach(ref.name)
            hit = self.mapped[ref.slot_id] = (ref.name, torch.frombuffer(seg, dtype=torch.uint8))
        return hit[1]

    def write(self, task: m.Task, batch, worker_id: int) -> m.Done:
        payload, objs, leaves, nbytes = layout.plan(batch)
        overflow = None
        if nbytes:
            if task.slot is not None and nbytes <= task.slot.size:
                base = self._base(task.slot)
            else:  # no slot yet, or the batch outgrew it: a one-off segment
                seg = segments.create(self.prefix, segments.pages(nbytes))
                overflow = seg.name
                base = torch.frombuffer(seg, dtype=torch.uint8)
            try:
                layout.fill(base, objs, leaves)
            except BaseException:
                if overflow:  # nobody will ever be told its name
                    segments.unlink(overflow)
                raise
        return m.Done(task.idx, worker_id, nbytes, leaves, payload, overflow)


def _yield_to_main() -> None:
    # SCHED_BATCH: a worker woken by a new task does not preempt the main
    # process (the training loop). Without it, every task sent to an idle
    # worker costs the main process a context switch on a busy machine.
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _seed(base_seed: int, worker_id: int) -> int:
    # Exactly torch's per-worker seeding, so augmentations match torch's.
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(torch_worker._generate_state(base_seed, worker_id))
    return seed


def _seed_datapipe(dataset, shared_seed):
    from torch.utils.data import IterDataPipe
    from torch.utils.data.graph_settings import apply_random_seed

    if isinstance(dataset, IterDataPipe):
        rng = torch.Generator()
        rng.manual_seed(shared_seed)
        dataset = apply_random_seed(dataset, rng)
    return dataset


def worker_main(
    worker_id, num_workers, dataset_kind, dataset, auto_collation, collate_fn,
    use_slot_collate, drop_last, base_seed, init_fn, shared_seed, prefix, parent_pid,
    task_conn, result_conn,
):  # fmt: skip
    """Entry point of one worker process."""
    try:
        signal_handling._set_worker_signal_handlers()
        # `kill -USR1 <pid>` (or FASTFEED_HANG_DUMP_S) prints where this worker is stuck.
        faulthandler.register(DUMP_SIGNAL, all_threads=True)
        torch.multiprocessing._set_thread_name("ff_data_worker")
        # A forked OpenMP pool deadlocks, and workers share the cores anyway.
        torch.set_num_threads(1)
        _yield_to_main()
        seed = _seed(base_seed, worker_id)
        dataset = _seed_datapipe(dataset, shared_seed)
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
        )
        if use_slot_collate:
            collate_fn = layout.slot_collate

        def new_fetcher():
            return _DatasetKind.create_fetcher(dataset_kind, dataset, auto_collation, collate_fn, drop_last)

        init_error = None
        try:
            if init_fn is not None:
                init_fn(worker_id)
            fetcher = new_fetcher()
        except Exception:
            init_error = ExceptionWrapper(where=f"in DataLoader worker process {worker_id}")

        writer = SlotWriter(prefix)
        poller = select.poll()
        poller.register(task_conn.fileno(), select.POLLIN)
        iteration_end = False
        while True:
            if not poller.poll(PARENT_CHECK_S * 1000):
                if os.getppid() != parent_pid:
                    break  # orphaned: the main process died without telling us
                continue
            try:
                task = m.loads(task_conn.recv_bytes())
            except (EOFError, OSError):
                break  # the main process closed our pipe or died
            kind = type(task)
            if kind is m.Stop:
                break
            if kind is m.Resume:
                iteration_end = False
                dataset = _seed_datapipe(dataset, task.shared_seed)
                fetcher = new_fetcher()
                result_conn.send_bytes(m.dumps(m.ResumeAck(worker_id)))
                continue
            if iteration_end:
                continue  # torch skips tasks after exhaustion, sending nothing
            if init_error is not None:
                reply, init_error = m.Failed(task.idx, worker_id, init_error), None
            else:
                try:
                    reply = writer.write(task, fetcher.fetch(task.index), worker_id)
                except Exception as e:
                    if isinstance(e, StopIteration) and dataset_kind == _DatasetKind.Iterable:
                        reply = m.IterEnd(task.idx, worker_id)
                        iteration_end = True
                    else:
                        wrapper = ExceptionWrapper(where=f"in DataLoader worker process {worker_id}")
                        reply = m.Failed(task.idx, worker_id, wrapper)
            result_conn.send_bytes(m.dumps(reply))
            del reply, task
    except KeyboardInterrupt:
        pass  # the main process raises KeyboardInterrupt itself
    except BrokenPipeError:
        pass  # the main process is gone; nobody is left to tell
