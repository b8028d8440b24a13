"""Headless Chromium for the tests that look at a page as a user would (the docs site, the doctor's HTML report).

The browser runs in a session of its own, killed whole on a timeout, and no process of it outlives a call: its
helper processes exit a moment after it, and any still there after a grace are killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no headless browser: chromium is not on PATH")
TIMEOUT_S = 90


def run(url: str, profile: Path, *args: str, timeout: float = TIMEOUT_S) -> tuple[str, str]:
    """Headless Chromium on ``url`` with ``args`` (and a fresh profile in ``profile``): its stdout and stderr.
    Fails the test when it does not finish in ``timeout`` s or exits non-zero."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", "--disable-sync", f"--user-data-dir={profile}", *args, url]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish with {url} in {timeout:.0f} s")
    finally:
        end_session(proc.pid)
    log = err.decode(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    return out.decode(errors="replace"), log


def session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the browser and every process it started)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] not in ("Z", "X") and int(fields[3]) == sid:
            found.append(int(name))
    return found


def end_session(sid: int, grace_s: float = 10.0) -> None:
    """Wait for the browser's helper processes to exit after it, kill those still there after ``grace_s``, and
    make sure none is left."""
    deadline = time.monotonic() + grace_s
    while session(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in session(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    while session(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not session(sid), f"chromium left processes behind: {[_cmdline(p) for p in session(sid)]}"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"{pid} (gone)"
