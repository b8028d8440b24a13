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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Epoch:
    """One epoch's order. ``samples[p]``: the global sample id at position p (0 <= p < n_samples); the shards of
    window w are ``shards[w*window:(w+1)*window]``, read at positions ``[window_start[w], window_start[w+1])``."""

    samples: np.ndarray  # int64, a permutation of the sample ids
    shards: np.ndarray  # int64, the shards in this epoch's order
    window_start: np.ndarray  # int64, n_windows + 1 positions
    shard_window: np.ndarray  # int64, the window of each shard (by shard id)

    def span(self, shard: int) -> tuple[int, int]:
        """Positions [first, end) over which ``shard`` is read this epoch."""
        w = int(self.shard_window[shard])
        return int(self.window_start[w]), int(self.window_start[w + 1])

    def window_of(self, position: int) -> int:
        return int(np.searchsorted(self.window_start, position, side="right")) - 1


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    # PCG64 from SeedSequence: the same stream on every machine and numpy version that keeps PCG64's stream.
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & (2**63 - 1), epoch, stream])))


def epoch_order(counts: np.ndarray, starts: np.ndarray, *, seed: int, epoch: int, shuffle: bool,
                window: int) -> Epoch:  # fmt: skip
    """The order of ``epoch`` over shards with ``counts[k]`` samples, shard k's first sample id ``starts[k]``."""
    n_shards = len(counts)
    shards = _rng(seed, epoch, 0).permutation(n_shards) if shuffle else np.arange(n_shards, dtype=np.int64)
    n_windows = math.ceil(n_shards / window) if n_shards else 0
    sizes = np.add.reduceat(counts[shards], np.arange(0, n_shards, window)) if n_shards else np.zeros(0, np.int64)
    window_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    shard_window = np.empty(n_shards, np.int64)
    shard_window[shards] = np.arange(n_shards) // window
    # The sample ids of the shards in order, then shuffled within each window.
    ids = np.concatenate([np.arange(starts[k], starts[k] + counts[k], dtype=np.int64) for k in shards]) \
        if n_shards else np.zeros(0, np.int64)  # fmt: skip
    if shuffle:
        rng = _rng(seed, epoch, 1)
        for w in range(n_windows):
            a, b = window_start[w], window_start[w + 1]
            ids[a:b] = rng.permutation(ids[a:b])
    return Epoch(ids, shards.astype(np.int64), window_start, shard_window)


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
