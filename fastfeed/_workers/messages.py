"""Every message that crosses a worker pipe, as a named type.

Main -> worker: ``Task``, ``Resume``, ``StateRequest``, ``Stop``.
Worker -> main: ``Done``, ``Failed``, ``IterEnd``, ``ResumeAck``, ``StateReply``.

Messages are pickled by our own code and travel only over the pipes the main
process created for its own workers; nothing is ever unpickled from shared
memory.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

from .._ring.leaf import Leaf  # noqa: F401  (Done carries a list of them; the type lives below ring and workers)

# The task index a worker's restored state goes by: a worker resumed mid-epoch (load_state_dict, or a replaced
# Ray actor) holds the state it was restored to as if task RESTORED had just ended, until it answers a task of its
# own; StateRequest(RESTORED) asks for that state. Real tasks count up from 0, so it is never one of theirs.
RESTORED = -1


class Task(NamedTuple):
    """Fetch and collate the samples of batch ``idx`` (into a slot the worker claims from the ring)."""

    idx: int
    index: Any  # a list of sample indices (auto-collation) or one index


class Resume(NamedTuple):
    """A persistent worker starts a new epoch (torch's ``_ResumeIteration``)."""

    shared_seed: int | None
    dataset_sync: dict | None = None  # what the dataset's copy here takes from the main process's (Shards' epoch)


class Stop(NamedTuple):
    """The worker exits its loop."""


class Done(NamedTuple):
    """Batch ``idx`` is written.

    ``payload`` is the batch structure pickled with each tensor replaced by its
    index in ``leaves``. The tensor bytes are in ring slot ``slot_id``, or in the
    segment named ``made`` that the worker created because no slot was free
    (``slot_id`` None) or the one it claimed was too small (``made`` replaces it).
    """

    idx: int
    worker_id: int
    nbytes: int
    leaves: list
    payload: bytes
    slot_id: int | None
    made: str | None
    fetch_s: float = 0.0  # seconds in the dataset, measured in the worker (fastfeed.stats)
    collate_s: float = 0.0  # seconds collating and writing into the slot
    done_at: float = 0.0  # the worker's perf_counter when the write ended (the doctor's timeline); 0: untimed


class Failed(NamedTuple):
    """Batch ``idx`` raised; ``error`` is torch's ``ExceptionWrapper``."""

    idx: int
    worker_id: int
    error: Any


class IterEnd(NamedTuple):
    """This worker's IterableDataset replica is exhausted (at batch ``idx``)."""

    idx: int
    worker_id: int


class ResumeAck(NamedTuple):
    """The worker has reset its fetcher for the new epoch."""

    worker_id: int


class StateRequest(NamedTuple):
    """Send the state this worker had right after task ``after_idx`` (None: at the epoch's start; ``RESTORED``: the
    state it was restored to)."""

    after_idx: int | None


class StateReply(NamedTuple):
    """The worker's state after the requested task, and at the start of its epoch (see ``fastfeed._state``)."""

    worker_id: int
    state: dict
    epoch_start: dict


def dumps(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


loads = pickle.loads
