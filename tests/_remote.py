"""Fixtures for the tests of remote reads: imported by name into a test module, they apply to all of its tests."""

from __future__ import annotations

import pytest

from fastfeed.io import remote


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    """The retry policy's shape at a test's pace (forked workers inherit it): retries wait up to 10 ms, doubling;
    a store that throttles is still asked at 50 requests/s at least (its stores throttle every object's first
    request, which at the real floor of 0.5/s would make each test take minutes); a request failing for good
    gives up after 10 s rather than the default two minutes."""
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    monkeypatch.setattr(remote.StoreRate, "MIN_RATE", 50.0)
    monkeypatch.setattr(remote, "DEFAULT_RETRY_BUDGET_S", 10.0)


@pytest.fixture(scope="module", autouse=True)
def fsspec_loop():
    """fsspec's event-loop thread lives as long as the process: start it before the first leak check."""
    import fsspec.asyn

    fsspec.asyn.get_loop()
