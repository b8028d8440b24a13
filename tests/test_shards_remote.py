"""fastfeed.io.Shards over HTTP (the latency and fault server) and S3 (moto's server): the same samples as from
local disk, one download per shard per machine, the cache's bound and its farthest-next-use eviction, faults."""

from __future__ import annotations

import os

import pytest

import _shards
from _s3 import s3_server  # noqa: F401 (a fixture)
from fastfeed import DataLoader
from fastfeed.io import ShardError, Shards, write_shards

pytest.importorskip("aiohttp", reason="the HTTP tests need aiohttp (the [remote] extra)")
from fastfeed.bench.http import FileServer  # noqa: E402

N = sum(_shards.UNEQUAL)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("shards")
    _shards.make(directory, payload=2000)
    return str(directory)


@pytest.fixture(scope="module", autouse=True)
def fsspec_loop():
    """fsspec's event-loop thread lives as long as the process: start it before the first leak check."""
    import fsspec.asyn

    fsspec.asyn.get_loop()


@pytest.fixture
def server(shard_dir):
    with FileServer(shard_dir, latency=0.002, jitter=0.002) as s:
        yield s


def pattern(server) -> str:
    return f"{server.url}/shard-{{000000..{len(_shards.UNEQUAL) - 1:06d}}}.tar"


def epoch_of(ds, batch_size=4, **loader_kw) -> list[int]:
    return _shards.flat(DataLoader(ds, batch_size=batch_size, **loader_kw))


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_http_shards_give_the_local_samples_downloading_each_shard_once(shard_dir, server, tmp_path, worker_type):
    """Over HTTP (a brace pattern, the index fetched from beside the shards) with 2 workers: the local run's
    samples in its order, and each shard downloaded once for the machine; a second epoch downloads nothing."""
    local = epoch_of(Shards(shard_dir, decode=_shards.as_tensor, shuffle=True, seed=2, shuffle_window=2))
    ds = Shards(pattern(server), decode=_shards.as_tensor, shuffle=True, seed=2, shuffle_window=2,
                cache_dir=tmp_path)  # fmt: skip
    assert epoch_of(ds, num_workers=2, worker_type=worker_type) == local
    stats = ds.cache_stats()
    assert stats["downloads"] == len(_shards.UNEQUAL) and stats["hits"] >= 0
    sizes = sum(os.path.getsize(os.path.join(shard_dir, f)) for f in os.listdir(shard_dir) if f.endswith(".tar"))
    assert stats["downloaded_bytes"] == sizes
    assert epoch_of(ds, num_workers=2, worker_type=worker_type) == local
    assert ds.cache_stats()["downloads"] == len(_shards.UNEQUAL)
    ds.cache.close()


def test_a_shard_that_fails_twice_is_retried_and_read_whole(shard_dir, server, tmp_path):
    """A shard answering 500 twice, then truncating once, is retried: the epoch is the local one."""
    local = epoch_of(Shards(shard_dir, decode=_shards.as_tensor))
    server.faults["shard-000002.tar"] = {"fail": 2}
    ds = Shards(pattern(server), decode=_shards.as_tensor, cache_dir=tmp_path, retries=3)
    assert epoch_of(ds, num_workers=1) == local


@pytest.mark.parametrize("fault,detail", [({"fail": 100}, "500"), ({"status": 404}, "not found|404"),
                                          ({"truncate": True}, "short|truncat|bytes")])  # fmt: skip
def test_a_shard_that_cannot_be_read_raises_naming_it_and_the_sample_with_nothing_partial(
        shard_dir, server, tmp_path, fault, detail):  # fmt: skip
    """A shard failing every retry (500, 404, a truncated body): ShardError names the shard's URL and the sample
    whose read needed it; every sample yielded before it is whole and in the local order."""
    local = epoch_of(Shards(shard_dir, decode=_shards.number), batch_size=None)
    server.faults["shard-000003.tar"] = dict(fault)
    ds = Shards(pattern(server), decode=_shards.number, cache_dir=tmp_path, retries=1, predownload=0,
                shuffle_window=1)  # fmt: skip
    got = []
    with pytest.raises(ShardError, match=detail) as caught:
        for sample in DataLoader(ds, batch_size=None, num_workers=1):
            got.append(sample)
    first_of_shard = sum(_shards.UNEQUAL[:3])
    assert got == local[:first_of_shard]
    assert caught.value.shard == f"{server.url}/shard-000003.tar"
    assert caught.value.key == f"s{first_of_shard:06d}"


