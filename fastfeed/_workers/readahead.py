"""The read-ahead protocol's worker side: tasks are taken from the main process ahead of their turn, so a
dataset's ``prefetch(indices)`` hears of each task's samples as soon as the task arrives, and its reads overlap
the batches before it. Messages are still answered strictly in the order they came.

The protocol is declared, and a dataset's ``prefetch`` found, in ``fastfeed._dataset_hooks`` (``ReadAhead``).
"""

from __future__ import annotations

import collections
import traceback
import warnings
from typing import Any, Callable

from . import messages as m

NOTHING = object()  # what ``get(block=False)`` returns when no message is waiting


def indices_of(index, auto_collation: bool) -> list:
    """The sample indices of one task: a batch's list, or the one index when there is no batching."""
    return list(index) if auto_collation else [index]


class Ahead:
    """``get()`` for a worker whose dataset reads ahead: one blocking receive when nothing is held, then every
    message already waiting, each task's indices passed to ``prefetch`` as it is taken.

    ``get(block=False)`` must return ``NOTHING`` when no message waits. ``prefetch`` is a hint: an exception in it
    is reported once, as a warning with its traceback, and loading goes on without read-ahead.
    """

    def __init__(self, get: Callable, prefetch: Callable[[list], Any], auto_collation: bool) -> None:
        self._get, self._prefetch, self._auto = get, prefetch, auto_collation
        self._held: collections.deque = collections.deque()

    def __call__(self):
        if not self._held:
            self._take(self._get())
        while self._held[-1] is not None and type(self._held[-1]) is not m.Stop:
            msg = self._get(block=False)
            if msg is NOTHING:
                break
            self._take(msg)
        return self._held.popleft()

    def _take(self, msg) -> None:
        self._held.append(msg)
        if type(msg) is m.Task and self._prefetch is not None:
            try:
                self._prefetch(indices_of(msg.index, self._auto))
            except Exception:  # noqa: BLE001 (a hint that failed; __getitem__ reads as usual)
                warnings.warn(f"the dataset's prefetch() raised; loading goes on without read-ahead:\n"
                              f"{traceback.format_exc()}", RuntimeWarning, stacklevel=2)  # fmt: skip
                self._prefetch = None
