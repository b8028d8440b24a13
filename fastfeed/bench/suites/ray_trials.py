"""One trial of the ray workload, and its dataset: a fresh loader over :class:`Costly` items, its first batch,
untimed warm-up batches, then timed windows; the actors it left are counted once it is gone.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from .. import workloads
from ..accounting import main_cpu_s
from ..trial import touch
from .ray_cluster import running, wait_actors_gone

BATCH = 64


class Costly(Dataset):
    """A map-style dataset of pre-made uint8 tensors, each item costing ``cost_s`` first.

    ``how="sleep"`` sleeps (work done elsewhere: no core of this machine is used); ``"spin"`` spins until its
    thread has used ``cost_s`` of CPU time (CPU-bound work: workers that share a core slow each other down, as
    real decoding does, where a spin on the wall clock would not). Pickled as its spec, so a Ray actor makes
    the pool itself (once per process, ``workloads.make_pool``) instead of receiving it through the object store:
    the transport pool is 400 MB.

    Args:
        length: Items the dataset reports.
        shape: Shape of every item.
        pool_items: Distinct pre-made items; item ``i`` is ``pool[i % pool_items]``.
        cost_s: Seconds of sleep or CPU per item.
        how: ``"sleep"`` or ``"spin"``.
    """

    def __init__(self, length: int, shape: tuple[int, ...], pool_items: int, cost_s: float = 0.0,
                 how: str = "sleep"):  # fmt: skip
        if how not in ("sleep", "spin"):
            raise ValueError(f"how must be 'sleep' or 'spin', got {how!r}")
        self.spec = (length, tuple(shape), pool_items, cost_s, how)
        self.length, self.cost_s, self.how = length, cost_s, how
        self.pool = workloads.make_pool(tuple(shape), "uint8", pool_items)

    def __reduce__(self):
        return type(self), self.spec

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.cost_s > 0:
            if self.how == "sleep":
                time.sleep(self.cost_s)
            else:
                end = time.thread_time() + self.cost_s
                while time.thread_time() < end:
                    pass
        return self.pool[index % len(self.pool)]


def batch_seconds(ds: Costly, batches: int = 3) -> float:
    """Median seconds to fetch and collate one batch of ``ds`` in this process: the t_batch of the ideal."""
    collate = torch.utils.data.default_collate
    times = []
    for b in range(batches):
        t0 = time.perf_counter()
        collate([ds[b * BATCH + i] for i in range(BATCH)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steady(make_loader: Callable[[], Any], warmup: int, batches: int, windows: int = 1) -> dict:
    """One fresh loader: its first batch, ``warmup - 1`` more untimed, then ``windows`` timed runs of ``batches``.

    Each window: seconds, batches/s, bytes/s, and CPU seconds per batch of this process (every thread: Ray's, a
    stream's reader) and of the loop's own thread (the one that would launch the GPU's work). When the loader is gone,
    the actors still alive are counted (after waiting for them to end).
    """
    loader = it = None
    gc.collect()
    try:
        t0 = time.perf_counter()
        loader = make_loader()
        it = iter(loader)
        touch(next(it))
        ttfb = time.perf_counter() - t0
        cluster = running()
        if cluster is not None:
            cluster.watch()  # the actors live only as long as their loader
        for _ in range(max(0, warmup - 1)):
            touch(next(it))
        out = []
        for _ in range(windows):
            cpu0, loop0, w0 = main_cpu_s(), time.thread_time(), time.perf_counter()
            nbytes = sum(touch(next(it)) for _ in range(batches))
            seconds, cpu = time.perf_counter() - w0, main_cpu_s() - cpu0
            loop = time.thread_time() - loop0
            out.append(dict(seconds=seconds, batches_per_s=batches / seconds, bytes_per_s=nbytes / seconds,
                            main_cpu_s_per_batch=cpu / batches, loop_cpu_s_per_batch=loop / batches,
                            batch_bytes=nbytes / batches))  # fmt: skip
    finally:
        del it, loader
        gc.collect()
    return dict(ttfb_s=ttfb, windows=out, actors_left=wait_actors_gone())


def new_loader(ds: Dataset, worker_type, num_workers, ray_options: dict | None = None, **kwargs):
    """A fastfeed DataLoader of ``ds`` in batches of ``BATCH``, with these workers (and Ray actor options)."""
    import fastfeed

    if ray_options is not None:
        kwargs["ray_options"] = ray_options
    return fastfeed.DataLoader(ds, batch_size=BATCH, num_workers=num_workers, worker_type=worker_type, **kwargs)


def stats(values: list[float]) -> dict:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# A sender of --batches buffers of --nbytes over one TCP connection: run as its own process, as an actor is.
_WIRE_SENDER = """
import socket, sys
import numpy as np
host, port, nbytes, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
buf = memoryview(np.ones(nbytes, np.uint8))
with socket.create_connection((host, port)) as sock:
    for _ in range(batches):
        sock.sendall(buf)
"""


def wire(nbytes: int, batches: int, host: str = "127.0.0.1") -> dict:
    """A bare TCP stream on this machine: another process sends ``batches`` buffers of ``nbytes`` over one
    connection, this one reads each with ``recv_into`` into one buffer. GB/s and this process's CPU per batch: what
    the stream path could reach here if it did nothing but move the bytes (no batch made, none touched)."""
    import socket
    import subprocess
    import sys

    import numpy as np

    from ..._workers.ray.sockets import fill

    dest = np.empty(nbytes, np.uint8)
    view = memoryview(dest)
    with socket.create_server((host, 0)) as server:
        sender = subprocess.Popen([sys.executable, "-c", _WIRE_SENDER, host, str(server.getsockname()[1]),
                                   str(nbytes), str(batches)])  # fmt: skip
        try:
            server.settimeout(30)
            conn, _ = server.accept()
            with conn:
                cpu0, w0 = main_cpu_s(), time.perf_counter()
                for _ in range(batches):
                    got = fill(conn, view)  # the stream's own read loop: recv_into until the buffer is full
                    if got < nbytes:
                        raise ConnectionError(f"the wire's sender ended after {got} of {nbytes} bytes")
                seconds, cpu = time.perf_counter() - w0, main_cpu_s() - cpu0
        finally:
            sender.wait(30)
    return dict(seconds=seconds, bytes_per_s=nbytes * batches / seconds, main_cpu_s_per_batch=cpu / batches,
                batch_bytes=nbytes)
