"""The tuner's noise meter: what other processes take of this rank's CPUs, and the CPU the workers and the loop spend.

The meter (``fastfeed.tuning.noise``) reads /proc at a window's edges; each trial, offline (``measure``) and online
(``num_workers="auto"``), carries ``others_cores``, ``worker_cpu_s`` and ``loop_cpu_s``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import Dataset

import fastfeed
from _burner import burner
from fastfeed import _procstat, stats
from fastfeed._procstat import CLK_TCK
from fastfeed.tuning import measure, online
from fastfeed.tuning.noise import CpuMeter, Reading, usage
from fastfeed.tuning.result import Setting, Trial, TuneResult
from fastfeed.tuning.search import CPU_BOUND, DEFAULT_PREFETCH, Search

pytestmark = pytest.mark.fastfeed_only

CPUS = len(os.sched_getaffinity(0))


class Spin(Dataset):
    """Samples that cost ``cpu_s`` of CPU each (counted in CPU time, so a loaded machine stretches only their wall
    time), or that wait ``sleep_s`` (I/O-like, next to no CPU)."""

    def __init__(self, n=100_000, cpu_s=0.0, sleep_s=0.0):
        self.n, self.cpu_s, self.sleep_s = n, cpu_s, sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        return torch.full((8,), i, dtype=torch.int64)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFEED_CACHE_DIR", str(tmp_path / "cache"))


def _ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of ``pid``: its CPU and that of the children it has reaped."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return sum(map(int, text[text.rindex(")") + 2 :].split()[11:15]))


# -- usage(): the arithmetic of two readings ---------------------------------------------------------------------


def test_usage_takes_the_tree_out_of_the_cpus_busy_ticks():
    """Of 1.5 cores busy over 2 s, 0.25 were this process's and 0.5 its children's: others kept 0.75."""
    a = Reading(t=10.0, busy=1000, own=1.0, children=0.5)
    b = Reading(t=12.0, busy=1000 + 3 * CLK_TCK, own=1.5, children=1.5)
    u = usage(a, b)
    assert u.seconds == 2.0
    assert u.own_cpu_s == pytest.approx(0.5) and u.children_cpu_s == pytest.approx(1.0)
    assert u.others_cores == pytest.approx(0.75)


def test_usage_never_reads_negative():
    """A descendant that left the tree unreaped takes its CPU time along: children and others stay at 0, not
    below."""
    a = Reading(t=0.0, busy=500, own=0.1, children=4.0)
    b = Reading(t=1.0, busy=500 + CLK_TCK // 10, own=0.2, children=1.0)
    u = usage(a, b)
    assert u.children_cpu_s == 0.0 and u.others_cores == 0.0 and u.own_cpu_s == pytest.approx(0.1)


# -- the meter on live processes ---------------------------------------------------------------------------------


def _kill_tree(child: subprocess.Popen) -> None:
    """Kill ``child`` and its descendants (listed before it dies: once it has, they are reparented)."""
    for pid in _procstat._scanned_stats(child.pid):
        if pid != child.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    child.kill()
    child.wait()


def test_the_children_files_and_the_scan_of_proc_find_the_same_tree():
    """Both ways of finding the descendants (the kernel's children files, and every process's parent) agree, a
    grandchild included."""
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('ready', flush=True); time.sleep(60)")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        scanned = _procstat._scanned_stats(os.getpid())
        assert child.pid in scanned and len(scanned) >= 3  # this process, the child, the grandchild
        if not _procstat._HAS_CHILDREN:
            pytest.skip("this kernel has no /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN): the scan alone")
        assert _procstat._tree_stats(os.getpid()).keys() == scanned.keys()
    finally:
        _kill_tree(child)


def test_a_busy_child_is_the_trees_cpu_not_others():
    """A child that spins, after reaping a grandchild that spun: all of it is the descendants' CPU, as much as the
    child counts itself, and it is not read as other processes' load."""
    # The grandchild spins 0.2 s of CPU and exits; the child reaps it (its cutime then holds those ticks) and spins.
    grandchild = "import time; e = time.process_time() + 0.2\nwhile time.process_time() < e: pass"
    code = (f"import subprocess, sys; g = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
            "print('ready', flush=True); g.wait()\nwhile True: pass")  # fmt: skip
    meter = CpuMeter()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        a, child_a = meter.read(), _ticks(child.pid)
        deadline = time.monotonic() + 60
        while _stat_field(child.pid, 13) == 0:  # its cutime: until it has reaped the grandchild
            assert time.monotonic() < deadline, "the grandchild did not exit in a minute"
            time.sleep(0.05)
        time.sleep(0.5)
        b, child_b = meter.read(), _ticks(child.pid)
    finally:
        _kill_tree(child)
    u = usage(a, b)
    spent = (child_b - child_a) / CLK_TCK  # the child's CPU, its reaped grandchild's included, by its own account
    assert spent >= 0.2 - 2 / CLK_TCK  # the grandchild's 0.2 s at least
    # The child's ticks were read a walk of /proc apart from the meter's readings: a few ticks either way.
    assert abs(u.children_cpu_s - spent) <= 5 / CLK_TCK + 0.05 * spent, (u, spent)
    # Read as others' load too, the child's cores would come on top of the tree's own: more than the CPUs hold.
    tree_cores = (u.own_cpu_s + u.children_cpu_s) / u.seconds
    assert u.others_cores + tree_cores <= CPUS + 0.15, (u, tree_cores)


