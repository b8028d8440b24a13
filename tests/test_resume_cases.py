"""Resume around the loop: the same scenarios through torchdata's StatefulDataLoader and the candidate, compared.

Each scenario builds loaders with the same arguments, stops one somewhere (after a `break`, at an epoch's end,
between `load_state_dict()` and `iter()`, ...), resumes another from its state, and records the samples (plain
ints). The samples before the save plus those after the resume must be one uninterrupted run's, in order.
torchdata's StatefulDataLoader runs each scenario too: where its resume is exact, the candidate's sequence is its
sequence; `TORCHDATA_DIFFERS` lists the scenarios where torchdata itself loses or repeats samples (it is then no
reference), with why. A hypothesis property test at the end covers any dataset kind, worker count, batch size,
break point and save point, with samples that draw from the workers' RNGs.
"""

import io
import json
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _candidate
import _datasets as ds
from _compare import assert_same, copy_batch, seed_all

pytestmark = pytest.mark.fastfeed_only

torchdata = pytest.importorskip("torchdata.stateful_dataloader")
TD = torchdata.StatefulDataLoader
FF = _candidate.DataLoader

N, BS = 40, 5  # 8 batches an epoch
DATA = {
    "map": ds.IndexMap, "stateful-map": ds.CountingMap, "iterable": ds.IndexIterable,
    "stateful-iterable": ds.EpochIterable, "self-iterable": ds.SelfIterable, "popping": ds.PoppingIterable,
}  # fmt: skip
SAMPLERS = {None: None, "fixed": ds.FixedOrderSampler, "stateful": ds.StatefulSampler}
WORKERS = [(0, False), (2, False), (2, True)]  # (num_workers, persistent_workers)

# Scenarios where torchdata 0.11's own resume is not the uninterrupted run, so it cannot be the reference.
TORCHDATA_DIFFERS = {
    # A state saved at an epoch's end restores the workers (or the sampler) in an iterator that is then replaced
    # by a fresh one: the dataset or sampler moves on twice, and the resumed epoch is the one after the next.
    ("between_epochs", "stateful-iterable", 2, True), ("between_epochs", "popping", 2, True),
    ("between_epochs", "map/stateful", 2, False), ("between_epochs", "map/stateful", 2, True),
    # load_state_dict hands the dataset the state it keeps: a dataset that pops its keys spoils it (KeyError), and
    # with workers the second resume repeats a shard's samples.
    ("popping", "popping", 0, False), ("popping", "popping", 2, False), ("popping", "popping", 2, True),
    # state_dict() before iter() starts an iterator of its own; an iterable then loses its loaded position.
    ("loaded", "iterable", 0, False), ("loaded", "iterable", 2, False), ("loaded", "iterable", 2, True),
    ("loaded", "stateful-iterable", 0, False), ("loaded", "stateful-iterable", 2, False),
    ("loaded", "stateful-iterable", 2, True), ("loaded", "map/stateful", 0, False),
    ("reload", "iterable", 0, False), ("reload", "iterable", 2, False), ("reload", "iterable", 2, True),
    ("reload", "stateful-iterable", 0, False), ("reload", "stateful-iterable", 2, False),
    ("reload", "stateful-iterable", 2, True), ("reload", "map/stateful", 0, False),
}  # fmt: skip


def maker(cls, data, sampler=None, nw=0, persistent=False):
    """A function that builds a fresh loader (and dataset, and sampler) of this configuration; ``nw`` overridable."""

    def make(nw=nw):
        kwargs = dict(batch_size=BS, num_workers=nw)
        if nw:
            kwargs.update(multiprocessing_context="fork", persistent_workers=persistent)
        if sampler:
            kwargs["sampler"] = SAMPLERS[sampler](N)
        return cls(DATA[data](N), **kwargs)

    return make


def epoch(loader, stop=None):
    """The samples of one epoch, leaving the loop with `break` after batch `stop` (None: to its end)."""
    out = []
    for k, batch in enumerate(loader):
        out += batch.tolist()
        if k == stop:
            break
    return out


def epochs(loader, count):
    return [x for _ in range(count) for x in epoch(loader)]


