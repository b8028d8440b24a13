"""Segment names and reclaiming what killed processes left (fastfeed._ring.segments)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from fastfeed._ring import segments

pytestmark = pytest.mark.fastfeed_only


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _make(base: str) -> str:
    name = "/" + base
    segments._native.C.Segment.create(name, segments.PAGE)
    return name


def test_reclaim_removes_only_dead_owners_in_this_pid_namespace():
    """Segments of a dead pid in our pid namespace go; a live owner's, or another namespace's, stay."""
    token = secrets.token_hex(4)
    dead = _make(f"fastfeed-{_dead_pid()}-{segments._PIDNS}-{token}-{secrets.token_hex(8)}")
    alive = _make(f"fastfeed-{os.getpid()}-{segments._PIDNS}-{token}-{secrets.token_hex(8)}")
    foreign = _make(f"fastfeed-{_dead_pid()}-{'f' * 9}-{token}-{secrets.token_hex(8)}")
    try:
        removed = segments.reclaim()
        assert dead in removed
        assert alive not in removed and foreign not in removed
        assert os.path.exists("/dev/shm" + alive) and os.path.exists("/dev/shm" + foreign)
    finally:
        for name in (dead, alive, foreign):
            segments.unlink(name)


def test_names_are_unguessable_and_carry_owner_and_namespace():
    """A ring prefix names this process and its pid namespace, plus 32 random bits; no two are alike."""
    prefixes = {segments.new_prefix() for _ in range(100)}
    assert len(prefixes) == 100
    for p in prefixes:
        assert p.startswith(f"/fastfeed-{os.getpid()}-{segments._PIDNS}-")
