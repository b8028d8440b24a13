"""The shards workload's data and its server: JPEG-like samples written as tar shards, served over HTTP.

``fastfeed bench shards`` (fastfeed/bench/suites/shards.py) writes the samples once with :func:`write_tar` and
serves them with :class:`Served`, which counts the bytes each loader downloads the same way for every loader.
"""

from __future__ import annotations

import collections
import multiprocessing
import random
from pathlib import Path

import numpy as np
import torch

SAMPLE_BYTES = 100_000  # decode pads or cuts every jpg to this many bytes, so batches stack
JPEG_HEAD = bytes.fromhex("ffd8ffe000104a46494600010100000100010000")  # SOI and a JFIF APP0 segment
JPEG_TAIL = b"\xff\xd9"  # EOI
BUCKET, MDS_PREFIX, TAR_DIR = "bench", "mds", "tar"


# --- the data ------------------------------------------------------------------------------------------------------


def jpeg_like(index: int, size: int, seed: int = 0) -> bytes:
    """Sample ``index``'s bytes: a JPEG header, seeded random bytes, an end marker; ``size`` +- 10% in all."""
    rng = random.Random(seed * 1_000_003 + index)
    n = round(size * rng.uniform(0.9, 1.1))
    return JPEG_HEAD + rng.randbytes(n - len(JPEG_HEAD) - len(JPEG_TAIL)) + JPEG_TAIL


class Samples(torch.utils.data.Dataset):
    """The bench's samples as a map-style dataset of ``{"jpg": bytes, "cls": int}`` (what write_shards takes)."""

    def __init__(self, n: int, size: int, seed: int = 0):
        self.n, self.size, self.seed = n, size, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"jpg": jpeg_like(i, self.size, self.seed), "cls": i}


def decode(sample: dict, nbytes: int = SAMPLE_BYTES) -> tuple[torch.Tensor, int]:
    """Every loader's decode: the jpg bytes padded or cut to ``nbytes`` (a uint8 tensor), and the cls int."""
    data = sample["jpg"]
    out = np.zeros(nbytes, np.uint8)
    n = min(len(data), nbytes)
    out[:n] = np.frombuffer(data, np.uint8, count=n)
    return torch.from_numpy(out), int(sample["cls"])


def write_tar(samples: Samples, dest: Path, per_shard: int) -> tuple[list[Path], np.ndarray]:
    """The samples as tar shards in ``dest`` with their index (``fastfeed.io.write_shards``, keys ``%09d``); the
    shard paths and each shard's first sample."""
    from fastfeed.io import ShardIndex, write_shards

    dest.mkdir(parents=True, exist_ok=True)
    # A shard ends before the sample that would take it past shard_bytes: ~per_shard samples, each its two members'
    # headers (512 bytes each) and the data's padding to 512.
    write_shards(samples, str(dest), shard_bytes=per_shard * (samples.size + 1536), num_workers=0, progress=False)
    index = ShardIndex.load(str(dest / "fastfeed-index.json"))
    return sorted(dest.glob("*.tar")), np.asarray(index.starts[:-1])


# --- the server ----------------------------------------------------------------------------------------------------


def _serve(root: str, latency: float, jitter: float, conn) -> None:
    from ..http import FileServer

    class Counting(FileServer):
        """Counts the bytes of GET bodies sent, by the first directory of the path (tar/, bench/)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.sent: collections.Counter = collections.Counter()

        async def _serve_file(self, request, relpath, truncate):
            response = await super()._serve_file(request, relpath, truncate)
            if relpath.startswith(BUCKET + "/"):
                # Mosaic downloads index.json in the main process and its forked workers inherit that boto3
                # client, keep-alive socket and all: two workers then share one socket, and one reads the other's
                # answer (a shard file of wrong bytes: Mosaic's IndexError "not present in the shard") or waits for
                # boto3's 60 s read timeout. Closing each S3 answer's connection costs a connect on 127.0.0.1.
                response.force_close()
            if request.method == "GET" and response.status in (200, 206):
                self.sent[relpath.split("/", 1)[0]] += int(response.headers.get("Content-Length", 0))
            return response

    with Counting(root, latency=latency, jitter=jitter) as server:
        conn.send(server.url)
        while conn.recv() == "bytes":
            conn.send(dict(server.sent))


class Served:
    """The file server in a process of its own (its threads never compete for the loaders' GIL), and its counts."""

    def __init__(self, root: Path, latency: float, jitter: float):
        self._conn, theirs = multiprocessing.Pipe()
        self._proc = multiprocessing.get_context("fork").Process(target=_serve, args=(str(root), latency, jitter,
                                                                                       theirs))  # fmt: skip
        self._proc.start()
        self.url = self._conn.recv()

    def sent(self, prefix: str) -> int:
        """Bytes of GET bodies sent so far under ``prefix``."""
        self._conn.send("bytes")
        return self._conn.recv().get(prefix, 0)

    def close(self) -> None:
        self._conn.send("stop")
        self._proc.join(10)

