"""The doctor's system sampler: its /proc parsers on fixed texts, the live thread, worker CPU, NVML and its absence."""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from _load import OthersLoad, skip_if_others_held
from _sysfs import make_tree

from fastfeed import topology
from fastfeed.doctor import sampler as sm
from fastfeed.doctor.sampler import Reading, Sampler
from fastfeed.topology import normalize_bus_id

THREAD = "fastfeed-doctor-sampler"
NEVER_A_PID = 2**22 + 1  # above the kernel's largest pid_max

STAT = """\
cpu  300 10 60 1000 40 5 5 0 7 0
cpu0 100 0 20 500 10 1 1 0 7 0
cpu1 100 10 20 300 20 2 2 0 0 0
cpu2 100 0 20 200 10 2 2 0 0 0
intr 12 0 3 4
ctxt 5
btime 1700000000
"""

DISKSTATS = """\
   7       0 loop0 9 0 99 9 0 0 0 0 0 0 0 0 0 0 0 0 0
 254       0 vda 352815 25796 18685634 2009801 22960 251931 13605624 62666 0 270696 2085878 140954 33 8158496 13390
 254       1 vda1 352000 25796 18600000 2009000 22960 251931 13605624 62666 0 270696 2085878
 259       0 nvme0n1 10 0 80 4 0 0 0 0 0 0 0 0 0 0
 253       0 dm-0 500 0 4000 60 0 0 0 0 0 0 0 0 0 0
"""


def run_sampler(seconds: float, **kwargs) -> Sampler:
    """A Sampler at 0.05 s run for ``seconds``, stopped."""
    with Sampler(0.05, **kwargs) as s:
        time.sleep(seconds)
    return s


def on_time(others: OthersLoad, seconds: float, bound: float, what: str) -> None:
    """``seconds`` (a cadence, a delay) is within ``bound``, an idle machine's; past it while other processes held
    this process's cores (``_load.skip_if_others_held``), the test is skipped naming their load: the sampler's
    thread then waited for a core as much as for its tick."""
    if seconds > bound:
        skip_if_others_held(others, f"{what} was {seconds * 1000:.0f} ms, over its {bound * 1000:g} ms bound")
    assert seconds <= bound, f"{what} was {seconds * 1000:.1f} ms, over its {bound * 1000:g} ms bound"


def test_parse_stat_sums_the_allowed_cpus_busy_and_iowait_ticks():
    """Only the cpuN lines of the allowed CPUs count, guest time is not counted twice, None reads the total line."""
    # cpu0: busy 100+0+20+1+1+0 = 122 (guest 7 is inside user already); cpu2: 124
    assert sm.parse_stat(STAT, {0, 2}) == (246, 20, 246 + 700 + 20)
    assert sm.parse_stat(STAT, None) == (380, 40, 380 + 1000 + 40)
    assert sm.parse_stat(STAT, {7}) == (0, 0, 0)
    assert sm.stat_cpus(STAT) == {0, 1, 2}


def test_parse_pressure_reads_the_some_total():
    """The ``some`` line's total= microseconds; a file without one gives None."""
    text = "some avg10=0.07 avg60=0.11 avg300=0.31 total=2241276105\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    assert sm.parse_pressure(text) == 2241276105
    assert sm.parse_pressure("some avg10=1.00 avg60=0.50 avg300=0.10 total=42\n") == 42  # kernels before "full"
    assert sm.parse_pressure("full avg10=0.00 avg60=0.00 avg300=0.00 total=5\n") is None


def test_parse_diskstats_counts_only_the_named_disks():
    """Reads, sectors and read ms of the named whole disks; partitions, loops and dm devices are left out."""
    assert sm.parse_diskstats(DISKSTATS, {"vda", "nvme0n1"}) == (352815 + 10, 18685634 + 80, 2009801 + 4)
    assert sm.parse_diskstats(DISKSTATS, set()) == (0, 0, 0)