def test_the_meter_sees_a_child_work_for_less_than_a_clock_tick():
    """A child that works 3 ms between two readings is 3 ms of the descendants' CPU, not the 0 or 10 ms of /proc's
    clock ticks: a 4-worker trial of 8 batches on the user's epoch read 1.25 ms of CPU per batch where its samples
    cost 2 ms (CI, test_auto_trials_carry_the_noise_and_the_cpu)."""
    meter = CpuMeter()
    seen = []
    with burner(3) as burn:
        for _ in range(3):
            a = meter.read()
            burn()
            seen.append(usage(a, meter.read()).children_cpu_s)
    # Past 3 ms by the child's reading of its clock and its reply; never a whole tick of 10 ms.
    assert all(0.0029 < s < 0.008 for s in seen), seen


@contextlib.contextmanager
def _stranger():
    """A process that spins on this process's CPUs (it inherits the affinity) and is not its descendant: its
    parent exits at once, so that it is reparented (to init, or a subreaper above this process). Killed after."""
    code = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'while True: pass'], "
            "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True); "
            "print(p.pid, flush=True); os._exit(0)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    pid = int(out.stdout)
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_an_unrelated_busy_process_is_others_load():
    """A spinning process outside this process's tree is read as other processes' cores, and not as the tree's."""
    meter = CpuMeter()
    with _stranger() as pid:
        assert pid not in _procstat._scanned_stats(os.getpid()), "the stranger is still a descendant"
        time.sleep(0.3)  # its interpreter starts
        a, theirs_a = meter.read(), _ticks(pid)
        time.sleep(1.0)
        b, theirs_b = meter.read(), _ticks(pid)
    u = usage(a, b)
    theirs = (theirs_b - theirs_a) / CLK_TCK / u.seconds  # the cores it had, by its own account
    assert u.others_cores >= theirs - 0.15, (u, theirs)  # all of it (and whatever else ran beside it)
    assert u.children_cpu_s <= 0.05, u
    if theirs < 0.6:
        pytest.skip(f"the machine is so loaded that a spinning process got {theirs:.2f} of a core in a second "
                    f"(the meter read {u.others_cores:.2f} cores of others' load): too little to see it alone")
    assert u.others_cores >= 0.5, (u, theirs)


def _stat_field(pid: int, n: int) -> int:
    """Field ``n`` of /proc/<pid>/stat counted from the one after the command name (0: the state)."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return int(text[text.rindex(")") + 2 :].split()[n])


# -- trials carry them -------------------------------------------------------------------------------------------


def _trial(dataset, setting: Setting) -> Trial:
    return measure.run(fastfeed.DataLoader, dataset, {"batch_size": BATCH}, setting, None, tolerance=1.0,
                       deadline=time.monotonic() + 120)  # fmt: skip


BATCH = 4


def test_a_cpu_bound_trial_has_worker_cpu_near_its_load_time():
    """Samples of 4 ms of CPU, one worker process: the workers' CPU per batch is what the samples cost, and, with a
    core to itself, close to the worker's seconds per batch (its load_s)."""
    trial = _trial(Spin(cpu_s=0.004), Setting("process", 1, 2))
    cost = BATCH * 0.004
    assert trial.others_cores is not None and trial.loop_cpu_s is not None
    # What the samples cost, and a little more: collating, the ring, the worker's loop.
    assert cost * 0.95 <= trial.worker_cpu_s <= cost * 1.5 + 0.002, (trial.worker_cpu_s, cost)
    if trial.others_cores > CPUS - 1.2:
        pytest.skip(f"other processes kept {trial.others_cores:.2f} of the {CPUS} cores busy: the worker had no core "
                    f"to itself, so its CPU ({trial.worker_cpu_s * 1e3:.1f} ms) and wall time "
                    f"({trial.load_s * 1e3:.1f} ms) per batch differ by the load, not by what it does")
    assert trial.worker_cpu_s >= 0.7 * trial.load_s, (trial.worker_cpu_s, trial.load_s, trial.others_cores)


