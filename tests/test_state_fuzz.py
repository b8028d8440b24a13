"""A loader state from a damaged or hostile checkpoint.

Each fuzzed example takes a real state, saved mid-epoch, and changes one thing in it as a truncated file, another
version or an attacker would: it drops a key, adds one (of another version, of torchdata's layout, or unknown),
puts in a value of another type, a count of 10**18, 2**64 or -1, a float, a string, a nested structure, a list
nested 150 deep, or truncates a list or a string. A fresh loader loads it, and either

- ``load_state_dict`` raises a ValueError whose message names a key on the changed path (or, for a plain
  IterableDataset, which is moved forward by reading it again, the first ``next()`` raises it once the data ends
  before the position the state claims), or
- the resumed loader yields exactly what an uninterrupted run yields: the rest of the epoch and the next one (with
  workers, the rest of the epoch).

It never ends in another exception (a MemoryError, an OverflowError, a bare KeyError, ...) or a hang.

Out of the fuzz's reach on purpose: what a state holds for a stateful sampler or dataset (their own
``state_dict()``, which only their ``load_state_dict`` can read: here it is only taken away), and a value that
is itself a well-formed other position (an epoch number of 10**18 is one; ``_free`` says which), which loads and
resumes there.
"""

from __future__ import annotations

import copy
import itertools
import random
import time

import pytest
import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _candidate
import _datasets as ds
import _shards
from _compare import seed_all
from _load import Within

pytestmark = pytest.mark.fastfeed_only

if not _candidate.AGAINST_TORCH:
    import fastfeed
    from fastfeed import _state_check
    from fastfeed.io import Shards

N, BS, SAVE_AT = 30, 4, 3  # 8 batches an epoch; the state is saved after batch 3 (the 4th) of epoch 0


