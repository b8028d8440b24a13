"""The sample order of an epoch: a pure function of (index, seed, epoch, shuffle, window).

Neither the world size nor the number of workers enters it, which is what makes resume elastic: the epoch is one
global sequence of samples, cut into global batches of ``batch_size x world`` consecutive positions, and rank r's
batch j is the r-th slice of global batch j. A run checkpointed after global batch j on W ranks continues on W'
ranks at global batch j, with the same samples in every global batch, whenever the global batch is the same.

The shuffle is shard-aware, so reads stay large and few: the shards are put in a new order each epoch, taken in
windows of ``window`` consecutive shards, and the samples of one window are shuffled together. Every sample mixes
with the samples of the ``window`` shards around it (Mosaic's ``py1b`` with blocks of whole shards); nothing mixes
across windows. While a window is read, only its shards need to be local, and the next window's are downloaded
meanwhile. Without shuffle, shards and samples keep the source's order.

Each window's samples are shuffled by a stream of their own, from (seed, epoch, window), so the order is made as it
is read: O(shards) per epoch and O(window) per window, never O(samples) (see ``Epoch``).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


ORDER = 2  # the order this fastfeed makes: each window shuffled by a stream of its own
LEGACY = 1  # fastfeed's first order: one stream through every window in turn (positions saved by it resume in it)
ORDERS = (LEGACY, ORDER)
_KEEP_WINDOWS = 2  # windows whose samples a process keeps: the one read and the one a batch may cross into


class Epoch:
    """One epoch's order, made as it is read: O(shards) when made, O(window) per window reached.

    The shards are permuted (``shards``), taken in windows of ``window`` consecutive shards, and window w's samples
    are read at positions ``[window_start[w], window_start[w + 1])``, shuffled by a stream of their own derived
    from (seed, epoch, w). So the sample at any position is found by locating its window through the windows'
    cumulative sizes and permuting that window alone: nothing is ever O(samples), which at a billion samples
    would be 8 GB in every worker of every rank.

    ``version=LEGACY`` is fastfeed's first order, in which one stream shuffled the windows in turn: window w's
    permutation depends on every window before it, so the whole epoch is made at once (O(samples)). Positions
    saved by that fastfeed resume in it; nothing else uses it.
    """

    def __init__(self, counts: np.ndarray, starts: np.ndarray, *, seed: int, epoch: int, shuffle: bool,
                 window: int, version: int = ORDER) -> None:  # fmt: skip
        if version not in ORDERS:
            raise ValueError(f"unknown shard order version {version!r}: this fastfeed makes {ORDERS}")
        n_shards = len(counts)
        self.seed, self.epoch, self.shuffle, self.window, self.version = seed, epoch, shuffle, window, version
        self._counts, self._starts = counts, starts  # the index's, not copies
        shards = _rng(seed, epoch, 0).permutation(n_shards) if shuffle else np.arange(n_shards, dtype=np.int64)
        self.shards = shards.astype(np.int64, copy=False)
        sizes = np.add.reduceat(counts[shards], np.arange(0, n_shards, window)) if n_shards else np.zeros(0, np.int64)
        self.window_start = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=self.window_start[1:])
        self.shard_window = np.empty(n_shards, np.int64)  # the window of each shard, by shard id
        self.shard_window[shards] = np.arange(n_shards) // window
        self._windows: OrderedDict[int, np.ndarray] = OrderedDict()
        self._legacy: np.ndarray | None = None
        # Positions [lo, hi) of the window last read and its ids, so that sample() is one comparison there. One
        # tuple, replaced whole: thread workers share this Epoch, and a reader must never pair one window's bounds
        # with another's ids.
        self._last: tuple[int, int, np.ndarray] = (0, 0, np.zeros(0, np.int64))
        self._lock = threading.Lock()  # the windows kept, which threads reach and evict together

    @property
    def n_samples(self) -> int:
        return int(self.window_start[-1])

    @property
    def n_windows(self) -> int:
        return len(self.window_start) - 1

    def sample(self, position: int) -> int:
        """The global sample id at ``position`` (0 <= position < n_samples)."""
        lo, hi, ids = self._last
        if not lo <= position < hi:
            w = self.window_of(position)
            if not 0 <= position < self.n_samples:
                raise IndexError(f"position {position} out of range: the epoch has {self.n_samples} samples")
            lo, hi, ids = int(self.window_start[w]), int(self.window_start[w + 1]), self.window_samples(w)
            self._last = (lo, hi, ids)
        return int(ids[position - lo])

    def window_samples(self, w: int) -> np.ndarray:
        """The sample ids of window w, in the order they are read."""
        if self.version == LEGACY:
            return self.samples[self.window_start[w]:self.window_start[w + 1]]
        with self._lock:
            found = self._windows.get(w)
            if found is None:
                found = self._windows[w] = self._make_window(w)
                while len(self._windows) > _KEEP_WINDOWS:
                    self._windows.popitem(last=False)
            else:
                self._windows.move_to_end(w)
            return found

    @property
    def samples(self) -> np.ndarray:
        """Every position's sample id: O(samples), for small sets and for the legacy order (which needs it)."""
        if self.version == LEGACY:
            with self._lock:
                if self._legacy is None:
                    self._legacy = self._make_legacy()
                return self._legacy
        if not self.n_windows:
            return np.zeros(0, np.int64)
        return np.concatenate([self._make_window(w) for w in range(self.n_windows)])

    def span(self, shard: int) -> tuple[int, int]:
        """Positions [first, end) over which ``shard`` is read this epoch."""
        w = int(self.shard_window[shard])
        return int(self.window_start[w]), int(self.window_start[w + 1])

    def window_of(self, position: int) -> int:
        return int(np.searchsorted(self.window_start, position, side="right")) - 1

    def _in_order(self, shards: np.ndarray) -> np.ndarray:
        """The sample ids of ``shards`` in that order, each shard's in its own order."""
        counts = self._counts[shards]
        if not len(counts):
            return np.zeros(0, np.int64)
        # position i of the run belongs to shard j = repeat(...)[i]: its id is starts[j] + (i - first[j]).
        first = np.zeros(len(counts), np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        return np.repeat(self._starts[shards] - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)

    def _make_window(self, w: int) -> np.ndarray:
        ids = self._in_order(self.shards[w * self.window:(w + 1) * self.window])
        return _rng(self.seed, self.epoch, 2, w).permutation(ids) if self.shuffle else ids

    def _make_legacy(self) -> np.ndarray:
        ids = self._in_order(self.shards)
        if self.shuffle:
            rng = _rng(self.seed, self.epoch, 1)
            for w in range(self.n_windows):
                a, b = self.window_start[w], self.window_start[w + 1]
                ids[a:b] = rng.permutation(ids[a:b])
        return ids


def _rng(seed: int, epoch: int, *stream: int) -> np.random.Generator:
    # PCG64 from SeedSequence: the same stream on every machine and numpy version that keeps PCG64's stream.
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & (2**63 - 1), epoch, *stream])))