def resumed(make, state, count, **kwargs):
    loader = make(**kwargs)
    loader.load_state_dict(state)
    return epochs(loader, count)


# -- the scenarios: each returns the samples in the order the user saw them, across saves and resumes ----------------


def after_break(make):
    """Case 1: `for ...: break` after batch 2, then state_dict(), then a new loader resumes (two epochs in all)."""
    loader = make()
    before = epoch(loader, stop=2)
    return before + resumed(make, loader.state_dict(), 2)


def between_epochs(make):
    """Case 2: epoch 0 to its end, state_dict(), then a new loader runs epoch 1."""
    loader = make()
    before = epoch(loader)
    return before + resumed(make, loader.state_dict(), 1)


def popping(make):
    """Case 4: a resumed loader saves again before its workers' first batches are seen, and is resumed; and the
    first state, used once already, resumes once more."""
    loader = make()
    before = epoch(loader, stop=2)
    first = loader.state_dict()
    second = make()
    second.load_state_dict(first)
    it = iter(second)
    middle = next(it).tolist()
    state = second.state_dict()
    del it
    chained = before + middle + resumed(make, state, 1)
    again = before + resumed(make, first, 1)
    return chained, again


def loaded(make):
    """Case 5: state_dict() between load_state_dict() and iter() is the loaded position."""
    loader = make()
    before = epoch(loader, stop=2)
    second = make()
    second.load_state_dict(loader.state_dict())
    return before + resumed(make, second.state_dict(), 2)


def reload(make):
    """Case 6: load_state_dict() on a loader whose (persistent) iterator is alive, then state_dict() and iter()."""
    loader = make()
    seen = []
    for k, batch in enumerate(loader):
        seen += batch.tolist()
        if k == 2:
            state = loader.state_dict()
    loader.load_state_dict(state)
    again = loader.state_dict()
    return seen[: 3 * BS] + epochs(loader, 2), seen[: 3 * BS] + resumed(make, again, 2)


def reference(make, scenario):
    """What `scenario` must give: the uninterrupted run's samples (in the scenario's shape)."""
    loader = make()
    if scenario is popping:  # one epoch, twice
        run = epochs(loader, 1)
        return run, run
    if scenario is reload:
        run = epochs(loader, 2)
        return run, run
    return epochs(loader, 2)


def check(scenario, data, sampler, nw, persistent):
    """Run `scenario` through torchdata and the candidate; both must give the uninterrupted run (torchdata where
    it resumes exactly)."""
    ref = reference(maker(FF, data, sampler, nw, persistent), scenario)
    ours = scenario(maker(FF, data, sampler, nw, persistent))
    assert ours == ref, f"{_candidate.NAME} lost or repeated samples"
    name = data if sampler is None else f"{data}/{sampler}"
    if (scenario.__name__, name, nw, persistent) in TORCHDATA_DIFFERS:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's deprecation of set_vital
        theirs = scenario(maker(TD, data, sampler, nw, persistent))
    assert theirs == ours, "torchdata's StatefulDataLoader resumes this scenario otherwise"


CONFIGS_1 = [("map", None), ("map", "fixed"), ("map", "stateful"), ("iterable", None), ("stateful-iterable", None)]


@pytest.mark.parametrize(("nw", "persistent"), WORKERS)
@pytest.mark.parametrize(("data", "sampler"), CONFIGS_1)
def test_state_after_break(data, sampler, nw, persistent):
    """A state taken after `break` resumes at the next batch, not at the next epoch (as torchdata does)."""
    check(after_break, data, sampler, nw, persistent)


@pytest.mark.parametrize(("nw", "persistent"), WORKERS)
@pytest.mark.parametrize(("data", "sampler"), [("stateful-iterable", None), ("stateful-map", None),
                                               ("map", "stateful")])  # fmt: skip
def test_state_between_epochs_keeps_the_dataset_state(data, sampler, nw, persistent):
    """A state saved at an epoch's end keeps the dataset's (and sampler's) own state: the next epoch is epoch 1's."""
    check(between_epochs, data, sampler, nw, persistent)


