"""What a dataset may offer fastfeed.DataLoader (fastfeed._dataset_hooks): declared by protocols that match the
datasets implementing them, found in one place, each optional, and refused clearly when it cannot be called."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import _shards
import fastfeed
from fastfeed import _dataset_hooks as dh
from fastfeed.io import Files, Shards

PACKAGE = Path(fastfeed.__file__).resolve().parent
PROTOCOLS = [c for c in vars(dh).values() if isinstance(c, type) and getattr(c, "_is_protocol", False)
             and c.__module__ == dh.__name__]  # fmt: skip
# Every method a protocol declares, by name, with the protocol that declares it (LoaderAware declares none of its
# own: it joins the others).
DECLARED = {name: proto for proto in PROTOCOLS for name, fn in vars(proto).items()
            if inspect.isfunction(fn) and not name.startswith("__")}  # fmt: skip


def _hooks_in(text: str) -> set[str]:
    """The ``_ff_`` names ``text`` refers to that are not a loader's own attributes: a name that is assigned
    anywhere (``self._ff_stats = ...``, a class-level ``_ff_tuner = None``) is state; a hook is defined, looked
    up and called, never assigned."""
    named = set(re.findall(r"(?<!\w)(_ff_\w+)", text))
    return named - set(re.findall(r"(?<!\w)(_ff_\w+)\s*(?::[^=\n]*)?=(?!=)", text))


def _sources() -> str:
    return "\n".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py")))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("shards")
    _shards.make(directory, (3, 2))
    return Shards(str(directory), decode=_shards.number)


def test_shards_offers_every_ff_hook_and_files_the_read_ahead(shards, tmp_path):
    assert isinstance(shards, dh.LoaderAware)
    for proto in (dh.LoaderSetup, dh.RankPosition, dh.WorkerSync):
        assert isinstance(shards, proto), proto.__name__
    assert not isinstance(shards, dh.ReadAhead)  # an IterableDataset picks its own samples
    (tmp_path / "a.bin").write_bytes(b"x")
    assert isinstance(Files([str(tmp_path / "a.bin")]), dh.ReadAhead)
    assert not isinstance(Files([str(tmp_path / "a.bin")]), dh.RankPosition)


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_each_declared_hook_has_its_implementations_signature(name):
    """The protocols declare the methods as the datasets define them: names, kinds and defaults of parameters."""
    implementer = Files if name == "prefetch" else Shards

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(getattr(implementer, name)) == shape(getattr(DECLARED[name], name))


def test_every_ff_hook_fastfeed_refers_to_is_declared():
    """A hook added anywhere under fastfeed/ (defined by a dataset, looked up or called by the loader) without a
    protocol declaring it fails here."""
    used = _hooks_in(_sources())
    # The scan finds the hooks in use today, and would find a new one however it is written.
    assert {"_ff_loader_setup", "_ff_position", "_ff_worker_sync", "_ff_worker_apply"} <= used
    assert _hooks_in('def _ff_a(self): ...\ngetattr(ds, "_ff_b", None)\nds._ff_c(1)\nloader._ff_d = 2\n') == {
        "_ff_a", "_ff_b", "_ff_c"}  # fmt: skip
    assert used - set(DECLARED) == set()


def test_only_the_hooks_module_looks_hooks_up():
    lookup = re.compile(r"""(?:getattr|hasattr)\([^,()]+,\s*["'](_ff_\w+|prefetch)["']""")
    assert lookup.search('getattr(loader.dataset, "prefetch", None)')
    found = {str(p.relative_to(PACKAGE)): lookup.findall(p.read_text()) for p in PACKAGE.rglob("*.py")
             if p.name != "_dataset_hooks.py"}  # fmt: skip
    assert {path: names for path, names in found.items() if names} == {}


class _Plain(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor(i)


class _Setup(_Plain):
    """Offers only the loader set-up, and a ``prefetch`` that is a setting of its own."""

    prefetch = 4

    def __init__(self):
        self.setups = []

    def _ff_loader_setup(self, **settings):
        self.setups.append(settings)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))

    def prefetch(self, indices):
        raise AssertionError("an IterableDataset's prefetch is never called")


def test_absent_hooks_are_none_and_present_ones_bound():
    assert dh.hooks_of(_Plain()) == dh.DatasetHooks()
    ds = _Setup()
    found = dh.hooks_of(ds)
    assert found.loader_setup.__self__ is ds
    assert (found.position, found.worker_sync, found.worker_apply, found.prefetch) == (None,) * 4
    assert dh.hooks_of(_Stream()).prefetch is None


def test_a_dataset_with_some_hooks_works_and_is_told_the_settings():
    ds = _Setup()
    loader = fastfeed.DataLoader(ds, batch_size=4, drop_last=True)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ds.setups == [dict(batch_size=4, drop_last=True, num_workers=0, prefetch_factor=None, epoch_starts=e)
                         for e in (False, True)]  # fmt: skip
    assert loader.state_dict()["shards"] is None  # no position hook: the loader keeps the position itself


class _ReadsAhead(_Plain):
    def __init__(self):
        self.announced = []

    def prefetch(self, indices):
        self.announced.extend(indices)


class _Synced(_Plain):
    """Persistent workers' copies take the main process's epoch."""

    def __init__(self):
        self.epoch, self.applied = 0, []

    def _ff_worker_sync(self):
        return {"epoch": self.epoch}

    def _ff_worker_apply(self, sync):
        self.applied.append(sync)


def test_thread_workers_call_the_hooks_they_find():
    ds = _ReadsAhead()
    assert sorted(int(x) for b in fastfeed.DataLoader(ds, batch_size=2, num_workers=2, worker_type="thread")
                  for x in b) == list(range(8))  # fmt: skip
    assert sorted(ds.announced) == list(range(8))
    ds = _Synced()
    loader = fastfeed.DataLoader(ds, batch_size=4, num_workers=2, worker_type="thread", persistent_workers=True)
    for epoch in range(3):
        ds.epoch = epoch
        assert len(list(loader)) == 2
    assert ds.applied == [{"epoch": 1}] * 2 + [{"epoch": 2}] * 2  # each worker at each later epoch


class _Broken(_Plain):
    _ff_position = {"epoch": 0}  # a position, where the hook that gives one belongs


def test_a_hook_that_is_not_callable_is_refused_naming_the_class_and_hook():
    with pytest.raises(TypeError, match=r"_Broken\._ff_position is a dict, not a method.*RankPosition"):
        dh.hooks_of(_Broken())
    with pytest.raises(TypeError, match=r"_Broken\._ff_position"):
        fastfeed.DataLoader(_Broken(), batch_size=2)  # when the loader is made, not later in a worker


class _HalfSynced(_Plain):
    def _ff_worker_sync(self):
        return {}


def test_worker_sync_without_its_apply_is_refused():
    with pytest.raises(TypeError, match=r"_HalfSynced has _ff_worker_sync and no _ff_worker_apply"):
        fastfeed.DataLoader(_HalfSynced(), batch_size=2, num_workers=1, persistent_workers=True)
