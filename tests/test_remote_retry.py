"""Remote reads at start-up retry as downloads do, and their errors say what happened (issue 31, items 2 and 3).

A store shedding load answers 503 (S3's SlowDown) to the first request for each object, then serves it; a
thousand ranks starting at once is exactly when that happens. Shards from an index, Shards with a scan, and
Files must then still read every sample once and whole. A 404 stays final, and a port where nothing listens is
named as a refused connection, never as a missing file.
"""

from __future__ import annotations

import os
import posixpath
import socket
import warnings
from pathlib import Path
from urllib.parse import quote

import pytest

import _shards
import fastfeed
from fastfeed.io import Files, ShardError, Shards

pytest.importorskip("aiohttp", reason="the HTTP tests need aiohttp (the [remote] extra)")
from aiohttp import web  # noqa: E402

from _remote import fast_backoff, fsspec_loop  # noqa: E402, F401 (autouse fixtures)
from fastfeed.bench.http import FileServer, make_files  # noqa: E402
from fastfeed.io.shards.cache import ShardCache  # noqa: E402

pytestmark = pytest.mark.fastfeed_only

N = sum(_shards.UNEQUAL)  # 65 samples in 10 shards; batches of 5 fill every batch, so none is padded
PAYLOAD = 2000
RETRIES = 5  # what the user passed


class SlowDown(FileServer):
    """The latency and fault server, answering 503 to the first request for each object, then serving it.

    ``first="get"``: each object's first GET (its HEADs are served): the issue's report, where the index read
    raised a raw ClientResponseError and the scan "read failed (503)". ``first="each"``: each object's first HEAD
    and first GET, so fsspec's ``info()``, which falls back from HEAD to GET, meets two 503s in a row.
    ``first="none"``: no 503 (the listings and the request counts only).

    Directories are listed as HTML links (as a web server's index page), so that the directory-URL form and
    globs work over HTTP. ``refused`` holds the paths that were answered 503; ``asked`` counts every request
    by (method, path).
    """

    def __init__(self, root, first: str = "each") -> None:
        super().__init__(root)
        self.first = first
        self.refused: set[str] = set()
        self.asked: dict[tuple[str, str], int] = {}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        relpath = request.path.lstrip("/")
        key = (request.method, relpath)
        self.asked[key] = self.asked.get(key, 0) + 1
        if self.asked[key] == 1 and (self.first == "each" or (self.first == "get" and request.method == "GET")):
            self._requests += 1
            self.refused.add(relpath)
            return web.Response(status=503, reason="Slow Down")
        listing = self._listing(relpath)
        if listing is not None:
            self._requests += 1
            return listing
        return await super()._handle(request)

    def _listing(self, relpath: str) -> web.Response | None:
        normal = posixpath.normpath(relpath) if relpath else "."
        if normal == ".." or normal.startswith(("../", "/")):
            return None
        directory = os.path.join(self.root, normal)
        if not os.path.isdir(directory):
            return None
        names = sorted(os.listdir(directory))
        links = "".join(f'<a href="{quote(n)}{"/" if os.path.isdir(os.path.join(directory, n)) else ""}">{n}</a>\n'
                        for n in names)  # fmt: skip
        return web.Response(text=f"<html><body>\n{links}</body></html>", content_type="text/html")

    def gets(self, relpath: str) -> int:
        return self.asked.get(("GET", relpath), 0)


def checked(sample) -> int:
    """A sample's number, once its every field is the one written (in the worker that reads it)."""
    i = int(sample["txt"])
    assert sample["cls"] == str(i % 3).encode() and sample["bin"] == bytes([i % 251]) * PAYLOAD, i
    return i


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("indexed")
    _shards.make(directory, payload=PAYLOAD)
    return str(directory)