@pytest.mark.parametrize(("nw", "persistent"), WORKERS)
def test_iterable_that_is_its_own_iterator(nw, persistent):
    """A stateful IterableDataset whose __iter__ returns self is restored after __iter__, not reset by it."""
    check(after_break, "self-iterable", None, nw, persistent)


@pytest.mark.parametrize(("nw", "persistent"), WORKERS)
def test_dataset_that_takes_its_state_apart(nw, persistent):
    """A dataset whose load_state_dict pops its argument's keys gets a copy: chained and repeated resumes stay exact."""
    check(popping, "popping", None, nw, persistent)


@pytest.mark.parametrize(("nw", "persistent"), WORKERS)
@pytest.mark.parametrize(("data", "sampler"), [("map", "fixed"), ("map", "stateful"), ("iterable", None),
                                               ("stateful-iterable", None)])  # fmt: skip
def test_state_between_load_and_iter_is_the_loaded_one(data, sampler, nw, persistent):
    """state_dict() after load_state_dict() and before iter() gives the loaded position, not a new epoch's."""
    check(loaded, data, sampler, nw, persistent)


@pytest.mark.parametrize(("nw", "persistent"), WORKERS)
@pytest.mark.parametrize(("data", "sampler"), [("map", "fixed"), ("map", "stateful"), ("iterable", None),
                                               ("stateful-iterable", None)])  # fmt: skip
def test_load_on_a_loader_whose_iterator_lives(data, sampler, nw, persistent):
    """load_state_dict() on a loader with a live (persistent) iterator replaces its state; state_dict() works."""
    check(reload, data, sampler, nw, persistent)


# -- case 7: another num_workers at resume ------------------------------------------------------------------------


def _saved(make, nw, stop=2):
    loader = make(nw=nw)
    before = epoch(loader, stop=stop)
    return before, loader.state_dict()


@pytest.mark.parametrize(("saved", "resumed_with"), [(3, 2), (0, 3), (3, 0), (2, 3)])
@pytest.mark.parametrize("sampler", [None, "fixed", "stateful"])
def test_map_style_resumes_with_another_worker_count(saved, resumed_with, sampler):
    """Map-style positions are the sampler's: a state resumes exactly with any num_workers (torchdata raises)."""
    make = maker(FF, "map", sampler)
    ref = epochs(make(nw=saved), 2)
    before, state = _saved(make, saved)
    assert before + resumed(make, state, 2, nw=resumed_with) == ref
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        td = maker(TD, "map", sampler)
        _, theirs = _saved(td, saved)
        with pytest.raises(Exception):  # noqa: B017 - torchdata asserts; it does not resume
            resumed(td, theirs, 1, nw=resumed_with)


@pytest.mark.parametrize(("saved", "resumed_with"), [(0, 3), (3, 0), (3, 2)])
@pytest.mark.parametrize("data", ["iterable", "stateful-iterable"])
def test_iterable_refuses_another_worker_count_mid_epoch(data, saved, resumed_with):
    """An IterableDataset's mid-epoch position is per shard: another num_workers is a ValueError naming both counts,
    at load_state_dict() (torchdata refuses too)."""
    make = maker(FF, data)
    _, state = _saved(make, saved)
    loader = make(nw=resumed_with)
    with pytest.raises(ValueError, match=f"num_workers={saved}.*num_workers={resumed_with}"):
        loader.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        td = maker(TD, data)
        _, theirs = _saved(td, saved)
        with pytest.raises(Exception):  # noqa: B017
            resumed(td, theirs, 1, nw=resumed_with)


def test_stateful_map_refuses_another_worker_count():
    """A stateful map-style dataset's state is per worker: another num_workers is a ValueError at load time."""
    make = maker(FF, "stateful-map")
    _, state = _saved(make, 2)
    with pytest.raises(ValueError, match="num_workers=2.*num_workers=3"):
        make(nw=3).load_state_dict(state)


