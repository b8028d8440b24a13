"""Every CUDA call of the GPU check, behind one small facade: ``Cuda`` is torch.cuda on one device.

``fake.FakeCuda`` has the same methods on the CPU, for ``--dry-run``; a check never calls torch.cuda itself, so that
every line of it runs against the fake too. ``Nvml`` holds the NVML readings the checks compare with their own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import torch

from ...transfer import map_tensors


def gpu_present() -> str:
    """Evidence that this machine has an NVIDIA GPU whatever torch says ("" when none is seen)."""
    try:
        entries = os.listdir("/proc/driver/nvidia/gpus")
    except OSError:
        entries = []
    if entries:
        return f"/proc/driver/nvidia/gpus lists {len(entries)}"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
        if gpus:
            return f"nvidia-smi -L lists {len(gpus)} ({gpus[0].strip()})"
    nvml, _ = Nvml.open()
    if nvml is not None and nvml.count() > 0:
        return f"NVML counts {nvml.count()}"
    return ""


class Nvml:
    """The NVML readings the check compares with what it measured (pynvml, from nvidia-ml-py)."""

    def __init__(self, pynvml) -> None:
        self.pynvml = pynvml

    @classmethod
    def open(cls) -> tuple[Nvml | None, str]:
        """An initialised NVML, or None and why not."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # not installed, or no driver: a state, not an error
            return None, f"NVML unavailable ({type(e).__name__}: {e})"
        return cls(pynvml), ""

    def count(self) -> int:
        return self.pynvml.nvmlDeviceGetCount()

    def handle(self, key: str | int):
        """The device ``key`` names: a UUID ("GPU-..."), else an NVML index."""
        if isinstance(key, str):
            return self.pynvml.nvmlDeviceGetHandleByUUID(key)
        return self.pynvml.nvmlDeviceGetHandleByIndex(key)

    def pcie_mbps(self, key, direction: str) -> float:
        """PCIe throughput in MB/s over NVML's 20 ms window; ``direction`` "rx" (into the GPU) or "tx"."""
        counter = self.pynvml.NVML_PCIE_UTIL_RX_BYTES if direction == "rx" else self.pynvml.NVML_PCIE_UTIL_TX_BYTES
        return self.pynvml.nvmlDeviceGetPcieThroughput(self.handle(key), counter) / 1e3  # KB/s

    def utilisation(self, key) -> float:
        """The share of NVML's last sample period in which a kernel ran."""
        return self.pynvml.nvmlDeviceGetUtilizationRates(self.handle(key)).gpu / 100

    def compute_pids(self, key) -> set[int]:
        return {p.pid for p in self.pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle(key))}


class Cuda:
    """torch.cuda on device ``index``: what the check runs on a GPU."""

    dry_run = False

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.device = torch.device("cuda", index)
        self._cycles_per_ms: float | None = None
        self._nvml: tuple[Nvml | None, str] | None = None

    def describe(self) -> str:
        props = torch.cuda.get_device_properties(self.device)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def loader_device(self, index: int | None = None) -> str:
        """The ``device=`` a loader bound for GPU ``index`` (default this one) is given."""
        return f"cuda:{self.index if index is None else index}"

    def uuid(self, index: int) -> str | int:
        """NVML's name for torch's device ``index``: its UUID (CUDA_VISIBLE_DEVICES may reorder indices), else
        the index when NVML does not know that UUID."""
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        nvml, _ = self.nvml()
        if uuid is not None and nvml is not None:
            key = str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}"
            try:
                nvml.handle(key)
                return key
            except Exception:  # an NVML that names devices otherwise (MIG): fall back to the index
                pass
        return index

    def nvml(self) -> tuple[Nvml | None, str]:
        if self._nvml is None:
            self._nvml = Nvml.open()
        return self._nvml

    # streams, events and time on the device
    def Event(self):
        return torch.cuda.Event(enable_timing=True)

    def Stream(self):
        return torch.cuda.Stream(self.device)

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def sleep(self, ms: float, stream=None) -> None:
        """Keep ``stream`` (default: the current one) busy for about ``ms`` of device time; the host goes on."""
        cycles = max(1, int(ms * self.cycles_per_ms()))
        with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)

    def cycles_per_ms(self) -> float:
        """``torch.cuda._sleep`` spins for clock cycles: how many make a millisecond, timed once with events."""
        if self._cycles_per_ms is None:
            start, end = self.Event(), self.Event()
            torch.cuda._sleep(1_000_000)  # warm-up
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
            end.synchronize()
            self._cycles_per_ms = 20_000_000 / max(start.elapsed_time(end), 1e-3)
        return self._cycles_per_ms

    # memory and copies
    def to_device(self, data, non_blocking: bool = True):
        """``data`` (tensors, or containers of them) copied to this device on the current stream."""
        return map_tensors(data, lambda t: t.to(self.device, non_blocking=non_blocking))

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)`` on the current stream."""
        dst.copy_(src, non_blocking=True)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """Host memory from torch's own pinned allocator."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def memory(self, index: int) -> tuple[int, int]:
        """torch's allocated and reserved bytes on device ``index`` (0, 0 while torch never used it)."""
        return torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index)

    def copier(self, stage, make):
        """The device stage's copier for ``stage``: ``make(stage)``, fastfeed's own (``transfer.copier_for``)."""
        return make(stage)

    @contextlib.contextmanager
    def reads_at_issue(self):
        yield  # a real copy reads when the device gets to it: nothing to change