class Noisy(tud.Dataset):
    """Map-style: item i is [i, a draw of torch's RNG, a draw of random's], so a resume must restore both."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([i, int(torch.randint(1000, (1,))), random.randrange(1000)])


class NoisyIterable(tud.IterableDataset):
    """A plain IterableDataset (no state of its own): worker w of n yields [i, draws] for i = w, w + n, ..."""

    def __iter__(self):
        info = tud.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, N, step):
            yield torch.tensor([i, int(torch.randint(1000, (1,))), random.randrange(1000)])


def _fork(nw):
    return dict(num_workers=nw, multiprocessing_context="fork") if nw else {}


CASES = {
    # name: (make a loader, the keys of what a sampler or dataset owns (only taken away), examples, epochs compared)
    "map": (lambda: fastfeed.DataLoader(Noisy(), batch_size=BS, shuffle=True,
                                        generator=torch.Generator().manual_seed(7)), (), 260, 2),
    "map/stateful-sampler": (lambda: fastfeed.DataLoader(ds.IndexMap(N), batch_size=BS,
                                                         sampler=ds.StatefulSampler(N)), ("sampler_state",), 100, 2),
    "iterable": (lambda: fastfeed.DataLoader(NoisyIterable(), batch_size=BS), (), 130, 2),
    "iterable/stateful": (lambda: fastfeed.DataLoader(ds.EpochIterable(N), batch_size=BS),
                          ("dataset", "dataset_iter"), 90, 2),
    "map/workers": (lambda: fastfeed.DataLoader(Noisy(), batch_size=BS, shuffle=True, **_fork(2)), (), 24, 1),
    "iterable/workers": (lambda: fastfeed.DataLoader(NoisyIterable(), batch_size=BS, **_fork(2)), (), 24, 1),
    "shards": (None, (), 120, 1),  # made by the shard_dir fixture
    "job": (None, (), 52, 2),  # "map"'s state as a job of one rank keys it
    "torchdata": (None, (), 200, 1),  # torchdata StatefulDataLoader's state (it saves no RNGs: this epoch only)
}


def _free(name, path, new) -> bool:
    """Whether a change makes a well-formed state of another position, which loads and resumes there."""
    if path[-2:] == ("shards", "epoch"):  # any count is an epoch: 10**18 resumes that epoch (its own order)
        return True
    if path[:1] != ("workers",) or new is not None:
        return False
    # An IterableDataset's worker state None: that worker's iterable ended and it exited. A map-style loader's
    # workers None: they were threads, which save no state (the workers' random streams start afresh).
    return len(path) == 2 if name.startswith("iterable") else len(path) == 1


HOSTILE = [None, -1, -3, 10**18, -(10**18), 2**64, 1e300, float("nan"), 0.5, "x", "", "0", True, [], {},
           {"nested": {"garbage": [1, [2, {"x": None}]]}}, [10**18] * 3, b"\x00" * 7]  # fmt: skip
FOREIGN_KEYS = ["bogus", "_num_yielded", "_snapshot", "_sampler_iter_yielded", "fastfeed_dali", "format", "ranks"]


def _deep(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _flat(batches) -> list:
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


def _epochs(loader, count: int, limit: int = 4 * N) -> list:
    """The batches of ``count`` epochs (at most ``limit`` each: a loader that went on forever fails, not hangs)."""
    return [_flat(itertools.islice(loader, limit)) for _ in range(count)]


# -- the real states, and what an uninterrupted run yields after them --------------------------------------------


def _saved(make, epochs: int, set_epoch=None):
    """(the state after batch SAVE_AT of epoch 0, the batches an uninterrupted run yields after it)."""
    seed_all(3)
    whole = []
    loader = make()
    for e in range(epochs):
        if set_epoch:
            set_epoch(loader, e)
        whole.append(_flat(loader))
    seed_all(3)
    loader = make()
    it = iter(loader)
    for _ in range(SAVE_AT + 1):
        next(it)
    state = loader.state_dict()
    del it
    rest = [whole[0][SAVE_AT + 1 :]] + whole[1:]
    return state, rest


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("shards")
    _shards.make(directory)
    return str(directory)


def _case(name, shard_dir=None):
    """(make, state, the batches expected after it, what others own, examples, epochs)."""
    make, owned, examples, epochs = CASES[name]
    if name == "shards":
        make = lambda: fastfeed.DataLoader(Shards(shard_dir, decode=_shards.as_tensor, shuffle=True, seed=5,  # noqa
                                                  shuffle_window=3), batch_size=BS)  # fmt: skip
    if name == "job":
        make = CASES["map"][0]
    if name == "torchdata":  # torchdata saves no RNG state: a resume from its state is exact in the indices
        make = lambda: fastfeed.DataLoader(ds.IndexMap(N), batch_size=BS, shuffle=True,  # noqa: E731
                                           generator=torch.Generator().manual_seed(7))  # fmt: skip
    state, rest = _saved(make, epochs)
    if name == "job":
        state = {"version": 3, "world_size": 1, "ranks": {"0": state}}
    if name == "torchdata":
        state, rest = _torchdata_state()
    return make, state, rest, owned, examples, epochs


def _torchdata_state():
    """The state torchdata's StatefulDataLoader saves after batch SAVE_AT of an epoch, and the rest of its epoch
    (its RandomSampler draws another order than torch's)."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        return StatefulDataLoader(ds.IndexMap(N), batch_size=BS, shuffle=True,
                                  generator=torch.Generator().manual_seed(7))  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's deprecation of set_vital
        seed_all(3)
        whole = _flat(make())
        seed_all(3)
        loader = make()
        it = iter(loader)
        for _ in range(SAVE_AT + 1):
            next(it)
        return loader.state_dict(), [whole[SAVE_AT + 1 :]]


# -- mutations ------------------------------------------------------------------------------------------------


def _children(value) -> list:
    """The keys (or indices) of ``value`` a mutation may reach."""
    if isinstance(value, dict):
        return list(value)
    if isinstance(value, (list, tuple)):
        return list(range(len(value)))
    return []


def _get(value, path):
    for key in path:
        value = value[key]
    return value


def _set(state, path, new):
    parent = _get(state, path[:-1])
    if isinstance(parent, tuple):  # a state's workers are a tuple: rebuilt as a list with the change
        parent = list(parent)
        parent[path[-1]] = new
        _set(state, path[:-1], parent)
    else:
        parent[path[-1]] = new