def test_iterable_between_epochs_takes_another_worker_count():
    """Between non-persistent epochs an iterable has no per-worker position: any num_workers starts the next epoch."""
    make = maker(FF, "iterable")
    loader = make(nw=3)
    epoch(loader)
    assert sorted(resumed(make, loader.state_dict(), 1, nw=2)) == list(range(N))


# -- the state's form ------------------------------------------------------------------------------------------------

KINDS = {
    "single process": dict(num_workers=0),
    "worker processes": dict(num_workers=2, multiprocessing_context="fork"),
    "persistent workers": dict(num_workers=2, multiprocessing_context="fork", persistent_workers=True),
    "worker threads": dict(num_workers=2, worker_type="thread"),
    "cpu device stage": dict(num_workers=2, multiprocessing_context="fork", device="cpu"),
}


def _augmented(kind, iterable):
    # Worker threads draw from the process's RNGs, in whichever order they run: their samples draw nothing.
    if iterable:
        dataset = ds.StatefulIterable(23)
    else:
        dataset = ds.PlainDataset(23) if "threads" in kind else ds.AugmentedDataset(23)
    kwargs = dict(KINDS[kind])
    if not iterable:
        kwargs.update(shuffle=True, generator=torch.Generator().manual_seed(3))
    return FF(dataset, batch_size=3, **kwargs)


def _round_trip(state, how):
    if how == "json":
        return json.loads(json.dumps(state))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("how", ["json", "torch.save"])
