"""fastfeed's loaders resume states saved by torchdata's StatefulDataLoader (a run that switches loaders mid-way).

Each scenario runs torchdata 0.11's StatefulDataLoader over an epoch and takes ``state_dict()`` before ``iter()``,
after batch k (several k, the last batch included) and after the epoch; each state goes through
``torch.save``/``torch.load`` and is loaded by ``fastfeed.StatefulDataLoader`` and ``fastfeed.DataLoader`` built with
the same arguments. What they yield for the rest of that epoch must be what torchdata had not yet delivered, in
torchdata's order (the reference: the rest of the uninterrupted torchdata run); after an epoch, the next epoch must
hold the samples of the uninterrupted run's next epoch (its order is fastfeed's own). States that cannot be read, or
cannot continue with the loader, raise ValueError naming why.
"""

import io
import json
import warnings

import pytest
import torch

import _datasets as ds
import fastfeed
from fastfeed import _from_torchdata, _state

pytestmark = pytest.mark.fastfeed_only

td = pytest.importorskip("torchdata.stateful_dataloader")
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler  # noqa: E402

TD = td.StatefulDataLoader
FF = (fastfeed.StatefulDataLoader, fastfeed.DataLoader)
N, BS = 22, 4  # 6 batches an epoch, the last of 2 samples (an iterable's 2 workers: 11 samples each, 3 batches)


def _dist(n):
    return StatefulDistributedSampler(ds.IndexMap(n), num_replicas=2, rank=1, shuffle=True, seed=3)


def _random_with_replacement(n):
    generator = torch.Generator().manual_seed(5)
    return RandomSampler(ds.IndexMap(n), replacement=True, num_samples=n + 5, generator=generator)


# name: (dataset, loader arguments, sampler): each loader gets fresh objects.
SCENARIOS = {
    "sequential": (ds.IndexMap, {"batch_size": BS}, None),
    "sequential-drop-last": (ds.IndexMap, {"batch_size": BS, "drop_last": True}, None),
    "shuffled": (ds.IndexMap, {"batch_size": BS, "shuffle": True}, None),
    "shuffled-unbatched": (ds.IndexMap, {"batch_size": None, "shuffle": True}, None),
    "torchdata-random-sampler": (ds.IndexMap, {"batch_size": BS}, _random_with_replacement),
    "distributed-sampler": (ds.IndexMap, {"batch_size": BS}, _dist),
    "user-sampler": (ds.IndexMap, {"batch_size": BS}, ds.StatefulSampler),
    "stateful-map": (ds.CountingMap, {"batch_size": BS}, None),
    "stateful-iterable": (ds.EpochIterable, {"batch_size": BS}, None),
    "self-iterable": (ds.SelfIterable, {"batch_size": BS}, None),
    "plain-iterable": (ds.IndexIterable, {"batch_size": BS}, None),
}


def make(cls, name, nw, n=N, **extra):
    data, kwargs, sampler = SCENARIOS[name]
    if cls is not TD:
        extra.pop("snapshot_every_n_steps", None)  # torchdata's: it says how old the state may be
    kwargs = dict(kwargs, num_workers=nw, **extra)
    if nw:
        kwargs["multiprocessing_context"] = "fork"
    if sampler is not None:
        kwargs["sampler"] = sampler(n)
    if name == "shuffled":  # (shuffled-unbatched has none: torchdata's RandomSampler then seeds one of its own)
        kwargs["generator"] = torch.Generator().manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's deprecation of set_vital
        return cls(data(n), **kwargs)


def samples(batch) -> list:
    return batch.tolist() if isinstance(batch, torch.Tensor) else [batch]


def round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def torchdata_run(name, nw, n=N, **extra):
    """torchdata's batches of epoch 0 and 1 (as sample lists), and its states: ``{k: state after batch k}`` with
    "before" (state_dict() before iter()) and "end" (after epoch 0's iterator ended)."""
    loader = make(TD, name, nw, n, **extra)
    states = {"before": round_trip(loader.state_dict())}
    first = []
    for batch in loader:
        first.append(samples(batch))
        states[len(first)] = round_trip(loader.state_dict())
    states["end"] = round_trip(loader.state_dict())
    second = [samples(b) for b in loader]
    return first, second, states


def resumed(cls, name, nw, state, n=N, **extra) -> list:
    loader = make(cls, name, nw, n, **extra)
    rng = torch.get_rng_state()
    loader.load_state_dict(state)
    if cls is not TD:
        assert torch.equal(torch.get_rng_state(), rng), "loading a torchdata state moved the global RNG"
    return [samples(b) for b in loader]


