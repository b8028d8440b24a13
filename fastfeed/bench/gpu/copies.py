"""Host-to-device copies: the device stage's rate against raw copies, non_blocking host time, registration cost."""

from __future__ import annotations

import os
import secrets
import statistics
import time

import torch

from .harness import copy_seconds, fmt, gbps, pool_dataset, ring_batch, stage_copier
from .report import Check, Skip
from .sizes import Sizes


def check_h2d(cuda, c: Check, z: Sizes) -> None:
    """The device stage's copies (its own events) against raw copies from a ring slot, pageable and torch-pinned."""
    import fastfeed

    bs = z.h2d_batch_size
    nbytes = bs * int(torch.Size(z.shape).numel())
    ds, _ = pool_dataset((z.h2d_batches + 5) * bs, z)
    loader = fastfeed.DataLoader(ds, batch_size=bs, num_workers=z.workers, device=cuda.loader_device())
    with stage_copier(cuda):
        for _ in loader:
            pass
    ring = gbps(nbytes, loader.stats().h2d_p50_s)
    del loader
    src, it = ring_batch(cuda, z, bs)
    raw = gbps(nbytes, copy_seconds(cuda, src, z.copies))
    pageable_src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    pageable = gbps(nbytes, copy_seconds(cuda, pageable_src, z.copies))
    torch_pinned = gbps(nbytes, copy_seconds(cuda, cuda.pinned_empty(nbytes).fill_(1), z.copies))
    del src, it
    for name, value in (("ring_gbps", ring), ("raw_slot_gbps", raw), ("pageable_gbps", pageable),
                        ("torch_pinned_gbps", torch_pinned)):  # fmt: skip
        c.figure(name, value, "GB/s")
    mb = f"{nbytes / 1e6:.1f} MB"
    ok = ring is not None and raw is not None and ring >= 0.9 * raw
    c.line("ring H2D (loader.stats h2d p50)", c.verdict("ring >= 0.9x raw", ok, f"{fmt(ring, '.1f')} GB/s = "
           f"{fmt(ring / raw if ring and raw else None)}x raw, bar >= 0.9x"))  # fmt: skip
    ok = raw is not None and torch_pinned is not None and raw >= 0.9 * torch_pinned
    c.line("raw copy from a ring slot", c.verdict("slot >= 0.9x torch pinned", ok, f"{fmt(raw, '.1f')} GB/s "
           f"(cudaMemcpyAsync of {mb}) = {fmt(raw / torch_pinned if raw and torch_pinned else None)}x torch's "
           "pinned memory, bar >= 0.9x"))  # fmt: skip
    c.line("torch pinned memory", f"{fmt(torch_pinned, '.1f')} GB/s (torch.empty(pin_memory=True), {mb})")
    c.line("pageable memory", f"{fmt(pageable, '.1f')} GB/s ({mb})")


def check_async(cuda, c: Check, z: Sizes) -> None:
    """``.to(non_blocking=True)`` from a ring slot returns before its copy is done: host time against device time."""
    src, it = ring_batch(cuda, z, z.batch_size)
    host, device = [], []
    for _ in range(10):
        cuda.sleep(2.0)  # the device is busy, as in training: a copy that blocked the host would wait for this too
        begin, end = cuda.Event(), cuda.Event()
        begin.record()
        t0 = time.perf_counter()
        x = cuda.to_device(src, non_blocking=True)
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        device.append(begin.elapsed_time(end) / 1e3)
        del x
    del src, it
    h, d = statistics.median(host), statistics.median(device)
    c.figure("host_s", h, "s")
    c.figure("copy_s", d, "s")
    c.line(".to(non_blocking=True) host time", c.verdict("host < copy / 2", h < d / 2, f"{h * 1e6:.0f} us on the "
           f"host against {d * 1e6:.0f} us of copy (medians of 10), bar host < copy / 2"))  # fmt: skip


def _segment(nbytes: int):
    """A new shared-memory segment of ``nbytes`` (touched, as ring slots are), already unlinked."""
    from fastfeed._native import C

    name = f"/fastfeed-gpucheck-{os.getpid()}-{secrets.token_hex(8)}"
    seg = C.Segment.create(name, nbytes)
    C.unlink(name)
    return seg


def check_register(cuda, c: Check, z: Sizes) -> None:
    """cudaHostRegister and unregister per GB, and what the first epoch's ``next()`` costs against a later one's."""
    import fastfeed
    from fastfeed import _pinning

    why = _pinning.enable()
    if why:
        raise Skip(f"the CUDA runtime cannot be loaded: {why}")
    n = z.register_bytes
    register, unregister = [], []
    for _ in range(2):  # one segment at a time: /dev/shm may not hold two
        pinned = _segment(n)
        t0 = time.perf_counter()
        pinned.pin()
        register.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        del pinned  # unregisters, then unmaps
        both = time.perf_counter() - t0
        plain = _segment(n)
        t0 = time.perf_counter()
        del plain
        unregister.append(max(0.0, both - (time.perf_counter() - t0)))
    per_gb = 1e9 / n
    reg, unreg = statistics.median(register) * per_gb, statistics.median(unregister) * per_gb
    c.figure("register_s_per_gb", reg, "s/GB")
    c.figure("unregister_s_per_gb", unreg, "s/GB")
    slot = z.batch_size * int(torch.Size(z.shape).numel())
    c.line("cudaHostRegister", f"{reg * 1e3:.1f} ms/GB ({reg * slot / 1e9 * 1e3:.2f} ms per {slot / 1e6:.1f} MB "
           f"slot; {n / 2**20:.0f} MiB segments, median of 2)")  # fmt: skip
    c.line("cudaHostUnregister", f"{unreg * 1e3:.1f} ms/GB (the segment's deletion less an unpinned one's unmap)")

    ds, _ = pool_dataset(z.epoch_batches * z.batch_size, z)
    loader = fastfeed.DataLoader(ds, batch_size=z.batch_size, num_workers=z.workers, pin_memory=not cuda.dry_run)
    epochs = []
    for _ in range(2):
        waits = []
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                break
            waits.append(time.perf_counter() - t0)
            del b
            time.sleep(z.host_step_s)  # a step, so that workers are ahead and next() is the loader's own cost
        del it
        epochs.append(waits)
    for k, waits in enumerate(epochs, 1):
        rest = waits[1:]
        c.figure(f"epoch{k}_first_next_s", waits[0], "s")
        c.figure(f"epoch{k}_next_p50_s", statistics.median(rest), "s")
        c.figure(f"epoch{k}_next_max_s", max(rest), "s")
        c.line(f"epoch {k} next()", f"first {waits[0] * 1e3:.1f} ms, then p50 {statistics.median(rest) * 1e3:.2f} "
               f"ms max {max(rest) * 1e3:.2f} ms ({len(rest)} batches, {z.host_step_s * 1e3:.0f} ms steps)")