@pytest.mark.parametrize("iterable", [False, True], ids=["map", "stateful-iterable"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_state_is_json_and_round_trips(kind, iterable, how):
    """json.dumps takes every loader kind's state, and the JSON (or torch.save) round trip resumes exactly."""
    if iterable and kind == "worker threads":
        pytest.skip("worker threads cannot save an iterable's position mid-epoch (a ValueError says so)")
    seed_all(5)
    ref_loader = _augmented(kind, iterable)
    ref = [copy_batch(b) for _ in range(2) for b in ref_loader]
    seed_all(5)
    loader = _augmented(kind, iterable)
    seen = [copy_batch(b) for _, b in zip(range(3), loader)]
    state = loader.state_dict()
    json.dumps(state)
    seed_all(99)
    other = _augmented(kind, iterable)
    other.load_state_dict(_round_trip(state, how))
    rest = [copy_batch(b) for _ in range(2) for b in other]
    assert_same(seen + rest, ref)


def test_version_1_tensor_states_still_load():
    """A state in version 1's form (RNG states as tensors and tuples) resumes exactly."""
    from fastfeed import _state

    make = lambda: FF(ds.AugmentedDataset(23), batch_size=3, num_workers=2, multiprocessing_context="fork",
                      shuffle=True, generator=torch.Generator().manual_seed(3))  # fmt: skip
    seed_all(5)
    ref = [copy_batch(b) for b in make()]
    seed_all(5)
    loader = make()
    seen = [copy_batch(b) for _, b in zip(range(2), loader)]
    state = _state.decode(loader.state_dict())
    old = {k: v for k, v in state.items() if k not in ("sampler_state", "dataset_iter", "num_workers")}
    old["version"] = 1
    for w in old["workers"]:
        del w["state"]["dataset_iter"]
    assert isinstance(old["rng"]["torch"], torch.Tensor)
    other = make()
    other.load_state_dict(old)
    assert_same(seen + [copy_batch(b) for b in other], ref)


@pytest.mark.parametrize("resume", [False, True])
def test_failing_worker_init_fn_raises_at_first_next(resume):
    """A worker_init_fn that raises surfaces at the first next(), as torch's does, resumed or not."""
    loader = FF(ds.PlainDataset(8), batch_size=2, num_workers=2, worker_init_fn=ds.raising_worker_init)
    if resume:
        good = FF(ds.PlainDataset(8), batch_size=2, num_workers=2)
        for _ in good:
            break
        loader.load_state_dict(good.state_dict())
    it = iter(loader)
    with pytest.raises(ds.InitError):
        next(it)
    del it


# -- fastfeed.StatefulDataLoader -----------------------------------------------------------------------------------


def test_stateful_dataloader_takes_torchdata_arguments(recwarn):
    """fastfeed.StatefulDataLoader is fastfeed's DataLoader with torchdata's arguments; the default snapshot
    interval is silent, another warns once, and neither changes the state."""
    import fastfeed
    from fastfeed import stateful

    stateful._warned = False
    plain = fastfeed.StatefulDataLoader(ds.IndexMap(N), batch_size=BS, num_workers=2, snapshot_every_n_steps=1)
    assert isinstance(plain, fastfeed.DataLoader) and not [w for w in recwarn if "snapshot" in str(w.message)]
    with pytest.warns(UserWarning, match="snapshot_every_n_steps"):
        sparse = fastfeed.StatefulDataLoader(ds.IndexMap(N), batch_size=BS, num_workers=2, snapshot_every_n_steps=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastfeed.StatefulDataLoader(ds.IndexMap(N), batch_size=BS, snapshot_every_n_steps=8)  # once only
    before = epoch(sparse, stop=2)
    plain.load_state_dict(sparse.state_dict())
    assert before + epoch(plain) == list(range(N))
    plain.load_state_dict({})  # torchdata's "no state"


# -- the property ----------------------------------------------------------------------------------------------------

SAVES = ["loop", "break", "between", "resumed"]
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
PROPERTY_DATA = {"map": ds.AugmentedDataset, "iterable": ds.ShardedIterable, "stateful": ds.StatefulIterable}


def _property_loader(kind, n, nw, bs, persistent):
    kwargs = dict(batch_size=bs, num_workers=nw)
    if nw:
        kwargs.update(multiprocessing_context="fork", persistent_workers=persistent)
    if kind == "map":
        kwargs.update(shuffle=True, generator=torch.Generator().manual_seed(11))
    return FF(PROPERTY_DATA[kind](n), **kwargs)


def _run(loader, stop=None):
    out = []
    for k, batch in enumerate(loader):
        out.append(copy_batch(batch))
        if k == stop:
            break
    return out


@PROPERTY
@given(
    kind=st.sampled_from(list(PROPERTY_DATA)), nw=st.integers(0, 3), bs=st.integers(1, 4), n=st.integers(5, 13),
    persistent=st.booleans(), save=st.sampled_from(SAVES), at=st.integers(0, 20), again=st.integers(0, 20),
    how=st.sampled_from(["json", "torch.save", "as is"]),
)  # fmt: skip
def test_resume_anywhere_is_one_uninterrupted_run(kind, nw, bs, n, persistent, save, at, again, how):
    """Samples before the save plus samples after the resume are one uninterrupted two-epoch run, in order: for
    any dataset kind, worker count, batch size and save point (in the loop, after a break, between epochs, from a
    resumed loader)."""
    make = lambda: _property_loader(kind, n, nw, bs, persistent)  # noqa: E731
    seed_all(1)
    ref_loader = make()
    ref = [_run(ref_loader), _run(ref_loader)]
    batches = len(ref[0])
    k = at % batches
    seed_all(1)
    loader = make()
    if save == "between":
        seen, first_epoch = _run(loader), 1
    else:
        first_epoch = 0
        if save == "loop":
            seen = []
            for batch in loader:
                seen.append(copy_batch(batch))
                if len(seen) == k + 1:
                    state = loader.state_dict()
                    break
        else:
            seen = _run(loader, stop=k)
    if save != "loop":
        state = loader.state_dict()
    del loader
    seed_all(2)  # the resumed process starts from other seeds: the state restores them
    resumed_loader = make()
    resumed_loader.load_state_dict(state if how == "as is" else _round_trip(state, how))
    if save == "resumed":
        remaining = batches - len(seen)
        if remaining:  # take some more, leave with a break, save again
            seen += _run(resumed_loader, stop=again % remaining)
        state = resumed_loader.state_dict()  # (or, with nothing left, the loaded state itself)
        resumed_loader = make()
        resumed_loader.load_state_dict(_round_trip(state, "json"))
    rest = [] if save == "between" else _run(resumed_loader)  # the rest of epoch 0 (maybe none)
    rest += _run(resumed_loader)  # epoch 1
    assert_same(seen + rest, ref[0] + ref[1])