@pytest.fixture(scope="module")
def unindexed(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("unindexed")
    _shards.make(directory, payload=PAYLOAD, index=False)
    return str(directory)


def pattern(server) -> str:
    return f"{server.url}/shard-{{000000..{len(_shards.UNEQUAL) - 1:06d}}}.tar"


def shard_names() -> list[str]:
    return [f"shard-{k:06d}.tar" for k in range(len(_shards.UNEQUAL))]


def epoch(ds, num_workers: int) -> list[int]:
    return _shards.flat(fastfeed.DataLoader(ds, batch_size=5, num_workers=num_workers))


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (bound for a moment by the kernel's choice, then freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- item 2: no retry at start-up -----------------------------------------------------------------------------------


@pytest.mark.parametrize("form, first, num_workers", [
    ("pattern", "get", 0),
    ("pattern", "each", 0),
    ("directory", "get", 0),
    ("directory", "each", 2),
])  # fmt: skip
def test_shards_from_the_index_beside_them_read_every_sample_once_through_503s(indexed, tmp_path, form, first,
                                                                               num_workers):  # fmt: skip
    """Every object (the listing, the index, each shard) first answers 503: Shards(retries=5) lists, loads the
    index beside the shards (no scan), and an epoch yields each of the 65 samples once, whole, in order."""
    with SlowDown(indexed, first) as server:
        source = pattern(server) if form == "pattern" else server.url + "/"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = Shards(source, decode=checked, retries=RETRIES, cache_dir=tmp_path)
        assert not [w for w in caught if "index" in str(w.message)], [str(w.message) for w in caught]
        assert epoch(ds, num_workers) == list(range(N))
        assert {"fastfeed-index.json", *shard_names()} <= server.refused
        assert ds.cache_stats()["downloads"] == len(_shards.UNEQUAL)
        if form == "directory":
            assert "" in server.refused and server.gets("") >= 2  # the listing was refused, then asked again
        ds.cache.close()


@pytest.mark.parametrize("first, num_workers", [("get", 0), ("each", 2)])
def test_shards_indexed_by_a_scan_read_every_sample_once_through_503s(unindexed, tmp_path, first, num_workers):
    """No index beside the shards: the scan that builds one meets a 503 on every shard and retries it; the epoch
    then yields each sample once, whole, in order."""
    with SlowDown(unindexed, first) as server:
        with pytest.warns(UserWarning, match="index"):
            ds = Shards(pattern(server), decode=checked, retries=RETRIES, cache_dir=tmp_path)
        assert ds.index.n_samples == N and ds.index.n_shards == len(_shards.UNEQUAL)
        assert epoch(ds, num_workers) == list(range(N))
        assert set(shard_names()) <= server.refused
        ds.cache.close()


@pytest.mark.parametrize("form, first", [("list", "each"), ("glob", "each"), ("glob", "get")])
def test_files_over_urls_read_every_file_once_through_503s(tmp_path, form, first):
    """Files over URLs (a list, with the cache's version checks; or a glob of the server's directory listing):
    every request first answers 503, and each file still arrives once, whole, in order."""
    names = make_files(tmp_path / "www", 24, 1000)
    expected = [(tmp_path / "www" / n).read_bytes() for n in names]
    with SlowDown(tmp_path / "www", first) as server:
        if form == "list":
            ds = Files([server.url_of(n) for n in names], retries=RETRIES, cache_dir=tmp_path / "cache")
        else:
            ds = Files((server.url + "/", "*.bin"), retries=RETRIES)
        got = list(fastfeed.DataLoader(ds, batch_size=None, num_workers=2))
        assert got == expected
        assert set(names) <= server.refused
        ds.close()


def test_a_503_is_retried_and_a_404_is_not(indexed, tmp_path):
    """A source naming a shard that is not there: its 503s are retried, its 404 ends the scan at once, as "not
    found". fsspec's info() asks HEAD then GET: two 503s, then a HEAD and a GET that both get 404; no more."""
    missing = "shard-000099.tar"
    with SlowDown(indexed, "each") as server:
        urls = [server.url_of(n) for n in shard_names()[:2]] + [server.url_of(missing)]
        with pytest.warns(UserWarning), pytest.raises(ShardError, match="not found") as caught:
            Shards(urls, retries=RETRIES, cache_dir=tmp_path)
        assert caught.value.shard == server.url_of(missing)
        # At once: the requests counted, not a time taken (which other processes' load stretches), say that the 404
        # was not retried.
        assert server.asked[("HEAD", missing)] == 2 and server.gets(missing) == 2


def test_a_403_ends_a_scan_at_once_named_as_denied_not_as_missing(unindexed, tmp_path):
    """A shard the store refuses to serve (403): the scan stops at once, saying access was denied (it used to
    say "not found")."""
    names = shard_names()[:2]
    with SlowDown(unindexed, "none") as server:
        server.faults[names[1]] = {"status": 403}
        with pytest.warns(UserWarning), pytest.raises(ShardError, match=r"access denied \(HTTP 403") as caught:
            Shards([server.url_of(n) for n in names], retries=RETRIES, cache_dir=tmp_path)
        assert caught.value.shard == server.url_of(names[1]) and "not found" not in str(caught.value)
        assert server.asked[("HEAD", names[1])] == 1 and server.gets(names[1]) == 1  # fsspec's info(): HEAD, GET


def test_files_raises_permission_error_at_once_for_a_403(tmp_path):
    """Files reading a file the store refuses to serve (403): PermissionError after its one request."""
    names = make_files(tmp_path / "www", 1, 100)
    with SlowDown(tmp_path / "www", "none") as server:
        server.faults[names[0]] = {"status": 403}
        with pytest.raises(PermissionError, match=r"sample 0: cannot read .*HTTP 403"):
            list(fastfeed.DataLoader(Files([server.url_of(names[0])], retries=RETRIES), batch_size=None,
                                     num_workers=1))  # fmt: skip
        assert server.gets(names[0]) == 1


# -- item 3: errors that say what happened ------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["list", "directory", "glob"])
def test_a_port_where_nothing_listens_is_named_as_a_refused_connection(tmp_path, form):
    """Shards over a port where nothing listens: after its retries, an OSError naming the URL and the refused
    connection (never "not found", never a raw aiohttp error)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    source = {"list": [f"{base}/shard-000000.tar"], "directory": f"{base}/", "glob": f"{base}/shard-*.tar"}[form]
    with pytest.raises(OSError, match=rf"connection refused \(nothing listens at 127\.0\.0\.1:{port}\?\)") as caught:
        Shards(source, retries=1, cache_dir=tmp_path)
    assert type(caught.value).__module__.startswith(("fastfeed", "builtins")), type(caught.value)
    assert base in str(caught.value) and "not found" not in str(caught.value)
    assert "failed 2 time(s)" in str(caught.value)


def test_the_cache_names_a_refused_connection_for_a_size_and_a_download(tmp_path):
    """The cache's size look-up (a shard without a size) and its download: a refused connection is retried, then
    named as one; neither says the shard is missing."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/shard-000000.tar"
    refused = rf"connection refused \(nothing listens at 127\.0\.0\.1:{port}\?\)"
    with ShardCache(tmp_path / "cache", None, retries=1, timeout=5.0) as cache:
        with pytest.raises(ShardError, match=rf"asking its size failed 2 time\(s\); last: {refused}") as caught:
            cache.local(0, url, None, None)
        assert caught.value.shard == url
        with pytest.raises(ShardError, match=rf"download failed 2 time\(s\); last: {refused}"):
            cache.local(0, url, 1000, None)


def test_files_names_a_refused_connection(tmp_path):
    """Files over a port where nothing listens: each read, and a listing, says connection refused."""
    port = free_port()
    refused = rf"connection refused \(nothing listens at 127\.0\.0\.1:{port}\?\)"
    url = f"http://127.0.0.1:{port}/f00000.bin"
    with pytest.raises(OSError, match=rf"sample 0: reading {url} failed 2 time\(s\); last: {refused}"):
        list(fastfeed.DataLoader(Files([url], retries=1), batch_size=None, num_workers=1))
    with pytest.raises(OSError, match=rf"listing '\*\.bin' in .*failed 2 time\(s\); last: {refused}"):
        len(Files((f"http://127.0.0.1:{port}/", "*.bin"), retries=1))


def test_a_failed_rename_into_the_cache_is_a_local_error_not_a_missing_shard(indexed, tmp_path):
    """The cache's entries directory vanishes while a shard downloads: the error names the cache directory, not
    the shard as missing from its store, and the descriptor opened for the caller is closed (the leak check)."""
    path = str(Path(indexed) / "shard-000000.tar")
    size = os.path.getsize(path)
    with ShardCache(tmp_path / "cache", None, retries=1) as cache:
        real = cache._fetcher.copy

        def copy_then_lose_the_entries(*args, **kwargs):
            result = real(*args, **kwargs)
            (cache.directory / "entries").rmdir()
            return result

        cache._fetcher.copy = copy_then_lose_the_entries
        with pytest.raises(ShardError, match="could not be moved into .*entries") as caught:
            cache.fd(0, path, size, None)
        assert "not found" not in str(caught.value) and caught.value.shard == path
        assert os.listdir(cache.directory / "tmp") == []
