"""GPU check: pinned staging and the device stage, measured on a GPU, one line per figure.

  (a) raw pinned H2D GB/s: cudaMemcpyAsync from a registered ring-like segment (the ceiling);
  (b) fastfeed ring H2D GB/s: the transport workload with device="cuda";
  (c) torch with pin_memory=True plus .cuda(non_blocking=True), same workload and workers;
  (d) data-stall fraction of a synthetic GPU step (a matmul loop of a set duration) fed by each
      loader (the jpeg workload when Pillow is installed, else transport);
  (e) checks: batches pinned without a copy, copies overlapping compute, no slot reused early
      (a checksum of every batch, with a consumer stream slower than the loader);
  (f) the doctor on the GPU: NVML sampled (utilisation, PCIe), and its verdict on three loops of known kind:
      the matmul step fed by a fast loader (compute), a tiny kernel plus .item() and a host pause every step
      (host_sync), and hundreds of tiny kernels per step (launch);
  (g) GPUDirect Storage: DataLoader(ArrayFiles(...), device="cuda", reader="gds") against kvikio's raw sequential
      read of the same 1 GiB file (bar >= 0.9x), and against reader="posix" (pread in 4 workers, the ring, H2D);
      each after dropping the file's pages from the page cache. Without kvikio or libcuda it says why;
  (h) the jpeg workload decoded on the GPU: fastfeed.dali's DALILoader with DALI's "mixed" decoder (nvJPEG,
      the crop's region only) and 2 CPU threads, against torch + Pillow with 2 workers, pin_memory and
      .cuda(non_blocking=True), in images/s delivered on the GPU; DALI's CPU path in the same line for scale.
      Without DALI or Pillow it says why.
Bars (issue 4): (b) >= 0.9 x (a) and (b) >= 2 x (c).

Run: .venv/bin/python benchmarks/gpu_check.py [--num-workers 8] [--batches 200] [--step-ms 20]
On a machine without CUDA it says so and exits 0, measuring nothing.

Measured: no GPU was lent to the sessions that wrote this; see the issue notes for runs.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time

import torch

from .. import workloads

BATCH_BYTES = workloads.BATCH_SIZE * int(torch.Size(workloads.IMAGE_SHAPE).numel())


def line(label: str, text: str) -> None:
    print(f"{label:<34} {text}", flush=True)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def raw_pinned_h2d(device, copies: int) -> float:
    """(a) cudaMemcpyAsync from one registered shared-memory segment into device memory."""
    from fastfeed._native import C

    name = f"/fastfeed-gpucheck-{os.getpid()}-{secrets.token_hex(8)}"
    seg = C.Segment.create(name, BATCH_BYTES)
    C.unlink(name)
    seg.pin()
    src = torch.frombuffer(seg, dtype=torch.uint8)
    dst = torch.empty(BATCH_BYTES, dtype=torch.uint8, device=device)
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(copies):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return gbps(BATCH_BYTES * copies, start.elapsed_time(end) / 1e3)


def _transport_dataset(batches: int):
    return workloads.transport().make_dataset(batches * workloads.BATCH_SIZE)


def loader_h2d(make_iter, batches: int, warmup: int = 10) -> float:
    """Batches/s as bytes/s of a loader whose batches end up on the GPU (timed to the last copy)."""
    it = make_iter()
    for _ in range(warmup):
        next(it)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    nbytes = 0
    for _ in range(batches):
        b = next(it)
        nbytes += b.nbytes
    torch.cuda.synchronize()
    return gbps(nbytes, time.perf_counter() - t0)


def fastfeed_iter(dataset, nw, device, **kw):
    import fastfeed

    return iter(fastfeed.DataLoader(dataset, batch_size=workloads.BATCH_SIZE, num_workers=nw, device=device, **kw))


def torch_iter(dataset, nw, device):
    loader = torch.utils.data.DataLoader(dataset, batch_size=workloads.BATCH_SIZE, num_workers=nw, pin_memory=True)
    return (b.to(device, non_blocking=True) for b in loader)


class Step:
    """A synthetic training step: bf16 matmuls lasting about ``ms`` on the GPU, which consume the batch."""

    def __init__(self, device, ms: float):
        self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        self.n = 1
        for _ in range(3):  # calibrate the matmul count to the wanted duration
            t = self.time(20)
            self.n = max(1, round(self.n * ms / t))
        self.ms = self.time(20)

    def __call__(self, batch) -> torch.Tensor:
        x = self.a
        for _ in range(self.n):
            x = x @ self.a
        return x[0, 0] + batch.float().mean()  # the step reads its batch

    def time(self, steps: int) -> float:
        dummy = torch.zeros(8, device=self.a.device)
        self(dummy)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            self(dummy)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / steps


def fed_steps_s(step: Step, it, steps: int) -> float:
    """Seconds that ``steps`` steps take, each fed a batch from ``it`` (after 5 untimed)."""
    for _ in range(5):
        step(next(it))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(next(it))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def stall_fraction(step: Step, it, steps: int) -> float:
    """1 - (time the steps alone need) / (time they took fed by the loader)."""
    return max(0.0, 1.0 - steps * step.ms / (fed_steps_s(step, it, steps) * 1e3))


def check_pinned(nw: int, batches: int) -> str:
    import fastfeed

    loader = fastfeed.DataLoader(_transport_dataset(batches), batch_size=workloads.BATCH_SIZE, num_workers=nw,
                                 pin_memory=True)  # fmt: skip
    it = iter(loader)
    slots = set()
    pinned = total = 0
    for b in it:
        total += 1
        pinned += b.is_pinned()
        slots.add(b.untyped_storage().data_ptr())
    in_ring = len(slots) <= nw * loader.prefetch_factor + 4  # reused slots, not fresh copies
    ok = pinned == total and in_ring
    return f"{'ok' if ok else 'FAIL'}: {pinned}/{total} batches pinned, in {len(slots)} distinct buffers (ring slots)"


def check_overlap(step: Step, nw: int, batches: int, device) -> str:
    """Copies overlap compute when fed steps take less than copy time plus compute time."""
    dataset = _transport_dataset(batches + 20)
    copy_s = batches * BATCH_BYTES / 1e9 / max(1e-9, loader_h2d(lambda: fastfeed_iter(dataset, nw, device), batches))
    compute_s = batches * step.ms / 1e3
    both_s = fed_steps_s(step, fastfeed_iter(_transport_dataset(batches + 20), nw, device), batches)
    hidden = (copy_s + compute_s - both_s) / min(copy_s, compute_s)
    ok = hidden > 0.5
    return (f"{'ok' if ok else 'FAIL'}: {hidden:.0%} of the shorter of copy ({copy_s:.2f} s) and compute "
            f"({compute_s:.2f} s) hidden; together {both_s:.2f} s")  # fmt: skip


def check_no_early_reuse(nw: int, batches: int, device) -> str:
    """Every batch's per-sample byte sums match the dataset's, with a consumer slower than the loader."""
    dataset = _transport_dataset(batches)
    expected = torch.stack([t.view(-1).sum(dtype=torch.int64) for t in dataset.pool])
    pool = len(dataset.pool)
    bad = 0
    for k, b in enumerate(fastfeed_iter(dataset, nw, device, device_prefetch=3)):
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time on the consumer stream before it reads
        got = b.view(b.shape[0], -1).sum(1, dtype=torch.int64).cpu()
        idx = torch.arange(k * workloads.BATCH_SIZE, k * workloads.BATCH_SIZE + b.shape[0]) % pool
        bad += int((got != expected[idx]).any())
    return f"{'ok' if bad == 0 else 'FAIL'}: {batches - bad}/{batches} batches checksum-identical"


def _doctor_verdict(loop, seconds: float = 6.0) -> tuple[str, dict]:
    """The doctor's verdict on ``loop(batch)`` fed by a fast in-memory loader for about ``seconds``."""
    from fastfeed import DataLoader, doctor

    loader = DataLoader(torch.zeros(100_000, 8), batch_size=8, num_workers=2, persistent_workers=True)
    with doctor.watch(seconds=seconds) as report:
        while True:
            for batch in loader:
                loop(batch)
    v = report.verdict()
    return v.bottleneck, v.evidence["system"]


