"""The tuning cache: fingerprints, hits and misses, concurrent writers, damaged files."""

import functools
import json
import multiprocessing
import os
import stat
import warnings
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from _tune_targets import Broken, Rows, result, stack
from fastfeed import topology
from fastfeed.tuning import TuneResult
from fastfeed.tuning.cache import Cache, fingerprint, key_of

SPACE = {"num_workers": "auto", "prefetch_factor": 2}
Pair = namedtuple("Pair", ["image", "label"])


def _fp(dataset=None, **changes):
    args = dict(batch_size=8, collate_fn=None, worker_type="process", space=SPACE, cpus={0, 1})
    args.update(changes)
    return fingerprint(Rows() if dataset is None else dataset, **args)


class Nested(torch.utils.data.Dataset):
    """One sample holding every kind of structure the fingerprint describes."""

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return {"pair": Pair(np.zeros((3, 4), np.uint8), 5), "rest": [torch.ones(2, dtype=torch.int64), "text", b"x"]}


def test_identical_fingerprint_hits(tmp_path):
    """A fingerprint computed again for the same dataset and loader finds the saved result."""
    cache = Cache(tmp_path / "tune.json")
    saved = result()
    cache.put(key_of(_fp()), saved, _fp())
    entry = cache.get(key_of(_fp()))
    assert entry is not None
    assert entry["loader_kwargs"] == saved.loader_kwargs()
    assert entry["fingerprint"] == _fp()
    assert TuneResult.from_dict(entry["result"]) == saved
    assert entry["saved"].endswith("+00:00")


@pytest.mark.parametrize(
    "change",
    [
        {"dataset": Rows(width=3)},
        {"batch_size": 16},
        {"cpus": {0}},
        {"worker_type": "thread"},
        {"collate_fn": stack},
        {"space": {"num_workers": "auto", "prefetch_factor": 4}},
    ],
    ids=["sample-shape", "batch-size", "cpus", "worker-type", "collate", "space"],
)
def test_changed_fingerprint_misses(tmp_path, change):
    """Changing what a result depends on gives another key, so the saved result is not reused."""
    cache = Cache(tmp_path / "tune.json")
    cache.put(key_of(_fp()), result(), _fp())
    assert key_of(_fp(**change)) != key_of(_fp())
    assert cache.get(key_of(_fp(**change))) is None


def test_fingerprint_describes_layout_not_values():
    """The sample is recorded as structure, shapes and dtypes, and the host by name, CPUs and memory."""
    fp = fingerprint(Nested(), batch_size=None, collate_fn=None, worker_type="process", space=SPACE)
    assert fp["dataset_type"] == f"{__name__}.Nested"
    assert fp["len"] == 1
    assert fp["sample"] == {
        "kind": "mapping",
        "len": 2,
        "items": {
            "pair": {"kind": "namedtuple", "type": f"{__name__}.Pair",
                     "items": [{"kind": "ndarray", "shape": [3, 4], "dtype": "uint8"}, {"kind": "int"}]},
            "rest": {"kind": "list", "len": 3,
                     "items": [{"kind": "tensor", "shape": [2], "dtype": "torch.int64"}, {"kind": "str"},
                               {"kind": "bytes"}]},
        },
    }  # fmt: skip
    assert fp["cpus"] == topology.format_cpus(topology.discover().allowed_cpus)
    assert fp["mem_total"] > 0
    assert fp["space"] == SPACE
    json.dumps(fp)  # the file stores it as JSON


def test_fingerprint_never_fails_on_the_sample():
    """A dataset whose first sample cannot be read is fingerprinted with the exception's name."""
    fp = _fp(Broken())
    assert fp["sample"] == {"error": "RuntimeError"}
    assert fp["len"] is None
    assert _fp(Rows(n=0))["sample"] == {"error": "IndexError"}


def test_collate_names():
    """torch's default collate counts as none; a partial is named by its function, an object by its type."""
    assert _fp(collate_fn=default_collate)["collate_fn"] is None
    assert _fp(collate_fn=functools.partial(stack))["collate_fn"] == "_tune_targets.stack"
    assert _fp(collate_fn=Rows())["collate_fn"] == "_tune_targets.Rows"


def _put_many(path, prefix, go):
    go.wait()
    cache = Cache(path)
    for i in range(20):
        cache.put(f"{prefix}{i}", result(num_workers=i), {"n": i})


def test_concurrent_puts_all_survive(tmp_path):
    """Two processes putting 20 different keys each at once lose none of them, and the file stays JSON."""
    path = tmp_path / "tune.json"
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=_put_many, args=(path, prefix, go)) for prefix in ("a", "b")]
    for p in procs:
        p.start()
    go.set()  # both start writing together, so their read-modify-writes overlap
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    with open(path) as f:
        data = json.load(f)
    assert sorted(data["entries"]) == sorted(f"{p}{i}" for p in "ab" for i in range(20))
    assert Cache(path).get("b7")["loader_kwargs"]["num_workers"] == 7


@pytest.mark.parametrize(
    "content", ["{not json", '{"some": "other file"}', "[1, 2]"], ids=["corrupt", "foreign", "list"]
)
def test_damaged_file_warns_and_is_empty(tmp_path, content):
    """A file that is not a tuning cache warns once, naming it, reads as empty, and is replaced by a put."""
    path = tmp_path / "tune.json"
    path.write_text(content)
    cache = Cache(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get("k") is None
    assert len(caught) == 1
    assert str(path) in str(caught[0].message)
    with pytest.warns(UserWarning, match="tune.json"):
        cache.put("k", result(), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(cache.entries()) == ["k"]


def test_missing_file_and_clear(tmp_path):
    """A missing cache is empty; put makes a private folder; clear counts and removes the entries."""
    cache = Cache(tmp_path / "new" / "tune.json")
    assert cache.entries() == {}
    assert cache.clear() == 0
    cache.put("a", result(), {})
    cache.put("b", result(), {})
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700
    assert cache.clear() == 2
    assert cache.entries() == {}
    assert cache.clear() == 0


def test_default_path_follows_cache_dir(tmp_path, monkeypatch):
    """Without a path the cache is tune.json in FASTFEED_CACHE_DIR."""
    monkeypatch.setenv("FASTFEED_CACHE_DIR", str(tmp_path))
    assert Cache().path == str(tmp_path / "tune.json")
