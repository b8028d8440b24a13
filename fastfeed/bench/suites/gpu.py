"""The GPU check: what fastfeed claims about pinned memory and the GPU, measured on one, with bars that can fail.

Run it on a GPU machine with ``bash scripts/gpu_check.sh`` (which also builds the extension and runs
tests/test_gpu.py), or ``python -m fastfeed.bench.suites.gpu`` / ``fastfeed bench gpu``. Each check prints a line
per figure, with the bar it is held to beside it; the JSON report goes to ``--out`` (default gpu-results/).

Checks (ids as in the report):
  pin_race       pin_memory=True without device=: each ``.cuda(non_blocking=True)`` queued behind ~50 ms of
                 kernels, its CPU batch dropped at once while workers wait for slots; every copy checksummed.
  stage_race     device="cuda" with the device stage's *copy* stream delayed before each copy, the consumer
                 slow too: every batch checksummed (the slot must stay out of the ring until its copy read it).
  h2d            the device stage's copy rate from ``loader.stats().h2d_p50_s``, beside cudaMemcpyAsync from a
                 registered ring slot, a pageable buffer and torch's own pinned memory.
  async          the host time of ``.to(non_blocking=True)`` from a ring slot against the copy's device time.
  register       cudaHostRegister and unregister time per GB, and the first epoch's ``next()`` latency of a
                 pin_memory loader against a later epoch's.
  other_device   a loader on cuda:1 leaves GPU 0 alone: no context of its process there, torch's memory on 0
                 unchanged (skipped, saying so, on a one-GPU machine).
  gds            reader="gds" (kvikio): stall fraction under a 20 ms step, kvikio's compat mode, aligned and
                 widened reads; the file fsync'ed, then dropped from the page cache (skipped without kvikio).
  nvml           NVML's PCIe rx and utilisation against a known load: pinned copies at a measured GB/s, then
                 a busy kernel.
  stall          the stall fraction of a ResNet-50-sized step (bf16 matmuls, ~60 ms) fed by fastfeed
                 (device="cuda") and by torch (pin_memory=True, .cuda(non_blocking=True)), same workers and data.
  doctor         fastfeed.doctor's verdict on three loops of known kind (compute, host_sync, launch).
  dali           the jpeg workload decoded by DALI's nvJPEG against torch + Pillow (skipped without DALI).

Every CUDA call goes through ``gpu_facade``: ``--dry-run`` runs every check on a CPU against its fake (tensors on
the CPU, fake streams, events and NVML; scripts/gpu_check.sh builds tests/fake_cudart.c for registration), with
tiny sizes. A dry run judges only what its fake models faithfully (the checksums of the two race checks); its
report says ``dry_run: true`` and no figure in it was measured on a GPU.

Exit status: 0 when every check and bar held; 1 when one failed (or a test did, or a check ran out of time);
2 without a CUDA device ("no CUDA device"); 3 when a GPU is present but this torch has no CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .. import workloads
from . import gpu_facade

REPORT_NAME = "gpu_check.json"
TIME_BUDGET_S = 390.0  # the checks and tests together; the script's build comes before


@dataclass(frozen=True)
class Sizes:
    """How big each check runs: a GPU run's sizes, or a dry run's tiny ones (``DRY``)."""

    shape: tuple = workloads.IMAGE_SHAPE  # uint8 items: 64 of them make a 9.6 MB batch
    batch_size: int = workloads.BATCH_SIZE
    workers: int = 8
    race_batches: int = 40
    race_sleep_ms: float = 50.0
    stage_batches: int = 40
    copy_sleep_ms: float = 20.0
    consumer_sleep_ms: float = 10.0
    h2d_batches: int = 60
    h2d_batch_size: int = 128  # 19 MB: the launch gap an event can catch before a copy is a small part of it
    copies: int = 50
    register_bytes: int = 1 << 30
    epoch_batches: int = 60
    host_step_s: float = 0.005
    nvml_s: float = 2.0
    step_ms: float = 60.0
    matrix: int = 4096
    stall_steps: int = 60
    doctor_s: float = 4.0
    gds_records: int = 512
    gds_record_floats: int = 1 << 18  # 1 MiB records
    gds_step_ms: float = 20.0
    dali_batches: int = 50
    jpeg_files: int = workloads.JPEG_FILES


DRY = Sizes(shape=(3, 16, 16), batch_size=8, workers=2, race_batches=24, race_sleep_ms=20.0, stage_batches=16,
            copy_sleep_ms=5.0, consumer_sleep_ms=2.0, h2d_batches=10, h2d_batch_size=8, copies=5, register_bytes=16 << 20,
            epoch_batches=10, host_step_s=0.001, nvml_s=0.3, step_ms=2.0, matrix=64, stall_steps=8, doctor_s=1.0,
            gds_records=64, gds_record_floats=1 << 14, gds_step_ms=2.0, dali_batches=3, jpeg_files=16)  # fmt: skip


# -- the report --------------------------------------------------------------------------------------------------


class Skip(Exception):
    """A check that cannot run here (no second GPU, no kvikio): said so, and not a failure."""


class OutOfTime(Exception):
    """A check that ran past its time budget."""


@dataclass
class Check:
    """One check's lines, figures and verdicts, as printed and as the JSON report keeps them."""

    id: str
    title: str
    dry_run: bool
    status: str = "ok"  # ok, FAIL, skipped, error; a dry run's check that ran and did not fail: dry-run
    lines: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    verdicts: list = field(default_factory=list)
    seconds: float = 0.0

    def figure(self, name: str, value, unit: str = "") -> None:
        self.figures[name] = {"value": value, "unit": unit}

    def verdict(self, name: str, ok: bool, shown: str, *, faithful_fake: bool = False) -> str:
        """Record whether ``name`` held; returns its tag for the line. A dry run judges only what its fake models
        faithfully (``faithful_fake``); the rest is shown, not judged."""
        judged = not self.dry_run or faithful_fake
        self.verdicts.append({"name": name, "ok": bool(ok), "judged": judged, "shown": shown})
        if judged and not ok:
            self.status = "FAIL"
        if not judged:
            return f"{shown}: {'holds' if ok else 'misses'} on the fake (not judged: dry run)"
        return f"{shown}: {'ok' if ok else 'FAIL'}"

    def line(self, label: str, text: str) -> None:
        self.lines.append(f"{label:<34} {text}")
        print(f"{'[dry run] ' if self.dry_run else ''}{label:<34} {text}", flush=True)


