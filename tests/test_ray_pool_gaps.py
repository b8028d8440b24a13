"""Ray workers out of order, beside local processes, and with a read-ahead dataset (issue 34's gaps): an actor that
finds no room raises while the others deliver, a mixed pool waits without spinning, and an actor's dataset is told of
its next tasks while it runs one, as in a worker process.

One local cluster for the module: a head with 1 CPU and two nodes of 1 CPU each, one of them labelled {"prep": 1}.
"""

import asyncio
import gc
import random
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import _DatasetKind
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data._utils.collate import default_collate

import _datasets as ds
import _ray_datasets as rds
from _compare import assert_same
from _ray import cluster, patient_starts, wait_no_actors  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.fastfeed_only, pytest.mark.ray_sockets]
ray = pytest.importorskip("ray")

import fastfeed  # noqa: E402
from fastfeed._ring import layout  # noqa: E402
from fastfeed._workers import messages as m  # noqa: E402
from fastfeed._workers.ray import actor as ray_actor  # noqa: E402
from fastfeed._workers.loop import WorkerSpec  # noqa: E402
from fastfeed._workers.ray.actor import RayWorker  # noqa: E402

# How long the cluster may take to count killed actors dead on a machine busy with other work (the wait ends as soon
# as none is left).
GONE_S = 60.0
# The loaders' timeout, a bound for a loop that would otherwise wait for ever: the first batch's wait includes the
# actor's start, which a busy machine makes minutes long.
TIMEOUT_S = 300



@pytest.mark.hang_limit(40)
def test_out_of_order_an_actor_with_no_room_raises_while_another_delivers(cluster, monkeypatch):
    """in_order=False, one actor placed and one that finds no room (the one node labelled "prep" holds the first):
    the start timeout raises the in-order error, counted from the actor's start, while the placed actor still
    delivers a batch every few hundredths of a second, not once its batches run out."""
    # Until the placed actor delivers, the start timeout is the suite's: beside other load its own start can take
    # longer than the 3 s the waiting one is then given (read at each look, counted from the start call).
    monkeypatch.setenv("FASTFEED_RAY_START_TIMEOUT_S", str(TIMEOUT_S))
    n = 120  # the waiting actor is owed 2 tasks: the other's 118 take 6 s at least
    loader = fastfeed.DataLoader(rds.SlowAugmented(n=n, delay=0.05), batch_size=1, num_workers=2, worker_type="ray",
                                 in_order=False, timeout=30, ray_options={"num_cpus": 0.25, "resources": {"prep": 1}})
    got = 0
    with pytest.raises(RuntimeError, match=r"DataLoader worker \d \(Ray actor\) found no node with room for it in 3 s "
                                           r"\(actor options \{'num_cpus': 0.25, 'resources': \{'prep': 1\}\}"):
        for _ in loader:
            got += 1
            if got == 1:
                monkeypatch.setenv("FASTFEED_RAY_START_TIMEOUT_S", "3")
    assert got < n - 2, "raised only once the placed actor had nothing left to deliver"
    del loader
    gc.collect()
    assert wait_no_actors(GONE_S) == []


@pytest.mark.hang_limit(40)
def test_a_mixed_pool_out_of_order_waits_without_spinning(cluster):
    """A local process and an actor, out of order, both 1.5 s into their batch: the training thread waits for
    either, its CPU time under 2 % of the wait (polling each side in turn every 2 ms spent 5 %), and
    nothing it waited with (a thread, a descriptor) is left once the loader is gone."""
    threads = set(threading.enumerate())
    loader = fastfeed.DataLoader(rds.SlowAugmented(n=2, delay=1.5), batch_size=1, num_workers=(1, 1),
                                 worker_type=("process", "ray"), in_order=False, timeout=TIMEOUT_S)  # fmt: skip
    it = iter(loader)
    wall, cpu = time.monotonic(), time.thread_time()
    indices = sorted(int(next(it)["index"]) for _ in range(2))
    wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
    assert indices == [0, 1]
    assert wall > 1.4 and cpu < 0.02 * wall, f"{cpu:.3f} s of CPU in {wall:.2f} s of waiting"
    with pytest.raises(StopIteration):
        next(it)
    del it, loader
    gc.collect()
    assert wait_no_actors(GONE_S) == []
    assert set(threading.enumerate()) <= threads


