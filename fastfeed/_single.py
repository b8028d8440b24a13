"""The single-process iterator (``num_workers=0``): torch's own, plus its position for ``state_dict``."""

from __future__ import annotations

import collections
import time

from torch.utils.data import _DatasetKind
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from . import _state, stats
from ._workers import readahead

_END = object()  # the sampler is exhausted


class SingleProcessIter(_SingleProcessDataLoaderIter):
    """torch's single-process iterator, plus what ``DataLoader.state_dict()`` needs.

    Its "worker" is the main process: the RNG states are the global ones, saved by the
    loader; this iterator adds the sampler's position and a stateful dataset's state.
    """

    def __init__(self, loader, resume: dict | None = None, indices=None, base_seed: int | None = None) -> None:
        """``indices``, ``base_seed``: as ``RingDataLoaderIter``'s (an online tuner's share of an epoch)."""
        self._stats = stats.recorder(0, None)  # see fastfeed.stats
        self._prefetch = readahead.prefetcher(loader.dataset, loader._dataset_kind == _DatasetKind.Map)
        self._ahead = None  # the next batch's indices, already announced to the dataset's prefetch
        self._timed = True  # False under a device stage, which times instead
        self._generator = loader.generator
        self._sampler_rng = None  # sampler RNGs just before this epoch's first index
        self._finished = False
        stateful = loader._dataset_kind == _DatasetKind.Iterable and _state.is_stateful_dataset(loader.dataset)
        self._stateful = stateful
        # A wrapper reading ahead (fastfeed.accelerate) asks for the state of batches ago: the dataset's states then.
        ahead = loader._ff_lookahead
        self._dataset_log = collections.deque(maxlen=ahead + 1) if stateful and ahead else None
        if resume is None:
            keep = _state.sampler_rngs(self._generator) if base_seed is not None else None
            super().__init__(loader)
            if base_seed is not None:
                _state.restore_sampler_rngs(keep, self._generator)
                self._base_seed = base_seed
            if indices is not None:
                self._sampler_iter = indices
            return
        keep = _state.main_rngs(self._generator)  # resuming draws nothing the user would see
        if stateful and resume["dataset"] is not None:
            loader.dataset.load_state_dict(resume["dataset"])  # before iter(dataset)
        super().__init__(loader)
        if resume["sampler_rng"] is not None:
            self._sampler_rng = resume["sampler_rng"]
            _state.restore_sampler_rngs(self._sampler_rng, self._generator)
            replay = self._dataset_kind == _DatasetKind.Iterable and not stateful
            for _ in range(resume["yielded"]):
                index = next(self._sampler_iter)
                if replay:  # a plain iterable can only be moved forward by reading it
                    self._dataset_fetcher.fetch(index)
        self._num_yielded = resume["yielded"]
        _state.restore_main_rngs(keep, self._generator)

    def _next_index(self):
        if self._sampler_rng is None:
            self._sampler_rng = _state.sampler_rngs(self._generator)
        if self._dataset_log is not None and not self._dataset_log:
            self._log_dataset()  # its state before this epoch's (or this resumed run's) first batch
        if self._prefetch is None:
            return next(self._sampler_iter)
        # The read-ahead protocol: the dataset hears of this batch's samples and the next one's before they
        # are read, so its reads run while the step does.
        if self._ahead is None:
            self._ahead = self._draw()
        index, self._ahead = self._ahead, self._draw()
        if index is _END:
            raise StopIteration
        return index

    def _draw(self):
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            return _END
        self._prefetch(readahead.indices_of(index, self._auto_collation))
        return index

    def _next_data(self):
        try:
            rec = self._stats
            if rec is None or not self._timed:
                data = super()._next_data()
            else:
                asked = time.perf_counter()
                data = super()._next_data()
                rec.add(asked, 0, time.perf_counter())
            self._log_dataset()
            return data
        except StopIteration:
            self._finished = True
            raise

    def _log_dataset(self) -> None:
        if self._dataset_log is not None:
            self._dataset_log.append(_state.dataset_state(self._dataset))

    def state_dict(self, held_back: int = 0) -> dict:
        """This epoch's position; ``held_back``: as of that many batches ago (see ``RingDataLoaderIter``)."""
        dataset = None
        if self._stateful:
            dataset = self._dataset_log[-1 - held_back] if held_back else _state.dataset_state(self._dataset)
        return {
            "mid_epoch": not self._finished or held_back > 0,
            "yielded": self._num_yielded - held_back,
            "sampler_rng": self._sampler_rng,
            "base_seed": self._base_seed,
            "dataset": dataset,
            "next_worker": 0,
            "workers": None,
        }