class Report:
    """The JSON report, rewritten after each check so that a run stopped early still leaves one."""

    def __init__(self, out: Path, dry_run: bool, argv: list[str]):
        self.path = out / REPORT_NAME
        self.started = time.perf_counter()
        self.data = {
            "dry_run": dry_run,
            "note": ("DRY RUN: every check ran on the CPU against fakes; no figure here was measured on a GPU, "
                     "and only the race checks' checksums were judged") if dry_run else "",  # fmt: skip
            "command": [sys.executable, "-m", "fastfeed.bench.suites.gpu", *argv],
            "machine": {},
            "tests": None,
            "checks": [],
            "failed": [],
            "exit_code": None,
            "elapsed_s": 0.0,
        }
        out.mkdir(parents=True, exist_ok=True)

    def add(self, check: Check) -> None:
        self.data["checks"].append(asdict(check))
        if check.status in ("FAIL", "error"):
            self.data["failed"].append(check.id)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


# -- shared pieces -----------------------------------------------------------------------------------------------


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


# -- the checks --------------------------------------------------------------------------------------------------


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


def check_other_device(cuda, c: Check, z: Sizes) -> None:
    """A loader on cuda:1 (no set_device) puts no context on GPU 0, and torch's memory there is unchanged."""
    if cuda.device_count() < 2:
        raise Skip(f"one CUDA device here ({cuda.device_count()}): a second GPU is needed to target another one")
    nvml, why = cuda.nvml()
    if nvml is None:
        raise Skip(f"{why}: the contexts on GPU 0 cannot be counted")
    gpu0 = cuda.uuid(0)
    before = len(nvml.compute_pids(gpu0))
    # In a process of its own: this one has used GPU 0 already.
    cmd = [sys.executable, "-m", "fastfeed.bench.suites.gpu", "--child", "other_device", "--gpu0", str(gpu0)]
    proc = subprocess.run(cmd + (["--dry-run"] if cuda.dry_run else []), capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"the child process failed ({proc.returncode}): {proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["pid_on_gpu1"]:
        contexts, how = int(got["pid_on_gpu0"]), "its pid in NVML's processes on GPU 0"
    else:  # NVML lists other pids (a container's namespace): count the processes on GPU 0 instead
        contexts, how = got["procs_on_gpu0"] - before, f"NVML's processes on GPU 0: {before} -> {got['procs_on_gpu0']}"
    c.figure("contexts_on_gpu0", contexts)
    for name in ("memory_before", "memory_after", "batches"):
        c.figure(name, got[name])
    ok = contexts == 0 and got["memory_before"] == got["memory_after"]
    c.line("cuda:1 loader, GPU 0", c.verdict("nothing on GPU 0", ok, f"{contexts} context(s) of its process on "
           f"GPU 0 ({how}), torch memory on 0 {got['memory_before']} -> {got['memory_after']} bytes, "
           f"{got['batches']} batches, bar 0 contexts and no memory"))  # fmt: skip


def _other_device_child(cuda, gpu0: str) -> int:
    """The other_device check's process: a pin_memory loader on cuda:1, then what NVML sees on GPU 0."""
    import fastfeed

    z = DRY if cuda.dry_run else Sizes()
    before = cuda.memory(0)
    ds, _ = pool_dataset(20 * z.batch_size, z)
    loader = fastfeed.DataLoader(ds, batch_size=z.batch_size, num_workers=2, device=cuda.loader_device(1),
                                 pin_memory=True)  # fmt: skip
    batches = 0
    with stage_copier(cuda):
        for _ in loader:
            batches += 1
    cuda.synchronize()
    nvml, _ = cuda.nvml()
    pid = os.getpid()
    on0 = nvml.compute_pids(gpu0 if gpu0.startswith("GPU-") else int(gpu0))
    print(json.dumps({"pid_on_gpu0": pid in on0, "procs_on_gpu0": len(on0),
                      "pid_on_gpu1": pid in nvml.compute_pids(cuda.uuid(1)), "memory_before": sum(before),
                      "memory_after": sum(cuda.memory(0)), "batches": batches}))  # fmt: skip
    return 0


def _uncached(path: str) -> None:
    """Drop ``path`` from the page cache: written pages must reach the disk first, or they stay cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _gds_counts(it) -> dict:
    """The GDS iterator's own account of its reads (kvikio's mode and threads, aligned, widened and POSIX reads)."""
    stats = getattr(it, "gds_stats", None)
    return stats() if callable(stats) else {}


def _kvikio_compat() -> str:
    import kvikio

    defaults = getattr(kvikio, "defaults", None)
    for name in ("compat_mode", "is_compat_mode_preferred", "get"):
        fn = getattr(defaults, name, None)
        if callable(fn):
            with contextlib.suppress(Exception):
                return str(fn("compat_mode") if name == "get" else fn())
    return "unknown (this kvikio has no compat-mode query)"


def check_gds(cuda, c: Check, z: Sizes) -> None:
    """reader="gds": the share of a 20 ms step spent waiting for reads, kvikio's mode, aligned and widened reads."""
    import numpy as np

    from fastfeed import DataLoader
    from fastfeed.io import ArrayFiles, gds

    ok, why = gds.available()
    reader = "gds"
    if cuda.dry_run:
        reader = "posix"  # the dry run's stand-in: the same file, loop and figures without kvikio
        c.line("GDS (dry run)", f"reader='posix' stands in for 'gds' (kvikio here: {why})")
    elif not ok:
        raise Skip(f"GPUDirect Storage cannot run here: {why}")
    floats = z.gds_record_floats
    with tempfile.TemporaryDirectory(dir=os.environ.get("FASTFEED_GDS_DIR")) as tmp:
        path = os.path.join(tmp, "records.bin")
        np.random.default_rng(0).random((z.gds_records, floats), dtype=np.float32).tofile(path)
        rows = {}
        for name in ([reader] if cuda.dry_run else [reader, "posix"]):
            _uncached(path)
            loader = DataLoader(ArrayFiles(path, np.float32, (floats,)), batch_size=16, device=cuda.loader_device(),
                                reader=name, num_workers=0 if name == "gds" else min(4, z.workers))  # fmt: skip
            with stage_copier(cuda):
                it = iter(loader)
                for batch in it:
                    cuda.sleep(z.gds_step_ms)
                    batch.sum()
                    cuda.synchronize()  # the step ends on the host, as a loss.item() would end it
                counts = _gds_counts(it)
            del it, batch
            rows[name] = (loader.stats().stall_fraction, counts)
    stall, counts = rows[reader]
    c.figure("stall_fraction", stall)
    c.figure("aligned_reads", counts.get("aligned"))
    c.figure("widened_reads", counts.get("widened"))
    mode = counts.get("compat_mode", _kvikio_compat()) if reader == "gds" else "n/a (posix)"
    c.figure("kvikio_compat_mode", mode)
    c.figure("kvikio_threads", counts.get("threads"))
    c.line(f"reader={reader!r}, {z.gds_step_ms:.0f} ms step", f"stall {stall:.1%}; kvikio compat mode: {mode}, "
           f"threads {counts.get('threads', 'n/a')}; reads aligned {counts.get('aligned', 'n/a')}, widened "
           f"{counts.get('widened', 'n/a')}, POSIX {counts.get('posix', 'n/a')}")  # fmt: skip
    if reader == "gds" and "KVIKIO_NTHREADS" not in os.environ and (os.cpu_count() or 1) > 1:
        threads = counts.get("threads")
        c.line("kvikio threads", c.verdict("kvikio_threads", threads not in (None, 1),
                                           f"{threads} (from the rank's CPUs), bar > 1"))
    if "posix" in rows and reader != "posix":
        c.figure("posix_stall_fraction", rows["posix"][0])
        c.line("reader='posix', same step", f"stall {rows['posix'][0]:.1%} ({min(4, z.workers)} workers, the ring, "
               "H2D)")


