"""The retry budget, exactly, on a clock of the test's own: ``fastfeed.io.remote.retry`` keeps retrying a transient
failure until ``budget`` seconds after the first one, its last wait ending with the budget and none going past it;
a Retry-After longer than what is left ends the retries at once; and the waits are full jitter.

The storm tests (tests/test_remote_storm.py) check the same policy against a real store on the wall clock, with
the margins a busy machine needs; here the clock moves only by the waits ``retry`` asks for, and the jitter is a
seeded stream, so every instant is known and the assertions are exact and cannot flake. No server, no sleeping.
"""

from __future__ import annotations

import random
import time
import types

import pytest

from fastfeed.io import remote


class Endless(BaseException):
    """Raised by a call that was retried far past any budget: not an ``Exception``, so ``retry`` cannot catch it."""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.waits.append(seconds)
        self.t += seconds


@pytest.fixture
def clock(monkeypatch):
    """remote's clock, moved only by the waits; its jitter a seeded stream (the OS's is unseeded by design)."""
    c = Clock()
    monkeypatch.setattr(remote, "time", types.SimpleNamespace(monotonic=c.monotonic, sleep=c.sleep, time=time.time))
    monkeypatch.setattr(remote, "_JITTER", random.Random(48))
    monkeypatch.setattr(remote, "BACKOFF_S", 0.5)
    monkeypatch.setattr(remote, "MAX_BACKOFF_S", 4.0)
    return c


def failing(clock: Clock, error_of=lambda: OSError("connection reset")):
    """A call that always fails transiently, noting when it was made."""
    calls: list[float] = []

    def call():
        calls.append(clock.t)
        if len(calls) > 10_000:
            raise Endless(f"still retried {clock.t - calls[0]:.0f} s after the first failure")
        raise error_of()

    return call, calls


@pytest.mark.parametrize("budget", [7.0, 30.0, 61.5])
def test_retries_go_on_until_the_budget_and_the_last_wait_ends_with_it(clock, budget):
    """Failures from t0: attempts go on, each after a full-jitter wait (within its doubling bound), and the last
    wait is cut to end exactly at t0 + budget, where the last attempt fails and ``retry`` gives up saying the budget
    is spent. Guards against the last wait left uncut (the budget overrun by up to MAX_BACKOFF_S) and against the
    budget counted from the latest failure instead of the first (it would never run out)."""
    call, calls = failing(clock)
    with pytest.raises(remote.RemoteError, match=rf"the retry budget of {budget:g} s is spent") as info:
        remote.retry(call, wait=clock.sleep, budget=budget)
    t0 = calls[0]
    assert calls[-1] == pytest.approx(t0 + budget, abs=1e-9) and clock.t == calls[-1]
    assert sum(clock.waits) == pytest.approx(budget, abs=1e-9)
    assert info.value.attempts == len(calls) == len(clock.waits) + 1
    for n, wait in enumerate(clock.waits[:-1]):
        assert 0 <= wait <= min(0.5 * 2**n, 4.0)
    # full jitter: over the waits that were not cut, the draws spread over their bounds (not all at the bound)
    fractions = [w / min(0.5 * 2**n, 4.0) for n, w in enumerate(clock.waits[:-1])]
    assert min(fractions) < 0.5 < max(fractions)


def test_a_retry_after_longer_than_the_budget_left_ends_the_retries_without_waiting(clock):
    """The store asks for 4 s each time, budget 10 s: attempts at t0 and after two waits of 4 s plus a jitter (at
    most 0.5 s, then 1 s: t0 + 8 to 9.5 s), when less than the 4 s asked is left: ``retry`` then gives up at once,
    naming the wait asked for, rather than waiting past the budget. Guards against a Retry-After waited for past
    the budget."""
    from aiohttp import ClientResponseError

    call, calls = failing(clock, lambda: ClientResponseError(None, (), status=503, headers={"Retry-After": "4"}))
    with pytest.raises(remote.RemoteError, match=r"asked to wait 4 s more, past the retry budget of 10 s"):
        remote.retry(call, wait=clock.sleep, budget=10.0)
    t0 = calls[0]
    assert len(calls) == 3 and len(clock.waits) == 2 and all(4.0 <= w <= 5.0 for w in clock.waits)
    assert clock.t == calls[-1] and 8.0 <= calls[-1] - t0 <= 9.5


@pytest.mark.parametrize("retries", [0, 1, 4])
def test_a_count_of_retries_still_bounds_the_attempts_inside_the_budget(clock, retries):
    """``retries=n``: n + 1 attempts at most, however much budget is left."""
    call, calls = failing(clock)
    with pytest.raises(remote.RemoteError, match=rf"failed {retries + 1} time\(s\)"):
        remote.retry(call, retries, wait=clock.sleep, budget=1000.0)
    assert len(calls) == retries + 1 and len(clock.waits) == retries
