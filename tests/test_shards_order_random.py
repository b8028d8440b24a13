"""The Shards order is random, not only well formed: epochs differ, windows are shuffled independently, seeds give
other orders, positions are close to uniform, and the same seed gives the same order on every rank and worker count.

``tests/test_shards_order.py`` checks the order's structure (every sample once, windows, spans, lookups in any
order). A shuffle can keep all of that and still be bad: every window shuffled by one stream, or one within-window
order every epoch, trains on correlated or repeated orders while every structural test stays green. These tests
look at the permutations themselves.

Each window's permutation is described by its *pattern*: the window's samples laid out shard after shard in the
epoch's shard order (what an unshuffled read of that window gives), and, for each position read, the slot in that
layout of the sample read there. Two windows of equal size shuffled independently share a slot at about one
position on average whatever their shards; windows shuffled by one stream share all of them.

The statistics are computed for fixed seeds, so they are deterministic: each threshold sits far above what the
correct order gives (noted beside it) and far below what the broken order it guards against gives.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import _shards
from fastfeed import DataLoader
from fastfeed.io import Shards
from fastfeed.io.shards import order


def index(counts):
    counts = np.asarray(counts, np.int64)
    starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    return counts, starts


def make(counts, starts, *, seed=7, epoch=0, window=3):
    return order.epoch_order(counts, starts, seed=seed, epoch=epoch, shuffle=True, window=window)


def pattern(e, counts, starts, w):
    """Window w's permutation (see the module): slot, in the window's shard-after-shard layout, of each sample read."""
    shards = e.shards[w * e.window:(w + 1) * e.window]
    laid = np.concatenate([np.arange(starts[k], starts[k] + counts[k]) for k in shards])
    by_id = np.argsort(laid)
    return by_id[np.searchsorted(laid[by_id], e.window_samples(w))]


def chi_square(permutations) -> float:
    """Pearson's statistic of the table (item, position) summed over ``permutations`` of one length n, against
    every item landing at every position equally often; about (n-1)^2 when they are uniform and independent, and
    M*n*(n-1) when all M of them are one permutation."""
    permutations = np.asarray(permutations)
    m, n = permutations.shape
    table = np.zeros((n, n))
    for p in permutations:
        table[p, np.arange(n)] += 1
    expected = m / n
    return float(((table - expected) ** 2 / expected).sum())


def coincidences(a, b) -> int:
    """Positions at which two permutations agree: about 1 for independent uniform ones, n for the same one."""
    return int((np.asarray(a) == np.asarray(b)).sum())


# Equal shards, so that every window has the same size and the same pattern means the same permutation.
EQUAL = index([6] * 60)  # 60 shards of 6 samples; window 2: 30 windows of 12 samples


def test_windows_are_not_all_shuffled_by_the_same_stream():
    """Guards against *every window shuffled by the same stream* (``_rng(seed, epoch, 2, 0)`` instead of
    ``_rng(seed, epoch, 2, w)`` in ``order.Epoch._make_window``): windows of equal size would then all be read in
    one pattern, so the shuffle would be correlated across the whole epoch.

    Over 4 epochs of 30 windows of 12: no two windows of an epoch share a pattern, two windows share about one
    slot (1.0 on average for independent ones), and the table of where each slot is read is close to uniform."""
    counts, starts = EQUAL
    patterns, shared, pairs = [], 0, 0
    for epoch in range(4):
        e = make(counts, starts, epoch=epoch, window=2)
        assert e.n_windows == 30
        mine = [pattern(e, counts, starts, w) for w in range(e.n_windows)]
        assert len({p.tobytes() for p in mine}) == len(mine)
        for a, b in itertools.combinations(mine, 2):
            shared, pairs = shared + coincidences(a, b), pairs + 1
        patterns += mine
    assert shared / pairs < 2.0  # these seeds: 0.98; one stream: 12
    assert chi_square(patterns) < 400  # these seeds: ~120 (df 121); one stream: 120 * 12 * 11 = 15840


def test_the_within_window_order_is_not_the_same_every_epoch():
    """Guards against *the same within-window order every epoch* (``_rng(seed, 0, 2, w)`` instead of
    ``_rng(seed, epoch, 2, w)`` in ``order.Epoch._make_window``): with one shard every epoch would be read in the
    same order, and with more, window w of every epoch in the same pattern.

    One shard of 20 samples over 200 epochs: every epoch's order differs and where each sample lands is close to
    uniform. 30 windows over 6 epochs: window w's patterns in two epochs share about one slot."""
    counts, starts = index([20])
    orders = np.array([make(counts, starts, epoch=epoch, window=1).samples for epoch in range(200)])
    assert len({o.tobytes() for o in orders}) == len(orders)
    assert chi_square(orders) < 800  # these seeds: ~350 (df 361); the same order: 200 * 20 * 19 = 76000

    counts, starts = EQUAL
    epochs = [make(counts, starts, epoch=epoch, window=2) for epoch in range(6)]
    shared = pairs = 0
    for w in range(30):
        for a, b in itertools.combinations(epochs, 2):
            shared += coincidences(pattern(a, counts, starts, w), pattern(b, counts, starts, w))
            pairs += 1
    assert shared / pairs < 2.0  # these seeds: ~1; the same order every epoch: 12