def test_parse_ticks_with_spaces_and_parentheses_in_the_command_name():
    """utime + stime are found after the last ')', whatever the command name holds."""
    text = "4242 (my (weird) app) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 37 0 0 20 0 1 0 12345 1000 10\n"
    assert sm.parse_ticks(text) == 287
    with open(f"/proc/{os.getpid()}/stat") as f:
        assert sm.parse_ticks(f.read()) >= 0


def test_whole_disks_leaves_out_loop_ram_zram_and_stacked_devices(tmp_path):
    """/sys/block's loop, ram, zram and devices stacked on others (dm, md) are not counted as disks."""
    for name in ("vda", "nvme0n1", "loop0", "ram0", "zram0", "dm-0", "md0"):
        (tmp_path / name / "slaves").mkdir(parents=True)
    (tmp_path / "dm-0" / "slaves" / "vda").touch()
    (tmp_path / "md0" / "slaves" / "nvme0n1").touch()
    assert sm.whole_disks(str(tmp_path)) == {"vda", "nvme0n1"}
    assert sm.whole_disks(str(tmp_path / "absent")) == frozenset()


def test_delta_turns_two_readings_into_a_sample():
    """Each figure of a sample from two fixed readings; a pid seen only once is left out, shares are clamped."""
    tick = sm.CLK_TCK
    prev = Reading(10.0, (100, 10, 400), 1_000_000, 0, (10, 1000, 50), 100, {1: 10, 2: 20})
    cur = Reading(10.5, (250, 20, 600), 1_250_000, 2_000_000, (20, 3000, 150), 100 + tick // 2, {1: 10 + tick, 3: 5})
    s = sm.delta(prev, cur)
    assert tuple(s) == sm.SAMPLE_KEYS
    assert s["t"] == 10.5 and s["dt"] == 0.5
    assert s["cpu_busy"] == pytest.approx(0.75) and s["iowait"] == pytest.approx(0.05)
    assert s["psi_cpu"] == pytest.approx(0.5) and s["psi_io"] == 1.0
    assert s["disk_read_mbps"] == pytest.approx(2000 * 512 / 1e6 / 0.5)
    assert s["disk_read_ms"] == pytest.approx(10.0) and s["disk_reads"] == 10
    assert s["main_cpu"] == pytest.approx((tick // 2) / tick / 0.5)
    assert s["proc_cpu"] == {"1": pytest.approx(2.0)}
    assert all(s[k] is None for k in sm.GPU_KEYS)
    idle = sm.delta(prev, Reading(10.5, None, None, None, prev.disk, None))
    assert idle["disk_reads"] == 0 and idle["disk_read_mbps"] == 0 and idle["disk_read_ms"] is None
    assert idle["cpu_busy"] is None and idle["psi_cpu"] is None and idle["main_cpu"] is None


def test_live_sampler_fills_every_field_in_range_at_the_interval():
    """Run at 0.05 s for 0.5 s: every sample has every key, values in range, dt about the interval, JSON-able."""
    with OthersLoad() as others:
        s = run_sampler(0.5)
    assert len(s.samples) >= 5
    json.dumps(s.samples)
    for x in s.samples:
        assert tuple(x) == sm.SAMPLE_KEYS
        assert 0 <= x["cpu_busy"] <= 1 and 0 <= x["iowait"] <= 1
        assert all(x[k] is None or 0 <= x[k] <= 1 for k in ("psi_cpu", "psi_io"))
        assert x["disk_read_mbps"] is None or x["disk_read_mbps"] >= 0
        assert x["disk_read_ms"] is None or x["disk_read_ms"] >= 0
        assert 0 <= x["main_cpu"] < 2 and x["proc_cpu"] == {}
    assert all(b["t"] - a["t"] == pytest.approx(b["dt"]) for a, b in zip(s.samples, s.samples[1:]))
    interval = statistics.median(x["dt"] for x in s.samples)
    assert interval >= 0.04
    on_time(others, interval, 0.07, "the median interval at 0.05 s")


def test_a_spinning_worker_shows_in_proc_cpu_and_cpu_busy():
    """A child process spinning a core reads in proc_cpu as the CPU it was given (its own clock ticks over the
    same time), and its share shows in cpu_busy. Compared with the child's own ticks, not with a whole core, so a
    busy machine, which gives the spinner less than a core, cannot fail it."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)
        t0, ticks0 = time.monotonic(), _cpu_ticks(child.pid)
        s = run_sampler(1.0, pids=lambda: [child.pid])
        t1, ticks1 = time.monotonic(), _cpu_ticks(child.pid)
    finally:
        child.kill()
        child.wait()
    given = (ticks1 - ticks0) / os.sysconf("SC_CLK_TCK") / (t1 - t0)  # cores the child had, by its own account
    seen = [x for x in s.samples if str(child.pid) in x["proc_cpu"]]
    assert len(seen) >= 5
    spin = over_time(seen, lambda x: x["proc_cpu"][str(child.pid)])  # single samples are a few clock ticks
    assert given > 0.05, "the spinner was given no CPU at all"
    assert abs(spin - given) <= 0.25 * given + 0.05, (spin, given)
    assert over_time(seen, lambda x: x["cpu_busy"]) >= 0.8 * spin / len(os.sched_getaffinity(0))


def _cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid``, in clock ticks (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def over_time(samples: list[dict], value) -> float:
    """The mean of ``value(sample)`` over the samples' time."""
    return sum(value(x) * x["dt"] for x in samples) / sum(x["dt"] for x in samples)


def test_a_pid_that_exits_is_dropped_and_sampling_goes_on():
    """A watched process that exits mid-run (and one that never existed) just drops out of proc_cpu."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        with Sampler(0.05, pids=lambda: [child.pid, NEVER_A_PID]) as s:
            child.wait(timeout=10)
            gone = len(s.samples)
            time.sleep(0.3)
    finally:
        child.kill()
        child.wait()
    pid = str(child.pid)
    assert any(pid in x["proc_cpu"] for x in s.samples[:gone])
    assert len(s.samples) >= gone + 3
    assert all(pid not in x["proc_cpu"] for x in s.samples[gone + 1 :])
    assert all(str(NEVER_A_PID) not in x["proc_cpu"] for x in s.samples)


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


def test_without_an_nvml_library_the_gpu_fields_are_none(caplog):
    """Where NVML cannot start (no library, no driver), gpu is None, every GPU field is None, and nothing warns."""
    if _nvml_works():
        pytest.skip("NVML works on this machine")
    with caplog.at_level(logging.WARNING, logger="fastfeed"):
        s = run_sampler(0.15)
    assert s.gpu is None and s.samples
    assert all(x[k] is None for x in s.samples for k in sm.GPU_KEYS)
    assert not caplog.records


def test_without_pynvml_the_gpu_fields_are_none(monkeypatch):
    """When pynvml cannot be imported, gpu is None and every GPU field is None."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    s = run_sampler(0.15)
    assert s.gpu is None and s.samples
    assert all(x[k] is None for x in s.samples for k in sm.GPU_KEYS)


# The machine the fake NVML describes: four GPUs in PCI bus order (NVML's form of the address), the second one
# split into two MIG instances. Each GPU's utilisation tells which one a sample was read from.
MACHINE = [
    ("00000000:1A:00.0", "GPU-a1a1a1a1-0000-4000-8000-000000000001", ()),
    ("00000000:3B:00.0", "GPU-b2b2b2b2-0000-4000-8000-000000000002",
     ("MIG-5c5c5c5c-0000-5000-8000-000000000001", "MIG-6d6d6d6d-0000-5000-8000-000000000002")),
    ("00000000:86:00.0", "GPU-c3c3c3c3-0000-4000-8000-000000000003", ()),
    ("00000000:AF:00.0", "GPU-d4d4d4d4-0000-4000-8000-000000000004", ()),
]  # fmt: skip
BUS_IDS = ["0000:1a:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"]  # as sysfs writes them


def fake_pynvml(calls: list, init_error: bool = False, pcie_s: float = 0.0) -> types.ModuleType:
    """A pynvml stand-in for MACHINE: GPU i is 10*(i+1)% busy, 30% memory busy, 2 MB/s in over PCIe (after
    ``pcie_s`` seconds, NVML's sampling window), tx NotSupported. ``calls`` records init, shutdown, the
    handle each utilisation reading used, and each PCIe reading."""
    m = types.ModuleType("pynvml")
    m.NVMLError = type("NVMLError", (Exception,), {})
    m.NVMLError_NotSupported = type("NVMLError_NotSupported", (m.NVMLError,), {})
    m.NVMLError_NotFound = type("NVMLError_NotFound", (m.NVMLError,), {})
    m.NVMLError_InvalidArgument = type("NVMLError_InvalidArgument", (m.NVMLError,), {})
    m.NVMLError_LibraryNotFound = type("NVMLError_LibraryNotFound", (m.NVMLError,), {})
    m.NVML_PCIE_UTIL_TX_BYTES, m.NVML_PCIE_UTIL_RX_BYTES = 0, 1
    migs = {mig: (i, j) for i, (_, _, names) in enumerate(MACHINE) for j, mig in enumerate(names)}

    def init():
        calls.append("init")
        if init_error:
            raise m.NVMLError_LibraryNotFound()

    def by_index(index):
        if not 0 <= index < len(MACHINE):
            raise m.NVMLError_InvalidArgument()
        return f"gpu{index}"

    def by_pci(bus_id):
        wanted = normalize_bus_id(bus_id)
        for i, (bus, _, _) in enumerate(MACHINE):
            if normalize_bus_id(bus) == wanted:
                return f"gpu{i}"
        raise m.NVMLError_NotFound()

    def by_uuid(uuid):
        for i, (_, gpu_uuid, _) in enumerate(MACHINE):
            if uuid == gpu_uuid:
                return f"gpu{i}"
        if uuid in migs:
            return "mig{}.{}".format(*migs[uuid])
        raise m.NVMLError_NotFound()

    def index_of(handle):
        if not handle.startswith("gpu"):
            raise m.NVMLError_InvalidArgument()
        return int(handle[3:])

    def utilization(handle):
        calls.append(("util", handle))
        return types.SimpleNamespace(gpu=10 * (index_of(handle) + 1), memory=30)

    def pcie(handle, counter):
        time.sleep(pcie_s)
        calls.append("pcie")
        if counter == m.NVML_PCIE_UTIL_TX_BYTES:
            raise m.NVMLError_NotSupported()
        return 2000

    m.nvmlInit, m.nvmlShutdown = init, lambda: calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(MACHINE)
    m.nvmlDeviceGetHandleByIndex = by_index
    m.nvmlDeviceGetHandleByPciBusId = by_pci
    m.nvmlDeviceGetHandleByUUID = by_uuid
    m.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = lambda mig: "gpu" + mig[3:].split(".")[0]
    m.nvmlDeviceGetIndex = index_of
    m.nvmlDeviceGetPciInfo = lambda handle: types.SimpleNamespace(busId=MACHINE[index_of(handle)][0])
    m.nvmlDeviceGetUUID = lambda handle: MACHINE[index_of(handle)][1]
    m.nvmlDeviceGetName = lambda handle: b"Fake GPU"
    m.nvmlDeviceGetUtilizationRates = utilization
    m.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=123, free=877, total=1000)
    m.nvmlDeviceGetPcieThroughput = pcie
    return m


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """MACHINE behind a fake NVML, its GPUs also in a fake sysfs tree that stands for the real one (so that
    discovery asks NVML, as on a real machine); CUDA not initialised, no torchrun or CUDA variables."""
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls))
    root = make_tree(tmp_path, nodes={0: "0-3", 1: "4-7"}, gpus=[(bus, i // 2, None) for i, bus in enumerate(BUS_IDS)])
    monkeypatch.setenv("FASTFEED_SYSFS_ROOT", root)
    monkeypatch.setattr(topology, "REAL_ROOT", os.path.realpath(root))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    return calls


def watched(calls: list) -> int:
    """Sample for a moment: which of MACHINE's GPUs the readings came from (the one the sampler says it watches)."""
    s = run_sampler(0.12)
    used = {c[1] for c in calls if isinstance(c, tuple) and c[0] == "util"}
    assert len(used) == 1, used
    index = int(used.pop()[3:])
    assert s.gpu["index"] == index and s.samples[-1]["gpu_util"] == (index + 1) / 10
    return index


def test_nvml_figures_are_scaled_and_a_call_nvml_refuses_is_none(machine):
    """With NVML the GPU fields are shares, bytes and MB/s; a NotSupported call is None; stop shuts NVML down once."""
    s = Sampler(0.05).start()
    time.sleep(0.15)
    s.stop()
    s.stop()
    assert s.gpu == {"index": 0, "name": "Fake GPU", "bus_id": BUS_IDS[0]}
    assert machine[0] == "init" and machine.count("shutdown") == machine.count("init") and machine[-1] == "shutdown"
    x = s.samples[-1]
    assert (x["gpu_util"], x["gpu_mem_util"], x["gpu_mem_used"]) == (0.1, 0.3, 123)
    assert x["pcie_rx_mbps"] == pytest.approx(2.0) and x["pcie_tx_mbps"] is None
    assert run_sampler(0.06, gpu_index=2).gpu == {"index": 2, "name": "Fake GPU"}  # an NVML index, as it is


def test_an_nvml_that_fails_to_start_means_no_gpu(monkeypatch, caplog):
    """An NVMLError from nvmlInit means no GPU figures, no shutdown call and no warning."""
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls, init_error=True))
    with caplog.at_level(logging.WARNING, logger="fastfeed"):
        s = run_sampler(0.1)
    assert s.gpu is None and calls == ["init"] and not caplog.records
    assert all(x[k] is None for x in s.samples for k in sm.GPU_KEYS)


@pytest.mark.parametrize("visible,bus", [
    ("3,1", 3),  # indices: cuda:0 is NVML's GPU 3
    ("GPU-c3c3c3c3-0000-4000-8000-000000000003,GPU-a1a1a1a1-0000-4000-8000-000000000001", 2),  # UUIDs
    ("GPU-d4d4,GPU-a1a1", 3),  # unique UUID prefixes, as CUDA takes them
])  # fmt: skip
def test_cuda_visible_devices_by_index_or_uuid_picks_the_gpu_cuda_calls_cuda_0(machine, monkeypatch, visible, bus):
    """Before CUDA starts, cuda:0 is the first entry of CUDA_VISIBLE_DEVICES, found by its PCI address and opened
    by it: a UUID list watches that GPU, not NVML's GPU 0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert watched(machine) == bus


@pytest.mark.parametrize("visible", ["MIG-6d6d6d6d-0000-5000-8000-000000000002",
                                     "MIG-GPU-b2b2b2b2-0000-4000-8000-000000000002/1/0"])  # fmt: skip
def test_a_mig_instance_watches_the_gpu_it_is_carved_from(machine, monkeypatch, visible):
    """A MIG entry in CUDA_VISIBLE_DEVICES (today's MIG-<uuid>, or the old MIG-GPU-<uuid>/gi/ci) means its GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert watched(machine) == 1


@pytest.mark.parametrize("visible,bus", [(None, 1), ("2,3", 3), ("2", 2)])
def test_a_torchrun_rank_before_cuda_starts_watches_its_local_ranks_gpu(machine, monkeypatch, visible, bus):
    """LOCAL_RANK=1 before CUDA is initialised: cuda:1, as fastfeed's NUMA plan assumes; with one GPU visible per
    rank, that one."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert watched(machine) == bus


def test_once_cuda_is_up_torchs_pci_address_wins(machine, monkeypatch):
    """With CUDA initialised, the current device's PCI address from torch decides (CUDA's FASTEST_FIRST order
    need not be PCI order), and CUDA_VISIBLE_DEVICES is not second-guessed."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    props = {0: "00000000:1A:00.0", 1: "00000000:86:00.0"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(pci_bus_id=props[i]))
    assert watched(machine) == 2


def test_a_device_no_gpu_matches_gives_no_gpu_figures(machine, monkeypatch):
    """CUDA_VISIBLE_DEVICES naming no GPU here (an empty list hides them all) means no GPU figures, not GPU 0's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    s = run_sampler(0.1)
    assert s.gpu is None and all(x[k] is None for x in s.samples for k in sm.GPU_KEYS)
    assert machine.count("init") == machine.count("shutdown")


def test_pcie_readings_do_not_delay_the_tick(machine, monkeypatch):
    """NVML's PCIe call waits out its 20 ms window (twice, rx and tx): read on a thread of its own, it leaves each
    sample on time and the 0.1 s cadence whole, its figures still arrive, and it stops before NVML shuts down."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(machine, pcie_s=0.02))
    late = []
    with OthersLoad() as others, Sampler(0.1, on_tick=lambda x: late.append(time.perf_counter() - x["t"])) as s:
        time.sleep(0.75)
    assert len(s.samples) >= 5
    interval = statistics.median(x["dt"] for x in s.samples)
    assert interval >= 0.09
    assert s.samples[-1]["pcie_rx_mbps"] == pytest.approx(2.0) and machine.count("pcie") >= 6
    assert machine[-1] == "shutdown" and not any(t.name == "fastfeed-doctor-pcie" for t in threading.enumerate())
    with OthersLoad() as others_fast, Sampler(0.03) as fast:  # shorter than the two windows: only a thread keeps it
        time.sleep(0.45)
    # The delay and the cadences last, each judged against other processes' load while it was measured. Read in the
    # tick, a sample would be 40 ms old when handed on.
    on_time(others, statistics.median(late), 0.01, "the median delay of a sample handed on")
    on_time(others, interval, 0.11, "the median interval at 0.1 s")
    on_time(others_fast, statistics.median(x["dt"] for x in fast.samples), 0.036, "the median interval at 0.03 s")


def test_on_tick_sees_every_sample():
    """on_tick is called on the thread with each sample, after it is appended."""
    seen = []
    s = Sampler(0.05, on_tick=lambda x: seen.append((x, x is s.samples[-1])))
    with s:
        time.sleep(0.3)
    assert len(seen) == len(s.samples) >= 3
    assert all(appended for _, appended in seen) and [x for x, _ in seen] == s.samples


def test_an_on_tick_that_raises_is_logged_once_and_sampling_goes_on(caplog):
    """An exception in on_tick is logged once on the fastfeed logger; the thread keeps sampling."""
    calls = []

    def broken(sample):
        calls.append(sample)
        raise ValueError("boom")

    with caplog.at_level(logging.WARNING, logger="fastfeed"):
        s = run_sampler(0.3, on_tick=broken)
    assert len(calls) == len(s.samples) >= 3
    logged = [r for r in caplog.records if r.name == "fastfeed"]
    assert len(logged) == 1 and "on_tick" in logged[0].getMessage() and logged[0].exc_info[0] is ValueError


def test_stop_is_idempotent_and_leaves_no_thread():
    """stop() before start, twice, and after a with-block does nothing more and leaves no sampler thread."""
    s = Sampler(0.05)
    s.stop()
    s = Sampler(0.05).start()
    assert any(t.name == THREAD for t in threading.enumerate())
    s.stop()
    s.stop()
    assert not any(t.name == THREAD for t in threading.enumerate())
    with Sampler(0.05) as s:
        pass
    s.stop()
    assert not any(t.name == THREAD for t in threading.enumerate())
    with pytest.raises(RuntimeError):
        s.start()
