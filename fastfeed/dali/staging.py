"""Pinned staging for a CPU pipeline's outputs bound for a GPU.

A copy from pageable memory blocks the host until the GPU has it: CUDA stages it through a pinned bounce
buffer of its own. So each output is first copied out of DALI's buffer (DALI reuses it at its next run) into a
pinned buffer of ours, and the copy to the GPU is queued from there with ``non_blocking=True``. The buffers are
reused, since pinning is slow, and a buffer whose copy is still queued on the consumer's stream is never
rewritten: each copy records an event, and a buffer is taken again only once its event has completed. When every
buffer of an output is still in flight (the GPU is ``DEPTH`` batches behind), the oldest is waited for.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

DEPTH = 4  # pinned buffers per output: copies that may be in flight at once


class TorchCuda:
    """The CUDA calls staging makes, through torch; tests put a fake whose copies complete when they say."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A pinned host buffer of ``nbytes`` bytes (uint8)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """Queue ``host``'s copy to ``device`` on its current stream; returns (device tensor, its event)."""
        out = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return out, event

    def done(self, event) -> bool:
        """Whether the copy behind ``event`` has completed (never blocks)."""
        return event.query()

    def wait(self, event) -> None:
        """Block the host until the copy behind ``event`` has completed."""
        event.synchronize()


CUDA = TorchCuda()


@dataclass
class _Buffer:
    memory: torch.Tensor  # uint8, pinned
    event: Any = None  # the copy out of it still (maybe) in flight; None: free
    issued: int = 0  # order of that copy, to wait for the oldest first


class PinnedStaging:
    """Copies host tensors to ``device`` through reused pinned buffers, one pool per output name.

    Args:
        device: the CUDA device the outputs go to.
        cuda: the CUDA calls (``TorchCuda``); None: this module's ``CUDA``.
        depth: buffers per output.
    """

    def __init__(self, device: torch.device, cuda: TorchCuda | None = None, depth: int = DEPTH):
        self.device = device
        self._cuda = cuda if cuda is not None else CUDA
        self._depth = depth
        self._pools: dict[str, list[_Buffer]] = {}
        self._order = itertools.count()

    def copy(self, name: str, shape, dtype: torch.dtype, fill: Callable[[torch.Tensor], None],
             rows: int | None = None) -> torch.Tensor:  # fmt: skip
        """A tensor on the device holding what ``fill`` writes into a pinned host tensor of ``shape`` / ``dtype``.

        ``rows``: keep only the first rows (a padded last batch's real samples) before copying.
        """
        shape = tuple(shape)
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        buf = self._free(name, nbytes)
        host = buf.memory[:nbytes].view(dtype).view(shape)
        fill(host)
        if rows is not None:
            host = host[:rows]
        out, buf.event = self._cuda.copy(host, self.device)
        buf.issued = next(self._order)
        return out

    def _free(self, name: str, nbytes: int) -> _Buffer:
        """A buffer of at least ``nbytes`` that no copy is reading."""
        pool = self._pools.setdefault(name, [])
        for buf in pool:
            if buf.event is not None and self._cuda.done(buf.event):
                buf.event = None
        free = [buf for buf in pool if buf.event is None]
        if not free and len(pool) >= self._depth:
            oldest = min(pool, key=lambda buf: buf.issued)
            self._cuda.wait(oldest.event)
            oldest.event = None
            free = [oldest]
        fit = next((buf for buf in free if buf.memory.numel() >= nbytes), None)
        if fit is not None:
            return fit
        if free:  # a batch larger than before: a free buffer (its copy done) makes room for a larger one
            pool.remove(free[0])
        buf = _Buffer(self._cuda.pinned(nbytes))
        pool.append(buf)
        return buf


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
