"""What the GPUs themselves show: a loader on cuda:1 leaves GPU 0 alone, and NVML's readings under a known load."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

from .harness import fmt, pool_dataset, stage_copier
from .report import MODULE, Check, Skip
from .sizes import DRY, Sizes


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
    cmd = [sys.executable, "-m", MODULE, "--child", "other_device", "--gpu0", str(gpu0)]
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


def other_device_child(cuda, gpu0: str) -> int:
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