class Mutation(tuple):
    """(a changed copy of a state, the path changed, the keys that name it, what was done, whether it is a
    well-formed other position), shown as what was done."""

    def __repr__(self):
        return self[3]


@st.composite
def mutations(draw, state, owned, case):
    """A ``Mutation`` of ``state``."""
    # A walk from the top, stopping at each level with even odds: top-level fields are changed as often as the
    # 625 words of an RNG state.
    path, old = (), state
    while True:
        children = [] if path and path[-1] in owned else _children(old)
        if not children or (path and draw(st.booleans())):
            break
        key = draw(st.sampled_from(children))
        path, old = path + (key,), old[key]
    names = [k for k in path if isinstance(k, str)]
    if path[-1] in owned and old is not None:  # theirs to read: fastfeed checks only that it is there
        new_state = copy.deepcopy(state)
        _set(new_state, path, None)
        return Mutation((new_state, path, names, f"set {path} to None", False))
    ops = ["replace", "deep", "garbage"]
    if isinstance(path[-1], str):
        ops.append("drop")
    if isinstance(old, dict):
        ops.append("add")
    if isinstance(old, (list, tuple, str, torch.Tensor)) and len(old):
        ops.append("truncate")
    op = draw(st.sampled_from(ops))
    new_state = copy.deepcopy(state)
    if op == "drop":
        parent = _get(new_state, path[:-1])
        del parent[path[-1]]
        return Mutation((new_state, path, names, f"drop {path}", False))
    if op == "add":
        key = draw(st.sampled_from(FOREIGN_KEYS))
        if key in old:
            key = "bogus"
        _get(new_state, path)[key] = draw(st.sampled_from(HOSTILE[:6]))
        return Mutation((new_state, path, names + [key], f"add {key!r} at {path}", False))
    if op == "truncate":
        cut = draw(st.sampled_from([0, 1, len(old) // 2, len(old) - 1]))
        new = old[:cut]
        _set(new_state, path, list(new) if isinstance(old, tuple) else new)
        return Mutation((new_state, path, names, f"truncate {path} to {cut}", False))
    if op == "deep":
        new = _deep(150)
    elif op == "garbage":
        new = draw(st.recursive(st.none() | st.text(max_size=3) | st.sampled_from(HOSTILE[1:10]),
                                lambda inner: st.lists(inner, min_size=1, max_size=3)
                                | st.dictionaries(st.text(max_size=3), inner, min_size=1, max_size=3),
                                max_leaves=6).filter(lambda v: isinstance(v, (list, dict))))  # fmt: skip
    else:
        new = draw(st.sampled_from(HOSTILE))
    # A value of the same type and truth is a well-formed other state (True for False, 3 for 4), not damage.
    if type(new) is type(old) and (isinstance(old, bool) or new == old):
        new = "x"
    _set(new_state, path, new)
    return Mutation((new_state, path, names, f"set {path} to {_state_check.show(new)}",
                     _free(case, path, new)))


# -- the property ---------------------------------------------------------------------------------------------

def _check(make, mutated, names, did, free, rest, epochs):
    seed_all(99)  # the resumed process starts elsewhere: the state must restore what matters
    loader = make()
    with Within(30, f"{did}: loading the state and its epochs"):
        try:
            loader.load_state_dict(mutated)
            got = _epochs(loader, epochs)
        except ValueError as e:
            message = str(e)
            # The translation of a torchdata state says what it cannot continue, in its own words (a stateful
            # sampler's state where this loader's sampler has none, ...), not always by the key's name.
            translated = "this torchdata StatefulDataLoader state" in message
            assert any(name in message for name in names) or translated, (
                f"{did}: the ValueError does not name the field ({names}): {message}")  # fmt: skip
            assert len(message) < 2000, f"{did}: a message of {len(message)} characters"
            return "refused"
    if free:
        return "free"
    assert got == rest, f"{did}: loaded without an error, and the resume is not the uninterrupted run's"
    return "exact"


@pytest.mark.parametrize("name", list(CASES))
def test_a_damaged_state_is_refused_naming_its_field_or_resumes_exactly(name, shard_dir):
    if name == "torchdata":
        pytest.importorskip("torchdata.stateful_dataloader")
    make, state, rest, owned, examples, epochs = _case(name, shard_dir)
    outcomes = {"refused": 0, "exact": 0, "free": 0}

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(mutations(state, owned, name))
    def fuzz(mutation):
        mutated, _, names, did, free = mutation
        outcomes[_check(make, mutated, names, did, free, rest, epochs)] += 1

    fuzz()
    # (hypothesis stops early only where it ran out of distinct inputs)
    assert sum(outcomes.values()) >= examples * 0.9, (name, outcomes)
    assert outcomes["refused"] and outcomes["exact"], (name, outcomes)  # both ways are exercised
    # The real state, unchanged, resumes exactly: the checks refuse no valid state.
    assert _check(make, copy.deepcopy(state), ["?"], "unchanged", False, rest, epochs) == "exact"


# -- the obvious ones, by hand ---------------------------------------------------------------------------------


def _map_state():
    make = CASES["map"][0]
    state, rest = _saved(make, 2)
    return make, state, rest


def _refused(loader, state, *named):
    with pytest.raises(ValueError) as e:
        loader.load_state_dict(state)
    for name in named:
        assert name in str(e.value), str(e.value)
    return str(e.value)


def test_the_brief_example_a_negative_torchdata_count_names_its_field():
    pytest.importorskip("torchdata.stateful_dataloader")
    state, _ = _torchdata_state()
    state["_sampler_iter_yielded"] = -3
    make = CASES["map"][0]
    message = _refused(make(), state, "state['_sampler_iter_yielded'] is -3", "count")
    assert message.startswith("DataLoader.load_state_dict")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda s: s.update(yielded=-3), "state['yielded'] is -3; expected a count >= 0"),
        (lambda s: s.update(yielded=10**18), "state['yielded'] is 1000000000000000000; expected at most 8"),
        (lambda s: s.update(asked=2**64), "state['asked']"),
        (lambda s: s.update(epochs=1.0), "state['epochs'] is 1.0"),
        (lambda s: s.update(next_worker=10**18), "state['next_worker']"),
        (lambda s: s.update(base_seed=2**63), "state['base_seed']"),
        (lambda s: s.update(mid_epoch="yes"), "state['mid_epoch'] is 'yes'; expected True or False"),
        (lambda s: s.update(version=True), "version"),
        (lambda s: s.update(version="3"), "version"),
        (lambda s: s.pop("rng"), "lacks the key(s) ['rng']"),
        (lambda s: s.update(_num_yielded=4), "_num_yielded"),  # a key of torchdata's layout
        (lambda s: s["rng"].update(extra=1), "extra"),
        (lambda s: s["rng"]["random"][1].__setitem__(5, 2**33), "state['rng']['random'][1][5]"),  # random takes it
        (lambda s: s["rng"]["random"][1].pop(), "625 items"),
        (lambda s: s["rng"]["numpy"].__setitem__(2, 10**6), "state['rng']['numpy'][2]"),  # numpy takes it
        (lambda s: s["rng"].update(torch=s["rng"]["torch"][:-8]), "state['rng']['torch']"),
        (lambda s: s["rng"].update(torch="!" * len(s["rng"]["torch"])), "base64"),
        (lambda s: s["rng"].update(generator=None), "state['rng']['generator'] is None"),
        (lambda s: s["sampler_rng"].update(torch=None), "state['sampler_rng']"),
        (lambda s: s.update(received_ahead=[10**18]), "state['received_ahead'][0]"),
        (lambda s: s.update(due=[[0, 10**18]]), "state['due'][0][1]"),
        (lambda s: s.update(dataset={"pos": 3}), "state['dataset']"),  # a dataset without state of its own
        (lambda s: s.update(dataset_iter={"pos": 3}), "state['dataset_iter']"),
        (lambda s: s.update(workers=[None] * 5), "state['workers']"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_a_damaged_state_names_its_field(change, named):
    make, state, rest = _map_state()
    change(state)
    _refused(make(), state, named)


def test_a_refused_state_changes_nothing():
    """The check comes first: a refused state leaves the loader, its generator and the global RNGs as they were."""
    make, state, rest = _map_state()
    loader = make()
    state["workers"] = "garbage"
    seed_all(5)
    before = torch.get_rng_state(), random.getstate(), loader.generator.get_state()
    _refused(loader, state, "state['workers']")
    assert torch.equal(before[0], torch.get_rng_state()) and before[1] == random.getstate()
    assert torch.equal(before[2], loader.generator.get_state())
    seed_all(5)
    got = _epochs(loader, 1)
    seed_all(5)
    assert got == _epochs(make(), 1)  # a plain first epoch, as if nothing was loaded


def test_a_huge_string_and_deep_nesting_are_refused_quickly_with_a_short_message():
    make, state, rest = _map_state()
    huge = dict(state, rng=dict(state["rng"], torch="A" * 100_000_000))
    # This thread's CPU time (the refusal is made here, in load_state_dict): what the check costs, which other
    # processes' load does not stretch as it does the wall clock.
    started = time.thread_time()
    message = _refused(make(), huge, "state['rng']['torch']")
    assert len(message) < 1000 and time.thread_time() - started < 5
    del huge
    deep = dict(state, sampler_state=_deep(100_000))  # a torch.load'ed pickle can nest that deep; copying it fails
    message = _refused(make(), deep, "state['sampler_state']", "nested more than")
    assert len(message) < 1000


def test_a_non_dict_state_is_refused():
    import numpy as np

    make = CASES["map"][0]
    for state in (None, [1, 2], "state", torch.zeros(3), np.zeros(3)):
        _refused(make(), state, "DataLoader.load_state_dict", type(state).__name__)
        # torchdata's name takes {} as "no state": anything else that is not a dict is refused too
        _refused(fastfeed.StatefulDataLoader(Noisy(), batch_size=BS), state, type(state).__name__)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda j: j.update(world_size=0), "state['world_size']"),
        (lambda j: j.update(ranks={"zero": j["ranks"]["0"]}), "'zero'"),
        (lambda j: j.update(ranks={"5": j["ranks"]["0"]}), "'5'"),
        (lambda j: j.update(ranks={"0": [1, 2]}), "state['ranks']['0']"),
        (lambda j: j.pop("ranks"), "'ranks'"),
        (lambda j: j["ranks"]["0"].update(yielded=-1), "state['ranks']['0']['yielded']"),
    ],
)  # fmt: skip
def test_a_damaged_job_state_names_its_field(change, named):
    make, state, rest = _map_state()
    job = {"version": 3, "world_size": 1, "ranks": {"0": state}}
    change(job)
    _refused(make(), job, named)


