"""What a benchmark counts as left behind in /dev/shm (fastfeed.bench.accounting.shm_left), and a process tree's
CPU time (tree_cpu_s)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

from _burner import burner
from fastfeed.bench.accounting import main_cpu_s, shm_left, shm_owner, tree_cpu_s

SHM = "/dev/shm"


def _make(name: str) -> str:
    with open(os.path.join(SHM, name), "wb"):
        pass
    return name


# Prints the pid of a sleeping grandchild whose parent exits at once: a live process outside this process's tree.
# The grandchild's output goes nowhere, so that reading the parent's output does not wait for the grandchild.
_SPAWN_ORPHAN = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(p.pid)
"""


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_live_strangers_segment_is_not_left_but_ours_and_a_dead_makers_are():
    """An entry named for a live process outside this run's tree (another test run beside it) is not counted as
    left; one named for this process, for one of its children, for a dead process, or for no process at all is."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    outside = subprocess.run([sys.executable, "-c", _SPAWN_ORPHAN], capture_output=True, text=True, check=True)
    outside_pid = int(outside.stdout)
    tag = secrets.token_hex(4)
    before = set(os.listdir(SHM))
    names = {
        "stranger": _make(f"fastfeed-{outside_pid}-0-{tag}-a"),
        "mine": _make(f"fastfeed-{os.getpid()}-0-{tag}-b"),
        "child": _make(f"torch_{child.pid}_{tag}"),
        "dead": _make(f"fastfeed-{_dead_pid()}-0-{tag}-c"),
        "unnamed": _make(f"mosaic-{tag}"),
    }
    try:
        assert shm_owner(names["child"]) == child.pid and shm_owner(names["unnamed"]) is None
        left = shm_left(before)
        assert names["stranger"] not in left
        assert {names[k] for k in ("mine", "child", "dead", "unnamed")} <= set(left)
    finally:
        for n in names.values():
            os.unlink(os.path.join(SHM, n))
        child.kill()
        child.wait()
        os.kill(outside_pid, 9)


def test_a_process_trees_cpu_time_sees_a_child_work_for_less_than_a_clock_tick():
    """A child that works 3 ms between two readings adds 3 ms, not the 0 or 10 ms of /proc's clock ticks: a
    2-batch trial whose batches were prefetched read 0 s of CPU for its whole tree (CI, test_jpeg)."""
    seen = []
    with burner(3) as burn:
        for _ in range(3):
            tree0, self0 = tree_cpu_s(), main_cpu_s()
            burn()
            self1, tree1 = main_cpu_s(), tree_cpu_s()
            # This process's own time between the readings (reading /proc, the pipe) is not the child's.
            seen.append((tree1 - tree0) - (self1 - self0))
    # Past 3 ms by the child's reading of its clock and its reply; never a whole tick of 10 ms.
    assert all(0.0029 < s < 0.008 for s in seen), seen
