"""The worker loop: fetch a batch, collate it straight into a slot, report.

This mirrors torch's ``_worker_loop`` step for step (seeding, worker info,
init errors, IterableDataset exhaustion, persistent-worker resume), so user
code sees the same worker environment; only the transport differs. The loop
itself (``serve``) is shared by worker processes (``worker_main``, here) and
worker threads (``threads.py``); they differ in set-up and in how messages travel.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import random
import select
import sys
import time
from typing import Any, Callable, NamedTuple

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _DatasetKind
from torch.utils.data._utils import signal_handling
from torch.utils.data._utils import worker as torch_worker

from .. import _state, affinity
from .._dataset_hooks import hooks_of
from .._ring import layout, segments
from .._ring.control import Control
from . import messages as m
from . import readahead
from .pool import DUMP_SIGNAL

PARENT_CHECK_S = 5.0  # how often an idle worker process checks that its parent lives


class WorkerSpec(NamedTuple):
    """What every worker of one iterator is given (pickled once per worker process)."""

    num_workers: int
    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Callable
    use_slot_collate: bool  # the default collate: stack straight into the slot
    drop_last: bool
    base_seed: int
    init_fn: Callable | None
    shared_seed: int | None
    prefix: str  # the ring's segment name prefix, for the segments workers create
    control: str  # the name of the ring's control block (its shared free list)
    history: int  # per-task state snapshots to keep (every task in flight, and one more)
    placement: Any = None  # affinity.Placement: the CPUs and NUMA node of every worker, or None
    timed: bool = True  # measure fetch and collate seconds for the main process's stats


class SlotWriter:
    """Writes batches into ring slots it claims, mapping each slot once.

    Args:
        control: the ring's ``Control`` (its shared free list).
        attach: the segment behind a claimed slot (a process maps it by name; a
            thread uses the ring's own mapping).
        numa_node: where the segments it creates belong.
    """

    def __init__(self, control, attach: Callable[[Any], Any], numa_node: int | None = None):
        self.control = control
        self.attach = attach
        self.numa_node = numa_node
        self.mapped: dict[int, tuple[str, torch.Tensor]] = {}

    def _base(self, claimed) -> torch.Tensor:
        hit = self.mapped.get(claimed.slot_id)
        if hit is None or hit[0] != claimed.name:  # new slot, or the ring replaced it
            seg = self.attach(claimed)
            hit = self.mapped[claimed.slot_id] = (claimed.name, torch.frombuffer(seg, dtype=torch.uint8))
        return hit[1]

    def claim(self, nbytes: int) -> tuple[int | None, str | None, torch.Tensor]:
        """Memory for a batch of ``nbytes``: ``(slot_id, made, base)``, a free slot or a segment of our own."""
        claimed = self.control.claim()  # only now: a task waiting its turn holds no memory
        if claimed is not None and nbytes <= claimed.size:
            return claimed.slot_id, None, self._base(claimed)
        # No slot free, or it is too small: a segment of our own, which the
        # ring adopts. A replacement gets headroom, as sizes evidently vary.
        size = nbytes if claimed is None else nbytes + nbytes // 4
        seg = segments.create(self.control.prefix, segments.pages(size), self.numa_node)
        if claimed is None:
            self.control.made_one()
        return (None if claimed is None else claimed.slot_id), seg.name, torch.frombuffer(seg, dtype=torch.uint8)

    def abandon(self, slot_id: int | None, made: str | None) -> None:
        """Give back what ``claim`` gave, for a batch that will never be reported."""
        if made:  # nobody will ever be told its name
            segments.unlink(made)
        if slot_id is not None:
            self.control.release(slot_id)

    def write(self, task: m.Task, batch, worker_id: int, fetch_s=0.0, collate_s=0.0, since=0.0, timed=False) -> m.Done:
        """Write ``batch`` into a slot; ``timed``: its collate time runs on from ``since`` to the end of the write."""
        payload, objs, leaves, nbytes = layout.plan(batch)
        slot_id = made = None
        if nbytes:
            slot_id, made, base = self.claim(nbytes)
            try:
                layout.fill(base, objs, leaves)
            except BaseException:
                self.abandon(slot_id, made)
                raise
        done_at = 0.0
        if timed:
            done_at = time.perf_counter()
            collate_s += done_at - since
        return m.Done(task.idx, worker_id, nbytes, leaves, payload, slot_id, made, fetch_s, collate_s, done_at)


def node_of(spec: WorkerSpec) -> int | None:
    return None if spec.placement is None else spec.placement.node


def yield_to_main() -> None:
    """Put the calling process or thread under SCHED_BATCH.

    A worker woken by a new task then does not preempt the main thread (the
    training loop). Without it, every task sent to an idle worker costs the
    main process a context switch on a busy machine.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: the calling thread
    except (AttributeError, OSError):
        pass


def preload() -> None:
    """Import here what each worker's seeding imports, so that forked workers inherit it.

    numpy 2 imports ``numpy.random`` on first use: without this, every worker of every
    epoch (``persistent_workers=False``) would import it anew, 10-30 ms before its first batch.
    """
    try:
        import numpy.random  # noqa: F401
    except ImportError:
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


def _plain(rngs) -> dict:
    return rngs if isinstance(rngs, dict) else _state.rngs_to_plain(rngs)


def _state_reply(worker_id, after_idx, snapshots, epoch_start, start_positions) -> m.StateReply:
    start = _plain(epoch_start)
    if after_idx is None:  # no task of this epoch was seen yet
        ds_state, it_state = start_positions or (None, None)
        state = dict(start, dataset=ds_state, dataset_iter=it_state, batches=0, ended=False)
        return m.StateReply(worker_id, state, start)
    for idx, rngs, positions, n_batches, ended in reversed(snapshots):
        if idx == after_idx:
            ds_state, it_state = positions or (None, None)
            state = dict(_plain(rngs), dataset=ds_state, dataset_iter=it_state, batches=n_batches, ended=ended)
            return m.StateReply(worker_id, state, start)
    raise RuntimeError(f"worker {worker_id} no longer holds its state after task {after_idx}")


def _pipe_reader(task_conn, parent_pid: int) -> Callable[..., Any]:
    """The next message from the main process, or None once it is gone (``block=False``: ``NOTHING`` when
    no message is waiting)."""
    poller = select.poll()
    poller.register(task_conn.fileno(), select.POLLIN)

    def get(block: bool = True):
        if not block and not poller.poll(0):
            return readahead.NOTHING
        while not poller.poll(PARENT_CHECK_S * 1000):
            if os.getppid() != parent_pid:
                return None  # orphaned: the main process died without telling us
        try:
            return m.loads(task_conn.recv_bytes())
        except (EOFError, OSError):
            return None  # the main process closed our pipe or died

    return get


def _stderr_fd() -> int:
    """Where a worker prints its stacks: stderr's descriptor, even when ``sys.stderr`` is no file
    (pytest's capture, a notebook), which would make ``faulthandler`` raise in every worker."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return 2


def worker_main(worker_id, spec: WorkerSpec, parent_pid, resume, task_conn, result_conn):
    """Entry point of one worker process.

    ``resume``: None, or where ``DataLoader.load_state_dict`` restarts this worker:
    ``{"state": ..., "epoch_start": ..., "mid_epoch": bool, "replay_index": ...}``.
    """
    try:
        signal_handling._set_worker_signal_handlers()
        affinity.apply(spec.placement)  # first: what this worker allocates from here on lands on its node
        # `kill -USR1 <pid>` (or FASTFEED_HANG_DUMP_S) prints where this worker is stuck.
        faulthandler.register(DUMP_SIGNAL, file=_stderr_fd(), all_threads=True)
        torch.multiprocessing._set_thread_name("ff_data_worker")
        # A forked OpenMP pool deadlocks, and workers share the cores anyway.
        torch.set_num_threads(1)
        yield_to_main()
        seed = _seed(spec.base_seed, worker_id)
        dataset = _seed_datapipe(spec.dataset, spec.shared_seed)
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=dataset
        )
        try:
            control = Control.attach(spec.control, spec.prefix)
        except FileNotFoundError:
            # The epoch ended, and its ring was unlinked, before this worker started (a resumed epoch with
            # nothing left ends while the later workers are still forked): there is nothing to serve.
            return
        writer = SlotWriter(control, lambda claimed: segments.attach(claimed.name), node_of(spec))
        get = _pipe_reader(task_conn, parent_pid)
        serve(worker_id, spec, dataset, writer, get, lambda msg: result_conn.send_bytes(m.dumps(msg)), resume)
    except KeyboardInterrupt:
        pass  # the main process raises KeyboardInterrupt itself
    except BrokenPipeError:
        pass  # the main process is gone; nobody is left to tell


def serve(worker_id, spec: WorkerSpec, dataset, writer: SlotWriter, get, put, resume=None, *, thread=False,
          where: str | None = None):
    """Answer tasks until ``get()`` returns ``Stop`` or None.

    ``thread``: this worker is a thread. It keeps no RNG snapshots for
    ``DataLoader.state_dict()``, since the RNGs it draws from are the process's.
    ``where``: how errors name this worker (default: its kind and id, as torch's).
    """
    track_state = not thread
    where = where or f"in DataLoader worker {'thread' if thread else 'process'} {worker_id}"
    collate_fn = layout.slot_collate if spec.use_slot_collate else spec.collate_fn
    kind = spec.dataset_kind
    clock = time.perf_counter
    collating = [0.0]  # seconds spent in collate_fn during the current fetch
    if spec.timed:
        untimed = collate_fn

        def collate_fn(samples):
            t = clock()
            try:
                return untimed(samples)
            finally:
                collating[0] += clock() - t

    def new_fetcher():
        return _DatasetKind.create_fetcher(kind, dataset, spec.auto_collation, collate_fn, spec.drop_last)

    snapshot = _state.snapshot if track_state else lambda: None
    hooks = hooks_of(dataset)
    if hooks.prefetch is not None:
        get = readahead.Ahead(get, hooks.prefetch, spec.auto_collation)
    init_error = None
    fetcher = None
    try:
        if spec.init_fn is not None:
            spec.init_fn(worker_id)
        fetcher = new_fetcher()
    except Exception:
        init_error = ExceptionWrapper(where=where)

    def has_state() -> bool:
        """The dataset, or the iterator it gave, saves its own position (torchdata's ``Stateful``)."""
        it = getattr(fetcher, "dataset_iter", None)
        return track_state and (_state.is_stateful(dataset) or _state.is_stateful(it))

    # State for DataLoader.state_dict(): the RNGs at the start of this epoch, and after each recent task
    # (idx, rngs, (dataset's state, its iterator's), batches this epoch, ended); a stateful dataset's state at
    # the start of this epoch.
    stateful = has_state()
    snapshots = collections.deque(maxlen=spec.history if track_state else 0)
    n_batches = 0
    iteration_end = False
    retry_empty = False  # a dataset restored at an epoch's end may end at once: its next epoch is a fresh iter()
    epoch_start = snapshot()
    start_positions = _state.dataset_positions(dataset, fetcher) if stateful else None
    if resume is not None and init_error is None:
        state = resume["state"]
        positions = (state["dataset"], state.get("dataset_iter"))
        restore = positions != (None, None)
        if resume["mid_epoch"]:
            epoch_start = resume["epoch_start"]
            if restore:
                _state.restore_rngs(epoch_start)  # what iter(dataset) drew from when this epoch began
                fetcher = _state.restore_dataset(dataset, *positions, new_fetcher)
                retry_empty = kind == _DatasetKind.Iterable and not state["batches"]
            elif kind == _DatasetKind.Iterable and state["batches"]:
                # A plain iterable: replay this epoch's batches from its start, unseen.
                _state.restore_rngs(epoch_start)
                fetcher = new_fetcher()
                for _ in range(state["batches"]):
                    fetcher.fetch(resume["replay_index"])
            n_batches, iteration_end = state["batches"], state["ended"]
        elif restore:  # persistent workers between epochs: the dataset as it was, and a new epoch of it
            _state.restore_rngs(state)
            fetcher = _state.restore_dataset(dataset, *positions, new_fetcher)
            retry_empty = kind == _DatasetKind.Iterable
        _state.restore_rngs(state)
        stateful = has_state()
        # The dataset was given copies: what it does with them leaves the state to report as it was saved.
        if resume["mid_epoch"]:  # the state to report until this worker's next task is seen
            snapshots.append((m.RESTORED, state, positions if restore else None, n_batches, iteration_end))
            if not n_batches:
                start_positions = positions if restore else None
        else:  # a new epoch of persistent workers begins here
            epoch_start = snapshot()
            start_positions = positions if restore else None

    while True:
        task = get()
        msg_kind = type(task)
        if task is None or msg_kind is m.Stop:
            break
        if msg_kind is m.Resume:
            iteration_end = retry_empty = False
            dataset = _seed_datapipe(dataset, task.shared_seed)
            if task.dataset_sync is not None:
                hooks.worker_apply(task.dataset_sync)  # still this dataset's: _seed_datapipe reseeds in place
            fetcher = new_fetcher()
            snapshots.clear()
            n_batches, epoch_start = 0, snapshot()
            stateful = has_state()
            start_positions = _state.dataset_positions(dataset, fetcher) if stateful else None
            put(m.ResumeAck(worker_id))
            continue
        if msg_kind is m.StateRequest:
            put(_state_reply(worker_id, task.after_idx, snapshots, epoch_start, start_positions))
            continue
        if iteration_end:
            continue  # torch skips tasks after exhaustion, sending nothing
        if init_error is not None:
            reply, init_error = m.Failed(task.idx, worker_id, init_error), None
        else:
            try:
                collating[0] = 0.0
                t0 = clock()
                try:
                    batch = fetcher.fetch(task.index)
                except StopIteration:
                    if not retry_empty:
                        raise
                    fetcher = new_fetcher()  # it continued the epoch that had ended: the next is a fresh iter()
                    batch = fetcher.fetch(task.index)
                t1 = clock()
                # The write into the slot is the rest of collating.
                reply = writer.write(task, batch, worker_id, t1 - t0 - collating[0], collating[0], t1, spec.timed)
                del batch
                n_batches += 1
                retry_empty = False
            except Exception as e:
                retry_empty = False
                if isinstance(e, StopIteration) and kind == _DatasetKind.Iterable:
                    reply = m.IterEnd(task.idx, worker_id)
                    iteration_end = True
                else:
                    wrapper = ExceptionWrapper(where=where)
                    reply = m.Failed(task.idx, worker_id, wrapper)
        if track_state:
            snapshots.append((
                task.idx, snapshot(), _state.dataset_positions(dataset, fetcher) if stateful else None,
                n_batches, iteration_end,
            ))  # fmt: skip
        put(reply)
        del reply, task
