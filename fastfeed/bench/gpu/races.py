"""The two race checks: a copy must read its own batch, never a ring slot the workers rewrote before it ran.

Both checksum every batch, so a slot handed back too early shows as a wrong sum; the fake's copies read late as a
DMA does, so a dry run judges these two faithfully.
"""

from __future__ import annotations

import contextlib
import warnings

from .harness import bad_batches, pool_dataset, stage_copier
from .report import Check
from .sizes import Sizes


def check_pin_race(cuda, c: Check, z: Sizes, fake_reads_late: bool = False) -> None:
    """pin_memory=True without device=: copies queued behind busy kernels still read their own batch.

    ``x = batch.cuda(non_blocking=True)`` queues the copy behind the previous step's kernels, and the CPU view of
    the slot dies at once. A worker waiting for a slot may then rewrite it before the DMA reads it, unless fastfeed
    holds the slot until the copy is done. On a dry run the fake's copies read at issue (fastfeed's guard, an
    event on the device's stream, cannot see the fake's streams); ``fake_reads_late`` makes them read late, so a
    test can show that this check catches a copy that read a rewritten slot.
    """
    import fastfeed

    ds, sums = pool_dataset(z.race_batches * z.batch_size, z)
    loader = fastfeed.DataLoader(ds, batch_size=z.batch_size, num_workers=max(2, z.workers // 2), pin_memory=True,
                                 prefetch_factor=4)  # fmt: skip
    kept, pinned, buffers = [], 0, set()
    reads = contextlib.nullcontext() if fake_reads_late else cuda.reads_at_issue()
    with reads, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a dry run's pin_memory=True without CUDA warns, as torch does
        it = iter(loader)
        for _ in range(z.race_batches):
            batch = next(it)
            pinned += cuda.is_pinned(batch)
            buffers.add(batch.untyped_storage().data_ptr())
            cuda.sleep(z.race_sleep_ms)  # the previous step's kernels, still running
            kept.append(cuda.to_device(batch, non_blocking=True))
            del batch  # as `x = x.cuda(non_blocking=True)` drops it: the slot's last CPU view
        cuda.synchronize()
        bad = bad_batches(kept, sums, z.batch_size)
        del it
    n = z.race_batches
    c.figure("bad_batches", bad)
    c.figure("pinned_batches", pinned)
    c.figure("distinct_buffers", len(buffers))
    c.line("pin_memory + .cuda() behind kernels", c.verdict("checksums", bad == 0, f"{n - bad}/{n} batches intact "
           f"({z.race_sleep_ms:.0f} ms of kernels before each copy)", faithful_fake=True))  # fmt: skip
    c.line("pin_memory batches pinned", c.verdict("pinned", pinned == n, f"{pinned}/{n} pinned, in {len(buffers)} "
           "distinct buffers (ring slots, no pinned copy)"))  # fmt: skip


def check_stage_race(cuda, c: Check, z: Sizes) -> None:
    """device="cuda": with the copy stream delayed before every copy, each slot waits for its copy."""
    import fastfeed

    ds, sums = pool_dataset(z.stage_batches * z.batch_size, z)
    loader = fastfeed.DataLoader(ds, batch_size=z.batch_size, num_workers=2, device=cuda.loader_device(),
                                 device_prefetch=2, prefetch_factor=4)  # fmt: skip
    with stage_copier(cuda, z.copy_sleep_ms) as made:
        it = iter(loader)
    if not made:
        raise RuntimeError("the device stage did not take the delayed copier (fastfeed.transfer.copier_for)")
    kept = []
    with warnings.catch_warnings():
        # The host runs ahead of the late copies, and each slot waits for its copy: the ring grows, as it should.
        warnings.simplefilter("ignore", fastfeed.RingGrowthWarning)
        for b in it:
            cuda.sleep(z.consumer_sleep_ms)  # the consumer is slow too
            kept.append(b)  # checksummed at the end: the copies' reads are what is checked
    cuda.synchronize()
    bad = bad_batches(kept, sums, z.batch_size)
    c.figure("bad_batches", bad)
    c.figure("batches", len(kept))
    ok = bad == 0 and len(kept) == z.stage_batches
    c.line("device stage, copy stream delayed", c.verdict("checksums", ok, f"{len(kept) - bad}/{z.stage_batches} "
           f"batches intact ({z.copy_sleep_ms:.0f} ms on the copy stream before each copy, "
           f"{z.consumer_sleep_ms:.0f} ms consumer)", faithful_fake=True))  # fmt: skip
