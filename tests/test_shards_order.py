"""The shard order made window by window (O(shards + window)) against the order fastfeed made before it, which
materialised every sample id: the same shards, windows and samples per window; the legacy order sample for sample,
so that positions saved by the earlier fastfeed resume where they were."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _shards
from fastfeed import DataLoader
from fastfeed.io import Shards
from fastfeed.io.shards import order


def materialised(counts, starts, *, seed, epoch, shuffle, window):
    """The order as fastfeed computed it before the order was made window by window (kept verbatim as the
    reference): every sample id at once, one stream shuffling the windows in turn."""
    n_shards = len(counts)
    shards = order._rng(seed, epoch, 0).permutation(n_shards) if shuffle else np.arange(n_shards, dtype=np.int64)
    n_windows = math.ceil(n_shards / window) if n_shards else 0
    sizes = np.add.reduceat(counts[shards], np.arange(0, n_shards, window)) if n_shards else np.zeros(0, np.int64)
    window_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    shard_window = np.empty(n_shards, np.int64)
    shard_window[shards] = np.arange(n_shards) // window
    ids = np.concatenate([np.arange(starts[k], starts[k] + counts[k], dtype=np.int64) for k in shards]) \
        if n_shards else np.zeros(0, np.int64)  # fmt: skip
    if shuffle:
        rng = order._rng(seed, epoch, 1)
        for w in range(n_windows):
            a, b = window_start[w], window_start[w + 1]
            ids[a:b] = rng.permutation(ids[a:b])
    return ids, shards.astype(np.int64), window_start, shard_window


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=st.lists(st.integers(0, 40), max_size=40), seed=st.integers(0, 2**63), epoch=st.integers(0, 50),
       shuffle=st.booleans(), window=st.integers(1, 9), probes=st.lists(st.integers(0, 10**6), max_size=30))
def test_the_order_made_by_window_keeps_the_shards_windows_and_samples_of_the_materialised_one(
        counts, seed, epoch, shuffle, window, probes):  # fmt: skip
    """Any shard sizes (empty shards too), seed, epoch, window: the same shard order, windows and spans; each window
    the same samples, in an order of its own when shuffled and the same order when not; the legacy order the same
    sample at every position; and a position looked up in any order (a resumed worker starts mid-epoch) finds what
    the whole epoch holds there."""
    counts = np.asarray(counts, np.int64)
    starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    kw = dict(seed=seed, epoch=epoch, shuffle=shuffle, window=window)
    ids, shards, window_start, shard_window = materialised(counts, starts, **kw)
    new = order.epoch_order(counts, starts, **kw)
    legacy = order.epoch_order(counts, starts, **kw, version=order.LEGACY)
    for made in (new, legacy):
        assert made.shards.tolist() == shards.tolist()
        assert made.window_start.tolist() == window_start.tolist()
        assert made.shard_window.tolist() == shard_window.tolist()
    assert legacy.samples.tolist() == ids.tolist()
    everything = new.samples
    for w in range(len(window_start) - 1):
        a, b = window_start[w], window_start[w + 1]
        assert sorted(everything[a:b].tolist()) == sorted(ids[a:b].tolist())
    if not shuffle:
        assert everything.tolist() == ids.tolist()
    n = len(ids)
    for p in [q % n for q in probes] if n else []:
        assert new.sample(p) == everything[p] and legacy.sample(p) == ids[p]
    again = order.epoch_order(counts, starts, **kw)  # a pure function: another process makes the same
    assert [again.sample(p) for p in reversed(range(n))] == everything[::-1].tolist()


def test_a_window_is_made_from_its_own_stream_and_only_kept_while_read():
    """Window w's permutation depends on (seed, epoch, w), not on the windows before it, and a process keeps at
    most two windows' samples however far it reads."""
    counts = np.full(50, 7, np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    e = order.epoch_order(counts, starts, seed=3, epoch=2, shuffle=True, window=4)
    last = e.n_windows - 1
    first_read_last = e.window_samples(last).copy()
    for p in range(e.n_samples):
        e.sample(p)
        assert len(e._windows) <= 2
    assert e.window_samples(last).tolist() == first_read_last.tolist()
    assert not (e.window_samples(0) == np.sort(e.window_samples(0))).all()
    with pytest.raises(IndexError, match="position 350 out of range: the epoch has 350 samples"):
        e.sample(e.n_samples)
    with pytest.raises(ValueError, match="unknown shard order version 7"):
        order.epoch_order(counts, starts, seed=3, epoch=2, shuffle=True, window=4, version=7)


def test_threads_sharing_an_epoch_each_find_the_sample_at_their_position(monkeypatch):
    """Thread workers share one Epoch. Each thread reads its own windows in turn, so the window last read changes
    under the others: a reader must never pair one window's bounds with another's samples. Making a window is
    slowed (a thread switch lands between deciding on a window and reading it), so the race is there to lose."""
    import threading
    import time

    counts = np.full(64, 5, np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    e = order.epoch_order(counts, starts, seed=5, epoch=1, shuffle=True, window=2)
    expect = e.samples.tolist()
    made = order.Epoch._make_window

    def slow(self, w):
        time.sleep(0.0005)
        return made(self, w)

    monkeypatch.setattr(order.Epoch, "_make_window", slow)
    wrong, errors = [], []

    def read(first):
        try:
            for p in range(first, e.n_samples, 30):  # 30 positions past a window of 10: a new window each read
                for q in (p, p + 1):
                    if q < e.n_samples and e.sample(q) != expect[q]:
                        wrong.append(q)
        except Exception as exc:  # an IndexError is the race lost too
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(first,)) for first in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong, (errors[:3], wrong[:10])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_position_saved_by_the_earlier_order_resumes_in_it(tmp_path, num_workers):
    """A mid-epoch state in the format the earlier fastfeed saved (Shards state version 1, no "order") continues
    with exactly the samples that fastfeed's order had next, then the next epoch in the current order; a state
    saved now names its order and resumes in it."""
    _shards.make(tmp_path, (9, 4, 12, 7, 10, 3, 8, 6))
    ds = Shards(str(tmp_path), decode=_shards.as_tensor, shuffle=True, seed=11, shuffle_window=3)
    legacy_ids, *_ = materialised(ds.index.counts, ds.index.starts, seed=11, epoch=1, shuffle=True, window=3)
    dl = DataLoader(ds, batch_size=5, num_workers=num_workers)
    ds.set_epoch(1)
    it = iter(dl)
    head = [next(it).tolist() for _ in range(3)]
    state = json.loads(json.dumps(dl.state_dict()))
    del it
    assert state["shards"]["order"] == order.ORDER and state["shards"]["version"] == 2
    old = json.loads(json.dumps(state))
    del old["shards"]["order"]
    old["shards"]["version"] = 1
    for saved, expect_order in ((old, order.LEGACY), (state, order.ORDER)):
        ds2 = Shards(str(tmp_path), decode=_shards.as_tensor, shuffle=True, seed=11, shuffle_window=3)
        dl2 = DataLoader(ds2, batch_size=5, num_workers=num_workers)
        dl2.load_state_dict(saved)
        rest = _shards.flat(dl2)
        if expect_order == order.LEGACY:
            assert rest == legacy_ids[15:].tolist()
        else:
            assert _shards.flat(head) + rest == ds._order(1).samples.tolist()
        ds2.set_epoch(2)
        assert _shards.flat(dl2) == ds._order(2).samples.tolist()
    bad = dict(state["shards"], order=9)
    with pytest.raises(ValueError, match="shard order 9, and this fastfeed makes orders"):
        Shards(str(tmp_path), decode=_shards.as_tensor, seed=11, shuffle_window=3).load_state_dict(bad)


def test_a_billion_samples_order_within_64_mb_and_the_scale_bench_reports_both_orders(tmp_path):
    """1 billion samples in 1 million shards: the order from set_epoch to its first position holds at most 64 MB
    at its peak, in a fresh process (deterministic: tracemalloc counts numpy's buffers). And ``fastfeed bench
    shards --scale``'s report, run small, has both orders, the whole one costlier, and prints its table."""
    from fastfeed.bench import report
    from fastfeed.bench.suites import shards_scale

    big = shards_scale.measure(1_000_000, 1_000, order.ORDER)
    assert big["peak_bytes"] <= 64 * 2**20, big
    res = shards_scale.main(["--quick", "--scales", "2000x1000", "20x10"])
    small = res["rows"][0]
    window, whole = small["window"]["rounds"][0], small["whole"]["rounds"][0]
    assert small["samples"] == 2_000_000 and small["whole_over_window"]["peak_bytes"] > 5
    # Both read the whole epoch (2M positions): every sample once, so the same sum; in different orders.
    assert window["checksum"] == whole["checksum"] == sum(range(2_000_000)) and window["first"] != whole["first"]
    rows = list(report.figure_rows({"workloads": {"shards": {"kind": "shards_scale", "result": res}}}))
    assert {r["figure"] for r in rows} == {"order_time", "order_memory"} and len(rows) == 4
    table = report.markdown({"workloads": {"shards": {"kind": "shards_scale", "result": res}}})
    assert "| 2,000,000 | 2,000 | window |" in table and table.count("| | | whole / window |") == 2