def test_a_plain_iterable_read_again_past_its_end_names_yielded_at_the_first_next():
    """A plain IterableDataset is moved forward by reading it: only the read tells that the state claims more
    batches than the data has."""
    make = CASES["iterable"][0]
    state, _ = _saved(make, 1)
    state["yielded"] = state["asked"] = 10**18
    loader = make()
    loader.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['yielded'\]"):
        next(iter(loader))


def test_an_iterable_workers_batch_count_above_the_batches_received_is_refused():
    """A plain iterable's worker reads its batches again on resuming: a count above those received is refused
    before any worker starts (it would read the whole stream, or past its end)."""
    make = CASES["iterable/workers"][0]
    state, _ = _saved(make, 1)
    state["workers"][1]["state"]["batches"] = 10**18
    _refused(make(), state, "state['workers'][1]['state']['batches']", "at most 4")


def test_a_state_saved_right_after_iter_resumes_with_workers():
    """A single process's state taken after iter() and before the first batch holds no sampler RNGs yet; a loader
    with workers continues it as the single process would have."""
    make0 = CASES["map"][0]
    make2 = lambda: fastfeed.DataLoader(Noisy(), batch_size=BS, shuffle=True,  # noqa: E731
                                        generator=torch.Generator().manual_seed(7), **_fork(2))  # fmt: skip
    seed_all(3)
    loader = make0()
    it = iter(loader)
    state = loader.state_dict()
    assert state["mid_epoch"] and state["sampler_rng"]["torch"] is None
    order = [sample[0] for batch in _flat(it) for sample in batch]  # the indices (the draws are the workers' own)
    del it
    seed_all(99)
    resumed = make2()
    resumed.load_state_dict(state)
    assert [sample[0] for batch in _epochs(resumed, 1)[0] for sample in batch] == order