def check_doctor(step: Step, device) -> list[tuple[str, str]]:
    tiny = torch.zeros(16, device=device)

    def host_sync(batch):
        tiny.add_(1)
        tiny.sum().item()  # waits for the device every step
        time.sleep(0.005)  # the host idles: the GPU does almost nothing meanwhile

    def launch(batch):
        for _ in range(300):
            tiny.add_(1)

    rows = []
    for name, loop in (("compute", step), ("host_sync", host_sync), ("launch", launch)):
        got, system = _doctor_verdict(loop)
        util = system.get("gpu_util")
        rows.append((f"(f) doctor on a {name} loop", f"verdict {got} ({'ok' if got == name else 'MISS'}), GPU "
                     f"{'n/a' if util is None else f'{util:.0%}'} busy, PCIe rx {system.get('pcie_rx_mbps')} MB/s, "
                     f"host thread {system.get('main_cpu')}"))  # fmt: skip
    return rows


def _uncached(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_gds(device) -> str:
    import tempfile

    import numpy as np

    from fastfeed import DataLoader
    from fastfeed.io import ArrayFiles, gds

    ok, why = gds.available()
    if not ok:
        return f"not measured: {why}"
    import kvikio

    record = 1 << 18  # float32s: 1 MiB records
    with tempfile.TemporaryDirectory(dir=os.environ.get("FASTFEED_GDS_DIR")) as tmp:
        path = os.path.join(tmp, "records.bin")
        np.random.default_rng(0).random((1024, record), dtype=np.float32).tofile(path)
        nbytes = os.path.getsize(path)
        _uncached(path)
        buf = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        t0 = time.perf_counter()
        with kvikio.CuFile(path, "r") as f:
            for offset in range(0, nbytes, buf.numel()):
                f.pread(buf, size=min(buf.numel(), nbytes - offset), file_offset=offset).get()
        raw = nbytes / (time.perf_counter() - t0) / 1e9
        rates = {}
        for reader, nw in (("gds", 0), ("posix", 4)):
            _uncached(path)
            loader = DataLoader(ArrayFiles(path, np.float32, (record,)), batch_size=16, device=device, reader=reader,
                                num_workers=nw)  # fmt: skip
            t0 = time.perf_counter()
            for batch in loader:
                pass
            torch.cuda.synchronize()
            rates[reader] = nbytes / (time.perf_counter() - t0) / 1e9
    g = rates["gds"]
    return (f"reader='gds' {g:.2f} GB/s = {g / raw:.2f}x kvikio raw {raw:.2f} GB/s (bar >= 0.9x: "
            f"{'ok' if g >= 0.9 * raw else 'MISS'}); reader='posix' {rates['posix']:.2f} GB/s")


def images_per_s(make_iter, batches: int, warmup: int = 5) -> float:
    """Images/s of a loader whose batches end up on the GPU (timed to the last copy)."""
    it = make_iter()
    for _ in range(warmup):
        next(it)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    images = sum(next(it).shape[0] for _ in range(batches))
    torch.cuda.synchronize()
    return images / (time.perf_counter() - t0)


def dali_iter(dataset, nw, device):
    """The jpeg workload through fastfeed.dali (workloads.dali_jpeg_loader), its 1-tuples unpacked."""
    loader = workloads.dali_jpeg_loader(dataset, batch_size=workloads.BATCH_SIZE, num_workers=nw, device=device)
    return (images for (images,) in loader)


def check_dali_jpeg(device, batches: int, nw: int = 2) -> str:
    """(h) DALI's nvJPEG decoding and its CPU path against torch + Pillow, the same files, crop, flip and workers."""
    try:
        import fastfeed.dali  # noqa: F401
        import PIL  # noqa: F401
    except ImportError as e:
        return f"not measured: {e}"
    wl = workloads.jpeg()

    def make():
        return wl.make_dataset((batches + 5) * workloads.BATCH_SIZE)

    gpu = images_per_s(lambda: dali_iter(make(), nw, device), batches)
    cpu = images_per_s(lambda: (b.to(device, non_blocking=True) for b in dali_iter(make(), nw, None)), batches)
    pil = images_per_s(lambda: torch_iter(make(), nw, device), batches)
    return (f"DALI mixed (nvJPEG) {gpu:,.0f} images/s = {gpu / pil:.2f}x torch + Pillow {pil:,.0f} images/s; "
            f"DALI CPU {cpu:,.0f} images/s = {cpu / pil:.2f}x (nw={nw}, {batches} batches of 64)")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
              "nothing measured")  # fmt: skip
        return 0
    from fastfeed import _pinning

    why_not = _pinning.enable()
    device = torch.device("cuda", 0)
    nw, n = args.num_workers, args.batches
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, {os.cpu_count()} CPUs, nw={nw}",
          flush=True)  # fmt: skip
    if why_not:
        print(f"gpu_check: the ring cannot be pinned: {why_not}")
        return 1
    a = raw_pinned_h2d(device, copies=n)
    line("(a) raw pinned H2D", f"{a:.1f} GB/s (cudaMemcpyAsync, 9.6 MB, registered shm)")
    dataset = _transport_dataset(n + 20)
    b = loader_h2d(lambda: fastfeed_iter(dataset, nw, device), n)
    line("(b) fastfeed ring H2D", f"{b:.1f} GB/s  = {b / a:.2f}x (a)  bar >= 0.9x: {'ok' if b >= 0.9 * a else 'MISS'}")
    c = loader_h2d(lambda: torch_iter(dataset, nw, device), n)
    line("(c) torch pin_memory + .cuda()", f"{c:.1f} GB/s  (b)/(c) = {b / c:.2f}x  bar >= 2x: "
         f"{'ok' if b >= 2 * c else 'MISS'}")  # fmt: skip
    step = Step(device, args.step_ms)
    try:
        feed = workloads.jpeg()
        name = "jpeg"
    except ImportError:
        feed, name = workloads.transport(), "transport"
    steps = max(20, int(30_000 / step.ms))  # about 30 s of compute per loader at most
    steps = min(steps, 300)
    ff = stall_fraction(step, fastfeed_iter(feed.make_dataset((steps + 10) * 64), nw, device), steps)
    th = stall_fraction(step, torch_iter(feed.make_dataset((steps + 10) * 64), nw, device), steps)
    line(
        "(d) data-stall fraction", f"fastfeed {ff:.1%}  torch {th:.1%}  ({name}, step {step.ms:.1f} ms, {steps} steps)"
    )
    line("(e) pinned without a copy", check_pinned(nw, 50))
    line("(e) copies overlap compute", check_overlap(step, nw, 50, device))
    line("(e) no slot reused early", check_no_early_reuse(nw, 100, device))
    for label, text in check_doctor(step, device):
        line(label, text)
    line("(g) GPUDirect Storage", check_gds(device))
    line("(h) jpeg decoded on the GPU", check_dali_jpeg(device, min(n, 100)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