@pytest.mark.hang_limit(40)
def test_an_actors_dataset_is_told_of_its_next_tasks_while_it_runs_one(cluster):
    """A map-style dataset with prefetch() in an actor is told of the tasks sent ahead of the one it runs, as in a
    worker process (an actor took one call at a time, so it heard of each task only as it began it); the batches
    are the sampler's, in order."""
    n = 12
    loader = fastfeed.DataLoader(rds.ToldAhead(n=n, delay=0.05), batch_size=1, num_workers=1, prefetch_factor=4,
                                 worker_type="ray", timeout=TIMEOUT_S)  # fmt: skip
    got = [b[0].tolist() for b in loader]
    assert [index for index, _ in got] == list(range(n))
    told = [t for _, t in got]
    # Task k + 1 is sent when batch k - 3 is taken, long before task k + 1 runs: only the last task has none after it.
    assert sum(t > 0 for t in told) >= n // 2, told


@pytest.fixture
def worker_here(monkeypatch):
    """A RayWorker run in this process, not in an actor: what its start sets for the process (worker info, torch's
    threads, the RNGs) is put back afterwards, and it does not ask Ray where it runs (which would start Ray here)."""
    monkeypatch.setattr(ray_actor, "_node_id", lambda: None)
    saved = (torch_worker._worker_info, torch.get_num_threads(), torch.get_rng_state(), random.getstate(),
             np.random.get_state())  # fmt: skip
    yield
    torch_worker._worker_info = saved[0]
    torch.set_num_threads(saved[1])
    torch.set_rng_state(saved[2])
    random.setstate(saved[3])
    np.random.set_state(saved[4])


def _answers(dataset, kind, messages: list, order: list) -> dict:
    """Start a RayWorker here for ``dataset`` and make calls ``0 ..`` with ``messages``, arriving in ``order`` and all
    before the start (as Ray may run an asyncio actor's calls); returns each call's answer by its number."""
    spec = WorkerSpec(1, kind, dataset, True, default_collate, True, False, 5, None, None, "", "", history=16)

    async def run():
        worker = RayWorker()
        calls = [asyncio.ensure_future(worker.call(1, n, messages[n])) for n in order]
        await asyncio.sleep(0)  # each call runs up to its wait for its turn
        await worker.start(1, 0, spec, None)
        try:
            return dict(zip(order, await asyncio.wait_for(asyncio.gather(*calls), 20)))
        finally:
            worker._end_thread()

    return asyncio.run(run())


def test_calls_that_arrive_out_of_order_reach_the_loop_in_their_order(worker_here):
    """Calls that reach an actor in reverse, before its start, are handed to its loop in the order they were
    numbered: the batches, random augmentations drawn in turn, equal those of calls that came in order."""
    tasks = [m.Task(n, [2 * n, 2 * n + 1]) for n in range(4)]
    reverse = _answers(ds.AugmentedDataset(n=8), _DatasetKind.Map, tasks, [3, 2, 1, 0])
    forward = _answers(ds.AugmentedDataset(n=8), _DatasetKind.Map, tasks, [0, 1, 2, 3])
    for n in range(4):
        (got, _, got_buf), (ref, _, ref_buf) = reverse[n], forward[n]
        assert type(got) is m.Done and got.idx == n
        assert_same(layout.unpack(got.payload, got.leaves, torch.from_numpy(got_buf)),
                    layout.unpack(ref.payload, ref.leaves, torch.from_numpy(ref_buf)))


def test_tasks_past_an_iterables_end_are_answered_with_nothing(worker_here):
    """An iterable of 3 samples, 5 tasks: each batch comes with the state right after it, the 4th task's answer is
    its end, and the 5th, which the loop goes past (as torch's worker does), returns nothing rather than waiting."""
    got = _answers(ds.ShardedIterable(n=3), _DatasetKind.Iterable, [m.Task(n, [0]) for n in range(5)], range(5))
    for n in range(3):
        reply, state, buf = got[n]
        assert type(reply) is m.Done and reply.idx == n and buf is not None
        assert state.state["batches"] == n + 1 and not state.state["ended"]
    reply, state, buf = got[3]
    assert type(reply) is m.IterEnd and state.state["ended"] and buf is None
    assert got[4] == (None, None, None)
