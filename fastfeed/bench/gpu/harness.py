"""What the checks share: checksummed datasets, the device stage's copier, timed copies and a synthetic step."""

from __future__ import annotations

import contextlib
import time

import torch

from .. import workloads
from .sizes import Sizes


def gbps(nbytes: float, seconds: float | None) -> float | None:
    return None if not seconds else nbytes / seconds / 1e9


def fmt(x, spec: str = ".2f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def pool_dataset(length: int, z: Sizes, pool_items: int = 97):
    """``length`` uint8 items of ``z.shape`` from a pool of distinct random ones, and each pool item's byte sum.

    97 (a prime) distinct items: a batch rewritten with another batch's items changes its sums.
    """
    ds = workloads.PoolDataset(length, tuple(z.shape), "uint8", pool_items, seed=7)
    sums = torch.stack([t.reshape(-1).sum(dtype=torch.int64) for t in ds.pool])
    return ds, sums


def bad_batches(batches: list, sums: torch.Tensor, batch_size: int) -> int:
    """How many of ``batches`` (batch k holds items k * batch_size...) differ from the items' byte sums."""
    bad = 0
    for k, b in enumerate(batches):
        got = b.reshape(b.shape[0], -1).sum(1, dtype=torch.int64).cpu()
        idx = torch.arange(k * batch_size, k * batch_size + b.shape[0]) % len(sums)
        bad += int(not torch.equal(got, sums[idx]))
    return bad


@contextlib.contextmanager
def stage_copier(cuda, delay_ms: float = 0.0):
    """Loaders made ``iter()`` inside get a device stage whose copies first wait ``delay_ms`` on the copy stream.

    On a dry run the copier is the fake's (the loader's ``device="cpu"`` would otherwise not copy at all).
    Yields the list of copiers made, so a check can tell that the device stage took one.
    """
    from ... import transfer

    made: list = []
    if not cuda.dry_run and delay_ms <= 0:
        yield made
        return
    real = transfer.copier_for

    def copier_for(stage):
        copier = cuda.copier(stage, real)
        if delay_ms > 0:
            start = copier.start

            def delayed_start(batch):
                cuda.sleep(delay_ms, copier.stream)  # the copy stream is busy: the copy runs late
                return start(batch)

            copier.start = delayed_start
        made.append(copier)
        return copier

    transfer.copier_for = copier_for
    try:
        yield made
    finally:
        transfer.copier_for = real


def ring_batch(cuda, z: Sizes, batch_size: int) -> tuple[torch.Tensor, object]:
    """A batch that is a view of a registered ring slot (pin_memory=True), and the iterator that lent it."""
    import fastfeed

    ds, _ = pool_dataset(4 * batch_size, z)
    it = iter(fastfeed.DataLoader(ds, batch_size=batch_size, num_workers=1, pin_memory=not cuda.dry_run))
    return next(it), it


def copy_seconds(cuda, src: torch.Tensor, copies: int) -> float:
    """Device seconds per ``non_blocking`` copy of ``src`` into device memory, timed with events."""
    dst = cuda.empty(src.nbytes)
    src = src.reshape(-1).view(torch.uint8)
    for _ in range(3):
        cuda.copy_(dst, src)
    start, end = cuda.Event(), cuda.Event()
    start.record()
    for _ in range(copies):
        cuda.copy_(dst, src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / copies


class Step:
    """A synthetic training step: bf16 matmuls lasting about ``ms`` on the device, which read the batch."""

    def __init__(self, cuda, ms: float, size: int):
        self.cuda = cuda
        self.a = torch.randn(size, size, device=cuda.device, dtype=torch.bfloat16) / size**0.5
        self.n = 1
        for _ in range(3):  # calibrate the matmul count to the wanted duration
            self.n = max(1, round(self.n * ms / self.time(5)))
        self.ms = self.time(10)

    def __call__(self, batch) -> torch.Tensor:
        x = self.a
        for _ in range(self.n):
            x = x @ self.a
        return x[0, 0] + batch.float().mean()  # the step reads its batch

    def time(self, steps: int) -> float:
        dummy = torch.zeros(8, device=self.cuda.device)
        self(dummy)
        self.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            self(dummy)
        self.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / steps


def fed_seconds(cuda, step: Step, it, steps: int, warmup: int = 5) -> float:
    """Seconds ``steps`` steps take, each fed a batch from ``it`` (after ``warmup`` untimed)."""
    for _ in range(warmup):
        step(next(it))
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(next(it))
    cuda.synchronize()
    return time.perf_counter() - t0


def torch_feed(cuda, dataset, batch_size: int, workers: int):
    """torch's way to the GPU: pin_memory=True, then ``.cuda(non_blocking=True)`` of each batch."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                         pin_memory=not cuda.dry_run)  # fmt: skip
    return (cuda.to_device(b, non_blocking=True) for b in loader)
