"""The single-process iterator (``num_workers=0``): torch's own, plus its position for ``state_dict``."""

from __future__ import annotations

import collections
import copy
import time

from torch.utils.data import _DatasetKind
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from . import _state, stats
from ._dataset_hooks import hooks_of
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
        self._prefetch = hooks_of(loader.dataset).prefetch
        self._ahead = None  # the next batch's indices, already announced to the dataset's prefetch
        self._timed = True  # False under a device stage, which times instead
        self._generator = loader.generator
        self._sampler_rng = None  # sampler RNGs just before this epoch's first index
        self._finished = False
        self._retry_empty = False  # a dataset resumed between epochs may end at once: then a fresh iter() follows
        # A wrapper reading ahead (fastfeed.accelerate) asks for the state of batches ago: the dataset's states then.
        ahead = loader._ff_lookahead
        sampler = _state.sampler_of(loader)
        self._sampler_log = None if sampler is None else _state.SamplerLog(sampler, ahead + 3)
        mid_epoch = resume is not None and resume["mid_epoch"]
        # The batches delivered before this iterator: every one below the frontier and those past it (a state
        # saved with in_order=False by workers); this iterator delivers the others in the order they are asked.
        self._frontier0, self._ahead0, self._yielded0 = 0, (), 0
        self._due = None  # the rest of an epoch given explicitly (a torchdata state's)
        on_draw = None if self._sampler_log is None else self._sampler_log.drew
        if not mid_epoch:
            keep = _state.sampler_rngs(self._generator) if base_seed is not None else None
            if resume is not None and resume["dataset"] is not None:
                loader.dataset.load_state_dict(copy.deepcopy(resume["dataset"]))  # before iter(dataset)
            super().__init__(loader)
            if base_seed is not None:
                _state.restore_sampler_rngs(keep, self._generator)
                self._base_seed = base_seed
            if indices is not None:
                self._sampler_iter = indices
            if resume is not None:
                self._resume_between_epochs(loader, resume)
            self._sampler_iter = _state.Drawn(self._sampler_iter, on_draw=on_draw)
            self._track_dataset(ahead)
            return
        keep = _state.main_rngs(self._generator)  # resuming draws nothing the user would see
        if resume["dataset"] is not None:
            loader.dataset.load_state_dict(copy.deepcopy(resume["dataset"]))  # before iter(dataset)
        super().__init__(loader)
        self._load_iterator(resume)
        self._track_dataset(ahead)
        self._sampler_rng = resume["sampler_rng"]
        yielded = resume["yielded"]
        ahead_set = frozenset(resume.get("received_ahead") or ())
        frontier = yielded - len(ahead_set)
        asked = resume.get("asked", yielded)
        if resume.get("due") is not None:
            self._due = resume["due"]
            due = self._due if self._auto_collation else [batch[0] for batch in self._due]
            self._sampler_iter = _state.Drawn(iter(due))
            self._sampler_iter.replay(frontier, asked, drop=ahead_set)
        elif resume.get("sampler_state") is not None and sampler is not None:
            resumed = _state.resume_sampler(loader, resume["sampler_state"], frontier == 0)
            self._sampler_iter = _state.Drawn(resumed, frontier, ahead_set, on_draw)
            self._sampler_log.start(resume["sampler_state"], frontier)
        else:
            self._sampler_iter = _state.Drawn(self._sampler_iter, on_draw=on_draw)
            if self._sampler_rng is not None:
                _state.restore_sampler_rngs(self._sampler_rng, self._generator)
                iterable = self._dataset_kind == _DatasetKind.Iterable
                replay = iterable and not self._stateful
                # A plain iterable can only be moved forward by reading it; the asks made ahead are made again.
                self._sampler_iter.replay(frontier, asked, self._dataset_fetcher.fetch if replay else None,
                                          ahead_set, constant=iterable)  # fmt: skip
            if self._sampler_log is not None:
                self._sampler_log.start(None, frontier)
        self._frontier0, self._ahead0, self._yielded0 = frontier, ahead_set, yielded
        self._num_yielded = yielded
        _state.restore_main_rngs(keep, self._generator)

    def _load_iterator(self, resume: dict) -> None:
        """A stateful iterator (an iterable whose ``__iter__`` returned itself, say) gets its state after ``iter()``."""
        it_state = resume.get("dataset_iter")
        it = getattr(self._dataset_fetcher, "dataset_iter", None)
        if it_state is not None and _state.is_stateful(it):
            it.load_state_dict(copy.deepcopy(it_state))

    def _resume_between_epochs(self, loader, resume: dict) -> None:
        """A state saved between epochs: the dataset's and sampler's positions then, and a new epoch from there."""
        self._load_iterator(resume)
        iterable = self._dataset_kind == _DatasetKind.Iterable
        self._retry_empty = iterable and (resume["dataset"] is not None or resume.get("dataset_iter") is not None)
        if resume.get("sampler_state") is not None and self._sampler_log is not None:
            self._sampler_iter = _state.resume_sampler(loader, resume["sampler_state"], True)
            self._sampler_log.start(resume["sampler_state"])

    def _track_dataset(self, ahead: int) -> None:
        stateful = _state.is_stateful(self._dataset) or _state.is_stateful(
            getattr(self._dataset_fetcher, "dataset_iter", None)
        )
        self._stateful = stateful
        self._dataset_log = collections.deque(maxlen=ahead + 1) if stateful and ahead else None

    def _next_index(self):
        if self._sampler_rng is None:
            self._sampler_rng = _state.sampler_rngs(self._generator)
        log = self._sampler_log
        if log is not None and not log.states:
            log.start()  # its state before this epoch's first ask (each ask notes the state after it: Drawn)
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
                data = self._fetch_next()
            else:
                asked = time.perf_counter()
                data = self._fetch_next()
                rec.add(asked, 0, time.perf_counter())
            self._log_dataset()
            return data
        except StopIteration:
            self._finished = True
            raise

    def _fetch_next(self):
        if not self._retry_empty:
            return super()._next_data()
        self._retry_empty = False
        try:
            return super()._next_data()
        except StopIteration:  # it continued the epoch that had ended: the next one is a fresh iter()
            self._dataset_fetcher = _DatasetKind.create_fetcher(
                self._dataset_kind, self._dataset, self._auto_collation, self._collate_fn, self._drop_last
            )
            return super()._next_data()

    def _log_dataset(self) -> None:
        if self._dataset_log is not None:
            self._dataset_log.append(_state.dataset_positions(self._dataset, self._dataset_fetcher))

    def state_dict(self, held_back: int = 0) -> dict:
        """This epoch's position; ``held_back``: as of that many batches ago (see ``RingDataLoaderIter``)."""
        dataset = dataset_iter = sampler_state = None
        if self._stateful:
            if held_back:
                dataset, dataset_iter = self._dataset_log[-1 - held_back]
            else:
                dataset, dataset_iter = _state.dataset_positions(self._dataset, self._dataset_fetcher)
        mid_epoch = not self._finished or held_back > 0
        frontier, ahead = _state.advance(self._frontier0, self._ahead0, self._num_yielded - held_back - self._yielded0)
        log = self._sampler_log
        if log is not None:
            sampler_state = log.after(frontier) if log.states else copy.deepcopy(log.sampler.state_dict())
        return {
            "mid_epoch": mid_epoch,
            "yielded": frontier + len(ahead),
            "sampler_rng": self._sampler_rng,
            "sampler_state": sampler_state,
            "base_seed": self._base_seed,
            "dataset": dataset,
            "dataset_iter": dataset_iter,
            "num_workers": 0,
            "asked": self._sampler_iter.asked,
            "next_worker": 0,
            "workers": None,
            "received_ahead": sorted(ahead) if mid_epoch else [],
            "due": self._due if mid_epoch else None,
        }
