"""Parity with torch: for identical arguments and seeds, the candidate yields bit-identical batches.

Each configuration runs torch's DataLoader, then the candidate's, from the same global
seeds (torch, random, numpy) with fresh datasets/samplers/generators, and compares the
batch sequences leaf by leaf, including container and leaf types. Batches are copied as
they arrive, the way a training loop uses them, so the ring is reused rather than grown.
"""

import collections
import itertools
import multiprocessing
import os
import time
import traceback
import warnings

import pytest
import torch
import torch.utils.data as tud

import _candidate
import _datasets as ds
import _leaks
from _compare import assert_same, copy_batch, frozen, seed_all

SEED = 1234


def workers(n, context="fork"):
    """DataLoader kwargs for n workers started with `context` (none for n == 0)."""
    return {} if n == 0 else {"num_workers": n, "multiprocessing_context": context}


def run(loader_cls, make, seed, epochs):
    """Epochs of copied batches, plus the warnings raised while building and iterating.

    epochs is a count of full epochs, or a list of per-epoch batch limits (None: all).
    """
    limits = [None] * epochs if isinstance(epochs, int) else epochs
    dataset, kwargs = make()
    if hasattr(dataset, "verify_worker_info"):
        # Only the candidate's run checks its get_worker_info() against torch's.
        dataset.verify_worker_info = loader_cls is _candidate.DataLoader
    seed_all(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = None
        try:
            loader = loader_cls(dataset, **kwargs)
            epochs_out = [[copy_batch(b) for b in itertools.islice(loader, limit)] for limit in limits]
        except Exception as error:  # noqa: BLE001 - reported below, without its traceback
            report = "".join(traceback.format_exception(error))
            loader = _leaks.drop_tracebacks(error) and None
            pytest.fail(f"{loader_cls.__module__}.DataLoader raised:\n{report}", pytrace=False)
        del loader
    return epochs_out, [(w.category, str(w.message)) for w in caught]


@pytest.fixture
def parity(spawn_picklable):
    """parity(make, ...) runs torch then the candidate on make()'s (dataset, kwargs) and compares.

    Returns torch's epochs so a test can also check what the batches contain.
    """

    def check(make, *, seed=SEED, epochs=1, in_order=True, candidate_seed=None):
        dataset, kwargs = make()
        if kwargs.get("multiprocessing_context") == "spawn":
            spawn_picklable(dataset, *kwargs.values())
        ref, ref_warnings = run(tud.DataLoader, make, seed, epochs)
        got, got_warnings = run(
            _candidate.DataLoader, make, seed if candidate_seed is None else candidate_seed, epochs
        )
        assert got_warnings == ref_warnings
        assert len(got) == len(ref)
        for epoch, (g, r) in enumerate(zip(got, ref)):
            if in_order:
                assert_same(g, r, f"epoch {epoch}")
            else:
                assert collections.Counter(map(frozen, g)) == collections.Counter(map(frozen, r))
        return ref

    return check


def indices_seen(epoch):
    return sorted(int(i) for batch in epoch for i in batch["index"].flatten())


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_map_style_matches(parity, num_workers, shuffle):
    """Map-style batches, shuffled or not, match torch's for 0, 1 and 2 forked workers."""
    ref = parity(
        lambda: (ds.AugmentedDataset(23), dict(batch_size=4, shuffle=shuffle, **workers(num_workers)))
    )
    assert indices_seen(ref[0]) == list(range(23))


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_iterable_matches(parity, num_workers):
    """An IterableDataset sharded by get_worker_info() yields torch's batches, partial tails included."""
    ref = parity(lambda: (ds.ShardedIterable(23), dict(batch_size=4, **workers(num_workers))))
    assert indices_seen(ref[0]) == list(range(23))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_drop_last_matches(parity, kind, num_workers):
    """drop_last drops the same partial batches as torch (per worker for iterables)."""
    dataset = ds.AugmentedDataset if kind == "map" else ds.ShardedIterable
    parity(lambda: (dataset(23), dict(batch_size=4, drop_last=True, **workers(num_workers))))


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_spawn_matches(parity, kind):
    """With the spawn start method the batches match torch's."""
    if kind == "map":
        parity(lambda: (ds.AugmentedDataset(12), dict(batch_size=3, shuffle=True, **workers(2, "spawn"))))
    else:
        parity(lambda: (ds.ShardedIterable(11), dict(batch_size=3, **workers(2, "spawn"))))


@pytest.fixture(scope="module")
def forkserver_run(tmp_path_factory):
    """One script for the forkserver tests (the server outlives any test, so it runs in a script of its own, which
    imports torch and starts a server once for every check): it prints "SAME" when the batches match torch's, then
    both loaders' order behind a straggler, then how many items each started while the first batch was held.
    Returns (return code, stdout lines, stderr). Module-scoped, so no test's hang limit covers it: finish() bounds it.
    """
    from _scripts import finish, start_script

    tmp_path = tmp_path_factory.mktemp("forkserver")
    proc = start_script(
        f"""
        import torch, torch.utils.data as tud
        from _compare import assert_same
        def run(cls):
            torch.manual_seed(3)
            return list(cls(ds.AugmentedDataset(12), batch_size=3, shuffle=True, num_workers=2,
                            multiprocessing_context="forkserver"))
        assert_same(run(_candidate.DataLoader), run(tud.DataLoader))
        print("SAME", flush=True)
        def order(cls, gate):
            # The gate holds the straggler's delay until the other worker has started: beside other load the
            # forkserver's second worker started over a second after the first, and there was no straggler
            loader = cls(ds.StragglerMap(10, slow=0, gate=gate), num_workers=2, in_order=False,
                         multiprocessing_context="forkserver")
            return [int(b[1]) for b in loader]
        def started(cls, directory):
            os.mkdir(directory)
            it = iter(cls(ds.StartLog(directory, 16, delay=0.05), num_workers=2, prefetch_factor=1,
                          multiprocessing_context="forkserver"))
            held = next(it)
            time.sleep(1.0)
            return len(os.listdir(directory))
        print(order(_candidate.DataLoader, {str(tmp_path / "gate-c")!r}),
              order(tud.DataLoader, {str(tmp_path / "gate-t")!r}))
        print(started(_candidate.DataLoader, {str(tmp_path / "c")!r}), started(tud.DataLoader, {str(tmp_path / "t")!r}))
        """
    )
    out, err = finish(proc, timeout=130)  # the two scripts it replaces had 50 s and 80 s
    return proc.returncode, out.splitlines(), err


def test_forkserver_matches(forkserver_run):
    """With the forkserver start method the batches match torch's (in a script: the server outlives any test)."""
    code, lines, err = forkserver_run
    assert lines[:1] == ["SAME"], err


def test_context_object_matches(parity):
    """A multiprocessing context object works like its start-method name."""
    context = multiprocessing.get_context("fork")
    options = dict(batch_size=3, num_workers=2, multiprocessing_context=context)
    parity(lambda: (ds.AugmentedDataset(12), options))


def test_explicit_generator_drives_shuffle_and_worker_seeds(parity):
    """With generator=, order and worker seeds come from it alone, whatever the global seed."""
    parity(
        lambda: (
            ds.AugmentedDataset(16),
            dict(batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7), **workers(2)),
        ),
        candidate_seed=SEED + 1,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("sampler", ["custom", "subset_random"])
def test_explicit_sampler_matches(parity, sampler, num_workers):
    """An explicit sampler (custom, or one drawing from the global RNG) gives torch's batches."""

    def make():
        s = ds.EveryOtherSampler(20) if sampler == "custom" else tud.SubsetRandomSampler(range(0, 20, 2))
        return ds.AugmentedDataset(20), dict(batch_size=3, sampler=s, **workers(num_workers))

    parity(make)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_sampler", ["irregular", "random_drop_last"])
def test_explicit_batch_sampler_matches(parity, batch_sampler, num_workers):
    """An explicit batch_sampler (irregular sizes, or random with drop_last) gives torch's batches."""

    def make():
        dataset = ds.AugmentedDataset(17)
        if batch_sampler == "irregular":
            bs = ds.IrregularBatchSampler(17)
        else:
            bs = tud.BatchSampler(tud.RandomSampler(dataset), 5, drop_last=True)
        return dataset, dict(batch_sampler=bs, **workers(num_workers))

    parity(make)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_batch_size_none_matches(parity, kind, num_workers):
    """batch_size=None yields torch's unbatched, default_convert-ed samples (python leaves intact)."""
    dataset = ds.AugmentedDataset if kind == "map" else ds.ShardedIterable
    ref = parity(lambda: (dataset(9), dict(batch_size=None, **workers(num_workers))))
    assert type(ref[0][0]["index"]) is int and type(ref[0][0]["np"]) is torch.Tensor


@pytest.mark.parametrize("num_workers", [0, 2])
def test_getitems_dataset_matches(parity, num_workers):
    """A dataset with __getitems__ is fetched in whole batches, as torch does."""
    ref = parity(lambda: (ds.GetitemsDataset(14), dict(batch_size=4, **workers(num_workers))))
    assert ref[0][0]["request"].tolist() == [4, 4, 4, 4]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_collate_fn_matches(parity, num_workers):
    """A custom collate_fn's output (tuple of tensor, list, str, numpy scalar) comes back unchanged."""
    options = dict(batch_size=4, collate_fn=ds.tuple_collate, **workers(num_workers))
    ref = parity(lambda: (ds.AugmentedDataset(10), options))
    assert ref[0][-1][2] == "custom-2"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_nested_samples_match(parity, num_workers):
    """Nested samples (dict/list/tuple/namedtuple of tensor/ndarray/int/float/str/bool) collate as in torch."""
    ref = parity(lambda: (ds.NestedDataset(10), dict(batch_size=4, **workers(num_workers))))
    first = ref[0][0]
    assert type(first["namedtuple"]) is ds.Point
    assert first["str"] == ["item-0", "item-1", "item-2", "item-3"]
    assert first["bool"].dtype == torch.bool


@pytest.mark.parametrize(("kind", "context"), [("map", "fork"), ("iterable", "fork"), ("map", "spawn")])
def test_persistent_workers_epochs_match(parity, kind, context):
    """With persistent_workers each of 3 epochs (shuffled, for map-style) matches torch's epoch."""
    options = dict(batch_size=3, persistent_workers=True, **workers(2, context))
    if kind == "map":
        parity(lambda: (ds.AugmentedDataset(11), dict(shuffle=True, **options)), epochs=3)
    else:
        parity(lambda: (ds.ShardedIterable(11), options), epochs=3)


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_persistent_workers_restart_mid_epoch_matches(parity, kind):
    """Abandoning a persistent-workers epoch after 2 batches, the next epochs still match torch's."""
    dataset = ds.AugmentedDataset if kind == "map" else ds.ShardedIterable
    options = dict(batch_size=2, persistent_workers=True, **workers(2))
    parity(lambda: (dataset(17), options), epochs=[2, None, 1])


@pytest.mark.parametrize("prefetch_factor", [1, 4])
def test_prefetch_factor_matches(parity, prefetch_factor):
    """prefetch_factor 1 and 4 change nothing about the batches."""
    options = dict(batch_size=2, prefetch_factor=prefetch_factor, **workers(2))
    parity(lambda: (ds.AugmentedDataset(20), options))


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_out_of_order_yields_same_batches(parity, kind):
    """in_order=False yields the same multiset of batches as torch (order may differ)."""
    # Out of order, torch hands map-style indices to whichever worker has room, so
    # per-worker random draws are timing-dependent there: use deterministic items.
    # An iterable's worker streams are fixed whichever worker is asked first.
    dataset = ds.PlainDataset if kind == "map" else ds.ShardedIterable
    parity(lambda: (dataset(21), dict(batch_size=3, in_order=False, **workers(2))), in_order=False)


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_worker_init_fn_effects_match(parity, kind):
    """worker_init_fn runs in each worker after seeding; its dataset edits and reseeds show as in torch."""
    dataset = ds.AugmentedDataset if kind == "map" else ds.ShardedIterable
    options = dict(batch_size=3, worker_init_fn=ds.offset_worker_init, **workers(2))
    ref = parity(lambda: (dataset(12), options))
    assert all(int(i) >= 1000 for batch in ref[0] for i in batch["index"])


def test_timeout_with_fast_dataset_matches(parity):
    """timeout>0 does not disturb a dataset that answers in time."""
    parity(lambda: (ds.AugmentedDataset(12), dict(batch_size=3, timeout=5, **workers(2))))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_memory_without_accelerator_warns_like_torch(parity, num_workers):
    """pin_memory=True on a CPU-only machine gives torch's warning and still the right batches."""
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present, so torch does not warn")
    parity(lambda: (ds.AugmentedDataset(8), dict(batch_size=4, pin_memory=True, **workers(num_workers))))


LENGTH_CASES = {
    "map": lambda: (ds.AugmentedDataset(23), dict(batch_size=5)),
    "map_drop_last": lambda: (ds.AugmentedDataset(23), dict(batch_size=5, drop_last=True)),
    "map_unbatched": lambda: (ds.AugmentedDataset(23), dict(batch_size=None)),
    "batch_sampler": lambda: (ds.AugmentedDataset(23), dict(batch_sampler=ds.IrregularBatchSampler(23))),
    "iterable": lambda: (ds.ShardedIterable(23), dict(batch_size=5)),
    "iterable_drop_last": lambda: (ds.ShardedIterable(23), dict(batch_size=5, drop_last=True)),
}


@pytest.mark.parametrize("case", list(LENGTH_CASES))
def test_len_matches(case):
    """len(loader) equals torch's, for map-style, batch_sampler and iterable datasets."""
    dataset, kwargs = LENGTH_CASES[case]()
    assert len(_candidate.DataLoader(dataset, num_workers=2, **kwargs)) == len(
        tud.DataLoader(dataset, num_workers=2, **kwargs)
    )


def test_is_a_torch_dataloader():
    """The candidate's loader is an instance of torch.utils.data.DataLoader."""
    assert isinstance(_candidate.DataLoader(ds.AugmentedDataset(4)), tud.DataLoader)


def test_worker_info_is_none_in_main_process():
    """get_worker_info() is None outside workers, as torch's is."""
    assert _candidate.get_worker_info() is None and tud.get_worker_info() is None


def _outcome(loader_cls, dataset, kwargs, action):
    """(exception type and message or None, [(warning category, message)]) of building then acting."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            action(loader_cls(dataset, **kwargs))
            error = None
        except Exception as e:  # noqa: BLE001 - any exception is part of the outcome compared
            error = (type(e), str(e))
    return error, [(w.category, str(w.message)) for w in caught]


_SAMPLER = tud.SequentialSampler(range(24))
_BATCH_SAMPLER = tud.BatchSampler(_SAMPLER, 4, drop_last=False)
BAD_ARGUMENTS = {
    "negative num_workers": ("map", dict(num_workers=-1)),
    "negative timeout": ("map", dict(timeout=-1)),
    "prefetch_factor without workers": ("map", dict(prefetch_factor=2)),
    "negative prefetch_factor": ("map", dict(num_workers=2, prefetch_factor=-1)),
    "persistent_workers without workers": ("map", dict(persistent_workers=True)),
    "unknown start method": ("map", dict(num_workers=2, multiprocessing_context="bogus")),
    "start method without workers": ("map", dict(multiprocessing_context="fork")),
    "context of the wrong type": ("map", dict(num_workers=2, multiprocessing_context=3)),
    "batch_sampler with batch_size": ("map", dict(batch_sampler=_BATCH_SAMPLER, batch_size=4)),
    "batch_sampler with drop_last": ("map", dict(batch_sampler=_BATCH_SAMPLER, drop_last=True)),
    "sampler with shuffle": ("map", dict(sampler=_SAMPLER, shuffle=True)),
    "batch_size None with drop_last": ("map", dict(batch_size=None, drop_last=True)),
    "iterable with shuffle": ("iterable", dict(shuffle=True)),
    "iterable with sampler": ("iterable", dict(sampler=_SAMPLER)),
    "iterable with batch_sampler": ("iterable", dict(batch_sampler=_BATCH_SAMPLER)),
}
_DATASETS = {"map": ds.AugmentedDataset(24), "iterable": ds.ShardedIterable(24)}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_constructor_rejects_like_torch(case):
    """Invalid arguments raise torch's exception type with torch's message."""
    kind, kwargs = BAD_ARGUMENTS[case]
    ref = _outcome(tud.DataLoader, _DATASETS[kind], kwargs, lambda loader: None)
    assert ref[0] is not None, "torch accepted it; the case is wrong"
    assert _outcome(_candidate.DataLoader, _DATASETS[kind], kwargs, lambda loader: None) == ref


@pytest.mark.parametrize("attribute", ["batch_size", "sampler", "dataset", "persistent_workers"])
def test_frozen_attributes_like_torch(attribute):
    """Setting a frozen attribute after construction raises torch's ValueError."""
    action = lambda loader: setattr(loader, attribute, None)  # noqa: E731
    ref = _outcome(tud.DataLoader, _DATASETS["map"], {}, action)
    assert ref[0] is not None and ref[0][0] is ValueError
    assert _outcome(_candidate.DataLoader, _DATASETS["map"], {}, action) == ref


def test_too_many_workers_warns_like_torch():
    """More workers than usable CPUs gives torch's UserWarning, at construction and at iteration."""
    count = torch._utils.cpu_count() or 1
    dataset = ds.PlainDataset(count + 1)
    kwargs = dict(batch_size=1, num_workers=count + 1, multiprocessing_context="fork")
    ref = _outcome(tud.DataLoader, dataset, kwargs, lambda loader: next(iter(loader)))
    assert ref[0] is None and len(ref[1]) == 2 and ref[1][0][0] is UserWarning
    assert _outcome(_candidate.DataLoader, dataset, kwargs, lambda loader: next(iter(loader))) == ref


def _flat(epoch):
    """An epoch of (worker id, index) or index batches of size 1, as plain lists."""
    if isinstance(epoch[0], torch.Tensor):
        return [int(b) for b in epoch], None
    return [int(b[1]) for b in epoch], [int(b[0]) for b in epoch]


@pytest.mark.hang_limit(90)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_out_of_order_does_not_wait_for_a_straggling_map_worker(parity, context, tmp_path):
    """in_order=False: while worker 0 sleeps on item 0, worker 1 takes every next task and its batches come first, as torch's."""
    options = dict(num_workers=2, prefetch_factor=2, in_order=False, multiprocessing_context=context)
    made = itertools.count()  # each loader's dataset has its own gate: worker 0 sleeps once worker 1 runs
    ref = parity(lambda: (ds.StragglerMap(10, slow=0, gate=str(tmp_path / f"gate-{next(made)}")), options))
    assert _flat(ref[0]) == ([1, 3, 4, 5, 6, 7, 8, 9, 0, 2], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0])


