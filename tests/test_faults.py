"""The fault matrix: each failure gives a clear message, never hangs, and leaks nothing."""

from __future__ import annotations

import gc
import os
import re
import signal
import time

import pytest

import _datasets as ds
import _leaks
from _candidate import DataLoader
from _load import Within
from _scripts import finish, gone, read_stderr_until, start_script
from fastfeed._workers import pool

pytestmark = pytest.mark.fastfeed_only


@pytest.mark.hang_limit(30)
def test_segfault_in_native_code_names_worker_pid_and_signal():
    """A worker dying of SIGSEGV inside native code gives a RuntimeError naming its id, pid and SIGSEGV within 5 s."""
    it = iter(DataLoader(ds.SegfaultDataset(), batch_size=1, num_workers=2))
    pids = [w.process.pid for w in it._pool.workers]
    with Within(5, "the segfaulted worker's error"), pytest.raises(RuntimeError) as info:
        for _ in it:
            pass
    message = str(info.value)
    assert "SIGSEGV" in message and "worker 1" in message and str(pids[1]) in message, message
    del it, info
    gc.collect()


def test_worker_init_fn_error_is_reraised_with_its_type_and_traceback():
    """An exception in worker_init_fn comes back with its own type and the worker's traceback."""
    loader = DataLoader(ds.PlainDataset(8), batch_size=2, num_workers=2, worker_init_fn=ds.raising_worker_init)
    with pytest.raises(ds.InitError) as info:
        next(iter(loader))
    text = str(info.value)
    assert "in DataLoader worker process 0" in text and "raising_worker_init" in text, text
    del info, loader
    gc.collect()


@pytest.mark.hang_limit(40)
def test_a_hung_loader_dumps_every_worker_stack():
    """With FASTFEED_HANG_DUMP_S, a loader stuck in __getitem__ prints each worker's stack, naming the stuck function."""
    proc = start_script(
        """
        it = iter(_candidate.DataLoader(ds.SlowDataset(8, delay=60), batch_size=1, num_workers=2))
        next(it)
        """,
        FASTFEED_HANG_DUMP_S="3",  # time for both workers to reach __getitem__, on a loaded machine too
    )
    with proc:
        err = read_stderr_until(proc, "in __getitem__", 2)
        family = _leaks.descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert "fastfeed: no batch for 3 s" in err, err
    assert err.count("in __getitem__") >= 2, err  # one stack per worker
    assert _leaks.wait_until_gone(family, []) == []
    from fastfeed import cli

    assert cli.main(["cleanup"]) == 0  # the ring of a SIGKILLed process: what any later fastfeed process reclaims


# A stand-in worker: it takes SIGUSR1 with a handler that prints when it ran, after holding the signal blocked for
# argv[1] seconds (a worker descheduled on a busy machine, or in a long C call).
_HOLDER = """
import signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(time.monotonic()))
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR1])
end = time.monotonic() + 10
while not got and time.monotonic() < end:
    time.sleep(0.005)
print(got[0] if got else -1, flush=True)
"""


