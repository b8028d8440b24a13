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

from fastfeed.doctor import sampler as sm
from fastfeed.doctor.sampler import Reading, Sampler

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
    assert 0.04 <= statistics.median(x["dt"] for x in s.samples) <= 0.07
    assert all(b["t"] - a["t"] == pytest.approx(b["dt"]) for a, b in zip(s.samples, s.samples[1:]))


def test_a_spinning_worker_shows_in_proc_cpu_and_cpu_busy():
    """A child process spinning a core reads as > half a core in proc_cpu, and its core shows in cpu_busy."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.1)
        s = run_sampler(0.6, pids=lambda: [child.pid])
    finally:
        child.kill()
        child.wait()
    seen = [x for x in s.samples if str(child.pid) in x["proc_cpu"]]
    assert len(seen) >= 5
    spin = over_time(seen, lambda x: x["proc_cpu"][str(child.pid)])  # single samples are a few clock ticks
    assert spin > 0.5
    assert over_time(seen, lambda x: x["cpu_busy"]) >= 0.8 * spin / len(os.sched_getaffinity(0))


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


def fake_pynvml(calls: list, init_error: bool = False) -> types.ModuleType:
    """A pynvml stand-in: one GPU at 75% busy, 30% memory busy, 2 MB/s in over PCIe, tx NotSupported."""
    m = types.ModuleType("pynvml")
    m.NVMLError = type("NVMLError", (Exception,), {})
    m.NVMLError_NotSupported = type("NVMLError_NotSupported", (m.NVMLError,), {})
    m.NVMLError_LibraryNotFound = type("NVMLError_LibraryNotFound", (m.NVMLError,), {})
    m.NVML_PCIE_UTIL_TX_BYTES, m.NVML_PCIE_UTIL_RX_BYTES = 0, 1

    def init():
        calls.append("init")
        if init_error:
            raise m.NVMLError_LibraryNotFound()

    def pcie(handle, counter):
        if counter == m.NVML_PCIE_UTIL_TX_BYTES:
            raise m.NVMLError_NotSupported()
        return 2000

    m.nvmlInit, m.nvmlShutdown = init, lambda: calls.append("shutdown")
    m.nvmlDeviceGetHandleByIndex = lambda index: calls.append(("handle", index)) or f"gpu{index}"
    m.nvmlDeviceGetName = lambda handle: b"Fake GPU"
    m.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=75, memory=30)
    m.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=123, free=877, total=1000)
    m.nvmlDeviceGetPcieThroughput = pcie
    return m


def test_nvml_figures_are_scaled_and_a_call_nvml_refuses_is_none(monkeypatch):
    """With NVML the GPU fields are shares, bytes and MB/s; a NotSupported call is None; stop shuts NVML down once."""
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    s = Sampler(0.05).start()
    time.sleep(0.15)
    s.stop()
    s.stop()
    assert s.gpu == {"index": 3, "name": "Fake GPU"}
    assert calls[:2] == ["init", ("handle", 3)] and calls.count("shutdown") == 1 and calls[-1] == "shutdown"
    x = s.samples[-1]
    assert (x["gpu_util"], x["gpu_mem_util"], x["gpu_mem_used"]) == (0.75, 0.3, 123)
    assert x["pcie_rx_mbps"] == pytest.approx(2.0) and x["pcie_tx_mbps"] is None
    assert run_sampler(0.06, gpu_index=5).gpu["index"] == 5


def test_an_nvml_that_fails_to_start_means_no_gpu(monkeypatch, caplog):
    """An NVMLError from nvmlInit means no GPU figures, no shutdown call and no warning."""
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls, init_error=True))
    with caplog.at_level(logging.WARNING, logger="fastfeed"):
        s = run_sampler(0.1)
    assert s.gpu is None and calls == ["init"] and not caplog.records
    assert all(x[k] is None for x in s.samples for k in sm.GPU_KEYS)


def test_gpu_index_maps_the_current_device_through_cuda_visible_devices(monkeypatch):
    """The current CUDA device (0 before CUDA starts) is mapped to its physical index when the list holds integers."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)
    assert sm.gpu_index() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert sm.gpu_index() == 3
    cuda = types.SimpleNamespace(is_initialized=lambda: True, current_device=lambda: 1)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert sm.gpu_index() == 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2c,GPU-11aa")
    assert sm.gpu_index() == 1


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
