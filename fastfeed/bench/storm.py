"""A start-up storm: every rank of a job opening ``fastfeed.io.Shards`` at once against a store that sheds load.

The store (``ThrottledStore``) is a threaded HTTP server on 127.0.0.1 that admits ``rate`` requests a second (a
token bucket holding one second's worth) and answers the rest ``503 Slow Down`` with ``Retry-After``, as S3 does
past a prefix's request rate; it counts what it admitted and what it refused. The job is ``nodes`` processes, each
standing for a machine with its own cache directory, each running ``ranks`` readers in threads; every reader is a
``Shards(url, rank=r, world_size=nodes x ranks)`` with default settings (a batch of 1, so that each node's ranks
read a sample of every shard: the storm's worst case), started at one signal, reading its whole epoch.

Figures: readers that read exactly their samples, whole; the time from the signal to the last reader's end against
the ideal (the admitted requests / rate, and no less than the minimum / rate); the requests admitted against the
minimum (each node's index once, plus each node's shards once: what one reader per machine would need), and the
requests refused.

Run: .venv/bin/python -m fastfeed.bench.storm [--nodes 6] [--ranks 8] [--shards 24] [--rate 30]
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO
from pathlib import Path
from urllib.parse import unquote, urlsplit

RETRY_AFTER_S = 1
START_TIMEOUT_S = 120.0  # node processes importing torch on a loaded machine: generous, and outside the timing


# -- the store --------------------------------------------------------------------------------------------------------


class ThrottledStore:
    """Files under ``root`` over HTTP/1.1 on 127.0.0.1, ``rate`` requests a second admitted (GET and HEAD alike),
    the others refused with 503 and ``Retry-After: retry_after``.

    ``admitted`` and ``refused`` count requests by ``(method, path)``, and ``log`` lists each as ``(time.monotonic(),
    (method, path), admitted)``; all are read after ``stop()`` (or under ``lock``). A refused request never reaches
    the file; an admitted one for a missing file gets 404. A ranged GET gets 206 and its bytes.
    """

    def __init__(self, root, rate: float, *, burst: float | None = None, initial: float | None = None,
                 retry_after: int = RETRY_AFTER_S, refuse_first: int = 0) -> None:  # fmt: skip
        self.root = os.path.realpath(root)
        self.rate = float(rate)
        # The bucket's size (one second's worth by default, one request at least), and what it holds at the start.
        self.burst = max(1.0, float(rate if burst is None else burst))
        initial = self.burst if initial is None else float(initial)
        self.retry_after = retry_after
        self.refuse_first = refuse_first  # requests refused whatever the bucket holds (a store already shedding load)
        self.lock = threading.Lock()
        self.admitted: dict[tuple[str, str], int] = {}
        self.refused: dict[tuple[str, str], int] = {}
        self.log: list[tuple[float, tuple[str, str], bool]] = []
        self._tokens = initial
        self._filled = time.monotonic()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set = set()
        self.url = ""

    def __enter__(self) -> ThrottledStore:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> ThrottledStore:
        store = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as object stores and fsspec's client use it

            def setup(self) -> None:
                super().setup()
                with store.lock:
                    store._connections.add(self.connection)

            def finish(self) -> None:
                try:
                    super().finish()
                finally:
                    with store.lock:
                        store._connections.discard(self.connection)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                store._answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                store._answer(self, body=False)

            def log_message(self, *args) -> None:
                pass  # hundreds of requests a second: the counts say what happened

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="throttled-store", daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def stop(self) -> None:
        """Stop listening and close every connection (the clients' keep-alive ones included)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        with self.lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(2)  # its handler thread, waiting for the next request, reads the end and leaves
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with self.lock:
                if not self._connections:
                    break
            time.sleep(0.01)
        self._server = None

    def counts(self) -> dict:
        with self.lock:
            return {"admitted": sum(self.admitted.values()), "refused": sum(self.refused.values()),
                    "heads": sum(n for counted in (self.admitted, self.refused) for (m, _), n in counted.items()
                                 if m == "HEAD")}  # fmt: skip

    def _admit(self) -> bool:
        with self.lock:
            if self.refuse_first > 0:
                self.refuse_first -= 1
                return False
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._filled) * self.rate)
            self._filled = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        relpath = unquote(urlsplit(handler.path).path).lstrip("/")
        key = (handler.command, relpath)
        admitted = self._admit()
        with self.lock:
            self.log.append((time.monotonic(), key, admitted))
        if not admitted:
            with self.lock:
                self.refused[key] = self.refused.get(key, 0) + 1
            payload = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            handler.send_response(503, "Slow Down")
            handler.send_header("Retry-After", str(self.retry_after))
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            if body:
                handler.wfile.write(payload)
            return
        with self.lock:
            self.admitted[key] = self.admitted.get(key, 0) + 1
        normal = posixpath.normpath(relpath)
        path = os.path.join(self.root, normal)
        if normal.startswith(("..", "/")) or not os.path.isfile(path):
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        size = os.path.getsize(path)
        first, last = 0, size - 1
        ranged = _range(handler.headers.get("Range"), size)
        if ranged is not None:  # a ranged GET (S3 clients read by ranges): 206 and those bytes
            first, last = ranged
            handler.send_response(206)
            handler.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        else:
            handler.send_response(200)
        handler.send_header("Content-Length", str(last - first + 1))
        handler.send_header("Content-Type", "application/octet-stream")
        handler.end_headers()
        if body:
            with open(path, "rb") as f:
                f.seek(first)
                left = last - first + 1
                while left > 0:
                    chunk = f.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    handler.wfile.write(chunk)
                    left -= len(chunk)