def test_a_shards_position_names_its_field(shard_dir):
    ds = Shards(shard_dir, decode=_shards.as_tensor, shuffle=True, seed=5, shuffle_window=3)
    loader = fastfeed.DataLoader(ds, batch_size=BS)
    it = iter(loader)
    next(it)
    good = loader.state_dict()["shards"]
    del it
    for change, named in [
        (dict(batch=10**18), "state['batch']"), (dict(within=-1), "state['within']"),
        (dict(within=BS), "state['within']"), (dict(worker=[3, 2]), "state['worker'][0]"),
        (dict(ahead=[0]), "state['ahead'][0]"), (dict(rank=5), "state['rank']"), (dict(epoch="0"), "state['epoch']"),
        (dict(order=True), "shard order"), (dict(version=True), "version"), (dict(format=None), "state['format']"),
        (dict(seed=5.0), "seed=5.0"), (dict(world=3), "state['global_batch']"), (dict(extra=1), "extra"),
    ]:  # fmt: skip
        fresh = Shards(shard_dir, decode=_shards.as_tensor, shuffle=True, seed=5, shuffle_window=3)
        fastfeed.DataLoader(fresh, batch_size=BS)  # tells it the batch size
        with pytest.raises(ValueError) as e:
            fresh.load_state_dict(dict(good, **change))
        assert named in str(e.value) and str(e.value).startswith("fastfeed.io.Shards.load_state_dict"), str(e.value)
    bad = dict(good)
    del bad["global_batch"]
    with pytest.raises(ValueError, match="global_batch"):
        ds.load_state_dict(bad)


