"""``fastfeed.DataLoader``: torch's DataLoader, fed through a shared-memory ring.

The class is a subclass of ``torch.utils.data.DataLoader`` and takes the same
arguments, validated by torch itself, so ``isinstance`` checks and every
torch behaviour carry over. With ``num_workers=0`` it *is* torch's loader.
With workers, batches travel sampler -> workers -> ring slot -> user (see
``_iterator.py``): each batch is copied once, by the worker, into shared memory
that was allocated and touched once, and the user receives views of it.
"""

from __future__ import annotations

import torch.utils.data

from ._iterator import RingDataLoaderIter


class DataLoader(torch.utils.data.DataLoader):
    """A drop-in replacement for ``torch.utils.data.DataLoader``.

    Args:
        *args, **kwargs: exactly torch's (``dataset``, ``batch_size``, ``shuffle``,
            ``sampler``, ``batch_sampler``, ``num_workers``, ``collate_fn``,
            ``pin_memory``, ``drop_last``, ``timeout``, ``worker_init_fn``,
            ``multiprocessing_context``, ``generator``, ``prefetch_factor``,
            ``persistent_workers``, ``pin_memory_device``, ``in_order``).

    Batches from worker processes are views of reused shared-memory slots. A
    slot is recycled only once no tensor views it, so holding on to batches is
    safe; holding on to many of them makes the ring grow (with one
    ``RingGrowthWarning``) rather than deadlock.
    """

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()  # torch's single-process path, unchanged
        self.check_worker_number_rationality()
        return RingDataLoaderIter(self)
