"""Resume with ``in_order=False``: a state taken at any point, through JSON, makes a fresh loader built with the same
arguments yield every sample of the epoch not yet delivered exactly once (in any order), then later epochs in full.

With ``in_order=False`` batches arrive in the order workers finish them, so the batches received at a save are not
the epoch's first ones: a position counted in batches repeats some samples and loses others. Every dataset here has
slow samples so that workers do finish out of order, and the tests check that they did (else they would pass
without ever losing the race they are about).

For comparison, torchdata 0.11's StatefulDataLoader(in_order=False) over ``SlowIndex(60, every=3)`` at batch 3 with
3 workers, state after 6 batches, resumed in a fresh loader (measured on 2 cores, 20 runs): it repeated samples in
16 runs (3 to 9 of them) and lost 3 in 2 runs. (Over Shards, whose per-worker state it saves, it was exact in 5 of
5 runs of the one-rank scenario below.) Hence no torchdata reference in the assertions.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import _out_of_order as O
import _shards
from fastfeed import DataLoader

pytestmark = pytest.mark.fastfeed_only

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
IN_ORDER = False  # the loaders under test (True runs the same checks on in-order delivery)

# 6 generated examples besides the explicit ones (derandomize: the same every run). Of the 40 generated once, most
# were shrink-like variants of a dozen draws (the same workers, prefetch and batch size with a smaller n or save
# point), and 15 drew nothing that 6 do not: each example starts some ten worker processes, so fewer draws is most
# of the time this module takes. The explicit examples pin the corners a draw may miss (out-of-order workers, a
# state after the last batch and after the epoch's end); with them the 6 draws still take every value of nw, pf,
# bs, shuffle and mode, and save points 0 and 100 (fewer draws lose one: 5 leave out mode "end" and bs 3).
PROPERTY = settings(
    max_examples=6, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip


# -- helpers ---------------------------------------------------------------------------------------------------


def saved(loader) -> dict:
    """``loader.state_dict()``, through JSON (it must survive it)."""
    return json.loads(json.dumps(loader.state_dict()))


def take(loader, k: int, mode: str):
    """One epoch of ``loader``, with a state taken after ``k`` batches received.

    ``mode``: ``"inside"``: the state is taken inside the loop (after batch k, before asking for the next) and the
    epoch goes on to its end; ``"break"``: taken after batch k, then the loop stops (the loader keeps its
    iterator); ``"end"``: taken after the epoch ended (``k`` is moot). Returns ``(batches received, batches received
    before the state, state, whether the state was taken after the epoch's end)``; an epoch shorter than ``k``
    batches gives its end's state.
    """
    batches, before, state = [], None, None
    it = iter(loader)
    while True:
        if mode != "end" and state is None and len(batches) == k:
            state, before = saved(loader), list(batches)
            if mode == "break":
                break
        try:
            batch = next(it)
        except StopIteration:
            break
        batches.append(O.ids(batch))
    del it
    ended = state is None
    if ended:
        state, before = saved(loader), list(batches)
    return batches, before, state, ended


def epoch(loader) -> list[int]:
    return [i for batch in loader for i in O.ids(batch)]


def assert_once(got, expected, what: str) -> None:
    """``got`` holds each sample of ``expected`` exactly once (any order)."""
    counts = collections.Counter(got)
    repeated = sorted(x for x, c in counts.items() if c > 1)
    lost = sorted(set(expected) - set(counts))
    foreign = sorted(set(counts) - set(expected))
    assert not (repeated or lost or foreign), (
        f"{what}: {len(got)} samples for {len(set(expected))}; repeated {len(repeated)} {repeated[:20]}, "
        f"lost {len(lost)} {lost[:20]}, not of this epoch {foreign[:20]}"
    )


# -- 1. the property: map-style and iterable datasets, any workers, batch size and save point -------------------


def loader_for(kind, n, every, nw, pf, bs, shuffle, in_order=IN_ORDER):
    if kind == "map":
        return DataLoader(O.SlowIndex(n, every), batch_size=bs, shuffle=shuffle, num_workers=nw, prefetch_factor=pf,
                          in_order=in_order)  # fmt: skip
    return DataLoader(O.SlowSharded(n, every, shuffle=shuffle), batch_size=bs, num_workers=nw, prefetch_factor=pf,
                      in_order=in_order)  # fmt: skip


def in_order_sequence(kind, n, nw, bs, shuffle):
    """What an in-order loader delivers, as the key ``delivery_keys`` gives each batch (None: not known ahead)."""
    if kind == "map":
        return None if shuffle else [list(range(s, min(s + bs, n))) for s in range(0, n, bs)]
    per_worker = [-(-len(range(w, n, nw)) // bs) for w in range(nw)]
    return [w for r in range(max(per_worker)) for w in range(nw) if r < per_worker[w]]  # round robin


def delivery_keys(kind, batches, nw):
    """Map-style: the batches themselves; iterable: the worker that made each batch (its ids are w mod nw)."""
    return batches if kind == "map" else [b[0] % nw for b in batches]


def total_batches(kind, n, nw, bs):
    if kind == "map":
        return -(-n // bs)
    return sum(-(-len(range(w, n, nw)) // bs) for w in range(nw))


def check_resume(kind, n, every, nw, pf, bs, shuffle, mode, pk, pk2, seen) -> None:
    """Save after k batches (``mode``), resume in a fresh loader, save again after k2 batches of the resumed epoch,
    resume again: each resumed epoch delivers exactly what was not yet delivered, the next epoch everything."""
    make = lambda: loader_for(kind, n, every, nw, pf, bs, shuffle)  # noqa: E731
    everything = range(n)
    total = total_batches(kind, n, nw, bs)
    k = total * pk // 100
    a = make()
    got_a, before, state1, ended = take(a, k, mode)
    del a
    if mode == "inside":
        assert_once(O.flat(got_a), everything, f"the saving loader's own epoch (state taken after batch {k} inside it)")
    # Did the workers finish out of order (delivery), and were the batches before the save not the first k (race)?
    expected = in_order_sequence(kind, n, nw, bs, shuffle)
    if expected is not None:
        keys = delivery_keys(kind, got_a, nw)
        if keys != expected[: len(keys)]:
            seen["out of order"] += 1
            event("out-of-order delivery")
        first = delivery_keys(kind, before, nw)
        if collections.Counter(map(str, first)) != collections.Counter(map(str, expected[: len(first)])):
            seen["lost race"] += 1
            event("batches before the save were not the first k")
    b = make()
    b.load_state_dict(state1)
    if ended:  # a state between epochs: the next iter() is a whole epoch
        assert_once(epoch(b), everything, "the epoch after a state taken at the epoch's end")
        return
    rest_b = total - k
    k2 = rest_b * pk2 // 100
    got_b, before_b, state2, b_ended = take(b, k2, "inside")
    assert_once(O.flat(before) + O.flat(got_b), everything,
                f"{len(before)} batches before the save ({mode} at k={k}) + the resumed epoch")  # fmt: skip
    assert_once(epoch(b), everything, "the epoch after the resumed one")
    del b
    c = make()
    c.load_state_dict(state2)
    if not b_ended:
        assert_once(O.flat(before) + O.flat(before_b) + epoch(c), everything,
                    f"{len(before)} batches before the first save + {len(before_b)} before the second (k2={k2}) + "
                    "the twice-resumed epoch")  # fmt: skip
    assert_once(epoch(c), everything, "the epoch after the twice-resumed one")
    del c


def strategies():
    return dict(
        nw=st.sampled_from([1, 2, 3]), pf=st.sampled_from([1, 2]), bs=st.sampled_from([1, 3, 4]),
        n=st.integers(10, 60), every=st.integers(2, 7), shuffle=st.booleans(),
        mode=st.sampled_from(["inside", "break", "end"]), pk=st.integers(0, 100), pk2=st.integers(0, 100),
    )  # fmt: skip


def run_property(kind) -> collections.Counter:
    seen = collections.Counter()

    @PROPERTY
    @given(**strategies())
    # The first two: workers that surely finish out of order (batch 0 holds item 0, which sleeps; the next ones
    # do not). The third: a state after the last batch, then a break. The fourth: a state after the epoch's end.
    # The fifth: 2 workers, prefetch 1, batch 1, shuffled, both saves inside the loop.
    @example(nw=3, pf=2, bs=1, n=40, every=7, shuffle=False, mode="inside", pk=25, pk2=50)
    @example(nw=2, pf=2, bs=3, n=60, every=7, shuffle=False, mode="break", pk=30, pk2=40)
    @example(nw=3, pf=1, bs=4, n=60, every=5, shuffle=True, mode="break", pk=100, pk2=0)
    @example(nw=3, pf=2, bs=3, n=12, every=3, shuffle=False, mode="end", pk=85, pk2=98)
    @example(nw=2, pf=1, bs=1, n=36, every=6, shuffle=True, mode="inside", pk=35, pk2=39)
    def prop(nw, pf, bs, n, every, shuffle, mode, pk, pk2):
        try:
            check_resume(kind, n, every, nw, pf, bs, shuffle, mode, pk, pk2, seen)
        finally:
            gc.collect()  # a failed example's loaders (and their workers) go now

    prop()
    return seen


@pytest.mark.hang_limit(280)  # a failing property shrinks for a while: keep its falsifying example
def test_map_style_resume_delivers_every_remaining_sample_once():
    """Map-style dataset (item i is i), any workers / prefetch / batch size / shuffle / save point (inside the loop,
    after a break, after the epoch), twice resumed: each sample of the epoch exactly once, then whole epochs."""
    seen = run_property("map")
    assert seen["out of order"] > 0, f"no example's workers finished out of order: the property proved nothing {seen}"


@pytest.mark.hang_limit(280)  # a failing property shrinks for a while: keep its falsifying example
def test_iterable_sharded_by_worker_resume_delivers_every_remaining_sample_once():
    """IterableDataset sharded by get_worker_info() (distinct ids), the same property."""
    seen = run_property("iterable")
    assert seen["out of order"] > 0, f"no example's workers finished out of order: the property proved nothing {seen}"


# -- 4. samples all slow at random: the race is lost, and the resume is still exact --------------------------------


def test_random_slowness_delivers_out_of_order_and_the_resume_is_still_exact():
    """RandomSlow (every item sleeps 0-10 ms at random, item 0 0.5 s more), 3 workers: delivery is out of order and
    the 8 batches before the save are not the epoch's first 8; the resumed loader still delivers the other samples
    once."""
    n, bs, k = 48, 2, 8
    out_of_order = lost_race = 0
    for attempt in range(5):
        ds = O.RandomSlow(n, 0.01, seed=attempt, first_delay=0.5)
        make = lambda: DataLoader(ds, batch_size=bs, num_workers=3, prefetch_factor=2, in_order=IN_ORDER)  # noqa: E731
        a = make()
        got, before, state, ended = take(a, k, "inside")
        del a
        assert not ended
        assert_once(O.flat(got), range(n), "the saving loader's own epoch")
        out_of_order += O.flat(got) != list(range(n))
        lost_race += sorted(O.flat(before)) != list(range(k * bs))
        b = make()
        b.load_state_dict(state)
        assert_once(O.flat(before) + epoch(b), range(n), f"attempt {attempt}: before the save + the resumed epoch")
        assert_once(epoch(b), range(n), f"attempt {attempt}: the epoch after the resumed one")
        del b
        if out_of_order and lost_race:
            break
    assert out_of_order, "workers never finished out of order: the test cannot lose the race it is about"
    assert lost_race, "the batches before the save were always the epoch's first ones: no race was lost"


# -- 2. fastfeed.io.Shards, one rank (and ranks simulated in one process) -------------------------------------

COUNTS = (130, 70, 110, 90, 150, 50, 120, 80, 100, 100, 140, 60)  # 1,200 samples in 12 unequal shards
N_SHARDS = sum(COUNTS)


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ooo-shards")
    _shards.make(directory, COUNTS)
    return str(directory)


def share(directory, epoch_number, rank=None, world=None) -> list[int]:
    """A rank's samples of an epoch, read in order in this process (num_workers=0: the reference)."""
    ds = O.shards(directory, decode=_shards.as_tensor, rank=rank, world_size=world)
    ds.set_epoch(epoch_number)
    return epoch(DataLoader(ds, batch_size=O.BATCH))


@pytest.mark.parametrize("resume_workers", [2, 3, 0])
@pytest.mark.parametrize("mode", ["inside", "break"])
def test_shards_one_rank_resumes_every_remaining_sample_once(big_shards, mode, resume_workers):
    """The bug report's scenario: 1,200 samples, batch 10, 2 workers, a slow sample every 5, state after 30 batches
    (inside the loop, or after a break): the resumed loader (2 workers, or 3, or none: Shards' position is the
    rank's) yields every remaining sample once, then the next epoch whole."""
    ds = O.shards(big_shards)
    dl = DataLoader(ds, batch_size=O.BATCH, num_workers=O.WORKERS, in_order=IN_ORDER)
    got, before, state, ended = take(dl, 30, mode)
    del dl, ds
    assert not ended and len(before) == 30
    everything = range(N_SHARDS)
    if mode == "inside":
        assert_once(O.flat(got), everything, "the saving loader's own epoch")
    first = share(big_shards, 0)[: 30 * O.BATCH]
    raced = sorted(O.flat(before)) != sorted(first)  # said in the failure message: was the race lost?
    ds2 = O.shards(big_shards)
    dl2 = DataLoader(ds2, batch_size=O.BATCH, num_workers=resume_workers, in_order=IN_ORDER)
    dl2.load_state_dict(state)
    assert_once(O.flat(before) + epoch(dl2), everything,
                f"30 batches before the save ({mode}; not the first 30: {raced}) + the resumed epoch with "
                f"num_workers={resume_workers}")  # fmt: skip
    ds2.set_epoch(ds2.epoch + 1)
    assert_once(epoch(dl2), everything, "the epoch after the resumed one")


def rank_loader(directory, rank):
    """A loader over ``rank`` of 2 ranks simulated in this process (Shards' rank=, world_size=)."""
    return DataLoader(O.shards(directory, rank=rank, world_size=2), batch_size=O.BATCH, num_workers=O.WORKERS,
                      in_order=IN_ORDER)  # fmt: skip


def test_shards_a_simulated_rank_resumes_its_own_state(big_shards):
    """Rank 0 of 2 simulated in one process: its in_order=False state after 12 batches resumes rank 0's share of
    the epoch exactly (each sample once)."""
    _, before, state, _ = take(rank_loader(big_shards, 0), 12, "break")
    own = rank_loader(big_shards, 0)
    own.load_state_dict(state)
    assert_once(O.flat(before) + epoch(own), share(big_shards, 0, 0, 2), "rank 0: before the save + resumed")


def test_shards_a_simulated_rank_refuses_another_ranks_state(big_shards):
    """Rank 1 of 2 (simulated in one process) loading rank 0's in_order=False state raises a ValueError naming the
    rank (out-of-order positions are per rank), at load_state_dict() or at the latest at the first batch."""
    _, _, state, _ = take(rank_loader(big_shards, 0), 12, "break")
    other = rank_loader(big_shards, 1)
    with pytest.raises(ValueError, match=r"(?i)\brank"):
        other.load_state_dict(state)
        epoch(other)


# -- 3. Shards on 2 ranks under torchrun (gloo, CPU) ---------------------------------------------------------------


def torchrun(world: int, *args, timeout: float = 120):
    """Run tests/_out_of_order.py's job on ``world`` CPU ranks (torchrun --standalone picks a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           os.path.join(TESTS_DIR, "_out_of_order.py"), *map(str, args)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(TESTS_DIR), os.environ.get("PYTHONPATH")])))  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def ranks_said(stderr: str) -> str:
    """What the ranks printed of their tracebacks (torchrun's own report of the failure is left out)."""
    lines = [line for line in stderr.splitlines() if line.startswith("[rank")]
    return "\n".join(lines[-40:]) if lines else stderr[-4000:]


def reports(out, kind: str, world: int) -> list[dict] | None:
    """Each rank's ``OUT.<kind>.<rank>.json``, or None where one is missing."""
    found = []
    for rank in range(world):
        try:
            with open(f"{out}.{kind}.{rank}.json") as f:
                found.append(json.load(f))
        except FileNotFoundError:
            return None
    return found


@pytest.fixture(scope="module")
def two_ranks(big_shards, tmp_path_factory):
    """Launch 1: each rank saves its in_order=False state after 25 of its 60 batches. Launch 2: each rank tries the
    other's state, then resumes its own. What failed is returned, for the tests to say."""
    out = tmp_path_factory.mktemp("ooo-ranks") / "run"
    done = torchrun(2, "save", big_shards, out, "--stop-after", 25)
    if done.returncode:
        failed = f"the saving launch failed:\n{ranks_said(done.stderr)}"
        return {"save": None, "swap": None, "resume": None, "failed": failed}
    again = torchrun(2, "resume", big_shards, out)
    failed = f"the resuming launch failed:\n{ranks_said(again.stderr)}" if again.returncode else None
    return {"save": reports(out, "save", 2), "swap": reports(out, "swap", 2), "resume": reports(out, "resume", 2),
            "failed": failed}  # fmt: skip


@pytest.mark.hang_limit(250)
def test_torchrun_each_rank_resumes_its_own_out_of_order_state(big_shards, two_ranks):
    """2 gloo ranks, slow samples, in_order=False, a state per rank after 25 batches (as JSON): per rank, the batches
    before + the resumed epoch are that rank's share of the epoch, each sample once, in as many steps on every rank;
    the next epoch is the rank's whole share."""
    assert two_ranks["resume"] is not None and not two_ranks["failed"], two_ranks["failed"]
    rests = []
    for saved_r, resumed in zip(two_ranks["save"], two_ranks["resume"]):
        rank, e = saved_r["rank"], saved_r["epoch"]
        assert resumed["epoch"] == e and len(saved_r["before"]) == 25
        assert_once(O.flat(saved_r["before"]) + O.flat(resumed["rest"]), share(big_shards, e, rank, 2),
                    f"rank {rank}: 25 batches before the save + the resumed epoch")  # fmt: skip
        assert_once(O.flat(resumed["next"]), share(big_shards, e + 1, rank, 2), f"rank {rank}: the next epoch")
        rests.append(len(resumed["rest"]))
    assert len(set(rests)) == 1, f"ranks resumed with different numbers of batches {rests}: DDP would hang"


@pytest.mark.hang_limit(250)
def test_torchrun_a_rank_refuses_another_ranks_out_of_order_state(two_ranks):
    """Each rank loading the other rank's in_order=False Shards state gets a ValueError that names the rank, at
    load_state_dict() or at the latest at the first batch, not a silently wrong epoch."""
    assert two_ranks["swap"] is not None, two_ranks["failed"]
    for resumed in two_ranks["swap"]:
        swap = resumed["swap"]
        assert swap["type"] == "ValueError", (
            f"rank {resumed['rank']} loaded rank {swap['from']}'s state: got {swap['type']} {swap['error']!r} at "
            f"{swap['where']}, having yielded {swap['yielded']} samples\n{swap.get('trace', '')}"
        )
        assert "rank" in swap["error"].lower(), f"the error does not say it is about ranks: {swap['error']!r}"