def epoch_order(counts: np.ndarray, starts: np.ndarray, *, seed: int, epoch: int, shuffle: bool, window: int,
                version: int = ORDER) -> Epoch:  # fmt: skip
    """The order of ``epoch`` over shards with ``counts[k]`` samples, shard k's first sample id ``starts[k]``."""
    return Epoch(counts, starts, seed=seed, epoch=epoch, shuffle=shuffle, window=window, version=version)


@dataclass(frozen=True)
class Split:
    """How an epoch's positions are dealt out: global batches of ``batch_size * world`` positions; rank ``rank``
    takes slice ``rank`` of each, ``batches`` of them.

    The last global batch is rarely full. ``drop_last`` drops it on every rank. ``pad`` fills it with the epoch's
    first samples (positions past the last sample wrap, as DistributedSampler pads), so every rank has exactly
    ``batches`` full batches: what ranks that meet at a collective each step need. Otherwise each sample comes once
    and the last positions go to the ranks in order: the rank holding the epoch's end gets a short last batch, and
    ranks after it one batch fewer (on one rank: a short last batch, as torch's loader gives)."""

    batch_size: int
    rank: int
    world: int
    batches: int
    n_samples: int = 0
    pad: bool = True

    @classmethod
    def of(cls, n_samples: int, batch_size: int, rank: int, world: int, drop_last: bool,
           pad: bool = True) -> Split:  # fmt: skip
        per_global = batch_size * world
        if drop_last:
            batches = n_samples // per_global
        elif pad:
            batches = math.ceil(n_samples / per_global)
        else:  # the global batches in which this rank's slice starts before the epoch's end
            batches = max(0, math.ceil((n_samples - rank * batch_size) / per_global))
        return cls(batch_size, rank, world, batches, n_samples, pad or drop_last)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world

    def positions(self, batch: int) -> range:
        """The epoch positions of this rank's batch ``batch`` (its samples are ``samples[p % n_samples]``)."""
        first = batch * self.global_batch + self.rank * self.batch_size
        end = first + self.batch_size
        return range(first, end if self.pad else min(end, self.n_samples))

    @property
    def samples(self) -> int:
        """The samples this rank yields this epoch (the last batch may be short when not padded)."""
        if not self.batches:
            return 0
        return (self.batches - 1) * self.batch_size + len(self.positions(self.batches - 1))

    @property
    def positions_per_epoch(self) -> int:
        """Positions an epoch spans, the same on every rank: where the next epoch's positions start."""
        if self.pad:
            return self.batches * self.global_batch
        return math.ceil(self.n_samples / self.global_batch) * self.global_batch
