"""The orders of map-style loaders are random through a resume, not only complete: a resumed run draws the same new
order each epoch as an unbroken one (epochs differ, and the resume repeats no epoch's order), the same seed gives
the same order with any number of workers, seeds give different orders, and where each sample lands over many
fixed seeds is close to uniform. ``in_order=False`` re-delivers the batches not received as the epoch made them.

fastfeed makes no permutation of its own here (the sampler draws it from torch's RNGs); what it owns is the
resume, which puts the RNGs back and replays the sampler (``fastfeed/_state.py``, ``_single.py``,
``_iterator.py``). A resume that put back the wrong RNG state would still deliver every sample once, so the
structural resume tests would pass while a run repeated an epoch's order or drew a fixed one: these tests compare
orders. Loaders here run in this process (num_workers=0 or thread workers): no process is launched.

Statistics are computed over fixed seeds, so they are deterministic; thresholds sit far above what the correct
code gives (noted beside them).
"""

from __future__ import annotations

import itertools
import json
import threading

import numpy as np
import pytest
import torch

from fastfeed import DataLoader

N = 12  # samples; batches of 3


def epochs(loader, n: int) -> list[list[int]]:
    return [[int(x) for b in loader for x in b] for _ in range(n)]


def chi_square(orders) -> float:
    """Pearson's statistic of the (sample, position) table over ``orders`` (each a permutation of range(n)) against
    every sample landing at every position equally often: about (n-1)^2 when uniform."""
    orders = np.asarray(orders)
    m, n = orders.shape
    table = np.zeros((n, n))
    for o in orders:
        table[o, np.arange(n)] += 1
    return float(((table - m / n) ** 2 / (m / n)).sum())


def unbroken(seed: int) -> list[list[int]]:
    torch.manual_seed(seed)
    return epochs(DataLoader(range(N), batch_size=3, shuffle=True), 3)


def broken(seed: int, at: int) -> list[list[int]]:
    """Three epochs, with a state taken ``at`` batches into epoch 1 and loaded, through JSON, into a new loader
    built after the process's RNG moved on (as a restarted job's would be)."""
    torch.manual_seed(seed)
    dl = DataLoader(range(N), batch_size=3, shuffle=True)
    first = epochs(dl, 1)
    before = []
    for b in dl:
        before += [int(x) for x in b]
        if len(before) == 3 * at:
            break
    state = json.loads(json.dumps(dl.state_dict()))
    torch.manual_seed(10_000 + seed)  # a fresh process's RNG is anything: the state must say what it was
    again = DataLoader(range(N), batch_size=3, shuffle=True)
    again.load_state_dict(state)
    return first + [before + epochs(again, 1)[0]] + epochs(again, 1)


SEEDS = range(40)


def test_a_resumed_run_draws_the_unbroken_runs_new_order_each_epoch():
    """Over 40 fixed seeds, a run resumed mid-epoch 1 yields the unbroken run's three epochs; its epochs differ from
    each other (the resume neither repeats the resumed epoch's order in the next one nor restarts epoch 0's), and
    where each sample lands, over the 120 epochs, is close to uniform. Guards against a resume that restores the
    sampler's RNG state from the epoch's start and leaves it there, or that draws the next epoch from the freshly
    seeded process RNG (both keep every sample once)."""
    orders = []
    for seed in SEEDS:
        got = broken(seed, at=1 + seed % 3)
        assert got == unbroken(seed), seed
        assert len({tuple(e) for e in got}) == 3, seed
        orders += got
    assert len({tuple(o) for o in orders}) > 110  # 120 draws of 12! orders
    assert chi_square(orders) < 300  # these seeds: ~130 (df 121); one repeated order: 120 * 12 * 11 = 15840


def test_seeds_give_different_orders_and_the_same_seed_the_same_with_any_worker_count():
    """A generator's seed fixes the order whatever num_workers (none, or 2 thread workers, in order or not: the
    sampler runs in the loop's process) and torch's own loader; another seed gives another order."""
    def order(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return [sorted(int(x) for x in b) for b in DataLoader(range(N), batch_size=3, shuffle=True, generator=g, **kw)]

    def torch_order(seed):
        g = torch.Generator().manual_seed(seed)
        return [sorted(int(x) for x in b)
                for b in torch.utils.data.DataLoader(range(N), batch_size=3, shuffle=True, generator=g)]  # fmt: skip

    per_seed = []
    for seed in (1, 2, 3):
        reference = order(seed)
        assert reference == torch_order(seed)
        assert order(seed, num_workers=2, worker_type="thread") == reference
        unordered = order(seed, num_workers=2, worker_type="thread", in_order=False)
        assert sorted(unordered) == sorted(reference)  # the same batches, delivered as workers finish them
        per_seed.append(reference)
    assert all(a != b for a, b in itertools.combinations(per_seed, 2))


class Held(torch.utils.data.Dataset):
    """Item i is i; item ``held`` waits for ``release`` (in a thread worker), so that the batches after its batch are
    delivered before it, whatever the machine's load: the out-of-order delivery the re-delivery is about."""

    def __init__(self, n: int, held: int | None = None):
        self.n, self.held = n, held
        self.release = threading.Event()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.held:
            assert self.release.wait(60), "never released"
        return i


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_order_false_re_delivers_the_epochs_own_batches_not_received(seed):
    """``in_order=False`` with thread workers, the epoch's first batch held back: the two batches received are
    later ones (the state names them as received ahead). A new loader then delivers the batches of the same
    shuffled epoch not received, each once and whole (not those received ahead again, not a re-shuffle of the
    rest), then the next epoch of the unbroken run (a new order, not the resumed epoch's again)."""
    def loader(dataset):
        return DataLoader(dataset, batch_size=3, shuffle=True, num_workers=2, worker_type="thread", in_order=False)

    def batches(dl):
        return [sorted(int(x) for x in b) for b in dl]

    free = Held(N)
    free.release.set()
    torch.manual_seed(seed)
    plain = loader(free)
    reference = [batches(plain) for _ in range(2)]  # the same batches in-order delivery makes, in any order
    torch.manual_seed(seed)
    held = Held(N, reference[0][0][0])
    dl = loader(held)
    it = iter(dl)
    try:
        got = [sorted(int(x) for x in next(it)) for _ in range(2)]
        state = json.loads(json.dumps(dl.state_dict()))
    finally:
        held.release.set()
    del it
    assert reference[0][0] not in got and state["received_ahead"], state  # delivered out of order
    torch.manual_seed(20_000 + seed)
    again = loader(free)
    again.load_state_dict(state)
    rest = batches(again)
    assert sorted(got + rest) == sorted(reference[0])
    following = batches(again)
    assert sorted(following) == sorted(reference[1]) and sorted(following) != sorted(reference[0])