def check_nvml(cuda, c: Check, z: Sizes) -> None:
    """NVML's PCIe rx under pinned copies at a measured rate, and its utilisation under a busy kernel."""
    nvml, why = cuda.nvml()
    if nvml is None:
        raise Skip(why)
    key = cuda.uuid(cuda.index)
    nbytes = z.batch_size * int(torch.Size(z.shape).numel())
    src, dst = cuda.pinned_empty(nbytes).fill_(1), cuda.empty(nbytes)
    readings: dict = {"rx": [], "tx": [], "util": []}
    stop = threading.Event()

    def sample(kinds):
        while not stop.is_set():
            for kind in kinds:
                readings[kind].append(nvml.utilisation(key) if kind == "util" else nvml.pcie_mbps(key, kind))
            stop.wait(0.05)

    def loaded(kinds, work) -> float:
        for kind in readings:
            readings[kind].clear()
        stop.clear()
        thread = threading.Thread(target=sample, args=(kinds,), daemon=True)
        start, end = cuda.Event(), cuda.Event()
        start.record()
        thread.start()
        deadline = time.perf_counter() + z.nvml_s
        done = 0
        while time.perf_counter() < deadline:
            done += work()
            cuda.synchronize()
        end.record()
        end.synchronize()
        stop.set()
        thread.join()
        return done / (start.elapsed_time(end) / 1e3)

    def copies() -> int:
        for _ in range(20):
            cuda.copy_(dst, src)
        return 20 * nbytes

    def busy() -> int:
        cuda.sleep(50.0)
        return 0

    rate = loaded(("rx", "tx"), copies) / 1e6  # MB/s
    rx, tx = statistics.median(readings["rx"] or [0.0]), statistics.median(readings["tx"] or [0.0])
    loaded(("util",), busy)
    util = statistics.median(readings["util"] or [0.0])
    c.figure("copy_mbps", rate, "MB/s")
    c.figure("nvml_rx_mbps", rx, "MB/s")
    c.figure("nvml_tx_mbps", tx, "MB/s")
    c.figure("nvml_util_busy", util)
    ratio = rx / rate if rate else None
    c.line("NVML PCIe rx under copies", c.verdict("rx within 2x", ratio is not None and 0.5 <= ratio <= 2.0,
           f"rx {rx:,.0f} MB/s (tx {tx:,.0f}) while copies ran at {rate:,.0f} MB/s = {fmt(ratio)}x, bar 0.5-2x"))
    c.line("NVML utilisation, busy kernel", c.verdict("util >= 80%", util >= 0.8, f"{util:.0%} busy, bar >= 80%"))


