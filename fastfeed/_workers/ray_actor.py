"""The body of one Ray actor worker: the worker loop (``loop.serve``), one message per actor call.

The loop is the same code process workers run, so seeding, ``get_worker_info()``, ``worker_init_fn``, IterableDataset
exhaustion, persistent-worker resume and errors are the same. It runs in a thread of the actor; each ``call`` hands
it one message and returns its answer. A batch comes back as one flat byte buffer laid out as a ring slot would be
(``layout.plan``/``fill``): Ray stores it in the object store, the main process copies it once into a slot.

With each answer to a task goes the worker's state right after it (RNGs, a stateful dataset's position, batches
made), which is what a replacement actor starts from if this one is lost (``ray_pool``). Nothing in this module
imports Ray: the actor class is made from it where Ray is used.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker

from .._ring import layout
from . import messages as m
from . import readahead
from .loop import _seed, _seed_datapipe, serve

_NO_REPLY = object()  # the loop went back for its next message without answering the last (a skipped task, Stop)


class BufferWriter:
    """``SlotWriter``'s face for an actor: the batch goes into a fresh flat buffer, not a ring slot."""

    def __init__(self):
        self.buffer = None  # the last batch's bytes, taken by the call that returns them

    def write(self, task: m.Task, batch, worker_id: int, fetch_s=0.0, collate_s=0.0, since=0.0, timed=False) -> m.Done:
        payload, objs, leaves, nbytes = layout.plan(batch)
        if nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            layout.fill(torch.from_numpy(buf), objs, leaves)
            self.buffer = buf
        if timed:
            collate_s += time.perf_counter() - since
        # done_at stays 0: this machine's clock says nothing about the main process's timeline.
        return m.Done(task.idx, worker_id, nbytes, leaves, payload, None, None, fetch_s, collate_s, 0.0)


class RayWorker:
    """One worker, as a Ray actor (made with ``ray.remote`` in ``ray_pool``). Reused across epochs: ``start``
    begins each one afresh, with that epoch's dataset, seed and ``worker_init_fn``."""

    def __init__(self):
        self._thread = None
        self._tasks = self._replies = None
        self._writer = None
        self._worker_id = None

    def where(self) -> dict:
        """Where this actor runs: for messages, and the tests' check of placement."""
        return {"host": socket.gethostname(), "pid": os.getpid(), "node_id": _node_id()}

    def start(self, worker_id: int, spec, resume: dict | None, sync: dict | None = None) -> dict:
        """Begin serving as worker ``worker_id`` of ``spec`` (the epoch's ``WorkerSpec``, from the object store).

        ``resume``: where a replacement (or ``load_state_dict``) picks up, as for a worker process. ``sync``: a
        persistent worker's later epoch (its ``Resume``): the dataset's sync and shared seed, applied first.
        Returns the worker's state at the epoch's start and, resumed mid-epoch, the state it resumed from (both
        ``StateReply``), and where it runs.
        """
        self._end_thread()
        torch.set_num_threads(1)  # as a worker process: the actor's cores are its workers' to share
        seed = _seed(spec.base_seed, worker_id)
        dataset = _seed_datapipe(spec.dataset, spec.shared_seed if sync is None else sync["shared_seed"])
        if sync is not None and sync.get("dataset_sync") is not None:
            dataset._ff_worker_apply(sync["dataset_sync"])
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=dataset
        )
        self._worker_id = worker_id
        self._tasks, self._replies = queue.SimpleQueue(), queue.SimpleQueue()
        self._writer = BufferWriter()
        pending = [False]  # a message was handed to the loop and not answered yet
        tasks, replies = self._tasks, self._replies

        def get(block: bool = True):
            if not block:
                try:
                    msg = tasks.get_nowait()
                except queue.Empty:
                    return readahead.NOTHING
            else:
                if pending[0]:
                    replies.put(_NO_REPLY)
                msg = tasks.get()
            pending[0] = True
            return msg

        def put(msg):
            pending[0] = False
            replies.put(msg)

        where = f"in DataLoader worker {worker_id} (Ray actor, pid {os.getpid()} on {socket.gethostname()})"
        self._thread = threading.Thread(
            target=_serve, args=(worker_id, spec, dataset, self._writer, get, put, resume, where, replies),
            name=f"ff_ray_worker_{worker_id}", daemon=True,
        )  # fmt: skip
        self._thread.start()
        restored = self._ask(m.StateRequest(-1)) if resume is not None and resume["mid_epoch"] else None
        return {"state": to_wire(self._ask(m.StateRequest(None))), "restored": to_wire(restored),
                "where": self.where()}  # fmt: skip

    def call(self, msg):
        """Hand ``msg`` to the loop. Returns ``(answer or None, state after it or None, batch bytes or None)``."""
        reply = self._ask(msg)
        if reply is _NO_REPLY:
            return None, None, None
        state = buf = None
        kind = type(reply)
        if kind in (m.Done, m.Failed, m.IterEnd):
            state = to_wire(self._ask(m.StateRequest(reply.idx)))
        elif kind is m.ResumeAck:
            state = to_wire(self._ask(m.StateRequest(None)))
        if kind is m.Done and reply.nbytes:
            buf, self._writer.buffer = self._writer.buffer, None
        return reply, state, buf

    def _ask(self, msg):
        self._tasks.put(msg)
        reply = self._replies.get()
        if isinstance(reply, _Crashed):
            raise reply.error
        return reply

    def _end_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._tasks.put(m.Stop())
            self._thread.join(timeout=5.0)  # one stuck in the dataset is left (a daemon); its queues are dropped
        self._thread = None


