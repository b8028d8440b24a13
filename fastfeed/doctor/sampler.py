"""The doctor's system sampler: what the machine did while the training loop ran.

A GPU that idles is waiting on something: CPUs too busy to decode, a disk too slow to read, workers starved of
cores, a main thread busy launching kernels, a PCIe link. The loader's own records say *that* the loop waited;
these samples say *on what*. A daemon thread reads cheap counters (/proc, NVML) about every ``interval`` seconds
(0.1 s by default) and appends one dict per interval to ``Sampler.samples``. It competes with the loop for the
GIL, so a reading is kept to tens of microseconds: the files stay open and are re-read from offset 0, and the
parsing is plain string splitting.

Each sample describes the interval that ended at ``t``; the first reading only sets baselines and is not kept,
so every sample has real deltas. Figures that cannot be read here are None. Fields:

- ``t``: ``time.perf_counter()`` when read. ``dt``: seconds since the previous reading.
- ``cpu_busy``: 0..1, the share of this process's allowed CPUs (``os.sched_getaffinity(0)`` at start) that was
  busy, by any process (user + nice + system + irq + softirq + steal, over that plus idle + iowait; /proc/stat).
- ``iowait``: 0..1, the share of those CPUs' time spent idle in iowait.
- ``psi_cpu``, ``psi_io``: 0..1, the share of the interval during which some task on the machine was stalled
  waiting for a CPU or for I/O (the ``some`` line of /proc/pressure/cpu and /proc/pressure/io); None where the
  kernel has no pressure stall information.
- ``disk_read_mbps``: MB/s (1e6 bytes) read from whole disks (/proc/diskstats; the devices of /sys/block except
  loop, ram, zram and stacked devices such as dm-* and md*, so no read is counted twice).
- ``disk_read_ms``: mean milliseconds per read completed in the interval; None when there was none.
- ``disk_reads``: reads completed in the interval.
- ``main_cpu``: the fraction of one core the process's main thread used (the loop, and its kernel launches).
- ``proc_cpu``: ``{str(pid): fraction of one core}`` for each watched process (the loader's workers) seen at
  both ends of the interval; can exceed 1 for a multi-threaded process.
- ``proc_uss``: ``{str(pid): bytes}``, each watched process's private memory (USS, ``fastfeed._memory``), and
  ``mem_available``: the machine's available memory in bytes (``MemAvailable`` of /proc/meminfo). Read every
  ``MEMORY_INTERVAL`` seconds, not every tick (the kernel walks a process's page tables to sum smaps_rollup, about
  a millisecond per few hundred MB mapped): None in the samples between.
- ``gpu_util``, ``gpu_mem_util``: 0..1, NVML's utilisation rates (time a kernel ran; time memory was read or
  written) of the watched GPU. ``gpu_mem_used``: bytes of its memory in use.
- ``pcie_rx_mbps``, ``pcie_tx_mbps``: MB/s over its PCIe link (NVML's KB/s ÷ 1000), rx into the GPU: the latest
  reading of a thread of their own, since NVML takes each of them over a 20 ms window (see ``_Pcie``).
  The GPU fields are None without NVML, and each one where this GPU does not report it.

The GPU watched is this process's CUDA device, found by its PCI address (``watched_gpu``): NVML's indices are not
CUDA's once ``CUDA_VISIBLE_DEVICES`` reorders the GPUs, names them by UUID or selects a MIG instance.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .. import _memory
from .._procstat import CLK_TCK, parse_stat  # shared with the tuner's noise meter, which must not import the doctor
log = logging.getLogger("fastfeed")

SECTOR = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own sector size
_NOT_DISKS = ("loop", "ram", "zram")
GPU_KEYS = ("gpu_util", "gpu_mem_util", "gpu_mem_used", "pcie_rx_mbps", "pcie_tx_mbps")
SAMPLE_KEYS = ("t", "dt", "cpu_busy", "iowait", "psi_cpu", "psi_io", "disk_read_mbps", "disk_read_ms", "disk_reads",
               "main_cpu", "proc_cpu", "proc_uss", "mem_available", *GPU_KEYS)  # fmt: skip
MEMORY_INTERVAL = 0.5  # seconds between readings of the workers' USS and the machine's available memory


# -- parsers: pure functions of a /proc file's text -----------------------------------------------------------------


def stat_cpus(text: str) -> set[int]:
    """The N of the ``cpuN`` lines of /proc/stat: the CPUs online."""
    return {int(line[3 : line.index(" ")]) for line in text.splitlines() if line.startswith("cpu") and line[3] != " "}


def parse_pressure(text: str) -> int | None:
    """Microseconds some task has been stalled, from the ``some ... total=N`` line of /proc/pressure/*."""
    for line in text.splitlines():
        if line.startswith("some "):
            _, sep, rest = line.partition(" total=")
            return int(rest.split(None, 1)[0]) if sep else None
    return None


def parse_diskstats(text: str, disks: Iterable[str]) -> tuple[int, int, int]:
    """``(reads completed, sectors read, ms spent reading)`` of the ``disks`` in /proc/diskstats, summed."""
    disks = set(disks)
    reads = sectors = ms = 0
    for line in text.splitlines():
        parts = line.split(None, 7)
        if len(parts) > 6 and parts[2] in disks:
            reads, sectors, ms = reads + int(parts[3]), sectors + int(parts[5]), ms + int(parts[6])
    return reads, sectors, ms


def parse_ticks(text: str) -> int:
    """utime + stime (clock ticks) of a /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat line."""
    # The command name (field 2) may hold spaces and ')': the fixed fields resume after the last ')'.
    fields = text[text.rindex(")") + 1 :].split(None, 13)
    return int(fields[11]) + int(fields[12])


def parse_meminfo(text: str, field: str = "MemAvailable") -> int | None:
    """A /proc/meminfo field in bytes (``MemAvailable``, ``MemTotal``), or None when absent."""
    for line in text.splitlines():
        if line.startswith(field + ":"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def whole_disks(root: str = "/sys/block") -> frozenset[str]:
    """The block devices whose reads are real disk reads: not loop, ram or zram, not stacked on other devices."""
    try:
        names = os.listdir(root)
    except OSError:
        return frozenset()
    return frozenset(n for n in names if not n.startswith(_NOT_DISKS) and not _has_slaves(f"{root}/{n}/slaves"))


def _has_slaves(path: str) -> bool:
    try:
        return bool(os.listdir(path))
    except OSError:
        return False


# -- reading --------------------------------------------------------------------------------------------------------


class _ProcFile:
    """A /proc file kept open: ``seek(0)`` + ``read()`` each tick is cheaper than open + read + close."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "rb", buffering=0)

    def read(self) -> str | None:
        """The file's text now, or None when it can no longer be read (its process has gone)."""
        try:
            self._f.seek(0)
            return self._f.read().decode("latin-1")
        except OSError:
            return None

    def close(self) -> None:
        self._f.close()


def _open(path: str) -> _ProcFile | None:
    """The file opened and readable now, or None (absent, or e.g. PSI compiled in but switched off)."""
    try:
        f = _ProcFile(path)
    except OSError:
        return None
    if f.read() is None:
        f.close()
        return None
    return f


@dataclass
class Reading:
    """The raw counters at one instant; ``delta`` turns two of them into a sample."""

    t: float
    cpu: tuple[int, int, int] | None  # busy, iowait, total ticks
    psi_cpu: int | None
    psi_io: int | None
    disk: tuple[int, int, int] | None  # reads, sectors, read ms
    main: int | None
    procs: dict[int, int] = field(default_factory=dict)
    gpu: dict = field(default_factory=dict)  # the GPU fields, read as they are (not cumulative)
    uss: dict[int, int] | None = None  # each process's USS, on the ticks memory is read (None on the others)
    mem_available: int | None = None


def delta(prev: Reading, cur: Reading) -> dict:
    """The sample of the interval between two readings (see the module docstring for its fields)."""
    dt = cur.t - prev.t
    sample = dict.fromkeys(SAMPLE_KEYS)
    sample.update(t=cur.t, dt=dt, psi_cpu=_share(prev.psi_cpu, cur.psi_cpu, dt),
                  psi_io=_share(prev.psi_io, cur.psi_io, dt))  # fmt: skip
    if prev.cpu is not None and cur.cpu is not None:
        busy, wait, total = (c - p for c, p in zip(cur.cpu, prev.cpu))
        if total > 0:  # an interval shorter than a clock tick has no CPU figures
            sample.update(cpu_busy=busy / total, iowait=wait / total)
    if prev.disk is not None and cur.disk is not None:
        reads, sectors, ms = (c - p for c, p in zip(cur.disk, prev.disk))
        if reads >= 0 and sectors >= 0:  # a disk that went away makes the sums go backwards
            sample.update(disk_read_mbps=sectors * SECTOR / 1e6 / dt, disk_read_ms=ms / reads if reads else None,
                          disk_reads=reads)  # fmt: skip
    sample["main_cpu"] = _cores(prev.main, cur.main, dt)
    sample["proc_cpu"] = {str(pid): _cores(prev.procs[pid], ticks, dt)
                          for pid, ticks in cur.procs.items() if pid in prev.procs}  # fmt: skip
    if cur.uss is not None:
        sample["proc_uss"] = {str(pid): b for pid, b in cur.uss.items()}
    sample["mem_available"] = cur.mem_available
    sample.update(cur.gpu)
    return sample


def _share(prev_us: int | None, cur_us: int | None, dt: float) -> float | None:
    if prev_us is None or cur_us is None:
        return None
    return min(1.0, max(0.0, (cur_us - prev_us) / 1e6 / dt))


def _cores(prev_ticks: int | None, cur_ticks: int | None, dt: float) -> float | None:
    if prev_ticks is None or cur_ticks is None:
        return None
    return (cur_ticks - prev_ticks) / CLK_TCK / dt


_NO_GPU = dict.fromkeys(GPU_KEYS)


class Probe:
    """The open files and the NVML handle one sampler reads; ``read()`` takes one reading of them all.

    Args:
        pids: returns the processes to watch now; called at each reading.
        gpu_index: the NVML index of the GPU to watch; None: the one this process uses (see ``watched_gpu``).
        pcie_interval: seconds between PCIe readings (the sampler's interval).
    """

    def __init__(self, pids: Callable[[], Iterable[int]] = lambda: (), gpu_index: int | None = None,
                 pcie_interval: float = 0.1) -> None:  # fmt: skip
        self._pids = pids
        self._stat = _ProcFile("/proc/stat")
        allowed = os.sched_getaffinity(0)
        # None: allowed on every CPU, so the aggregate line will do (see parse_stat)
        self.cpus = None if stat_cpus(self._stat.read() or "") <= allowed else sorted(allowed)
        self.disks = whole_disks()
        self._psi_cpu = _open("/proc/pressure/cpu")
        self._psi_io = _open("/proc/pressure/io")
        self._diskstats = _open("/proc/diskstats") if self.disks else None
        self._main = _open(f"/proc/self/task/{threading.main_thread().native_id}/stat")
        self._procs: dict[int, _ProcFile] = {}
        self._rollups: dict[int, _ProcFile] = {}  # each process's smaps_rollup, kept open as its stat is
        self._meminfo = _open("/proc/meminfo")
        self.memory_interval = MEMORY_INTERVAL
        self._memory_due = 0.0  # the first reading takes memory: the baseline of every worker's growth
        self._nvml, self._handle, self.gpu = _nvml_open(gpu_index)
        self._pcie = _Pcie(self._nvml, self._handle, pcie_interval) if self._nvml is not None else None

    def read(self) -> Reading:
        """The counters now."""
        t = time.perf_counter()
        reading = Reading(t, _parsed(self._stat, lambda text: parse_stat(text, self.cpus)),
                          _parsed(self._psi_cpu, parse_pressure), _parsed(self._psi_io, parse_pressure),
                          _parsed(self._diskstats, lambda text: parse_diskstats(text, self.disks)),
                          _parsed(self._main, parse_ticks), self._read_procs())  # fmt: skip
        reading.gpu = self._read_gpu()
        # A worker seen for the first time is read at once: its first reading is the baseline of its growth.
        if t >= self._memory_due or any(pid not in self._rollups for pid in reading.procs):
            self._memory_due = t + self.memory_interval
            reading.uss = self._read_uss(reading.procs)
            reading.mem_available = _parsed(self._meminfo, parse_meminfo)
        return reading

    def _read_uss(self, pids) -> dict[int, int]:
        """The USS of each of ``pids`` (those whose stat was just read), from its smaps_rollup kept open."""
        for pid in set(self._rollups) - set(pids):
            f = self._rollups.pop(pid)
            if f is not None:
                f.close()
        out = {}
        for pid in pids:
            if pid not in self._rollups:
                try:
                    self._rollups[pid] = _ProcFile(f"/proc/{pid}/smaps_rollup")
                except OSError:  # gone, or a kernel without smaps_rollup (before 4.14): None, not tried again
                    self._rollups[pid] = None
            use = _parsed(self._rollups[pid], _memory.parse_rollup)
            if use is not None:
                out[pid] = use.uss
        return out

    def _read_procs(self) -> dict[int, int]:
        wanted = set(self._pids())
        for pid in set(self._procs) - wanted:
            self._procs.pop(pid).close()
        ticks = {}
        for pid in wanted:
            f = self._procs.get(pid)
            if f is None:
                try:
                    f = self._procs[pid] = _ProcFile(f"/proc/{pid}/stat")
                except OSError:
                    continue  # gone already
            text = f.read()
            if text is None:
                self._procs.pop(pid).close()
            else:
                ticks[pid] = parse_ticks(text)
        return ticks

    def _read_gpu(self) -> dict:
        if self._nvml is None:
            return _NO_GPU
        nvml, handle = self._nvml, self._handle
        rates = _nvml_call(nvml, "nvmlDeviceGetUtilizationRates", handle)
        memory = _nvml_call(nvml, "nvmlDeviceGetMemoryInfo", handle)
        rx, tx = self._pcie.latest
        return {"gpu_util": None if rates is None else rates.gpu / 100,
                "gpu_mem_util": None if rates is None else rates.memory / 100,
                "gpu_mem_used": None if memory is None else int(memory.used),
                "pcie_rx_mbps": None if rx is None else rx / 1e3, "pcie_tx_mbps": None if tx is None else tx / 1e3}

    def close(self) -> None:
        """Close the files and shut NVML down (if it was initialised)."""
        for f in (self._stat, self._psi_cpu, self._psi_io, self._diskstats, self._main, self._meminfo,
                  *self._procs.values(), *(f for f in self._rollups.values() if f is not None)):  # fmt: skip
            if f is not None:
                f.close()
        self._procs.clear()
        self._rollups.clear()
        if self._pcie is not None:
            self._pcie.close()  # before NVML shuts down under its calls
            self._pcie = None
        if self._nvml is not None:
            _nvml_call(self._nvml, "nvmlShutdown")
            self._nvml = self._handle = None


def _parsed(f: _ProcFile | None, parse: Callable[[str], object]):
    text = f.read() if f is not None else None
    return None if text is None else parse(text)


# -- NVML -----------------------------------------------------------------------------------------------------------


def cuda_index() -> int:
    """The CUDA device this process uses, or most likely will: torch's current device once CUDA is initialised.

    Before that (the usual case when a watch starts), the rank's device as fastfeed's NUMA plan assumes it:
    torchrun's ``LOCAL_RANK`` (local rank r uses ``cuda:r``), else 0. torch is only consulted if something
    imported it already, and CUDA is never initialised here.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    from .. import affinity

    try:
        return affinity._env_int("LOCAL_RANK", 0)
    except ValueError as e:  # the loader refuses it with this message; the doctor just watches the likeliest GPU
        log.debug("fastfeed doctor: %s: watching cuda:0", e)
        return 0


def watched_gpu(pynvml, index: int | None = None, topo=None):
    """The GPU (``topology.Gpu``: its PCI address) that is CUDA's ``cuda:index`` here; None: unknown or none.

    ``index`` None: ``cuda_index()``; a local rank beyond the devices visible falls back to ``cuda:0`` (one GPU
    per rank through ``CUDA_VISIBLE_DEVICES``). Once CUDA is up, torch's answer wins. MIG instances in
    ``CUDA_VISIBLE_DEVICES`` stand for the GPU they are carved from: NVML's figures are per GPU. ``pynvml``
    (initialised) resolves MIG UUIDs; ``topo``: ``topology.discover()`` when None.
    """
    from .. import topology

    torch = sys.modules.get("torch")
    cuda_up = torch is not None and torch.cuda.is_initialized()
    guessed = index is None and not cuda_up  # from LOCAL_RANK
    index = cuda_index() if index is None else index
    topo = topology.discover() if topo is None else topo
    gpu = topo.gpu_for_cuda_index(index) if cuda_up else None
    if gpu is None:
        env = _without_mig(pynvml, os.environ)  # a copy: torch is not asked, so CUDA is not initialised
        gpu = topo.gpu_for_cuda_index(index, env)
        if gpu is None and guessed and index > 0:
            gpu = topo.gpu_for_cuda_index(0, env)
    return gpu


def _without_mig(pynvml, environ) -> dict:
    """``environ`` with each MIG entry of ``CUDA_VISIBLE_DEVICES`` replaced by its GPU's UUID."""
    env = dict(environ)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(_mig_parent(pynvml, e.strip()) for e in visible.split(","))
    return env


def _mig_parent(pynvml, entry: str) -> str:
    """The ``GPU-`` UUID of the GPU a ``MIG-`` entry is carved from (``entry`` itself when not MIG, or unknown)."""
    if not entry.upper().startswith("MIG-"):
        return entry
    if entry.upper().startswith("MIG-GPU-"):  # drivers before R470: MIG-GPU-<gpu uuid>/<gi>/<ci>
        return entry[4:].split("/", 1)[0]
    try:
        mig = pynvml.nvmlDeviceGetHandleByUUID(entry)
        return _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)))
    except pynvml.NVMLError as e:
        log.debug("fastfeed doctor: %s names no MIG instance NVML knows (%s)", entry, e)
        return entry


def _nvml_open(index: int | None):
    """``(pynvml, handle, {"index", "name"[, "bus_id"]})`` of the GPU to watch, or ``(None, None, None)``.

    ``index``: an NVML index; None: this process's GPU (``watched_gpu``), opened by its PCI address.
    """
    try:
        import pynvml
    except ImportError:
        return None, None, None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:  # no library, no driver, no device: no GPU figures
        log.debug("fastfeed doctor: no GPU figures (%s)", e)
        return None, None, None
    try:
        handle, gpu = _nvml_handle(pynvml, index)
    except pynvml.NVMLError as e:
        log.debug("fastfeed doctor: no GPU figures (%s)", e)
        handle = None
    if handle is None:
        _nvml_call(pynvml, "nvmlShutdown")
        return None, None, None
    return pynvml, handle, gpu


def _nvml_handle(pynvml, index: int | None):
    if index is not None:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return handle, {"index": index, "name": _text(pynvml.nvmlDeviceGetName(handle))}
    from .. import topology

    topo = topology.discover()
    gpu = watched_gpu(pynvml, topo=topo)
    if gpu is None:
        log.debug("fastfeed doctor: no GPU figures (cuda:%d matches no GPU found here; CUDA_VISIBLE_DEVICES=%r)",
                  cuda_index(), os.environ.get("CUDA_VISIBLE_DEVICES"))  # fmt: skip
        return None, None
    handle = pynvml.nvmlDeviceGetHandleByPciBusId(gpu.bus_id)  # NVML's nvmlDeviceGetHandleByPciBusId_v2
    index = _nvml_call(pynvml, "nvmlDeviceGetIndex", handle)
    if index is None:  # NVML numbers GPUs in PCI bus order, as topology lists them
        index = topo.gpus.index(gpu)
    return handle, {"index": index, "name": _text(pynvml.nvmlDeviceGetName(handle)), "bus_id": gpu.bus_id}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Pcie:
    """NVML's PCIe throughput (rx, tx KB/s), read every ``interval`` on a thread of its own.

    Each counter is measured over a 20 ms window that the call waits out: read in the tick, the two would make
    every sample (and the next tick) 40 ms late. The call releases the GIL, so the thread costs the loop nothing.
    ``latest`` is the last reading, (None, None) before the first.
    """

    def __init__(self, nvml, handle, interval: float) -> None:
        self.latest: tuple[int | None, int | None] = (None, None)
        self._nvml, self._handle, self._interval = nvml, handle, interval
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastfeed-doctor-pcie", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nvml = self._nvml
        while True:
            t0 = time.perf_counter()
            rx = _nvml_call(nvml, "nvmlDeviceGetPcieThroughput", self._handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
            tx = _nvml_call(nvml, "nvmlDeviceGetPcieThroughput", self._handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
            self.latest = (rx, tx)
            if rx is None and tx is None:
                return  # this GPU reports neither
            if self._stopping.wait(max(0.0, self._interval - (time.perf_counter() - t0))):
                return

    def close(self) -> None:
        """Stop the thread, waiting out a reading in progress."""
        self._stopping.set()
        self._thread.join()


def _nvml_call(pynvml, name: str, *args):
    """``pynvml.<name>(*args)``, or None where NVML says no (NotSupported on this GPU, GPU lost, ...)."""
    try:
        return getattr(pynvml, name)(*args)
    except pynvml.NVMLError:
        return None


# -- the thread -----------------------------------------------------------------------------------------------------


class Sampler:
    """Samples the system every ``interval`` seconds on a daemon thread into ``samples``.

    Args:
        interval: seconds between readings.
        pids: returns the worker processes to watch now (called each tick).
        gpu_index: NVML index of the GPU to watch; None: the one this process uses (``watched_gpu()``).
        on_tick: called on the thread with each sample once it is appended; an exception in it is logged once
            on the ``fastfeed`` logger and sampling goes on.

    ``gpu`` is ``{"index", "name"}`` of the GPU watched once started (and ``"bus_id"``, its PCI address, when
    found as this process's GPU), None without NVML.
    """

    def __init__(self, interval: float = 0.1, pids: Callable[[], Iterable[int]] = lambda: (),
                 gpu_index: int | None = None, on_tick: Callable[[dict], object] | None = None) -> None:  # fmt: skip
        self.interval = interval
        self.samples: list[dict] = []
        self.gpu: dict | None = None
        self._pids, self._gpu_index, self._on_tick = pids, gpu_index, on_tick
        self._probe: Probe | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._tick_failed = False

    def start(self) -> Sampler:
        """Open the counters, take the baseline reading and start the thread."""
        if self._thread is not None:
            raise RuntimeError("this Sampler was started already")
        self._probe = Probe(self._pids, self._gpu_index, self.interval)
        self.gpu = self._probe.gpu
        try:
            first = self._probe.read()
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._run, args=(first,), name="fastfeed-doctor-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and close the counters; again is a no-op."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, prev: Reading) -> None:
        due = prev.t + self.interval
        while not self._stopping.wait(max(0.0, due - time.perf_counter())):
            cur = self._probe.read()
            sample = delta(prev, cur)
            self.samples.append(sample)
            prev = cur
            due += self.interval
            if due <= cur.t:  # over a whole interval late (a GIL-hungry loop): skip ahead, no burst of short ticks
                due = cur.t + self.interval
            if self._on_tick is not None:
                self._call_on_tick(sample)

    def _call_on_tick(self, sample: dict) -> None:
        try:
            self._on_tick(sample)
        except Exception:
            if not self._tick_failed:
                self._tick_failed = True
                log.warning("fastfeed doctor: the sampler's on_tick failed; sampling goes on", exc_info=True)
