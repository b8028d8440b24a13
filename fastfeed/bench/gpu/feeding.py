"""A training step fed by fastfeed and by torch: its stall, the doctor's verdict on it, DALI's decoding."""

from __future__ import annotations

import time
import warnings

import torch

from .. import workloads
from .harness import Step, fed_seconds, pool_dataset, torch_feed
from .report import Check, Skip
from .sizes import Sizes


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
