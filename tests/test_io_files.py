"""fastfeed.io: the read-ahead protocol, Files on local disk, and the no-evict cache."""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

import fastfeed
from fastfeed.io import Files
from fastfeed.io import files as io_files
from fastfeed.io.cache import Cache

pytestmark = pytest.mark.fastfeed_only


class Announced(Dataset):
    """Records, in a file per process, each prefetch(indices) call and each __getitem__, in order."""

    def __init__(self, n: int, log_dir: str, fail: bool = False) -> None:
        self.n, self.log_dir, self.fail = n, log_dir, fail

    def __len__(self) -> int:
        return self.n

    def _log(self, line: str) -> None:
        with open(os.path.join(self.log_dir, f"{os.getpid()}.log"), "a") as f:
            f.write(line + "\n")

    def prefetch(self, indices) -> None:
        if self.fail:
            raise RuntimeError("prefetch is broken")
        self._log("p " + " ".join(map(str, indices)))

    def __getitem__(self, i: int):
        self._log(f"g {i}")
        return torch.tensor(i)


def _logs(log_dir) -> list[list[str]]:
    return [open(os.path.join(log_dir, f)).read().split("\n")[:-1] for f in sorted(os.listdir(log_dir))]


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_workers_announce_every_sample_before_reading_it(tmp_path, worker_type):
    """Each worker passes the indices of the tasks it holds to prefetch() before it reads any of them."""
    ds = Announced(64, str(tmp_path))
    got = [b.clone() for b in fastfeed.DataLoader(ds, batch_size=4, num_workers=2, shuffle=True,
                                                   worker_type=worker_type)]  # fmt: skip
    assert sorted(torch.cat(got).tolist()) == list(range(64))
    lines = [line for log in _logs(tmp_path) for line in log]
    if worker_type == "process":
        assert len(_logs(tmp_path)) == 2  # one log per worker process
    announced: set[int] = set()
    for log in _logs(tmp_path):
        announced = set()
        for line in log:
            kind, *rest = line.split()
            if kind == "p":
                announced.update(map(int, rest))
            else:
                assert int(rest[0]) in announced, f"sample {rest[0]} read before it was announced"
    assert sum(line.startswith("g") for line in lines) == 64


def test_more_than_the_current_task_is_announced_when_tasks_queue(tmp_path):
    """With tasks queued behind a slow one, a worker announces them ahead of reading them."""

    class Slow(Announced):
        def __getitem__(self, i):
            time.sleep(0.01)
            return super().__getitem__(i)

    for _ in fastfeed.DataLoader(Slow(64, str(tmp_path)), batch_size=4, num_workers=1, prefetch_factor=4):
        pass
    (log,) = _logs(tmp_path)
    ahead = 0
    announced, read = set(), set()
    for line in log:
        kind, *rest = line.split()
        if kind == "p":
            announced.update(map(int, rest))
        else:
            read.add(int(rest[0]))
        ahead = max(ahead, len(announced - read))
    assert ahead >= 8, ahead  # at least two batches announced beyond the one being read


def test_without_workers_the_loader_announces_one_batch_ahead(tmp_path):
    """num_workers=0: batch k+1's indices are announced before batch k is returned, and nothing changes order."""
    ds = Announced(20, str(tmp_path))
    torch.manual_seed(0)
    it = iter(fastfeed.DataLoader(ds, batch_size=4, shuffle=True))
    first = next(it).tolist()
    (log,) = _logs(tmp_path)
    announced = [line for line in log if line.startswith("p")]
    assert len(announced) == 2 and announced[0] == "p " + " ".join(map(str, first))
    rest = [b.tolist() for b in it]
    torch.manual_seed(0)
    assert [first, *rest] == [b.tolist() for b in TorchLoader(Announced(20, str(tmp_path)), batch_size=4, shuffle=True)]


