"""fastfeed/bench/http.py: the HTTP file server behind the storage tests and benchmarks/io.py, seen from fsspec."""

from __future__ import annotations

import http.client
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import fsspec
import pytest
from fsspec.asyn import sync
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.http import HTTPFileSystem

from _load import Within
from fastfeed.bench.http import FileServer, make_files, parse_range

N_FILES = 16
FILE_SIZE = 20_000
MakeFs = Callable[..., HTTPFileSystem]


def _close(fs: HTTPFileSystem) -> None:
    """Close fs's aiohttp session, hence its pooled sockets."""
    if fs._session is not None:
        sync(fs.loop, fs._session.close)


def _raw(server: FileServer, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[Any, bytes]:
    """(response, body) of one request sent verbatim: no client-side URL normalisation."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response, response.read()
    finally:
        conn.close()


@pytest.fixture(scope="module", autouse=True)
def fsspec_io_thread(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Start fsspec's event-loop thread ("fsspecIO", with its epoll and wake-up descriptors) with one request.

    fsspec starts it on first use and keeps it for the life of the process, so started inside a test it would
    read as that test's leaked descriptors; a module fixture runs before the leak check's first snapshot.
    """
    root = tmp_path_factory.mktemp("warm")
    names = make_files(root, 1, 100)
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    with FileServer(root) as server:
        fs.cat_file(server.url_of(names[0]))
    _close(fs)


@pytest.fixture
def make_fs() -> Iterator[MakeFs]:
    """A factory of fresh fsspec HTTP filesystems (no instance cache) whose sessions close at teardown."""
    made: list[HTTPFileSystem] = []

    def make(**client_kwargs: Any) -> HTTPFileSystem:
        fs = fsspec.filesystem("http", skip_instance_cache=True, client_kwargs=client_kwargs)
        made.append(fs)
        return fs

    yield make
    for fs in made:
        _close(fs)


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """N_FILES files under tmp_path/root, and tmp_path/outside.bin just outside that root."""
    make_files(tmp_path / "root", N_FILES, FILE_SIZE)
    (tmp_path / "outside.bin").write_bytes(b"secret")
    return tmp_path / "root"


@pytest.fixture
def server(files: Path) -> Iterator[FileServer]:
    """A server of `files` with no latency."""
    with FileServer(files) as running:
        yield running


def test_make_files_is_deterministic_with_sizes_within_ten_percent(tmp_path: Path) -> None:
    """make_files writes f00000.bin... of size ±10%, the same bytes for the same seed and others for another."""
    names = make_files(tmp_path / "a", 50, 1000, seed=3)
    assert names == [f"f{i:05d}.bin" for i in range(50)]
    sizes = [(tmp_path / "a" / name).stat().st_size for name in names]
    assert all(900 <= size <= 1100 for size in sizes) and len(set(sizes)) > 1
    make_files(tmp_path / "b", 50, 1000, seed=3)
    make_files(tmp_path / "c", 50, 1000, seed=4)
    first = (tmp_path / "a" / names[0]).read_bytes()
    assert (tmp_path / "b" / names[0]).read_bytes() == first != (tmp_path / "c" / names[0]).read_bytes()


def test_fsspec_reads_files_bit_exactly(server: FileServer, files: Path, make_fs: MakeFs) -> None:
    """cat_file, cat of many, open().read() (ranged and streamed) and info() all match the files on disk."""
    fs = make_fs()
    names = sorted(os.listdir(files))
    expected = {server.url_of(name): (files / name).read_bytes() for name in names}
    assert fs.cat(list(expected)) == expected
    url, data = next(iter(expected.items()))
    assert fs.cat_file(url) == data
    assert fs.info(url)["size"] == len(data)
    with fs.open(url, block_size=4096) as f:
        assert f.read() == data
    with fs.open(url, block_size=0) as f:
        assert f.read() == data
    assert server.url.startswith("http://127.0.0.1:") and not server.url.endswith("/")


def test_range_requests_answer_206_with_the_requested_bytes(server: FileServer, files: Path, make_fs: MakeFs) -> None:
    """Ranges a-b, a- and -n answer 206 with Content-Range; a range past the end answers 416."""
    data = (files / "f00001.bin").read_bytes()
    size = len(data)
    assert make_fs().cat_file(server.url_of("f00001.bin"), start=100, end=300) == data[100:300]
    spans = {"bytes=10-19": (10, 20), "bytes=500-": (500, size), "bytes=-7": (size - 7, size)}
    for header, (start, end) in spans.items():
        response, body = _raw(server, "GET", "/f00001.bin", {"Range": header})
        assert (response.status, body) == (206, data[start:end]), header
        assert response.headers["Content-Range"] == f"bytes {start}-{end - 1}/{size}"
    response, body = _raw(server, "GET", "/f00001.bin", {"Range": f"bytes={size}-"})
    assert (response.status, body, response.headers["Content-Range"]) == (416, b"", f"bytes */{size}")
    assert parse_range("bytes=0-99999", 50) == (0, 50) and parse_range("items=0-1", 50) is None


def test_head_gives_size_and_validators_without_a_body(server: FileServer, files: Path) -> None:
    """HEAD answers Content-Length of the whole file, Last-Modified and an ETag that changes with the file."""
    path = files / "f00002.bin"
    response, body = _raw(server, "HEAD", "/f00002.bin")
    assert (response.status, body) == (200, b"")
    assert int(response.headers["Content-Length"]) == path.stat().st_size
    assert response.headers["Last-Modified"].endswith(" GMT")
    path.write_bytes(b"changed")
    changed, _ = _raw(server, "HEAD", "/f00002.bin")
    assert changed.headers["Content-Length"] == "7" and changed.headers["ETag"] != response.headers["ETag"]


def test_latency_is_applied_to_each_request(files: Path, make_fs: MakeFs) -> None:
    """N sequential requests on one keep-alive connection take at least N x latency."""
    fs = make_fs()
    latency, n = 0.05, 6
    with FileServer(files, latency=latency) as server:
        fs.cat_file(server.url_of("f00000.bin"))  # connect outside the timing
        with Within(n * latency + 1.0, f"{n} requests at {latency:g} s") as timed:
            for i in range(n):
                fs.cat_file(server.url_of(f"f{i:05d}.bin"))
        assert server.requests == n + 1
    assert timed.seconds >= n * latency


def test_concurrent_requests_overlap_their_latency(files: Path, make_fs: MakeFs) -> None:
    """N_FILES concurrent requests take about one latency, not N_FILES of them, even with jitter."""
    latency, jitter = 0.3, 0.05
    with FileServer(files, latency=latency, jitter=jitter, seed=1) as server:
        urls = [server.url_of(f"f{i:05d}.bin") for i in range(N_FILES)]
        # The bound, 3 latencies, is under a quarter of N_FILES latencies: requests sent one after another miss it.
        assert 3 * latency < N_FILES * latency / 4
        with Within(3 * latency, f"{N_FILES} concurrent requests at {latency:g} s") as timed:
            make_fs().cat(urls)
    assert timed.seconds >= latency - jitter


def test_fail_fault_answers_500_k_times_then_serves(server: FileServer, files: Path, make_fs: MakeFs) -> None:
    """{"fail": 2}: two GETs raise aiohttp's ClientResponseError (500), the third returns the file."""
    fs = make_fs()
    url = server.url_of("f00003.bin")
    server.faults["f00003.bin"] = {"fail": 2}
    for _ in range(2):
        with pytest.raises(aiohttp.ClientResponseError) as raised:
            fs.cat_file(url)
        assert raised.value.status == 500
    assert fs.cat_file(url) == (files / "f00003.bin").read_bytes()
    assert server.faults["f00003.bin"] == {"fail": 0} and server.requests == 3


def test_fsspec_info_reports_a_server_error_as_file_not_found(server: FileServer, make_fs: MakeFs) -> None:
    """fsspec's info() turns a 500 (on HEAD, then on its fallback GET) into FileNotFoundError, the cause kept."""
    server.faults["f00003.bin"] = {"fail": 2}
    with pytest.raises(FileNotFoundError) as raised:
        make_fs().info(server.url_of("f00003.bin"))
    assert isinstance(raised.value.__cause__, aiohttp.ClientResponseError)
    assert raised.value.__cause__.status == 500 and server.faults["f00003.bin"] == {"fail": 0}


def test_status_fault_answers_that_status(server: FileServer, make_fs: MakeFs) -> None:
    """{"status": 403} answers 403 to every request, which fsspec raises as ClientResponseError."""
    server.faults["f00004.bin"] = {"status": 403}
    for _ in range(2):
        with pytest.raises(aiohttp.ClientResponseError) as raised:
            make_fs().cat_file(server.url_of("f00004.bin"))
        assert raised.value.status == 403


def test_truncate_fault_raises_in_fsspec_rather_than_returning_short_data(server: FileServer, make_fs: MakeFs) -> None:
    """{"truncate": True}: cat_file and open().read() (ranged or streamed) raise ClientPayloadError; half is sent."""
    fs = make_fs()
    url = server.url_of("f00005.bin")
    server.faults["f00005.bin"] = {"truncate": True}
    assert fs.info(url)["size"] > 0  # HEAD is not truncated
    with pytest.raises(aiohttp.ClientPayloadError):
        fs.cat_file(url)
    for block_size in (4096, 0):
        with pytest.raises(aiohttp.ClientPayloadError), fs.open(url, block_size=block_size) as f:
            f.read()
    with pytest.raises(http.client.IncompleteRead) as raised:
        _raw(server, "GET", "/f00005.bin")
    assert len(raised.value.partial) == raised.value.expected  # half the body came, half is missing


def test_stall_fault_times_out_a_client_with_a_timeout(server: FileServer, files: Path, make_fs: MakeFs) -> None:
    """{"stall": True}: a client with a 1 s total timeout gets FSTimeoutError; other paths are still served."""
    server.faults["f00006.bin"] = {"stall": True}
    fs = make_fs(timeout=aiohttp.ClientTimeout(total=1))
    with Within(3, "a stalled request under a 1 s timeout") as timed, pytest.raises(FSTimeoutError):
        fs.cat_file(server.url_of("f00006.bin"))
    assert timed.seconds > 0.9
    assert fs.cat_file(server.url_of("f00007.bin")) == (files / "f00007.bin").read_bytes()


def test_stop_with_a_stalled_request_is_prompt_and_leaves_no_thread(files: Path, make_fs: MakeFs) -> None:
    """stop() returns within 1 s though a request stalls; the stalled client then fails; no server thread is left."""
    fs = make_fs(timeout=aiohttp.ClientTimeout(total=30))
    server = FileServer(files).start()
    server.faults["f00008.bin"] = {"stall": True}
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            fs.cat_file(server.url_of("f00008.bin"))
        except Exception as exc:  # any error; which one is asserted below
            errors.append(exc)

    client = threading.Thread(target=fetch)
    client.start()
    while server.requests == 0:
        time.sleep(0.01)
    with Within(1.0, "stop() with a stalled request"):
        server.stop()
    server.stop()  # idempotent
    client.join(timeout=5)
    assert not client.is_alive() and len(errors) == 1 and isinstance(errors[0], aiohttp.ClientError)
    assert not [thread for thread in threading.enumerate() if thread.name == "fileserver"]


def test_unknown_and_outside_paths_answer_404(server: FileServer, make_fs: MakeFs) -> None:
    """A missing file raises FileNotFoundError in fsspec; directories and paths climbing out of root get 404."""
    with pytest.raises(FileNotFoundError):
        make_fs().cat_file(server.url_of("missing.bin"))
    for path in ("/missing.bin", "/../outside.bin", "/%2e%2e/outside.bin", "/sub/../../outside.bin", "/", "/a%00b"):
        response, body = _raw(server, "GET", path)
        assert response.status == 404, path
    assert _raw(server, "GET", "/f00000.bin")[0].status == 200
