"""Fixtures for the tests of remote reads: imported by name into a test module, they apply to all of its tests."""

from __future__ import annotations

import pytest

from fastfeed.io import remote


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    """Retries wait 10 ms, doubling: the policy's shape at a test's pace (forked workers inherit it)."""
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)


@pytest.fixture(scope="module", autouse=True)
def fsspec_loop():
    """fsspec's event-loop thread lives as long as the process: start it before the first leak check."""
    import fsspec.asyn

    fsspec.asyn.get_loop()
