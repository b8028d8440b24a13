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


class SlotRef(NamedTuple):
    """A ring slot lent to one task: the worker writes the batch into it."""

    slot_id: int
    name: str
    size: int


class Task(NamedTuple):
    """Fetch and collate the samples of batch ``idx``."""

    idx: int
    index: Any  # a list of sample indices (auto-collation) or one index
    slot: SlotRef | None  # None while the ring is still unsized


class Resume(NamedTuple):
    """A persistent worker starts a new epoch (torch's ``_ResumeIteration``)."""

    shared_seed: int | None


class Stop(NamedTuple):
    """The worker exits its loop."""


class Leaf(NamedTuple):
    """Where one tensor of a batch lies in the slot, and what it is."""

    offset: int
    dtype: Any  # torch.dtype
    shape: tuple
    requires_grad: bool
    # Dimension order of a dense but permuted tensor (transposed, channels_last):
    # its bytes lie in that order, so its strides come back as they were.
    perm: tuple | None = None


class Done(NamedTuple):
    """Batch ``idx`` is written.

    ``payload`` is the batch structure pickled with each tensor replaced by its
    index in ``leaves``. The tensor bytes are in the task's slot, or, when they
    did not fit, in the worker-created segment named ``overflow``.
    """

    idx: int
    worker_id: int
    nbytes: int
    leaves: list
    payload: bytes
    overflow: str | None


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
    """Send the state this worker had right after task ``after_idx`` (None: at the epoch's start)."""

    after_idx: int | None


class StateReply(NamedTuple):
    """The worker's state after the requested task, and at the start of its epoch (see ``fastfeed._state``)."""

    worker_id: int
    state: dict
    epoch_start: dict


def dumps(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


loads = pickle.loads
