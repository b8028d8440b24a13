"""Running a loader in a script of its own: for signals, exits and deaths of the whole process."""

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import _leaks

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

_PRELUDE = """
import os, sys, time
import _candidate, _datasets as ds, _leaks
"""


def start_script(body, **env_vars):
    """Run ``body`` (after imports of the test helpers) in a new Python, in its own session."""
    path = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, **env_vars)
    return subprocess.Popen(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # Its own process group, so a group-wide SIGINT reaches it and its workers only. (Its SIGINT is not
        # ignored even where the suite's was: tests/conftest.py's pytest_configure.)
        start_new_session=True,
    )


def read_stderr_until(proc, text, count, seconds=20.0):
    """What the script wrote to stderr until ``text`` appeared ``count`` times (or it stopped, or time ran out).

    Reads the pipe's descriptor with a deadline: a script that prints less than expected and then nothing more
    must not hold the test in a blocking read.
    """
    deadline = time.monotonic() + seconds
    fd = proc.stderr.fileno()
    raw = b""
    while raw.decode(errors="replace").count(text) < count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        raw += chunk
    return raw.decode(errors="replace")


def communicate(proc, timeout):
    """communicate() with a deadline, for a process started in a session of its own: ``(stdout, stderr, late)``;
    past the deadline (``late``) it is killed with its group (a launcher, its ranks, their workers: none is left)."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return out, err, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return out, err, True


def finish(proc, timeout):
    """communicate() with a deadline; a script past it is killed (with its group) and fails the test."""
    out, err, late = communicate(proc, timeout)
    if late:
        pytest.fail(f"script still running after {timeout} s\nstdout: {out}\nstderr: {err}")
    return out, err


def gone(pid, family):
    """What is left, after a process exited, of its former descendants and their segments."""
    makers = {pid} | set(family)
    prefixes = [f"fastfeed-{p}-" for p in makers] + [f"torch_{p}_" for p in makers]
    return _leaks.wait_until_gone(family, prefixes)