def _range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(first, last)`` of a ``Range: bytes=a-b`` header (b, or both, may be missing), clipped to the file."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    a, _, b = header[len("bytes="):].partition("-")
    try:
        if not a:  # the last b bytes
            first, last = max(0, size - int(b)), size - 1
        else:
            first, last = int(a), min(int(b), size - 1) if b else size - 1
    except ValueError:
        return None
    return (first, last) if first <= last else None


# -- the data ---------------------------------------------------------------------------------------------------------


def payload(i: int, size: int) -> bytes:
    """Sample i's bytes: checkable by any reader without the original."""
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def write_set(directory, shards: int, per_shard: int, size: int) -> list[str]:
    """``shards`` tar shards of ``per_shard`` samples (``txt``: the number, ``bin``: ``payload``), and their index
    beside them."""
    from fastfeed.io import index_shards

    os.makedirs(directory, exist_ok=True)
    paths = []
    for k in range(shards):
        path = os.path.join(directory, f"shard-{k:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(k * per_shard, (k + 1) * per_shard):
                for ext, data in (("txt", str(i).encode()), ("bin", payload(i, size))):
                    info = tarfile.TarInfo(f"s{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, BytesIO(data))
        paths.append(path)
    index_shards(paths, dest=True)
    return paths


# -- a node: one process, its ranks in threads ----------------------------------------------------------------------


def _check(sample) -> tuple[int, str]:
    i = int(sample["txt"])
    if sample["bin"] != payload(i, len(sample["bin"])):
        raise ValueError(f"sample {i}: its bytes are not the ones written")
    return i, sample["__url__"]


def _ranks(node: int, ranks: int, world: int, url: str, cache: str) -> list[dict]:
    """One node's ranks, each in a thread, each reading its whole epoch: what each read, or its error; when it
    ended."""
    from fastfeed.io import Shards

    results: list[dict] = [{} for _ in range(ranks)]

    def rank(j: int) -> None:
        r = node * ranks + j
        out = results[j]
        out["rank"] = r
        try:
            ds = Shards(url, rank=r, world_size=world, batch_size=1, cache_dir=cache)
            got = [_check(s) for s in ds]
            out["samples"] = [i for i, _ in got]
            out["shards"] = sorted({u for _, u in got})
        except Exception as e:  # noqa: BLE001 - reported to the driver, which says which rank failed and how
            out["error"] = f"{type(e).__name__}: {e}"
        out["end"] = time.time()

    threads = [threading.Thread(target=rank, args=(j,), name=f"rank-{j}") for j in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _node(args) -> None:
    """A node started as a program (``start="spawn"``): report "ready", wait for the start line, run its ranks,
    print their results as JSON."""
    import fastfeed.io  # noqa: F401 - imported before "ready": the start signal times the storm, not the imports

    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(_ranks(args.node, args.ranks, args.world, args.url, args.cache)), flush=True)


def _forked_node(conn, node: int, ranks: int, world: int, url: str, cache: str) -> None:
    """A node forked from the driver (``start="fork"``): the same, over a pipe."""
    conn.send("ready")
    conn.recv()
    conn.send(_ranks(node, ranks, world, url, cache))
    conn.close()


# -- the driver -------------------------------------------------------------------------------------------------------


def expected(directory, world: int) -> list[list[int]]:
    """Each rank's samples, read from local disk by the same split."""
    from fastfeed.io import Shards

    return [[int(s["txt"]) for s in Shards(str(directory), rank=r, world_size=world, batch_size=1)]
            for r in range(world)]  # fmt: skip


def run(nodes: int = 6, ranks: int = 8, shards: int = 24, rate: float = 30.0, size: int = 1000,
        workdir=None, start: str = "spawn", say=None) -> dict:  # fmt: skip
    """The storm, measured (see the module docstring). ``workdir``: where the data and the nodes' caches go (a
    temporary directory by default). ``start``: how the node processes start, as programs of their own
    (``"spawn"``: each imports fastfeed and torch, as a node would) or forked from this one (``"fork"``: in
    milliseconds, for a test); the storm is timed from the start signal either way."""
    if start not in ("spawn", "fork"):
        raise ValueError(f"storm: start must be 'spawn' or 'fork', got {start!r}")
    world = nodes * ranks
    with tempfile.TemporaryDirectory(prefix="fastfeed-storm-", dir=workdir) as tmp:
        data = Path(tmp) / "store"
        write_set(data, shards, world, size)  # world samples a shard: each node's ranks read from every shard
        want = expected(data, world)
        with ThrottledStore(data, rate) as store:
            source = f"{store.url}/shard-{{000000..{shards - 1:06d}}}.tar"
            caches = [str(Path(tmp) / f"node-{n}") for n in range(nodes)]
            nodes_run = _spawned if start == "spawn" else _forked
            t0, reports = nodes_run(nodes, ranks, world, source, caches)
        counts = store.counts()
        index_gets = store.admitted.get(("GET", "fastfeed-index.json"), 0)
    readers = [r for rep in reports for r in rep]
    failed = [r for r in readers if "error" in r or r.get("samples") != want[r["rank"]]]
    touched = [len({u for r in rep for u in r.get("shards", [])}) for rep in reports]
    minimum = sum(1 + t for t in touched)  # each node: its index once, its shards once
    elapsed = max(r["end"] for r in readers) - t0
    ideal = max(counts["admitted"], minimum) / rate
    out = {"nodes": nodes, "ranks": ranks, "world": world, "shards": shards, "rate": rate, "start": start,
           "readers_ok": len(readers) - len(failed), "readers": len(readers),
           "errors": sorted({r.get("error", "wrong samples") for r in failed})[:5],
           "elapsed_s": elapsed, "ideal_s": ideal, "time_limit_s": 2 * ideal + 10,
           "admitted": counts["admitted"], "refused": counts["refused"], "heads": counts["heads"],
           "index_gets": index_gets, "minimum": minimum, "request_limit": 1.5 * minimum}  # fmt: skip
    if say is not None:
        say(summary(out))
    return out


def _spawned(nodes: int, ranks: int, world: int, url: str, caches: list[str]) -> tuple[float, list]:
    """Run the nodes as programs; (the start signal's time, each node's results)."""
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        for n in range(nodes):
            cmd = [sys.executable, "-m", "fastfeed.bench.storm", "--as-node", str(n), "--ranks", str(ranks),
                   "--world", str(world), "--url", url, "--cache", caches[n]]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        for p in procs:
            line = _line(p, START_TIMEOUT_S)
            if line.strip() != "ready":
                raise RuntimeError(f"storm: a node process did not start (it said {line!r})")
        t0 = time.time()
        for p in procs:  # the start signal: every rank of every node opens its Shards now
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = [json.loads(_line(p, START_TIMEOUT_S + 600)) for p in procs]
        for p in procs:
            p.wait(timeout=60)
        return t0, reports
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()


def _forked(nodes: int, ranks: int, world: int, url: str, caches: list[str]) -> tuple[float, list]:
    """Run the nodes as forks of this process; (the start signal's time, each node's results)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    try:
        for n in range(nodes):
            mine, theirs = ctx.Pipe()
            pipes.append(mine)
            procs.append(ctx.Process(target=_forked_node, args=(theirs, n, ranks, world, url, caches[n]), daemon=True))
            procs[-1].start()
            theirs.close()
        for conn in pipes:
            if not conn.poll(START_TIMEOUT_S) or conn.recv() != "ready":
                raise RuntimeError("storm: a forked node process did not start")
        t0 = time.time()
        for conn in pipes:
            conn.send("go")
        reports = []
        for conn in pipes:
            if not conn.poll(600):
                raise RuntimeError("storm: a node process said nothing for 600 s")
            reports.append(conn.recv())
        for p in procs:
            p.join(60)
        return t0, reports
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        for conn in pipes:
            conn.close()


def summary(out: dict) -> str:
    return (f"storm ({out['start']}): {out['nodes']} nodes x {out['ranks']} ranks, {out['shards']} shards, "
            f"{out['rate']:g} requests/s admitted: {out['readers_ok']}/{out['readers']} readers ok; "
            f"{out['elapsed_s']:.1f} s (ideal {out['ideal_s']:.1f} s, limit {out['time_limit_s']:.1f} s); "
            f"{out['admitted']} requests admitted (minimum {out['minimum']}, limit {out['request_limit']:.0f}), "
            f"{out['refused']} refused, {out['heads']} HEAD, {out['index_gets']} index GETs")  # fmt: skip


def _line(p: subprocess.Popen, timeout: float) -> str:
    """The next line a node prints, or RuntimeError after ``timeout`` s (a node that hangs fails the run)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box:
        p.kill()
        raise RuntimeError(f"storm: a node process said nothing for {timeout:.0f} s")
    return box[0]


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--ranks", type=int, default=8, help="ranks per node (threads of its process)")
    p.add_argument("--shards", type=int, default=24)
    p.add_argument("--rate", type=float, default=30.0, help="requests a second the store admits")
    p.add_argument("--size", type=int, default=1000, help="bytes of each sample's payload")
    p.add_argument("--start", choices=("spawn", "fork"), default="spawn", help="node processes as programs of their "
                   "own (spawn), or forked from this one")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--as-node", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_node is not None:
        args.node = args.as_node
        _node(args)
        return None
    out = run(args.nodes, args.ranks, args.shards, args.rate, args.size, start=args.start,
              say=None if args.json else print)
    if args.json:
        print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