def test_epoch_two_downloads_about_what_the_cache_could_not_hold(tmp_path):
    """Data twice the cache: epoch 2 downloads at most (data - cache) x 1.1 with farthest-next-use eviction, and
    the same run with LRU downloads more; the cache never holds more than its bound."""
    counts = (6,) * 48
    _shards.make(tmp_path / "data", counts, payload=2000)
    shard_bytes = os.path.getsize(tmp_path / "data" / "shard-000000.tar")
    data = shard_bytes * len(counts)
    cache = data // 2
    downloaded = {}
    with FileServer(tmp_path / "data") as server:
        for policy in ("farthest", "lru"):
            ds = Shards(f"{server.url}/shard-{{000000..000047}}.tar", decode=_shards.as_tensor, shuffle=True,
                        shuffle_window=2, predownload=2, cache_dir=tmp_path / policy, cache_bytes=cache,
                        cache_policy=policy)  # fmt: skip
            dl = DataLoader(ds, batch_size=6, num_workers=2)
            for epoch in (0, 1):
                ds.set_epoch(epoch)
                before = ds.cache_stats()["downloaded_bytes"]
                assert len(_shards.flat(dl)) == len(ds)
                after = ds.cache_stats()
            downloaded[policy] = after["downloaded_bytes"] - before
            assert after["peak_bytes"] <= cache
    assert downloaded["farthest"] <= (data - cache) * 1.1, (downloaded, data - cache)
    assert downloaded["lru"] > downloaded["farthest"]


def test_shards_written_to_s3_are_read_back_through_s3fs(s3_server, tmp_path):  # noqa: F811
    """write_shards to an s3:// prefix on moto's server, then Shards over it: the samples written, in order."""
    bucket = s3_server.bucket()
    samples = [{"txt": str(i).encode(), "cls": str(i % 3).encode()} for i in range(40)]
    urls = write_shards(samples, f"s3://{bucket}/train/", shard_bytes=8000, progress=False,
                        storage_options=s3_server.storage_options, num_workers=0)  # fmt: skip
    assert len(urls) > 2
    ds = Shards(f"s3://{bucket}/train/", decode=_shards.number, cache_dir=tmp_path,
                storage_options=s3_server.storage_options)  # fmt: skip
    assert _shards.flat(DataLoader(ds, batch_size=5, num_workers=2)) == list(range(40))
    assert ds.cache_stats()["downloads"] == len(urls)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_smallest_cache_the_constructor_accepts_finishes_epochs(tmp_path, num_workers):
    """shuffle_window=1 and cache_bytes exactly what Shards accepts (two of the largest shards): both epochs end,
    each sample once, within the bound. Shards of fewer samples than the batches in flight used to make readers
    protect more shards than the constructor asked room for, and wait for room that never came."""
    _shards.make(tmp_path / "data", (20,) * 6, payload=20_000)
    largest = max(os.path.getsize(tmp_path / "data" / f"shard-{k:06d}.tar") for k in range(6))
    with FileServer(tmp_path / "data") as server:
        url = f"{server.url}/shard-{{000000..000005}}.tar"
        with pytest.raises(ValueError, match=rf"cache_bytes={2 * largest - 1} cannot hold.*at least {2 * largest}"):
            Shards(url, shuffle_window=1, cache_dir=tmp_path / "cache", cache_bytes=2 * largest - 1)
        ds = Shards(url, decode=_shards.as_tensor, shuffle=True, shuffle_window=1, cache_dir=tmp_path / "cache",
                    cache_bytes=2 * largest)  # fmt: skip
        ds.cache.wait_s = 10  # a read that cannot find room fails in seconds, not the default minute
        dl = DataLoader(ds, batch_size=16, num_workers=num_workers)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            assert sorted(_shards.flat(dl)) == list(range(120))
        assert ds.cache_stats()["peak_bytes"] <= 2 * largest


def test_a_constructor_that_fails_leaves_no_default_cache_directory(shard_dir, server, tmp_path, monkeypatch):
    """Shards over URLs without cache_dir makes its default directory under the temp directory; when the
    constructor then fails (a bad cache_policy), that directory is gone again."""
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    os.mkdir(tmp_path / "tmp")
    with pytest.raises(ValueError, match="policy must be one of"):
        Shards(pattern(server), cache_policy="mru")
    assert os.listdir(tmp_path / "tmp") == []
    Shards(pattern(server))  # a constructor that succeeds keeps it, for its cache
    assert os.listdir(tmp_path / "tmp") == [f"fastfeed-shards-{os.getuid()}"]


def test_an_index_beside_the_shards_that_is_denied_is_taken_as_absent(shard_dir, server, tmp_path):
    """S3 answers 403 for a missing key when listing is not allowed: a denied index beside the shards warns that
    it was denied, then the shards are indexed by reading them, and the epoch is whole."""
    server.faults["fastfeed-index.json"] = {"status": 403}
    with pytest.warns(UserWarning, match=r"reading .*fastfeed-index.json was denied \(HTTP 403.*reading all 10"):
        ds = Shards(pattern(server), decode=_shards.as_tensor, cache_dir=tmp_path / "cache")
    assert sorted(epoch_of(ds, batch_size=5)) == list(range(N))