def test_a_latency_bound_trial_has_worker_cpu_far_below_its_load_time():
    """Samples that wait 5 ms: a worker's seconds per batch are mostly waiting, its CPU a small part of them."""
    trial = _trial(Spin(sleep_s=0.005), Setting("process", 2, 2))
    assert trial.load_s >= BATCH * 0.005
    assert trial.worker_cpu_s < 0.3 * trial.load_s, (trial.worker_cpu_s, trial.load_s)


def test_without_worker_processes_the_loop_spends_the_cpu():
    """num_workers=0 loads in the loop: no workers' CPU, and the loop's own is what the samples cost."""
    trial = _trial(Spin(cpu_s=0.002), Setting("process", 0, None))
    assert trial.worker_cpu_s is None and trial.others_cores is not None
    assert trial.loop_cpu_s >= BATCH * 0.002 * 0.95, trial.loop_cpu_s
    threads = _trial(Spin(cpu_s=0.002), Setting("thread", 1, 2))
    assert threads.worker_cpu_s is None  # thread workers' CPU is this process's: in loop_cpu_s
    assert threads.loop_cpu_s >= BATCH * 0.002 * 0.95, threads.loop_cpu_s


class _Tail(Spin):
    """Samples that wait ``sleep_s``, and every ``every``-th ``late_s`` more: with 4 a batch, a quarter of the
    batches are slow."""

    def __init__(self, sleep_s=0.01, every=16, late_s=0.2):
        super().__init__(sleep_s=sleep_s)
        self.every, self.late_s = every, late_s

    def __getitem__(self, i):
        if i % self.every == 0:
            time.sleep(self.late_s)
        return super().__getitem__(i)


def test_a_trial_says_how_long_its_slowest_batches_last():
    """Samples that cost the same each time: the slowest batches (95th percentile) last about as long as a typical
    one, within what the default prefetch absorbs; a quarter of the batches 200 ms late, against 40 ms: several.
    Samples that wait 10 ms, so that a neighbour's burst (a few ms late to wake) cannot double a batch."""
    steady = _trial(Spin(sleep_s=0.01), Setting("process", 2, 2))
    assert 1.0 <= steady.load_tail <= DEFAULT_PREFETCH, steady.load_tail
    tailed = _trial(_Tail(), Setting("process", 2, 2))
    assert tailed.load_tail >= 3, tailed.load_tail
    assert _trial(Spin(sleep_s=0.01), Setting("process", 0, None)).load_tail is None  # no workers, no records


needs_schedstat = pytest.mark.skipif(not _procstat.HAS_SCHEDSTAT, reason="the kernel keeps no schedstat")


