"""fastfeed.io.Files over HTTP: a real server on 127.0.0.1 (fastfeed/bench/http.py) with latency and faults, and
fsspec's HTTP filesystem as the client. Every test iterates through worker processes, so no fsspec event loop
or connection outlives a test in this process."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

from _load import Within
import fastfeed
from fastfeed.io import Files

from fastfeed.bench.http import FileServer, make_files

pytestmark = pytest.mark.fastfeed_only


def _size(data: bytes) -> torch.Tensor:
    return torch.tensor(len(data))


@pytest.fixture
def site(tmp_path):
    rel = make_files(tmp_path / "www", 48, 2000)
    with FileServer(tmp_path / "www") as server:
        yield server, rel, tmp_path


class UrlSizes(Dataset):
    """A torch user's dataset: read each URL whole with fsspec."""

    def __init__(self, urls):
        self.urls = urls

    def __len__(self):
        return len(self.urls)

    def __getitem__(self, i):
        import fsspec

        return _size(fsspec.filesystem("http", skip_instance_cache=True).cat_file(self.urls[i]))


def test_remote_files_arrive_whole_in_torchs_order(site):
    """Files over HTTP yields each file's bytes in the order torch's loader yields a plain URL dataset's."""
    server, rel, _ = site
    urls = [server.url_of(r) for r in rel]
    torch.manual_seed(1)
    expected = [b.tolist() for b in TorchLoader(UrlSizes(urls), batch_size=6, shuffle=True, num_workers=2)]
    torch.manual_seed(1)
    got = [b.tolist() for b in fastfeed.DataLoader(Files(urls, decode=_size), batch_size=6, shuffle=True,
                                                   num_workers=2)]  # fmt: skip
    assert got == expected
    raw = next(iter(fastfeed.DataLoader(Files(urls[:1]), batch_size=None, num_workers=1)))
    assert raw == open(site[2] / "www" / rel[0], "rb").read()


def test_reads_behind_latency_run_in_flight(site):
    """48 files at 50 ms each through one worker take well under half of 48 x 50 ms: the reads overlap (16 in
    flight: about 0.15 s of requests, plus starting the worker on a busy machine)."""
    server, rel, _ = site
    server.latency = 0.05
    urls = [server.url_of(r) for r in rel]
    with Within(48 * 0.05 / 2, "48 reads at 50 ms through one worker"):
        n = sum(len(b) for b in fastfeed.DataLoader(Files(urls, decode=_size, readahead=16), batch_size=8,
                                                      num_workers=1, prefetch_factor=6))  # fmt: skip
    assert n == 48


def test_failing_requests_are_retried(site):
    """Two 500s then success: the sample arrives."""
    server, rel, _ = site
    server.faults[rel[0]] = {"fail": 2}
    got = next(iter(fastfeed.DataLoader(Files([server.url_of(rel[0])], decode=_size, retries=3), batch_size=1,
                                        num_workers=1)))  # fmt: skip
    assert got.item() == os.path.getsize(site[2] / "www" / rel[0])


@pytest.mark.parametrize("fault, error, message", [
    ({"fail": 100}, OSError, "failed 3 time"),
    ({"truncate": True}, OSError, "failed 3 time"),
    ({"stall": True}, OSError, "failed 3 time.*no data for 1 s"),
    ({"status": 404}, FileNotFoundError, "cannot read"),
])  # fmt: skip
def test_a_read_that_keeps_failing_names_the_source_and_index_and_never_hangs(site, fault, error, message):
    """Errors, truncated bodies and a server that never answers end in an error naming the URL and the sample."""
    server, rel, _ = site
    server.faults[rel[3]] = fault
    urls = [server.url_of(r) for r in rel[:4]]
    # Never hangs, told by counts rather than by a time that load stretches: the error says how many attempts were
    # made (retries=2: 3, then no more), that the silent server's were each ended by the 1 s read timeout, and that a
    # 404 was final at once ("cannot read": not retried).
    with pytest.raises(error, match=rf"sample 3: .*{message}") as caught:
        list(fastfeed.DataLoader(Files(urls, retries=2, timeout=1.0), batch_size=2, num_workers=1))
    assert urls[3] in str(caught.value)


def test_a_cached_epoch_asks_the_server_nothing_until_revalidation(site):
    """Epoch 2 from the cache sends no request; with revalidate_s=0 a changed file is fetched anew."""
    server, rel, tmp = site
    urls = [server.url_of(r) for r in rel[:8]]
    ds = Files(urls, decode=_size, cache_dir=tmp / "cache")
    sizes = [b.tolist() for b in fastfeed.DataLoader(ds, batch_size=4, num_workers=1)]
    before = server.requests
    assert [b.tolist() for b in fastfeed.DataLoader(ds, batch_size=4, num_workers=1)] == sizes
    assert server.requests == before
    (tmp / "www" / rel[0]).write_bytes(b"changed")
    strict = Files(urls, decode=_size, cache_dir=tmp / "cache", revalidate_s=0)
    first = next(iter(fastfeed.DataLoader(strict, batch_size=4, num_workers=1)))
    assert first[0].item() == len(b"changed") and first[1:].tolist() == sizes[0][1:]


def test_dropping_the_iterator_with_reads_in_flight_leaves_nothing_behind(site):
    """An epoch dropped after one batch, with slow reads in flight, ends at once (the leak check runs after)."""
    server, rel, _ = site
    server.latency = 0.3
    loader = fastfeed.DataLoader(Files([server.url_of(r) for r in rel], decode=_size), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    with Within(5, "dropping the iterator with reads in flight"):
        del it


def test_a_failing_version_check_is_retried_not_taken_for_a_missing_file(site):
    """fsspec reports a 500 on info() as FileNotFoundError; the cache's version check retries it instead."""
    server, rel, tmp = site
    url = server.url_of(rel[0])
    ds = Files([url], decode=_size, cache_dir=tmp / "cache", revalidate_s=0, retries=3)
    first = next(iter(fastfeed.DataLoader(ds, batch_size=1, num_workers=1)))
    server.faults[rel[0]] = {"fail": 2}  # info() spends both on its HEAD and its GET fallback
    again = next(iter(fastfeed.DataLoader(ds, batch_size=1, num_workers=1)))
    assert again.tolist() == first.tolist()
