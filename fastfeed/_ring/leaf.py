"""``Leaf``: where one tensor of a batch lies in a ring slot.

The ring's layout writes it and the workers' ``Done`` message carries it, so it lives below both: the ring
never imports the workers that write into it.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Leaf(NamedTuple):
    """Where one tensor of a batch lies in the slot, and what it is."""

    offset: int
    dtype: Any  # torch.dtype
    shape: tuple
    requires_grad: bool
    # Dimension order of a dense but permuted tensor (transposed, channels_last):
    # its bytes lie in that order, so its strides come back as they were.
    perm: tuple | None = None