def to_wire(reply: m.StateReply | None) -> m.StateReply | None:
    """A state with its RNGs' tensors as numpy arrays: Ray pickles an array in microseconds and a tensor in a
    fraction of a millisecond, and a state goes with every batch but is read only for a replacement or a
    ``state_dict()`` (``from_wire``)."""
    if reply is None or isinstance(reply, _Crashed):
        return reply
    return reply._replace(state=_rngs(reply.state, torch.Tensor.numpy), epoch_start=_rngs(reply.epoch_start,
                                                                                         torch.Tensor.numpy))


def owned(reply: m.StateReply | None) -> m.StateReply | None:
    """``to_wire``'s state with arrays of its own: what Ray hands back views the object the batch came in, and a
    kept state would keep that whole object (megabytes) in the object store."""
    if reply is None:
        return None
    return reply._replace(state=_rngs(reply.state, np.array), epoch_start=_rngs(reply.epoch_start, np.array))


def from_wire(reply: m.StateReply | None) -> m.StateReply | None:
    """``to_wire``'s state with its tensors back (copies: what Ray hands back may be read-only)."""
    if reply is None:
        return None
    return reply._replace(state=_rngs(reply.state, torch.tensor), epoch_start=_rngs(reply.epoch_start, torch.tensor))


def _rngs(state: dict | None, convert) -> dict | None:
    """``state`` (RNGs as ``_state.rngs_to_plain`` gives them, and more) with the torch state and the numpy keys
    converted."""
    if state is None:
        return None
    state = dict(state)
    state["torch"] = convert(state["torch"])
    if state.get("numpy") is not None:
        name, keys, *rest = state["numpy"]
        state["numpy"] = (name, convert(keys), *rest)
    return state


class _Crashed:
    """An exception that escaped the loop itself (not the dataset's, which the loop reports as ``Failed``)."""

    def __init__(self, error: BaseException):
        self.error = error


def _serve(worker_id, spec, dataset, writer, get, put, resume, where, replies) -> None:
    try:
        serve(worker_id, spec, dataset, writer, get, put, resume, where=where)
    except BaseException as e:  # noqa: BLE001 (raised in the actor's call, so the main process hears of it)
        replies.put(_Crashed(e))


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 (only for messages)
        return None
