"""``fastfeed.StatefulDataLoader``: fastfeed's loader under torchdata's name and arguments.

Code written against ``torchdata.stateful_dataloader.StatefulDataLoader`` (torchtitan,
Accelerate's ``use_stateful_dataloader``, trainers that checkpoint the loader) changes its
import only. The states it saves are fastfeed's (see ``DataLoader.state_dict``); ``load_state_dict``
also takes states saved by torchdata's loader, so a run can switch at a checkpoint (``fastfeed._from_torchdata``).
"""

from __future__ import annotations

import warnings

from .loader import DataLoader

SNAPSHOT_DEFAULT = 1  # torchdata's default for snapshot_every_n_steps
_warned = False


class StatefulDataLoader(DataLoader):
    """``fastfeed.DataLoader`` taking torchdata's ``StatefulDataLoader`` arguments.

    Args:
        *args, **kwargs: everything ``fastfeed.DataLoader`` takes (torch's arguments, and
            fastfeed's ``worker_type``, ``device``, ``numa``, ...).
        snapshot_every_n_steps: accepted for torchdata's code, and changes nothing. torchdata's
            workers send their state to the main process every n batches, so that
            ``state_dict()`` can be answered from the last snapshot; fastfeed's workers keep
            theirs and ``state_dict()`` asks them for it, so the state is always that of the
            last batch received, and costs nothing until it is asked for. A value other than
            the default warns once.
    """

    def __init__(self, *args, snapshot_every_n_steps: int | None = SNAPSHOT_DEFAULT, **kwargs):
        global _warned
        if snapshot_every_n_steps != SNAPSHOT_DEFAULT and not _warned:
            _warned = True
            warnings.warn(
                f"StatefulDataLoader(snapshot_every_n_steps={snapshot_every_n_steps!r}) changes nothing in fastfeed: "
                "its workers keep their state and state_dict() asks them for it, so every state is exact and costs "
                "nothing until it is asked for",
                UserWarning,
                stacklevel=2,
            )
        self.snapshot_every_n_steps = snapshot_every_n_steps
        super().__init__(*args, **kwargs)

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``DataLoader.load_state_dict``; an empty dict (torchdata's "no state") starts afresh."""
        if isinstance(state_dict, dict) and not state_dict:  # (not ==: a tensor or array compares elementwise)
            return
        super().load_state_dict(state_dict)