@contextlib.contextmanager
def _one_cpu():
    """This process on one of its CPUs while the block runs (what it starts inherits that), then all of them again."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@needs_schedstat
def test_run_delay_is_the_time_processes_waited_for_a_core():
    """Three processes spinning on one CPU each wait for it about two thirds of the time: over a second, the run
    queue held them about two seconds together (more on a busy CPU); one that sleeps waited next to nothing, and a
    process gone counts nothing."""
    with _one_cpu():
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # their interpreters up
        pids = [p.pid for p in spinners]
        a, slept_a, t0 = _procstat.run_delay_ns(pids), _procstat.run_delay_ns([sleeper.pid]), time.monotonic()
        time.sleep(1.0)
        b, slept_b, t1 = _procstat.run_delay_ns(pids), _procstat.run_delay_ns([sleeper.pid]), time.monotonic()
    finally:
        for p in [*spinners, sleeper]:
            p.kill()
            p.wait()
    assert (b - a) / 1e9 / (t1 - t0) >= 1.0, (a, b)
    assert (slept_b - slept_a) / 1e9 <= 0.05, (slept_a, slept_b)
    assert _procstat.run_delay_ns([sleeper.pid]) == 0


@needs_schedstat
def test_cpu_bound_workers_sharing_a_core_wait_for_it_and_read_cpu_bound():
    """Two workers of CPU-bound samples on one core: each waits for it about as long as it runs. The trial reads
    the waits, and the search the workers as CPU-bound: they used all the time they did not wait."""
    with _one_cpu():
        trial = _trial(Spin(cpu_s=0.004), Setting("process", 2, 2))
    assert trial.worker_wait_s >= 0.3 * trial.load_s, (trial.worker_wait_s, trial.load_s)
    assert Search(max_workers=2, tolerance=0.03, cores=1)._cpu_share(trial) >= CPU_BOUND


@needs_schedstat
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # torch's, rightly: 2 workers asked of 1 CPU
def test_the_tuning_epochs_trials_read_the_workers_run_queue_waits_too(tmp_path, monkeypatch):
    """num_workers="auto"'s trials, on the user's own epoch, read the workers' time per batch and their waits for a
    core as fastfeed.tune's do: two workers of CPU-bound samples on one core wait about as long as they run, and the
    search reads them as CPU-bound (without the waits, the model falls back on the cores others left, which misreads
    latency-bound workers beside busy neighbours as CPU-bound)."""
    monkeypatch.setenv("FASTFEED_CACHE_DIR", str(tmp_path))
    with _one_cpu():
        loader = fastfeed.DataLoader(Spin(n=1600, cpu_s=0.002), batch_size=BATCH, num_workers=2,
                                     prefetch_factor="auto")  # fmt: skip
        assert sum(1 for _ in loader) == 400
    trials = [t for t in loader.tune_result.trials if t.windows]
    assert trials and all(t.setting.num_workers == 2 for t in trials)
    for trial in trials:
        assert trial.load_s is not None and trial.worker_wait_s is not None, trial
        assert trial.worker_wait_s >= 0.3 * trial.load_s, trial
        assert Search(max_workers=2, tolerance=0.03, cores=1)._cpu_share(trial) >= CPU_BOUND, trial
    # The model had its readings on the user's epoch (the workers' time per batch was not read there before, so
    # num_workers="auto" never had a model)
    assert loader.tune_result.model is not None and loader.tune_result.model["cpu_bound"]


@needs_schedstat
def test_sleeping_workers_beside_a_spinning_neighbour_do_not_read_cpu_bound():
    """Workers whose samples wait 5 ms, on one core that a spinning stranger holds: each sleep ends in a run queue,
    so part of their time per batch is a wait for the core; of the rest they used little: not CPU-bound."""
    with _one_cpu(), _stranger():
        time.sleep(0.3)  # its interpreter up
        trial = _trial(Spin(sleep_s=0.005), Setting("process", 2, 2))
    assert trial.worker_wait_s is not None and trial.worker_wait_s > 0
    assert Search(max_workers=2, tolerance=0.03, cores=1)._cpu_share(trial) < CPU_BOUND, trial


class _Bursts:
    """A stand-in loader whose batches come in bursts of ``per_round`` (as workers that finish together hand them
    over): the first of each burst after ``gap_s``, the rest at once."""

    def __init__(self, per_round: int, gap_s: float):
        self.per_round, self.gap_s, self.taken = per_round, gap_s, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken % self.per_round == 0:
            time.sleep(self.gap_s)
        self.taken += 1
        return self.taken


def test_a_window_ends_after_whole_rounds_of_the_workers():
    """Three workers' batches come three at a time: every window takes a multiple of three, so no window is cut
    inside a burst (which read up to a batch too many or too few, and cost a trial extra windows). Time moves only at
    a burst's first batch, so a window ended by the clock alone would take one past a round, every time."""
    loader = _Bursts(per_round=3, gap_s=0.01)
    feed = measure._Feed(loader, loader, None, warm=1, per_round=3)
    counts = []
    for _ in range(5):
        before = feed.batches
        rate, _, _ = feed.window(0.035)
        counts.append(feed.batches - before)
        assert rate > 0
    assert all(n % 3 == 0 and n >= measure.WINDOW_BATCHES for n in counts), counts


def test_auto_trials_carry_the_noise_and_the_cpu():
    """num_workers="auto": the trials tuned on the first epoch have the same readings as fastfeed.tune()'s."""
    loader = fastfeed.DataLoader(Spin(n=6000, cpu_s=0.0005), batch_size=BATCH, num_workers="auto")
    assert sum(len(b) for b in loader) == 6000
    trials = [t for t in loader.tune_result.trials if t.windows]
    assert len(trials) >= 2
    for t in trials:
        assert t.others_cores is not None and t.others_cores >= 0 and t.loop_cpu_s is not None, t
        workers = t.setting.worker_type == "process" and t.setting.num_workers > 0
        assert (t.worker_cpu_s is not None) == workers, t
        if workers:
            assert t.worker_cpu_s >= BATCH * 0.0005 * 0.8, t  # what the samples cost (their share in the windows)