# Where the rest of the epoch is not the uninterrupted run's, for torchdata's own loader too: the reference is then
# torchdata's resume from the same state. StatefulSampler's state after its last index is "at the end", which it
# takes to mean "the next epoch" when loaded (tests/_datasets.py), so a state taken after the last batch resumes
# with a new epoch of the sampler, in torchdata as in fastfeed's own states.
RESTARTS = {("user-sampler", "last")}


def flat(batches) -> list:
    return [x for b in batches for x in b]


def check(name, nw, points, n=N, **extra):
    first, second, states = torchdata_run(name, nw, n, **extra)
    assert len(first) > 2, "the scenario must have an epoch to stop in"
    for point in points:
        key = len(first) if point == "last" else point
        state = states[key]
        assert _from_torchdata.is_torchdata_state(state)
        if point == "end":  # the next epoch: the uninterrupted run's samples, in fastfeed's order
            rest = None
        elif (name, point) in RESTARTS:
            rest = resumed(TD, name, nw, state, n, **extra)
        else:
            rest = first[0 if point == "before" else key :]
        for cls in FF:
            got = resumed(cls, name, nw, state, n, **extra)
            where = f"{cls.__name__} from torchdata's state {point!r} ({name}, num_workers={nw})"
            if rest is None:
                assert sorted(flat(got)) == sorted(flat(second)), where
                continue
            if len(set(flat(rest))) == len(flat(rest)):  # (a sampler drawing with replacement repeats samples)
                assert len(flat(got)) == len(set(flat(got))), f"{where}: repeated samples"
            assert got == rest, f"{where}: not the rest of torchdata's epoch"
    return states


POINTS = ["before", 1, 3, "last", "end"]


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("name", ["sequential", "sequential-drop-last", "shuffled", "shuffled-unbatched"])
def test_map_stateless_sampler(name, nw):
    """A map-style epoch with torch's samplers (torchdata swaps in its own RandomSampler and BatchSampler): the rest
    of torchdata's order, its permutation recomputed from the generator state it saved."""
    check(name, nw, POINTS)


@pytest.mark.parametrize("nw", [0, 2])
def test_torchdata_random_sampler_with_replacement(nw):
    """torchdata's own RandomSampler given as the sampler (drawing with replacement, in chunks): its draws are
    recomputed from the generator state its iterator saved."""
    check("torchdata-random-sampler", nw, ["before", 1, 3, "last"])


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("name", ["distributed-sampler", "user-sampler"])
def test_map_stateful_sampler(name, nw):
    """torchdata's StatefulDistributedSampler and a user sampler with state_dict(): the sampler's own state is
    loaded, and it continues its epoch."""
    check(name, nw, POINTS)


@pytest.mark.parametrize("nw", [0, 2])
def test_map_stateful_dataset(nw):
    """A map-style dataset with its own state (per worker with workers): each continues from its saved state."""
    check("stateful-map", nw, POINTS)


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("name", ["stateful-iterable", "self-iterable"])
def test_iterable_with_state(name, nw):
    """An IterableDataset with state_dict(), sharded by worker id: each worker's state (after 5 batches one worker
    has ended its shard) continues where torchdata's did; the dataset whose __iter__ returns itself too."""
    check(name, nw, POINTS + [5])


@pytest.mark.parametrize("nw", [0, 2])
def test_iterable_without_state(nw):
    """An IterableDataset without state_dict(): each worker's batches are read again and dropped (torchdata
    fast-forwards too), while no worker has ended (24 samples: 3 full batches per worker)."""
    check("plain-iterable", nw, ["before", 1, 4, "last", "end"], n=24)


@pytest.mark.parametrize("name", ["stateful-iterable", "stateful-map", "distributed-sampler"])
def test_persistent_workers(name):
    """persistent_workers=True: after an epoch, the workers' dataset states are the next epoch's start."""
    check(name, 2, ["before", 3, "last", "end"], persistent_workers=True)


@pytest.mark.parametrize(("name", "nw"), [("shuffled", 0), ("shuffled", 2), ("stateful-iterable", 2),
                                          ("user-sampler", 2), ("stateful-map", 0)])  # fmt: skip
def test_resumed_run_saves_and_resumes_again(name, nw):
    """A loader resumed from torchdata's state saves its own state one batch later (JSON's values only, with every
    key of fastfeed's layout), and a third loader continues from it: the rest of torchdata's epoch still."""
    first, _, states = torchdata_run(name, nw)
    loader = make(fastfeed.DataLoader, name, nw)
    translated = _from_torchdata.translate(states[2], loader)
    assert set(translated) == set(_state.KEYS)
    json.dumps(translated)
    loader.load_state_dict(states[2])
    it = iter(loader)
    got = [samples(next(it))]
    state = round_trip(json.loads(json.dumps(loader.state_dict())))
    del it
    again = make(fastfeed.StatefulDataLoader, name, nw)
    again.load_state_dict(state)
    got += [samples(b) for b in again]
    assert got == first[2:]