def check_stall(cuda, c: Check, z: Sizes) -> None:
    """A ResNet-50-sized step fed by fastfeed's device stage and by torch: the share of time the step waited."""
    import fastfeed

    step = Step(cuda, z.step_ms, z.matrix)
    steps = z.stall_steps
    try:
        if cuda.dry_run:
            raise ImportError("a dry run feeds the transport pool")
        work = workloads.jpeg(z.jpeg_files)
        make, name = (lambda: work.make_dataset((steps + 10) * z.batch_size)), "jpeg (Pillow decode)"
    except ImportError:
        make, name = (lambda: pool_dataset((steps + 10) * z.batch_size, z)[0]), "transport"
    ff = fastfeed.DataLoader(make(), batch_size=z.batch_size, num_workers=z.workers, device=cuda.loader_device())
    ff_s = fed_seconds(cuda, step, iter(ff), steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        th_s = fed_seconds(cuda, step, torch_feed(cuda, make(), z.batch_size, z.workers), steps)
    compute = steps * step.ms / 1e3
    ff_stall, th_stall = max(0.0, 1 - compute / ff_s), max(0.0, 1 - compute / th_s)
    c.figure("step_ms", step.ms, "ms")
    c.figure("fastfeed_stall", ff_stall)
    c.figure("torch_stall", th_stall)
    c.line("stall fraction, ~60 ms step", c.verdict("fastfeed <= torch + 5 points", ff_stall <= th_stall + 0.05,
           f"fastfeed {ff_stall:.1%}, torch {th_stall:.1%} ({name}, {z.workers} workers, step {step.ms:.1f} ms, "
           f"{steps} steps), bar fastfeed <= torch + 5 points"))  # fmt: skip


def _doctor_verdict(loop, seconds: float) -> tuple[str, dict]:
    """The doctor's verdict on ``loop(batch)`` fed by a fast in-memory loader for about ``seconds``."""
    from fastfeed import DataLoader, doctor

    loader = DataLoader(torch.zeros(100_000, 8), batch_size=8, num_workers=2, persistent_workers=True)
    with doctor.watch(seconds=seconds) as report:
        while True:
            for batch in loader:
                loop(batch)
    v = report.verdict()
    return v.bottleneck, v.evidence.get("system", {})


def check_doctor(cuda, c: Check, z: Sizes) -> None:
    """The doctor names the bottleneck of three loops whose kind is known."""
    step = Step(cuda, z.step_ms / 3, z.matrix)
    tiny = torch.zeros(16, device=cuda.device)

    def host_sync(batch):
        tiny.add_(1)
        tiny.sum().item()  # waits for the device every step
        time.sleep(0.005)  # the host idles: the GPU does almost nothing meanwhile

    def launch(batch):
        for _ in range(300):
            tiny.add_(1)

    for name, loop in (("compute", step), ("host_sync", host_sync), ("launch", launch)):
        got, system = _doctor_verdict(loop, z.doctor_s)
        c.figure(f"{name}_verdict", got)
        util = system.get("gpu_util")
        c.line(f"doctor on a {name} loop", c.verdict(f"{name} named", got == name, f"verdict {got}, GPU "
               f"{'n/a' if util is None else f'{util:.0%}'} busy, PCIe rx {system.get('pcie_rx_mbps')} MB/s"))


def images_per_s(cuda, it, batches: int, warmup: int = 2) -> float:
    """Images/s of an iterator whose batches end up on the device (timed to the last copy)."""
    for _ in range(warmup):
        next(it)
    cuda.synchronize()
    t0 = time.perf_counter()
    images = sum(next(it).shape[0] for _ in range(batches))
    cuda.synchronize()
    return images / (time.perf_counter() - t0)


def check_dali(cuda, c: Check, z: Sizes) -> None:
    """DALI's nvJPEG decoding of the jpeg workload against torch + Pillow: the same files, crop, flip, workers."""
    try:
        import fastfeed.dali  # noqa: F401
        import nvidia.dali  # noqa: F401
        import PIL  # noqa: F401
    except ImportError as e:
        raise Skip(f"DALI or Pillow is not installed ({e})") from None
    work, nw, n = workloads.jpeg(z.jpeg_files), 2, z.dali_batches

    def make():
        return work.make_dataset((n + 5) * z.batch_size)

    def dali(device):
        loader = workloads.dali_jpeg_loader(make(), batch_size=z.batch_size, num_workers=nw, device=device)
        return (images for (images,) in loader)

    on_gpu = images_per_s(cuda, dali(cuda.loader_device()), n)
    pil = images_per_s(cuda, torch_feed(cuda, make(), z.batch_size, nw), n)
    for key, value in (("dali_images_per_s", on_gpu), ("pillow_images_per_s", pil)):
        c.figure(key, value, "images/s")
    decoder = "CPU (dry run)" if cuda.dry_run else "mixed (nvJPEG)"
    c.line("jpeg decoded by DALI", f"DALI {decoder} {on_gpu:,.0f} images/s = {on_gpu / pil:.2f}x torch + Pillow "
           f"{pil:,.0f} images/s ({nw} threads/workers, {n} batches of {z.batch_size})")  # fmt: skip


CHECKS = (
    ("pin_race", "item 1: pin_memory=True, .cuda(non_blocking=True) behind busy kernels", check_pin_race, 60),
    ("stage_race", "the device stage with its copy stream delayed", check_stage_race, 60),
    ("h2d", "H2D copy rates", check_h2d, 60),
    ("async", "non_blocking copies do not block the host", check_async, 30),
    ("register", "registration cost and first-epoch next()", check_register, 60),
    ("other_device", "a loader on cuda:1 leaves GPU 0 alone", check_other_device, 120),
    ("gds", "GPUDirect Storage", check_gds, 90),
    ("nvml", "NVML readings against a known load", check_nvml, 30),
    ("stall", "stall fraction of a ResNet-50-sized step", check_stall, 120),
    ("doctor", "fastfeed.doctor's verdicts", check_doctor, 60),
    ("dali", "DALI's nvJPEG against torch + Pillow", check_dali, 90),
)


# -- running -----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise OutOfTime in the main thread after ``seconds``."""

    def alarm(signum, frame):
        raise OutOfTime(f"still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_check(cuda, z: Sizes, cid: str, title: str, fn, budget: float, left: float) -> Check:
    c = Check(cid, title, cuda.dry_run)
    print(f"{'[dry run] ' if cuda.dry_run else ''}== {cid}: {title}", flush=True)
    t0 = time.perf_counter()
    if left < budget / 3:
        c.status = "FAIL"
        c.line(cid, f"not run: {left:.0f} s of the time budget left, and it needs up to {budget:.0f} s")
        return c
    try:
        with time_limit(min(budget, left)):
            fn(cuda, c, z)
    except Skip as e:
        c.status = "skipped"
        c.line(cid, f"skipped: {e}")
    except Exception as e:  # a check that breaks is a failure with its traceback, and the others still run
        c.status = "error"
        c.line(cid, f"ERROR: {type(e).__name__}: {e}")
        traceback.print_exc()
    if cuda.dry_run and c.status == "ok":
        c.status = "dry-run"  # it ran; only its race checksums were judged, and they held
    # Loaders of this check go now, not inside a later check's forked workers (where their __del__ would run).
    gc.collect()
    c.seconds = round(time.perf_counter() - t0, 1)
    return c


def run_tests(path: str, dry_run: bool, timeout: float) -> dict:
    """tests/test_gpu.py through pytest where it is installed (not in a dry run), else scripts/gpu_tests.py."""
    repo = Path(path).resolve().parents[1]
    have_pytest = not dry_run and importlib.util.find_spec("pytest") is not None
    if have_pytest:
        cmd = [sys.executable, "-m", "pytest", path, "-q", "-rs", "-p", "no:cacheprovider"]
    else:
        cmd = [sys.executable, str(repo / "scripts" / "gpu_tests.py"), path]
    print(f"{'[dry run] ' if dry_run else ''}== tests: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"{e.stdout or ''}\n(stopped after {timeout:.0f} s)", -1
    for line in out.rstrip().splitlines():
        print(f"  | {line}", flush=True)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", out.splitlines()[-1]
                                                if out.strip() else "")}  # fmt: skip
    # pytest exits 5 when it collected nothing: with every test skipped that is not a failure.
    ok = rc == 0 or (rc == 5 and not counts.get("failed"))
    return {"runner": "pytest" if have_pytest else "scripts/gpu_tests.py", "exit_code": rc, "ok": ok,
            "counts": counts, "seconds": round(time.perf_counter() - t0, 1), "output_tail": out[-4000:]}


def machine(cuda) -> dict:
    from fastfeed import _pinning

    return {"device": cuda.describe(), "devices": cuda.device_count(), "torch": torch.__version__,
            "cuda_build": torch.version.cuda, "python": platform.python_version(), "cpus": os.cpu_count(),
            "cudart": _pinning.runtime_path() if not cuda.dry_run else os.environ.get("FASTFEED_CUDART")}


def no_cuda() -> int:
    """Exit 2 (no CUDA device) or 3 (a GPU this torch cannot use), saying which."""
    build = f"torch {torch.__version__}, CUDA build: {torch.version.cuda}"
    present = gpu_facade.gpu_present()
    if present:
        print(f"gpu_check: a GPU is present ({present}) but torch has no CUDA ({build}): run the check with a "
              "python whose torch is a CUDA build (PYTHON=... bash scripts/gpu_check.sh); nothing measured")
        return 3
    print(f"gpu_check: no CUDA device here ({build}); nothing measured. "
          "`bash scripts/gpu_check.sh --dry-run` runs every check against fakes on the CPU.")  # fmt: skip
    return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-results"), help="where gpu_check.json goes")
    parser.add_argument("--dry-run", action="store_true", help="every check on the CPU against fakes, tiny sizes")
    parser.add_argument("--tests", help="a test file to run first (scripts/gpu_check.sh: tests/test_gpu.py)")
    parser.add_argument("--only", help="comma-separated check ids (default: all, and the tests): tests, "
                        + ", ".join(c[0] for c in CHECKS))  # fmt: skip
    parser.add_argument("--num-workers", type=int, help="workers of the loaders (default min(8, CPUs))")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--gpu0", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "other_device":
        return _other_device_child(gpu_facade.FakeCuda() if args.dry_run else gpu_facade.Cuda(1), args.gpu0)
    if not args.dry_run and not torch.cuda.is_available():
        return no_cuda()
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {c[0] for c in CHECKS} - {"tests"}
    if unknown:
        parser.error(f"--only: no check named {', '.join(sorted(unknown))}")
    deadline = time.perf_counter() + TIME_BUDGET_S
    cuda = gpu_facade.FakeCuda() if args.dry_run else gpu_facade.Cuda(0)
    z = DRY if args.dry_run else Sizes()
    z = replace(z, workers=args.num_workers or min(z.workers, os.cpu_count() or 2))
    report = Report(args.out, args.dry_run, list(argv if argv is not None else sys.argv[1:]))
    if args.dry_run:
        print("gpu_check: DRY RUN on the CPU against fakes: no figure below was measured on a GPU, and only the "
              "race checks' checksums are judged", flush=True)  # fmt: skip
    from fastfeed import _pinning

    why_not = _pinning.enable()
    report.data["machine"] = machine(cuda)
    print(f"# {report.data['machine']['device']}; torch {torch.__version__}; {os.cpu_count()} CPUs; "
          f"{z.workers} workers; ring pinning: {why_not or 'ok'}", flush=True)  # fmt: skip
    failed = []
    if why_not and not args.dry_run:
        print(f"gpu_check: FAIL: fastfeed cannot pin its ring on this GPU machine: {why_not}", flush=True)
        failed.append("pinning")
    if args.tests and (only is None or "tests" in only):
        tests = run_tests(args.tests, args.dry_run, timeout=max(30.0, min(240.0, deadline - time.perf_counter())))
        report.data["tests"] = tests
        if not tests["ok"]:
            failed.append("tests")
        report.write()
    for cid, title, fn, budget in CHECKS:
        if only is None or cid in only:
            check = run_check(cuda, z, cid, title, fn, budget, deadline - time.perf_counter())
            report.add(check)
            if check.status in ("FAIL", "error"):
                failed.append(cid)
    code = 1 if failed else 0
    report.data["failed"] = failed
    report.data["exit_code"] = code
    report.write()
    tail = " (DRY RUN: fakes on the CPU; nothing was measured on a GPU)" if args.dry_run else ""
    held = "every check ran" if args.dry_run else "every check held"
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else held}; report "
          f"{report.path}{tail}", flush=True)  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