def test_a_prefetch_that_raises_warns_once_and_loading_goes_on(tmp_path):
    """prefetch() is a hint: when it raises, a warning says so and every batch still arrives."""
    ds = Announced(16, str(tmp_path), fail=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [b.clone() for b in fastfeed.DataLoader(ds, batch_size=4, num_workers=1, worker_type="thread")]
    assert torch.cat(got).tolist() == list(range(16))
    assert sum("prefetch() raised" in str(w.message) for w in caught) == 1


# -- Files on local disk -------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    paths = []
    for i in range(40):
        p = root / ("sub" if i % 2 else "") / f"f{i:03d}.bin"
        p.write_bytes(bytes([i]) * (100 + i))
        paths.append(str(p))
    return root, paths


class PlainFiles(Dataset):
    """What a torch user writes: open and read each path."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return torch.tensor(len(f.read()) * 1000 + f.name.count("sub"))


def _size_and_dir(data: bytes) -> torch.Tensor:
    return torch.tensor(len(data) * 1000 + (data[0] % 2))


@pytest.mark.parametrize("nw", [0, 2])
def test_files_give_torchs_batches_in_torchs_order(files, nw):
    """Files with read-ahead yields the same samples in the same order as a plain Dataset under torch."""
    _, paths = files
    torch.manual_seed(3)
    expected = [b.tolist() for b in TorchLoader(PlainFiles(paths), batch_size=5, shuffle=True, num_workers=nw)]
    torch.manual_seed(3)
    ds = Files(paths, decode=_size_and_dir, readahead=4)
    got = [b.tolist() for b in fastfeed.DataLoader(ds, batch_size=5, shuffle=True, num_workers=nw)]
    assert got == expected
    ds.close()


def test_a_directory_and_pattern_are_listed_sorted_and_lazily(files):
    """(directory, pattern) lists matching files, sorted, recursing with **, only when first needed."""
    root, paths = files
    ds = Files((str(root), "**/*.bin"))
    assert ds._sources is None  # nothing listed yet
    assert len(ds) == 40 and list(ds.sources) == sorted(paths)
    assert ds[0] == open(sorted(paths)[0], "rb").read()
    with pytest.raises(FileNotFoundError, match="no file matches"):
        len(Files((str(root), "*.jpg")))


def test_a_list_of_millions_starts_at_once():
    """A list of a million paths is kept as given: no stat, no copy."""
    paths = [f"/nonexistent/{i}.jpg" for i in range(1_000_000)]
    # This thread's CPU time, not the wall clock: other processes' load cannot stretch it, and a pass over the list
    # (a stat each, a check each) would cost far more than the bound.
    cpu0 = time.thread_time()
    ds = Files(paths)
    assert len(ds) == 1_000_000 and time.thread_time() - cpu0 < 0.1
    assert ds.sources is paths


@pytest.mark.parametrize("kwargs, error", [
    ({"sources": "one/path.jpg"}, TypeError), ({"sources": [], "readahead": -1}, ValueError),
    ({"sources": [], "retries": 1.5}, ValueError), ({"sources": [], "decode": 3}, TypeError),
    ({"sources": [], "cache_dir": "x", "cache_bytes": -1}, ValueError),
])  # fmt: skip
def test_bad_arguments_say_what_is_wrong(kwargs, error):
    """Wrong argument types and ranges raise at construction, naming the argument."""
    with pytest.raises(error, match="sources|readahead|retries|decode|cache_bytes"):
        Files(**kwargs)


def test_a_missing_file_names_the_source_and_the_index_from_a_worker(files, tmp_path, monkeypatch):
    """A missing file raises FileNotFoundError naming it and its sample index, through a worker, at once."""
    _, paths = files
    reads = tmp_path / "reads.log"
    read_local = io_files._read_local

    def logged(path):
        with open(reads, "a") as f:  # the worker's reads, seen from here: a file, as it is another process
            f.write(path + "\n")
        return read_local(path)

    monkeypatch.setattr(io_files, "_read_local", logged)  # the forked worker inherits it
    ds = Files([*paths[:3], "/nonexistent/gone.bin"], retries=3)
    with pytest.raises(FileNotFoundError, match=r"sample 3: cannot read /nonexistent/gone.bin"):
        list(fastfeed.DataLoader(ds, batch_size=2, num_workers=1))
    # Not retried (it will not appear): one attempt at it, counted, where a time taken would stretch with the load.
    assert reads.read_text().splitlines().count("/nonexistent/gone.bin") == 1


def test_an_unreadable_file_is_a_clear_error(files):
    """A directory where a file should be: a clear error naming it."""
    root, _ = files
    with pytest.raises(IsADirectoryError, match="sample 0"):
        Files([str(root / "sub")])[0]


# -- the cache -----------------------------------------------------------------------------------


def test_the_cache_admits_until_full_then_stops_and_never_evicts(files, tmp_path):
    """Entries are admitted on first read until cache_bytes; later files are not admitted; none is evicted."""
    _, paths = files
    cache_dir = tmp_path / "cache"
    ds = Files(paths, cache_dir=cache_dir, cache_bytes=1000)
    for i in range(len(paths)):
        assert ds[i] == open(paths[i], "rb").read()
    admitted = {p for p in paths if ds.cache.get(p, [os.path.getsize(p), os.stat(p).st_mtime_ns]) is not None}
    assert paths[:9] == sorted(admitted, key=paths.index)  # 100+101+...+108 = 936 bytes; +109 would pass 1000
    assert ds.cache.used() <= 1000
    for i in range(len(paths)):  # a second epoch: the same entries, none evicted, none added
        ds[i]
    assert {p for p in paths if ds.cache.get(p, [os.path.getsize(p), os.stat(p).st_mtime_ns])} == admitted


def test_a_cached_entry_is_served_from_the_cache(files, tmp_path):
    """A second read of a cached file comes from the cache (the source's bytes may differ only by version)."""
    _, paths = files
    ds = Files(paths[:1], cache_dir=tmp_path / "cache")
    first = ds[0]
    entry = ds.cache._path(paths[0])
    assert entry.exists() and oct(entry.stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o700"
    assert ds[0] == first


def test_a_changed_source_is_refetched_and_a_damaged_entry_ignored(files, tmp_path):
    """An entry whose source changed size or mtime is refetched; one whose body is short is not trusted."""
    _, paths = files
    ds = Files(paths[:1], cache_dir=tmp_path / "cache")
    ds[0]
    with open(paths[0], "wb") as f:
        f.write(b"new contents")
    assert ds[0] == b"new contents"
    entry = ds.cache._path(paths[0])
    entry.write_bytes(entry.read_bytes()[:-3])  # damaged: shorter than its header says
    assert ds[0] == b"new contents"


def _read_all(args):
    paths, cache_dir = args
    ds = Files(paths, cache_dir=cache_dir, cache_bytes=3000)
    return [ds[i] == open(p, "rb").read() for i, p in enumerate(paths)]


def test_concurrent_writers_of_one_cache_stay_correct_and_within_the_limit(files, tmp_path):
    """Four processes caching the same files at once: every read is right and the limit holds for all together."""
    _, paths = files
    cache_dir = str(tmp_path / "cache")
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_read_all, [(paths, cache_dir)] * 4)
    assert all(all(r) for r in results)
    cache = Cache(cache_dir, 3000)
    assert cache.used() <= 3000
    leftovers = [n for n in os.listdir(cache_dir) if n.endswith(".tmp")]
    assert not leftovers
    again = Files(paths, cache_dir=cache_dir, cache_bytes=3000)
    assert all(again[i] == open(p, "rb").read() for i, p in enumerate(paths))


def test_network_filesystems_are_told_from_local_disks(monkeypatch):
    """mountinfo lines give each mount's type, matched by the longest mount point; NFS and FUSE are network."""
    from fastfeed.io import mounts

    text = ("22 1 8:1 / / rw - ext4 /dev/vda rw\n"
            "40 22 0:50 / /mnt/data rw,relatime - nfs4 srv:/export rw\n"
            "41 22 0:51 / /mnt/data\\040x rw - fuse.s3fs s3fs rw\n")  # fmt: skip
    parsed = mounts.parse_mountinfo(text)
    assert parsed[0] == ("/mnt/data x", "fuse.s3fs") and ("/", "ext4") in parsed
    monkeypatch.setattr(mounts, "_mounts", lambda: parsed)
    mounts._type_of_dir.cache_clear()
    try:
        assert mounts.is_network("/mnt/data/train/0.jpg") and mounts.is_network("/mnt/data x/0.jpg")
        assert not mounts.is_network("/mnt/database/0.jpg") and not mounts.is_network("/home/me/0.jpg")
    finally:
        mounts._type_of_dir.cache_clear()