def test_another_huge_global_batch_is_named_at_once(shard_dir):
    """A global batch from a damaged state is refused with the world sizes that keep it, without counting to it."""
    ds = Shards(shard_dir, decode=_shards.as_tensor, shuffle=True, seed=5, shuffle_window=3)
    loader = fastfeed.DataLoader(ds, batch_size=BS)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    state["shards"]["global_batch"] = state["shards"]["world"] * 10**17
    again = fastfeed.DataLoader(Shards(shard_dir, decode=_shards.as_tensor, shuffle=True, seed=5, shuffle_window=3),
                                batch_size=BS)  # fmt: skip
    again.load_state_dict(state)
    started = time.thread_time()  # this thread's CPU time (no workers: the check is made here), as load leaves it
    with pytest.raises(ValueError, match=r"global batch of 100000000000000000 samples \(state\['global_batch'\]") as e:
        iter(again)
    assert time.thread_time() - started < 5 and len(str(e.value)) < 1000


def test_a_dali_state_names_its_field():
    """DALILoader's state is checked before its checkpoint reaches DALI (checked here without DALI installed)."""
    good = {"fastfeed_dali": 1, "checkpoint": "...", "epoch": 0, "runs": 3, "batch_size": 4, "samples_per_shard": 30,
            "shard": [0, 1], "last_batch": "partial"}  # fmt: skip
    _state_check.check_dali_state(good, 1, "DALILoader.load_state_dict")
    for change, named in [
        (dict(runs=-1), "state['runs']"), (dict(epoch=10**30), "state['epoch']"),
        (dict(shard=[2, 1]), "state['shard'][0]"),
        (dict(shard=5), "state['shard']"), (dict(checkpoint=None), "state['checkpoint']"), (dict(bogus=1), "bogus"),
        (dict(fastfeed_dali=True), "not a DALILoader state"), (dict(last_batch=0), "state['last_batch']"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            _state_check.check_dali_state(dict(good, **change), 1, "DALILoader.load_state_dict")
        assert named in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=r"lacks the key\(s\) \['runs'\]"):
        _state_check.check_dali_state({k: v for k, v in good.items() if k != "runs"}, 1, "DALILoader.load_state_dict")