def test_seeds_give_different_orders_in_every_window():
    """Another seed is another shuffle of each window, not only another shard order: guards against the seed left
    out of the window's stream (``_rng(0, epoch, 2, w)``), which would read window w in one pattern for every
    seed. 12 seeds, 30 windows: window w's patterns under two seeds share about one slot."""
    counts, starts = EQUAL
    runs = [make(counts, starts, seed=seed, epoch=3, window=2) for seed in range(12)]
    assert len({r.samples.tobytes() for r in runs}) == len(runs)
    shared = pairs = 0
    for w in range(30):
        for a, b in itertools.combinations(runs, 2):
            shared += coincidences(pattern(a, counts, starts, w), pattern(b, counts, starts, w))
            pairs += 1
    assert shared / pairs < 2.0  # these seeds: ~1; the seed ignored: 12


def test_positions_are_close_to_uniform_over_seeds():
    """Where each sample lands, over 360 fixed seeds, is close to uniform over the epoch's 36 positions (equal shards
    and whole windows, where it is exactly uniform in distribution): the shard order and each window's shuffle
    together are unbiased. Chi-square of the (sample, position) table against 10 per cell."""
    counts, starts = index([3] * 12)  # 4 windows of 3 shards, 9 samples each
    orders = np.array([make(counts, starts, seed=seed, epoch=1, window=3).samples for seed in range(360)])
    positions = np.argsort(orders, axis=1)  # positions[s, i]: where sample i is read under seed s
    assert chi_square(positions) < 1900  # these seeds: ~1260 (df 1225, sd 49.5)


def test_samples_of_a_shard_are_spread_over_their_window_not_read_in_runs():
    """A shuffle that keeps every sample once and each sample's position uniform can still keep neighbours
    together (a rotation of the window does): guards against that. After sample i of a shard, sample i+1 is read
    next at about 1 in 12 positions of a 12-sample window (5/66 for windows of 2 shards of 6)."""
    counts, starts = EQUAL
    follows = total = 0
    for epoch in range(4):
        samples = make(counts, starts, epoch=epoch, window=2).samples
        follows += int((np.diff(samples) == 1).sum())
        total += len(samples) - 1
    assert follows / total < 0.2  # these seeds: ~0.08; a rotation: ~0.9


def test_the_shard_order_differs_between_epochs_and_is_close_to_uniform():
    """The shards are put in a new order each epoch (which shards share a window changes too), and over 300 epochs
    each shard's place in that order is close to uniform: guards against a shard order fixed across epochs or
    seeds, which would always mix the same shards together."""
    counts, starts = index([4] * 10)
    shard_orders = np.array([make(counts, starts, epoch=epoch, window=2).shards for epoch in range(300)])
    assert len({s.tobytes() for s in shard_orders}) > 290  # of 10! orders, 300 draws are all but never equal
    # these seeds: ~99 (df 81, sd 12.7); one order every epoch: 300 * 10 * 9 = 27000
    assert chi_square(np.argsort(shard_orders, axis=1)) < 200
    together = {frozenset(s[i:i + 2].tolist()) for s in shard_orders[:20] for i in range(0, 10, 2)}
    assert len(together) > 30  # pairs of shards that share a window in 20 epochs: 40 (of 45)


def test_the_same_seed_gives_the_same_order_on_every_rank_and_worker_count(tmp_path):
    """Every rank, whatever the world size, makes the same epoch order from the same seed (the rank never enters
    it), and the global sequence read with one rank and no workers is read again with 2 ranks of thread workers;
    another seed gives another order on every rank."""
    _shards.make(tmp_path, (5, 3, 6, 4, 7, 2))
    n = 27

    def ds(rank=0, world=1, seed=11):
        d = Shards(str(tmp_path), decode=_shards.as_tensor, shuffle=True, seed=seed, shuffle_window=2,
                   rank=rank, world_size=world)  # fmt: skip
        d.set_epoch(2)
        return d

    reference = ds()._order(2).samples
    for world in (2, 3):
        for rank in range(world):
            assert ds(rank, world)._order(2).samples.tolist() == reference.tolist()
            assert ds(rank, world, seed=12)._order(2).samples.tolist() != reference.tolist()
    alone = _shards.flat(DataLoader(ds(), batch_size=3))
    assert alone == reference.tolist() and sorted(alone) == list(range(n))
    per_rank = [[b.tolist() for b in DataLoader(ds(r, 2), batch_size=3, num_workers=2, worker_type="thread")]
                for r in range(2)]  # fmt: skip
    together = _shards.interleave(per_rank)
    assert together[:n] == alone and together[n:] == alone[:len(together) - n]


@pytest.mark.parametrize("seed", [0, 1, 2**40 + 3])
def test_a_shuffled_epoch_is_not_the_source_order_and_an_unshuffled_one_is(seed):
    """Sanity for the statistics above: a shuffled epoch differs from the unshuffled one, and shuffle=False gives
    the source's order whatever the seed (so the tests above measure the shuffle and nothing else)."""
    counts, starts = index([5, 3, 6, 4, 7, 2, 8])
    shuffled = make(counts, starts, seed=seed, epoch=0, window=3).samples
    plain = order.epoch_order(counts, starts, seed=seed, epoch=0, shuffle=False, window=3).samples
    assert plain.tolist() == list(range(int(counts.sum())))
    assert shuffled.tolist() != plain.tolist() and sorted(shuffled.tolist()) == plain.tolist()