def test_map_position_continues_with_another_num_workers():
    """A map-style epoch's position is the sampler's: it continues with another num_workers too."""
    first, _, states = torchdata_run("shuffled", 2)
    assert resumed(fastfeed.DataLoader, "shuffled", 0, states[2]) == first[2:]
    first, _, states = torchdata_run("sequential", 0)
    assert resumed(fastfeed.DataLoader, "sequential", 2, states[2]) == first[2:]


def test_map_snapshot_behind():
    """snapshot_every_n_steps=3: torchdata's snapshot is older than the state; the batches after it are known
    delivered, and not delivered again."""
    states = check("shuffled", 2, [1, 2, 4, "last"], snapshot_every_n_steps=3)
    assert [states[k]["_steps_since_snapshot"] for k in (1, 2, 4)] == [1, 2, 1]


# -- what cannot be translated ---------------------------------------------------------------------------------


def test_recognises_torchdata_states_only():
    _, _, states = torchdata_run("sequential", 0, 12)
    _, _, worker_states = torchdata_run("sequential", 2, 12)
    for state in [*states.values(), *worker_states.values()]:
        assert _from_torchdata.is_torchdata_state(state)
    ours = make(fastfeed.DataLoader, "sequential", 0, 12)
    assert not _from_torchdata.is_torchdata_state(ours.state_dict())
    assert not _from_torchdata.is_torchdata_state({})
    assert not _from_torchdata.is_torchdata_state(None)


def _broken(name, nw, change, n=12):
    _, _, states = torchdata_run(name, nw, n)
    state = states[1]
    change(state)
    return state


@pytest.mark.parametrize(
    ("nw", "change", "named"),
    [
        (0, lambda s: s.update(bogus=1), "bogus"),
        (0, lambda s: s.pop("_num_yielded"), "_num_yielded"),
        (0, lambda s: s.update(_num_yielded="3"), "_num_yielded"),
        (2, lambda s: s.pop("_snapshot"), "_snapshot"),
        (2, lambda s: s["_snapshot"]["_worker_snapshots"].pop("worker_1"), "worker_1"),
        (2, lambda s: s["_snapshot"]["_main_snapshot"].pop("_base_seed"), "_base_seed"),
        (2, lambda s: s["_snapshot"]["_main_snapshot"]["_sampler_iter_state"].update(odd=1), "odd"),
    ],
    ids=["unknown-key", "missing-key", "not-a-count", "no-snapshot", "no-worker-snapshot", "no-base-seed",
         "unknown-sampler-key"],
)  # fmt: skip
def test_malformed_state_raises_value_error(nw, change, named):
    state = _broken("sequential", nw, change)
    for cls in FF:
        loader = make(cls, "sequential", nw, 12)
        with pytest.raises(ValueError, match=named):
            loader.load_state_dict(state)


def test_state_of_another_kind_of_dataset_raises():
    _, _, states = torchdata_run("sequential", 0, 12)
    loader = make(fastfeed.DataLoader, "stateful-iterable", 0, 12)
    with pytest.raises(ValueError, match="map-style"):
        loader.load_state_dict(states[1])


def test_stateful_sampler_state_into_a_stateless_sampler_raises():
    _, _, states = torchdata_run("user-sampler", 0, 12)
    loader = make(fastfeed.DataLoader, "sequential", 0, 12)
    with pytest.raises(ValueError, match="stateful sampler"):
        loader.load_state_dict(states[1])


def test_iterable_without_state_whose_worker_ended_raises():
    """torchdata's state does not say how many batches each worker of a plain IterableDataset made once one ended."""
    _, _, states = torchdata_run("plain-iterable", 2)
    assert states[5]["_snapshot"]["_worker_snapshots"]["worker_0"]["fetcher_state"]["fetcher_ended"]
    loader = make(fastfeed.DataLoader, "plain-iterable", 2)
    with pytest.raises(ValueError, match="had ended"):
        loader.load_state_dict(states[5])


def test_per_worker_states_with_another_num_workers_raise():
    _, _, states = torchdata_run("stateful-iterable", 2)
    loader = make(fastfeed.DataLoader, "stateful-iterable", 0)
    with pytest.raises(ValueError, match="num_workers=2"):
        loader.load_state_dict(states[2])


def test_stale_snapshot_of_worker_states_raises():
    """snapshot_every_n_steps>1 with per-worker dataset states: the state is older than the batches received."""
    _, _, states = torchdata_run("stateful-iterable", 2, snapshot_every_n_steps=4)
    assert states[2]["_steps_since_snapshot"] == 2
    loader = make(fastfeed.DataLoader, "stateful-iterable", 2, snapshot_every_n_steps=4)
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        loader.load_state_dict(states[2])