@pytest.mark.hang_limit(90)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_out_of_order_does_not_wait_for_a_straggling_iterable_worker(parity, context):
    """in_order=False: an iterable worker stuck on item 5 lets the other worker's items all come first, as torch's."""
    options = dict(num_workers=2, in_order=False, multiprocessing_context=context)
    ref = parity(lambda: (ds.StragglerIterable(5, slow=5), options))
    assert _flat(ref[0])[0] == list(range(10))


@pytest.mark.hang_limit(60)
def test_out_of_order_does_not_wait_for_a_straggling_collate(parity):
    """in_order=False: a collate_fn that stalls on item 0 holds back only its own worker, as torch's."""
    options = dict(in_order=False, collate_fn=ds.slow_on_zero_collate, **workers(2))
    ref = parity(lambda: (ds.StragglerMap(10, slow=-1), options))
    assert _flat(ref[0]) == ([1, 3, 4, 5, 6, 7, 8, 9, 0, 2], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0])


@pytest.mark.hang_limit(90)
@pytest.mark.parametrize("prefetch_factor", [1, 2])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_tasks_in_flight_do_not_shrink_while_the_consumer_holds_a_batch(tmp_path, context, prefetch_factor):
    """While the consumer holds batch 0, workers start num_workers*prefetch_factor+1 items, exactly as torch's do."""

    def started(cls, name):
        directory = tmp_path / name
        directory.mkdir()
        loader = cls(ds.StartLog(str(directory), 16, delay=0.05), batch_size=1, num_workers=2,
                     prefetch_factor=prefetch_factor, multiprocessing_context=context)  # fmt: skip
        it = iter(loader)
        held = next(it)  # noqa: F841 - held on purpose while the workers run
        time.sleep(1.0)  # every task sent so far is done by now
        count = len(os.listdir(directory))
        del held, it, loader
        return count

    ours, theirs = started(_candidate.DataLoader, "candidate"), started(tud.DataLoader, "torch")
    assert ours == theirs == 2 * prefetch_factor + 1


def test_forkserver_keeps_stragglers_and_the_in_flight_count_as_torch(forkserver_run):
    """Under forkserver too, an out-of-order straggler and a held batch leave torch's order and tasks in flight."""
    code, lines, err = forkserver_run
    assert code == 0, err
    _, orders, counts = lines
    assert orders == f"{[1, 3, 4, 5, 6, 7, 8, 9, 0, 2]} {[1, 3, 4, 5, 6, 7, 8, 9, 0, 2]}", lines
    assert counts == "3 3", lines
