"""``DataLoader(ArrayFiles(...), device="cuda", reader="gds")``: each batch read from disk straight into device
memory, in the loop's own thread, with no worker and no host copy.

The loader runs torch's single-process iterator (sampler, ``state_dict``, stats as with ``num_workers=0``) with
this fetcher in place of torch's, so shuffling, ``DistributedSampler`` and resume work as with any dataset.
"""

from __future__ import annotations

import torch

from .gds import GdsReader


class GdsFetcher:
    """torch's fetcher protocol (``fetch(index)``) over a ``GdsReader``: a batch of indices becomes one device
    tensor ``(len(batch), *sample_shape)``; without automatic batching, one sample."""

    def __init__(self, arrays, device: torch.device, auto_collation: bool, reader: GdsReader | None = None) -> None:
        self.arrays, self.device, self.auto_collation = arrays, device, auto_collation
        self.reader = reader if reader is not None else GdsReader(arrays)

    def fetch(self, index):
        indices = list(index) if self.auto_collation else [index]
        out = torch.empty((len(indices), *self.arrays.sample_shape), dtype=self.arrays.dtype, device=self.device)
        self.reader.read_batch(indices, out)
        return out if self.auto_collation else out[0]

    def __del__(self) -> None:
        reader = getattr(self, "reader", None)
        if reader is not None:
            reader.close()  # the epoch's iterator is gone: its file handles go with it
