"""Drop-in details that torch 2.13 checks for: ``DataLoader[T]`` subscripting, and start methods that pickle.

Under spawn and forkserver, a worker's arguments (dataset, collate_fn, worker_init_fn)
are pickled when the worker starts. When they cannot be, torch warns ("Got pickle
error ...") and re-raises the pickling error from ``iter(loader)``; each scenario here
runs through torch's DataLoader and the candidate's and the two must agree, with
nothing left behind (the autouse leak check).
"""

import inspect
import multiprocessing
import threading
import typing
import warnings

import pytest
import torch
import torch.utils.data as tud

import _candidate
import _datasets as ds
import _leaks
from _compare import assert_same

# --- DataLoader[T] ----------------------------------------------------------------------

Batch = dict[str, torch.Tensor]


@pytest.mark.parametrize("cls", [tud.DataLoader, _candidate.DataLoader], ids=["torch", "candidate"])
def test_subscripted_loader_constructs_and_yields(cls):
    """DataLoader[T] is a generic alias that builds a loader of the class itself, yielding its batches."""
    alias = cls[Batch]
    assert typing.get_origin(alias) is cls and typing.get_args(alias) == (Batch,)
    loader = alias(ds.PlainDataset(6), batch_size=4)
    assert type(loader) is cls
    batches = list(loader)
    assert len(batches) == 2
    assert_same(batches[0], ds.expected_plain_batch([0, 1, 2, 3]))
    assert_same(batches[1], ds.expected_plain_batch([4, 5]))


def test_generic_parameter_matches_torch():
    """The candidate's type parameter is one covariant TypeVar, as torch's, so annotations mean the same."""
    (ours,) = _candidate.DataLoader.__parameters__
    (theirs,) = tud.DataLoader.__parameters__
    assert (ours.__covariant__, ours.__contravariant__) == (theirs.__covariant__, theirs.__contravariant__)
    assert issubclass(_candidate.DataLoader, tud.DataLoader)


def test_subscripted_annotations_evaluate():
    """Functions annotated with DataLoader[Batch] (torch's and the candidate's) have hints that resolve."""

    def train(loader: _candidate.DataLoader[Batch], ref: tud.DataLoader[Batch]) -> _candidate.DataLoader[Batch]:
        return loader

    hints = typing.get_type_hints(train)
    assert hints["loader"] == hints["return"] == _candidate.DataLoader[Batch]
    assert hints["ref"] == tud.DataLoader[Batch]


# --- start methods that pickle ----------------------------------------------------------


class LockedDataset(ds.PlainDataset):
    """PlainDataset holding a lock: it cannot be pickled."""

    def __init__(self, n=8):
        super().__init__(n)
        self.lock = threading.Lock()


class LambdaDataset(ds.PlainDataset):
    """PlainDataset holding a lambda: it cannot be pickled by reference."""

    def __init__(self, n=8):
        super().__init__(n)
        self.transform = lambda x: x


class PicklesOnce(ds.PlainDataset):
    """Pickles for the first worker only; the second worker's start fails."""

    def __init__(self, n=8):
        super().__init__(n)
        self.pickled = 0

    def __reduce_ex__(self, protocol):
        self.pickled += 1
        if self.pickled > 1:
            raise TypeError("PicklesOnce: pickled once already")
        return PicklesOnce, (self.n,)


def unpicklable(kind):
    """(dataset, extra DataLoader kwargs) with one argument that cannot be pickled."""

    def local_worker_init(worker_id):
        pass

    if kind == "worker_init_fn":
        return ds.PlainDataset(8), {"worker_init_fn": local_worker_init}
    if kind == "collate_fn":
        return ds.PlainDataset(8), {"collate_fn": lambda batch: batch}
    if kind == "dataset_lock":
        return LockedDataset(), {}
    if kind == "dataset_lambda":
        return LambdaDataset(), {}
    raise ValueError(kind)