@pytest.mark.hang_limit(30)
def test_the_hang_dump_signals_a_worker_once_the_one_before_has_taken_its_signal(capsys):
    """Workers signalled at once write their stacks over each other on the stderr they share (faulthandler writes a
    few bytes at a time: "in   File __getitem__"): the first worker here holds the signal blocked for 0.5 s, and the
    second is signalled only after the first took it."""
    import subprocess
    import sys
    from types import SimpleNamespace

    procs = [subprocess.Popen([sys.executable, "-c", _HOLDER, hold], stdout=subprocess.PIPE, text=True)
             for hold in ("0.5", "0")]  # fmt: skip
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        fake = SimpleNamespace(pids=[p.pid for p in procs], workers=[SimpleNamespace(process=p) for p in procs])
        pool.Pool.dump_stacks(fake, 3.0)
        first, second = (float(p.stdout.readline()) for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
    assert 0 < first <= second, (first, second)
    assert "the stacks of the DataLoader workers follow" in capsys.readouterr().err


@pytest.mark.hang_limit(40)
@pytest.mark.parametrize(("worker_type", "processes"), [("process", 2), ("thread", 0)])
def test_ctrl_c_ends_workers_stuck_in_user_code_within_2_s(worker_type, processes):
    """SIGINT to the main process while both workers (processes or threads) sleep in __getitem__:
    KeyboardInterrupt, and the process and every worker gone within 2 s."""
    proc = start_script(
        f"""
        it = iter(_candidate.DataLoader(ds.SlowDataset(8, delay=60), batch_size=1, num_workers=2,
                                        worker_type={worker_type!r}))
        print("READY", flush=True)
        next(it)
        """
    )
    with proc:
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(0.5)
        family = _leaks.descendants(proc.pid)
        assert len(family) == processes
        with Within(2.5, "the script's exit after SIGINT"):
            os.kill(proc.pid, signal.SIGINT)
            _, err = finish(proc, timeout=15)
    assert "KeyboardInterrupt" in err, err
    assert gone(proc.pid, family) == []


@pytest.mark.hang_limit(40)
def test_too_little_shared_memory_is_an_error_that_names_the_bytes_and_the_fix():
    """When the shm directory cannot hold a batch, the first batch raises an OSError naming the bytes needed and the fixes, never SIGBUS."""
    proc = start_script(
        """
        import resource
        # Files over 1 MB are refused: /dev/shm made small without needing a mount.
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        data = _candidate.DataLoader(ds.BigItemDataset(8, 1 << 20), batch_size=4, num_workers=2)
        try:
            next(iter(data))
        except OSError as e:
            print("ERROR", e)
        """
    )
    out, err = finish(proc, timeout=30)
    assert proc.returncode == 0, err
    assert "ERROR" in out, out + err
    assert re.search(r"needs \d{7,} bytes", out) and "--shm-size" in out and "FASTFEED_SHM_DIR" in out, out


def test_fastfeed_shm_dir_moves_the_segments(tmp_path, monkeypatch):
    """With FASTFEED_SHM_DIR set, batches come through segments in that directory, and nothing is left there."""
    monkeypatch.setenv("FASTFEED_SHM_DIR", str(tmp_path))
    seen = set()
    it = iter(DataLoader(ds.BigItemDataset(12, 64 << 10), batch_size=2, num_workers=2))
    for k, batch in enumerate(it):
        assert int(batch[0, 0]) == (2 * k) % 256 and int(batch[1, -1]) == (2 * k + 1) % 256
        seen.update(os.listdir(tmp_path))
    del it, batch
    gc.collect()
    assert any(name.startswith(f"fastfeed-{os.getpid()}-") for name in seen)
    assert os.listdir(tmp_path) == []


# Restarts per case: persistent ones are cheap (the same workers), so 1,000; each non-persistent one starts and
# reaps 2 worker processes (~80 ms on CI's 2 cores), so 60 there. A leak of even one descriptor or segment per
# restart fails after any number of restarts; the RSS bound is per restart (16 KB each, 16 MB for 1,000), so it
# catches the same leak whatever the count, as long as the count keeps that bound (~1 MB at 60) well above the
# noise. Measured growth: ~32 KB over 1,000 restarts either way, none over 60.
RESTARTS = {False: 60, True: 1000}
RSS_PER_RESTART = (16 << 20) // 1000  # the bound 1,000 restarts had: 16 MB


@pytest.mark.hang_limit(120)
@pytest.mark.parametrize("persistent", [False, True])
def test_many_restarts_keep_fds_memory_and_segments_flat(persistent):
    """Many iterator restarts (1,000 with persistent workers, 60 without), with persistent workers on or off,
    leave fd count, RSS and segment count flat."""
    restarts = RESTARTS[persistent]
    loader = DataLoader(ds.PlainDataset(4), batch_size=2, num_workers=2, persistent_workers=persistent)

    def state():
        gc.collect()
        # An epoch whose workers all answered leaves their exit to a reaper thread, which holds each process's
        # descriptors until it has joined them: count once those of the epoch just ended are done, not by luck.
        pool._join_reapers()
        rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGESIZE")
        return len(os.listdir("/proc/self/fd")), rss, len(_leaks.shm_segments((f"fastfeed-{os.getpid()}-",)))

    for _ in range(20):  # warm up allocator pools and caches
        list(loader)
    fds0, rss0, segs0 = state()
    for _ in range(restarts):
        for batch in loader:
            pass
    fds1, rss1, segs1 = state()
    del loader, batch
    gc.collect()
    assert fds1 <= fds0, (fds0, fds1)
    # The ring may settle at any size up to its window (2 workers x prefetch 2), never beyond.
    assert segs1 <= 4, (segs0, segs1)
    assert rss1 - rss0 < restarts * RSS_PER_RESTART, f"RSS grew by {(rss1 - rss0) >> 10} KB in {restarts} restarts"


@pytest.mark.hang_limit(60)
def test_workers_of_a_killed_parent_exit_and_its_segments_are_reclaimed():
    """After SIGKILL of the main process its workers exit by themselves, and `fastfeed cleanup` removes its segments."""
    proc = start_script(
        """
        it = iter(_candidate.DataLoader(ds.PlainDataset(64), batch_size=2, num_workers=2))
        kept = [next(it), next(it)]
        print(*_leaks.descendants(os.getpid()), flush=True)
        time.sleep(60)
        """
    )
    with proc:
        family = {int(p) for p in proc.stdout.readline().split()}
        assert len(family) == 2
        assert _leaks.shm_segments((f"fastfeed-{proc.pid}-",))
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert _leaks.wait_until_gone(family, [], timeout=8) == []  # workers notice within their 5 s check
    from fastfeed import cli

    assert cli.main(["cleanup"]) == 0
    assert not _leaks.shm_segments((f"fastfeed-{proc.pid}-",))


def test_batches_that_fail_to_collate_leave_no_segment_while_the_iterator_lives():
    """A collate error after the worker made its own segment unlinks that segment at once, not at shutdown."""
    it = iter(DataLoader(ds.RaggedDataset(), batch_size=2, num_workers=2))
    for _ in range(len(ds.RaggedDataset()) // 2):  # every task answered: no worker is mid-batch
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
            next(it)
    # The iterator is still alive: only its ring's control block exists, no batch segment.
    assert _leaks.shm_segments((f"fastfeed-{os.getpid()}-",)) == {it._ring.control.name.lstrip("/")}
    del it
    gc.collect()


@pytest.mark.fastfeed_only
def test_a_script_that_exits_while_workers_are_still_exiting_waits_for_them_quietly():
    """The script ends right after an epoch, while the thread that reaps its workers still waits for them (made
    slow here, as a large dataset's page tables make it): exit waits for that thread, and multiprocessing's own
    exit handler then finds no closed process ("process object is closed")."""
    proc = start_script(
        """
        from fastfeed._workers import pool
        real = pool._end

        def slow(procs, grace):
            time.sleep(0.5)
            gone = real(procs, grace)
            print("reaped", flush=True)
            return gone

        pool._end = slow
        for _ in _candidate.DataLoader(ds.PlainDataset(8), batch_size=2, num_workers=2):
            pass
        """
    )
    with proc:
        out, err = finish(proc, 30)
    assert proc.returncode == 0 and out.split() == ["reaped"], (out, err)
    assert "Error" not in err and "Exception" not in err, err
