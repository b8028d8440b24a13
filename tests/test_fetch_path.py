"""One fetch path (issue 34): every remote read of Files and Shards is made, timed out, retried and closed by
``fastfeed.io.remote``, and every reader takes a ``file://`` URL as the local path it names.

A real HTTP server on 127.0.0.1 (fastfeed/bench/http.py) scripts what each request meets: a body sent slowly in
pieces, a body that stops half way, 503s before the answer, directory listings. Connections are counted from the
kernel's table of this host's TCP sockets (/proc/net/tcp), so closing is seen as the server would see it.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import multiprocessing
import os
import re
import time
import warnings
import zlib
from pathlib import Path

import pytest

import _shards
from _load import Within
import fastfeed
from fastfeed.io import Files, ShardError, ShardIndex, Shards, index_shards, remote
from fastfeed.io.shards import sources

pytest.importorskip("aiohttp", reason="the HTTP tests need aiohttp (the [remote] extra)")
from aiohttp import web  # noqa: E402

from _remote import fast_backoff, fsspec_loop  # noqa: E402, F401 (autouse fixtures)
from fastfeed.bench.http import FileServer, make_files  # noqa: E402
from fastfeed.io.shards.cache import ShardCache  # noqa: E402
from fastfeed.io.shards.fetch import Fetcher  # noqa: E402

pytestmark = pytest.mark.fastfeed_only

TIMEOUT = 1.0  # the read timeout of the slow and silent bodies' tests: each pause of a slow body is a third of it
COUNTS = (5, 3, 4)  # samples per shard of the shard set
BODY = 600_000  # bytes of the slow and silent bodies


class Scripted(FileServer):
    """The file server, where each path may be scripted: ``answers[(method, path)]``, statuses answered to that
    path's next requests before it is served; ``slow[path] = (pieces, pause_s)``, its body sent in that many
    pieces with a pause after each but the last; ``silent``, paths whose body stops half way and never goes on.
    Directories are listed as links (a web server's index page). ``asked`` counts requests by (method, path)."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.answers: dict[tuple[str, str], list[int]] = {}
        self.slow: dict[str, tuple[int, float]] = {}
        self.silent: set[str] = set()
        self.asked: collections.Counter = collections.Counter()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        relpath = request.path.lstrip("/")
        self.asked[(request.method, relpath)] += 1
        queued = self.answers.get((request.method, relpath))
        if queued:
            return web.Response(status=queued.pop(0))
        if relpath in self.slow or relpath in self.silent:
            return await self._stream(request, relpath)
        directory = Path(self.root, relpath)
        if relpath and relpath.endswith("/") and directory.is_dir() and relpath not in self.faults:
            links = "".join(f'<a href="{n}">{n}</a>\n' for n in sorted(os.listdir(directory)))
            return web.Response(text=f"<html><body>\n{links}</body></html>", content_type="text/html")
        return await super()._handle(request)

    async def _stream(self, request: web.Request, relpath: str) -> web.StreamResponse:
        data = Path(self.root, relpath).read_bytes()
        headers = {"Content-Length": str(len(data)), "Content-Type": "application/octet-stream"}
        if request.method == "HEAD":
            return web.Response(headers=headers)
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        if relpath in self.silent:
            await response.write(data[: len(data) // 2])
            await asyncio.get_running_loop().create_future()  # until stop() cancels this request
        pieces, pause = self.slow[relpath]
        step = -(-len(data) // pieces)
        for at in range(0, len(data), step):
            if at:
                await asyncio.sleep(pause)
            await response.write(data[at : at + step])
        await response.write_eof()
        return response

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


def connections_to(port: int) -> int:
    """Established TCP connections of this host whose far end is 127.0.0.1:``port``: the clients' ends."""
    count = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[2].split(":")[1], 16) == port and fields[3] == "01":
                count += 1
    return count


def settled(port: int, expected: int, within: float = 3.0) -> int:
    """``connections_to(port)`` once it is ``expected``, or after ``within`` s (closing takes a moment)."""
    deadline = time.monotonic() + within
    while (count := connections_to(port)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return count


def copy_to_file(fetcher: Fetcher, url: str, path: Path, size: int | None) -> tuple[int, int]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        return fetcher.copy(url, fd, size)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """``sub/``: a shard set and its index; ``big.bin``: BODY bytes; ``files/``: three small files."""
    directory = tmp_path_factory.mktemp("www")
    _shards.make(directory / "sub", COUNTS, payload=500)
    (directory / "big.bin").write_bytes(os.urandom(BODY))
    make_files(directory / "files", 3, 1000)
    return directory


@pytest.fixture
def server(root):
    with Scripted(root) as s:
        yield s


def shard_names() -> list[str]:
    return [f"shard-{k:06d}.tar" for k in range(len(COUNTS))]


def epoch(ds) -> list[int]:
    return _shards.flat(fastfeed.DataLoader(ds, batch_size=4))


# -- timeouts: a read timeout, never a total one -------------------------------------------------------------------


@pytest.mark.parametrize("reader", ["files", "fetch"])
def test_a_large_body_arriving_slowly_but_steadily_is_read_whole(server, root, tmp_path, reader):
    """The body takes about 2 s, past the 1 s timeout, but never pauses 1 s: it is read whole (Files' total
    timeout used to cut it)."""
    server.slow["big.bin"] = (7, TIMEOUT / 3)
    url, expected = server.url_of("big.bin"), (root / "big.bin").read_bytes()
    t0 = time.monotonic()
    if reader == "files":
        ds = Files([url], retries=0, timeout=TIMEOUT)
        try:
            assert ds[0] == expected
        finally:
            ds.close()
    else:
        fetcher = Fetcher(None, TIMEOUT)
        try:
            assert copy_to_file(fetcher, url, tmp_path / "copy", len(expected)) == (BODY, zlib.crc32(expected))
        finally:
            fetcher.close()
        assert (tmp_path / "copy").read_bytes() == expected
    assert time.monotonic() - t0 > 1.5 * TIMEOUT  # the body did take longer than the timeout
    assert server.asked[("GET", "big.bin")] == 1


@pytest.mark.parametrize("reader", ["files", "fetch"])
def test_a_server_silent_mid_body_fails_after_the_read_timeout(server, tmp_path, reader):
    """Half the body, then nothing: the read fails after about the timeout, said as a read timeout."""
    server.silent.add("big.bin")
    url = server.url_of("big.bin")
    with Within(TIMEOUT + 4, "the silent body's read") as read:
        if reader == "files":
            ds = Files([url], retries=0, timeout=TIMEOUT)
            try:
                with pytest.raises(OSError, match=rf"sample 0: .*no data for {TIMEOUT:g} s \(read timeout"):
                    ds[0]
            finally:
                ds.close()
        else:
            fetcher = Fetcher(None, TIMEOUT)
            try:
                with pytest.raises(Exception) as caught:
                    copy_to_file(fetcher, url, tmp_path / "copy", BODY)
            finally:
                fetcher.close()
    if reader == "fetch":
        assert remote.classify(caught.value) == "transient"
        assert remote.describe(caught.value, TIMEOUT).startswith(f"no data for {TIMEOUT:g} s")
    assert read.seconds > TIMEOUT * 0.9  # it did wait for the timeout


# -- retries: 503 then success is retried; 404 and 403 are not ----------------------------------------------------


def _listing(server, root, tmp_path, retries):
    assert sources.resolve(server.url + "/sub/", retries=retries, timeout=5.0) == [
        f"{server.url}/sub/{n}" for n in shard_names()]  # fmt: skip


def _index(server, root, tmp_path, retries):
    index = ShardIndex.load(server.url_of("sub/fastfeed-index.json"), retries=retries, timeout=5.0)
    assert index.urls == [f"{server.url}/sub/{n}" for n in shard_names()]


def _size(server, root, tmp_path, retries):
    with ShardCache(tmp_path / f"cache{retries}", None, retries=retries, timeout=5.0) as cache:
        path = cache.local(0, server.url_of("sub/shard-000000.tar"), None, None)
        assert Path(path).read_bytes() == (root / "sub" / "shard-000000.tar").read_bytes()


def _download(server, root, tmp_path, retries):
    expected = (root / "sub" / "shard-000000.tar").read_bytes()
    with ShardCache(tmp_path / f"cache{retries}", None, retries=retries, timeout=5.0) as cache:
        path = cache.local(0, server.url_of("sub/shard-000000.tar"), len(expected), zlib.crc32(expected))
        assert Path(path).read_bytes() == expected


CALLS = {"listing": (_listing, "sub/"), "index": (_index, "sub/fastfeed-index.json"),
         "size": (_size, "sub/shard-000000.tar"), "download": (_download, "sub/shard-000000.tar")}  # fmt: skip


@pytest.mark.parametrize("call", CALLS)
def test_a_503_is_retried(server, root, tmp_path, call):
    """The object's first HEAD and first GET answer 503: without retries the call fails, with them it succeeds
    (fsspec's size look-up falls back from HEAD to GET, so both must fail for one attempt to fail)."""
    run, path = CALLS[call]
    for retries, fails in ((0, True), (3, False)):
        server.asked.clear()
        server.answers.update({("HEAD", path): [503], ("GET", path): [503]})
        if fails:
            with pytest.raises(OSError, match="503"):
                run(server, root, tmp_path, retries)
        else:
            run(server, root, tmp_path, retries)
            assert server.asked[("GET", path)] >= 2


@pytest.mark.parametrize("status, error", [(404, FileNotFoundError), (403, PermissionError)])
@pytest.mark.parametrize("call", CALLS)
def test_a_404_or_a_403_is_not_retried(server, root, tmp_path, call, status, error):
    """Every request for the object answers ``status``: the call fails as missing or denied, after as many
    requests with retries=3 as with none."""
    run, path = CALLS[call]
    server.faults[path] = {"status": status}
    asked = {}
    for retries in (0, 3):
        server.asked.clear()
        with pytest.raises((error, ShardError)) as caught:
            run(server, root, tmp_path, retries)
        if isinstance(caught.value, ShardError):  # the cache's verdict names the shard; its cause is the status
            assert isinstance(caught.value.__cause__, error), repr(caught.value.__cause__)
        asked[retries] = sum(n for (_, p), n in server.asked.items() if p == path)
    assert asked[3] == asked[0] >= 1


# -- file:// is the local path it names, on every path -----------------------------------------------------------


def test_files_read_file_urls_as_the_paths_they_name(root):
    """Files over file:// URLs, and over a file:// directory's pattern, reads the local files (it used to open
    the URL as a path, and list nothing)."""
    paths = sorted(str(p) for p in (root / "files").iterdir())
    expected = [Path(p).read_bytes() for p in paths]
    listed = Files([f"file://{p}" for p in paths])
    pattern = Files((f"file://{root}/files", "*.bin"))
    try:
        assert [listed[i] for i in range(len(paths))] == expected
        assert list(pattern.sources) == [f"file://{p}" for p in paths]
        assert list(fastfeed.DataLoader(pattern, batch_size=None, num_workers=1)) == expected
    finally:
        listed.close()
        pattern.close()


@pytest.mark.parametrize("form", ["directory", "pattern", "glob"])
def test_shards_resolve_index_and_read_a_file_url_set_as_the_local_one(root, form):
    """A file:// shard set resolves to file:// URLs, finds the index beside it (no scan, no warning), needs no
    cache, and yields the local set's samples; the index, a scan and the fetch read it too."""
    local = root / "sub"
    source = {"directory": f"file://{local}/", "pattern": f"file://{local}/shard-{{000000..000002}}.tar",
              "glob": f"file://{local}/shard-*.tar"}[form]  # fmt: skip
    urls = [f"file://{local}/{n}" for n in shard_names()]
    assert sources.resolve(source) == urls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = Shards(source, decode=_shards.number)
    assert ds.cache is None and list(ds.index.urls) == urls
    assert epoch(ds) == epoch(Shards(str(local), decode=_shards.number)) == list(range(sum(COUNTS)))
    index = ShardIndex.load(f"file://{local}")
    assert list(index.urls) == urls and index == ds.index
    assert index_shards(source) == index
    fetcher = Fetcher(None, 5.0)
    assert [fetcher.size(u) for u in urls] == [os.path.getsize(local / n) for n in shard_names()]


def test_the_one_is_url_and_local_path():
    """file:// names a local file; every other protocol is remote."""
    assert not remote.is_url("file:///data/x.tar") and not remote.is_url("/data/x.tar")
    assert all(remote.is_url(u) for u in ("s3://b/x.tar", "https://h/x.tar", "gs://b/x", "memory://x"))
    assert remote.local_path("file:///data/x.tar") == "/data/x.tar" == remote.local_path("/data/x.tar")
    assert remote.local_path("s3://b/x.tar") == "s3://b/x.tar"


# -- closing -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", ["fetcher", "files"])
def test_closing_a_reader_releases_its_connections(server, tmp_path, reader):
    """A read leaves its connection pooled (kept alive) until the reader closes: then none is left (Files used to
    keep its own until collected)."""
    url = server.url_of("files/f00000.bin")
    if reader == "fetcher":
        made = Fetcher(None, 5.0)
        copy_to_file(made, url, tmp_path / "copy", None)
    else:
        made = Files([url])
        made[0]
    assert connections_to(server.port) >= 1
    made.close()
    assert settled(server.port, 0) == 0


@pytest.mark.parametrize("call", ["listing", "index", "scan"])
def test_start_up_reads_leave_no_connection_open(server, call):
    """Listing a source, loading its index and scanning its shards close their connections when done."""
    if call == "listing":
        sources.resolve(server.url + "/sub/")
    elif call == "index":
        ShardIndex.load(server.url_of("sub/fastfeed-index.json"))
    else:
        index_shards([server.url_of(f"sub/{n}") for n in shard_names()], num_threads=2)
    assert sum(server.asked.values()) >= 1
    assert settled(server.port, 0) == 0


def test_close_ends_the_http_session(server):
    """``remote.close`` closes the aiohttp session the filesystem used, seen through fsspec's public API."""
    from fsspec.asyn import sync

    fs, _ = remote.filesystem(server.url_of("files/f00000.bin"), timeout=5.0)
    fs.cat_file(server.url_of("files/f00000.bin"))
    session = sync(fs.loop, fs.set_session)
    assert not session.closed
    remote.close(fs)
    assert session.closed


def test_closing_an_s3_fetcher_releases_its_connections_and_it_reads_again(server, root, tmp_path):
    """Over S3 (s3fs, its path-style requests served by the file server, which keeps connections alive): a
    download, then close, leaves no connection; the next download makes its client anew."""
    pytest.importorskip("s3fs", reason="the S3 test needs s3fs (the [remote] extra)")
    data = (root / "files" / "f00000.bin").read_bytes()
    fetcher = Fetcher({"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": server.url}}, 5.0)
    for attempt in range(2):
        got = copy_to_file(fetcher, "s3://files/f00000.bin", tmp_path / "copy", len(data))
        assert got == (len(data), zlib.crc32(data)) and connections_to(server.port) >= 1, attempt
        fetcher.close()
        assert settled(server.port, 0) == 0, attempt


def _child(fetcher: Fetcher, url: str, port: int, parents_loops: set[int], report) -> None:
    # Every coroutine handed to an event loop the parent made (its filesystems' loops: the same objects, at the same
    # addresses, in a forked child) is a wait on a loop that no thread runs here: fsspec's finalizer, run in the
    # child, would wait a second on it. Counted as it happens, not timed, so that a busy machine cannot pass or fail
    # it.
    on_parents = []
    submit = asyncio.run_coroutine_threadsafe

    def watched(coro, loop):
        if id(loop) in parents_loops:
            on_parents.append(getattr(coro, "__qualname__", repr(coro)))
        return submit(coro, loop)

    asyncio.run_coroutine_threadsafe = watched
    size = fetcher.size(url)  # drops the parent's filesystems, makes this process's own
    gc.collect()
    during = connections_to(port)
    fetcher.close()
    report.send((size, on_parents, during, settled(port, during - 1)))
    report.close()


def test_a_forked_child_makes_and_closes_its_own_connections_and_never_waits_on_its_parents(server, root):
    """A Fetcher used in the parent, then in a forked child: the child drops its parent's filesystem at once
    (fsspec's finalizer used to wait a second on the parent's event loop, which no thread runs in the child),
    uses and closes its own connection, and leaves the parent's pooled one alone."""
    # Earlier tests' garbage first (their files left to the collector, whose finalizers close on the shared loop):
    # the child's collection below would finalize it too, and count it against this Fetcher.
    gc.collect()
    url = server.url_of("files/f00000.bin")
    fetcher = Fetcher(None, 5.0)
    try:
        size = fetcher.size(url)
        parents = connections_to(server.port)
        assert parents >= 1
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        loops = {id(fs.loop) for fs in list(remote._LIVE.values()) if getattr(fs, "loop", None) is not None}
        assert loops
        child = context.Process(target=_child, args=(fetcher, url, server.port, loops, send))
        child.start()
        send.close()
        got = receive.recv() if receive.poll(20) else None
        receive.close()
        child.join(10)
        assert child.exitcode == 0 and got is not None
        child_size, on_parents, during, after = got
        assert child_size == size and on_parents == [], got
        assert during == parents + 1 and after == parents, got
        assert fetcher.size(url) == size and connections_to(server.port) == parents
    finally:
        fetcher.close()


def test_the_io_package_closes_through_public_api_only():
    """No private attribute of fsspec's filesystems (``_session``, ``_s3``...) or of weakref's finalizers is
    touched anywhere in fastfeed.io."""
    package = Path(remote.__file__).parent
    private = re.compile(r"\._session\b|\._s3\w*|\bfinalize\._registry")
    found = [f"{p.relative_to(package)}:{n}: {line.strip()}" for p in sorted(package.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]  # fmt: skip
    assert found == []