KINDS = ["worker_init_fn", "collate_fn", "dataset_lock", "dataset_lambda"]


def start_fails(loader_cls, dataset, **kwargs):
    """iter() a loader whose workers cannot start: (error, [(category, message, filename, lineno)])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = loader_cls(dataset, batch_size=2, **kwargs)
        try:
            next(iter(loader))
        except Exception as e:  # noqa: BLE001 - compared by the caller
            error = _leaks.drop_tracebacks(e)
        else:
            pytest.fail(f"{loader_cls.__module__}.DataLoader started workers it could not pickle for")
    return error, [(w.category, str(w.message), w.filename, w.lineno) for w in caught]


def assert_fails_like_torch(make, **kwargs):
    """Run make()'s (dataset, kwargs) through torch, then the candidate: same warnings and error."""
    outcomes = {}
    for name, cls in (("torch", tud.DataLoader), ("candidate", _candidate.DataLoader)):
        dataset, extra = make()
        outcomes[name] = start_fails(cls, dataset, **extra, **kwargs)
    (ref_error, ref_warnings), (got_error, got_warnings) = outcomes["torch"], outcomes["candidate"]
    assert [w[:2] for w in got_warnings] == [w[:2] for w in ref_warnings]
    assert [w[0] for w in ref_warnings] == [UserWarning]
    assert ref_warnings[0][1].startswith("Got pickle error when attempting to start a worker Process.")
    assert type(got_error) is type(ref_error)
    assert str(got_error) == str(ref_error)
    return outcomes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_unpicklable_arguments_fail_like_torch(context, kind):
    """An argument spawn/forkserver cannot pickle: torch's UserWarning, then its error, from iter()."""
    assert_fails_like_torch(lambda: unpicklable(kind), num_workers=2, multiprocessing_context=context)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_global_start_method_fails_like_torch(method, kind):
    """With multiprocessing.set_start_method(spawn/forkserver), unpicklable arguments fail as torch's do."""
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(method, force=True)
    try:
        assert_fails_like_torch(lambda: unpicklable(kind), num_workers=2)
    finally:
        multiprocessing.set_start_method(previous, force=True)


def test_context_object_fails_like_torch():
    """A spawn context object (not its name) fails as torch's does on an unpicklable collate_fn."""
    context = multiprocessing.get_context("spawn")
    assert_fails_like_torch(lambda: unpicklable("collate_fn"), num_workers=1, multiprocessing_context=context)


@pytest.mark.parametrize("cls", [tud.DataLoader, _candidate.DataLoader], ids=["torch", "candidate"])
def test_pickle_warning_points_at_get_iterator(cls):
    """The warning names the line in the loader class's _get_iterator that makes the iterator, as torch's does."""
    dataset, extra = unpicklable("collate_fn")
    _, caught = start_fails(cls, dataset, **extra, num_workers=1, multiprocessing_context="spawn")
    (_, _, filename, lineno) = caught[0]
    lines, first = inspect.getsourcelines(cls._get_iterator)
    assert filename == inspect.getsourcefile(cls._get_iterator)
    assert first <= lineno < first + len(lines)


@pytest.mark.fastfeed_only
@pytest.mark.hang_limit(60)
def test_later_worker_unpicklable_stops_started_ones(spawn_picklable):
    """When a later worker's arguments fail to pickle, the workers already started are stopped, warned as torch."""
    spawn_picklable(PicklesOnce(8))
    dataset = PicklesOnce(8)
    error, caught = start_fails(_candidate.DataLoader, dataset, num_workers=2, multiprocessing_context="spawn")
    assert dataset.pickled == 2  # worker 0 got its copy and started
    assert type(error) is TypeError and str(error) == "PicklesOnce: pickled once already"
    assert [w[0] for w in caught] == [UserWarning]
    assert caught[0][1].startswith("Got pickle error when attempting to start a worker Process.")
    # The autouse leak check then finds no worker, pipe or segment left.