def test_the_tuning_epochs_readings_are_not_in_its_windows(monkeypatch):
    """The trial's readings (the workers' memory, the CPU meter) are taken inside the epoch's asks. Reading 4 workers'
    memory took 20-40 ms, in a first window of 10 ms of batches: it read a third of the setting's rate, and every
    trial's spread was too wide to stop before its last window. Here the readings take 40 ms and 10 ms, and batches
    2 ms (1 ms waited for, 1 ms of step): every window reads what the batches alone take."""
    monkeypatch.setattr(online, "private_bytes", lambda pids: (time.sleep(0.04), 1 << 20)[1])
    read = CpuMeter.read
    monkeypatch.setattr(CpuMeter, "read", lambda self: (time.sleep(0.01), read(self))[1])
    rec = stats.Recorder(0, None)
    run = online._Run(Trial(Setting("process", 1, 2)), 0, warm=3, window=6, pids=[os.getpid()])
    batches = 0.0  # the seconds of the batches alone: the asks' own time and the steps, readings excluded
    done = False
    while not done:
        asked = time.perf_counter()
        done = run.update(rec, tolerance=0.0)
        began = time.perf_counter()
        time.sleep(0.001)  # waiting for the batch
        returned = time.perf_counter()
        rec.add(asked, 0, returned)
        time.sleep(0.001)  # the step
        batches += time.perf_counter() - began
    rate = rec.batches / batches
    assert len(run.trial.windows) == measure.MAX_WINDOWS
    assert all(0.75 * rate <= w <= 1.33 * rate for w in run.trial.windows), (run.trial.windows, rate)
    assert 0.3 <= run.trial.stall_fraction <= 0.7, run.trial  # 1 ms waited of 2, the readings not counted as waits


class _NoMeter:
    """A CPU meter that reads nothing, at once: the windows' times below are made up, and a real meter's reading
    (taken out of them, as its own time) would be real."""

    def __init__(self, pids=()):
        pass

    def open(self):
        pass

    def close(self, batches):
        pass

    def settle(self, trial, workers):
        pass


def test_the_tuning_epochs_windows_are_whole_rounds_of_the_workers(monkeypatch):
    """3 workers hand over their batches together: two ready at once, then a wait of 6 ms for the next round. A
    window of 4 batches read its phase (two waits or one: 660 or 330 batches/s); whole rounds read 500, each."""
    monkeypatch.setattr(online, "WindowsCpu", _NoMeter)
    rec = stats.Recorder(0, None)
    run = online._Run(Trial(Setting("process", 3, 2)), 0, warm=3, window=4)
    t = 0.0
    while not run.update(rec, tolerance=0.0):
        wait = 0.006 if rec.batches % 3 == 0 else 0.0
        rec.add(t, 0, t + wait)
        t += wait
    assert len(run.trial.windows) == measure.MAX_WINDOWS
    assert all(w == pytest.approx(500, rel=0.02) for w in run.trial.windows), run.trial.windows


# -- saved results -----------------------------------------------------------------------------------------------


def test_results_saved_before_the_readings_load_and_new_ones_round_trip():
    """A trial saved without others_cores, worker_cpu_s, loop_cpu_s and repeated loads with their defaults; one
    with them keeps them."""
    old = {"setting": {"worker_type": "process", "num_workers": 2, "prefetch_factor": 2}, "windows": [10.0, 11.0],
           "stall_fraction": 0.5, "skipped": None, "seconds": 1.0}  # fmt: skip
    t = Trial.from_dict(old)
    assert (t.others_cores, t.worker_cpu_s, t.loop_cpu_s, t.repeated) == (None, None, None, 0)
    new = Trial(Setting("process", 2, 2), [10.0], others_cores=0.7, worker_cpu_s=0.01, loop_cpu_s=0.002, repeated=1,
                worker_wait_s=0.004, load_tail=1.3)
    again = Trial.from_dict(new.as_dict())
    assert again == new
    result = TuneResult(2, 2, "process", 10.0, None, 0.5, True, [t, new], 1.0, True)
    assert TuneResult.from_dict(result.as_dict()).trials == [t, new]
