"""worker_type="ray": Ray actors as workers, with process workers' batches, errors and resume, surviving lost actors.

One local cluster per module (a head and two nodes of 1 CPU each, all on 127.0.0.1: the head's CPU is the room a
replacement actor takes when a node goes); batches are compared with torch's DataLoader on the same seed, bit for
bit.
"""

import functools
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.utils.data as tud

import _datasets as ds
import _leaks
import _ray_datasets as rds
from _compare import assert_same, copy_batch, seed_all
from _load import Within
from _ray import alive_actors, cluster, owned_refs, patient_starts, wait_no_actors  # noqa: F401 (fixtures)

# Each loader here starts its actors (a process importing torch each) and waits for the last test's to be counted dead
# before the cluster has room: 10-15 s on an idle machine, but on one busy with other work a start waits for both, and
# tests took 4-16 times as long beside two busy loops. The hang guard (stretched by the load up to 4x) allows for it.
pytestmark = [pytest.mark.fastfeed_only, pytest.mark.ray_sockets, pytest.mark.hang_limit(180)]
ray = pytest.importorskip("ray")

import fastfeed  # noqa: E402
from fastfeed._workers.ray import pool as ray_pool  # noqa: E402


# How long the cluster may take to count a killed actor dead, or to start one, on a machine busy with other work:
# generous, since each wait returns as soon as its condition holds (a quiet machine takes a second or two).
GONE_S = 60.0
START_S = 600.0  # as patient_starts makes the loaders



def _epochs(loader, epochs=1, seed=0):
    seed_all(seed)
    return [[copy_batch(b) for b in loader] for _ in range(epochs)]


def _torch(dataset, epochs=1, seed=0, **kw):
    return _epochs(tud.DataLoader(dataset, **kw), epochs, seed)


def _workers_of(loader):
    """The latest iterator's Ray workers (their actors and where they run)."""
    it = loader._ff_last()
    pool = it._pool
    return pool.workers if isinstance(pool, ray_pool.RayPool) else pool.remote.workers


def _workers_of_pool(loader):
    """The latest iterator's RayPool."""
    pool = loader._ff_last()._pool
    return pool if isinstance(pool, ray_pool.RayPool) else pool.remote


def _where(loader, wid_index=0, timeout=START_S):
    w = _workers_of(loader)[wid_index]
    deadline = time.monotonic() + timeout
    while w.where is None and time.monotonic() < deadline:
        loader._ff_last()._pool.ready(w.wid)
        time.sleep(0.01)
    return w.where


def test_with_no_cluster_the_error_says_how_to_start_one():
    """With no ray.init and no running cluster, iterating names the problem and the commands that fix it."""
    from ray._private.services import find_gcs_addresses

    if find_gcs_addresses():
        pytest.skip("another Ray cluster runs on this machine: ray.init(address='auto') would join it")
    code = ("import fastfeed, torch\n"
            "dl = fastfeed.DataLoader(torch.arange(8), batch_size=2, num_workers=1, worker_type='ray')\n"
            "try:\n    next(iter(dl))\nexcept RuntimeError as e:\n    print('ERROR', e)\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "ERROR worker_type='ray' runs on a running Ray cluster and found none" in out.stdout, out.stderr
    assert "ray start --head" in out.stdout


def test_a_cluster_that_does_not_answer_is_named_at_once_not_waited_for():
    """RAY_ADDRESS naming a port where nothing listens (a head that is gone): iterating raises within seconds,
    naming the address and what to do, where ray.init alone retries for minutes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    # The child times its own wait, from the first next() to the error: its imports (seconds of CPU, many more on a
    # busy machine) are not the wait the error saves.
    code = ("import time, fastfeed, torch\n"
            "dl = fastfeed.DataLoader(torch.arange(8), batch_size=2, num_workers=1, worker_type='ray')\n"
            "t0 = time.monotonic()\n"
            "try:\n    next(iter(dl))\nexcept RuntimeError as e:\n    print('ERROR', e)\n"
            "print('WAITED', time.monotonic() - t0)\n")  # fmt: skip
    env = dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert f"ERROR worker_type='ray': the Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS=127.0.0.1:{port}) does not " \
        "answer" in out.stdout, out.stderr[-2000:]  # fmt: skip
    assert "ray start --head" in out.stdout
    assert float(out.stdout.rsplit("WAITED ", 1)[1]) < 60, out.stdout


FORCED = ["shm", "stream", "store"]  # each path alone; "auto" (a mix of the first two here) where it is cheap


@pytest.fixture(params=["auto", *FORCED])
def path(request, monkeypatch):
    """Each way a batch reaches the ring: chosen by where the actor runs (auto: the head, where this process is,
    has a CPU, so one actor may land there and take shm while the other streams), or forced."""
    monkeypatch.setenv("FASTFEED_RAY_PATH", request.param)
    return request.param


def check_paths(loader, path: str, nodes=None) -> None:
    """The loader's Ray workers took ``path`` (auto: shm on this process's node, a stream from any other; ``nodes``:
    each worker's node, taken while the epoch ran)."""
    paths = loader.stats().worker_paths
    if path == "auto":
        here = ray.get_runtime_context().get_node_id()
        want = tuple("shm" if node == here else "stream" for node in nodes)
    else:
        want = ("object store" if path == "store" else path,) * len(paths)
    assert paths == want, (path, paths)


def test_map_style_batches_equal_torchs_with_random_augmentation(cluster, path):
    """Shuffled map-style batches with torch, random and numpy augmentations equal torch's, two epochs running,
    whichever way the batches reach the ring."""
    data = ds.AugmentedDataset(n=26, width=4)
    kw = dict(batch_size=3, shuffle=True, num_workers=2)
    ref = _torch(data, epochs=2, generator=torch.Generator().manual_seed(7), **kw)
    loader = fastfeed.DataLoader(data, worker_type="ray", generator=torch.Generator().manual_seed(7), **kw)
    seed_all(0)
    got, nodes, links = [], None, None
    for _ in range(2):
        got.append([])
        for b in loader:
            got[-1].append(copy_batch(b))
            nodes = nodes or [_where(loader, i)["node_id"] for i in range(2)]
            links = links or [(w.direct, {type(ref) for _, ref in w.pending}) for w in _workers_of(loader)]
    assert_same(got, ref)
    check_paths(loader, path, nodes)
    # Off the object store, tasks and answers go over each actor's link (owed calls are numbers, not Ray refs).
    direct = path != "store"
    assert [d for d, _ in links] == [direct, direct], links
    assert all((kinds <= {int}) == direct for _, kinds in links if kinds), links


def test_iterable_batches_equal_torchs_with_persistent_workers(cluster):
    """An IterableDataset sharded by worker id, with random augmentation, equals torch's over two epochs of
    persistent workers, uneven shards included."""
    kw = dict(batch_size=4, num_workers=2, persistent_workers=True)
    ref = _torch(ds.UnevenIterable(n=23), epochs=2, **kw)
    got = _epochs(fastfeed.DataLoader(ds.UnevenIterable(n=23), worker_type="ray", **kw), 2)
    assert_same(got, ref)


def test_worker_info_and_worker_init_fn_run_in_the_actors(cluster):
    """get_worker_info() inside an actor is torch's (id, num_workers, seed), worker_init_fn ran on the actor's copy,
    and the samples were made in other processes than this one."""
    kw = dict(batch_size=2, num_workers=2, worker_init_fn=rds.set_offset)
    ref = _torch(rds.WhereAmI(), **kw)[0]
    got = _epochs(fastfeed.DataLoader(rds.WhereAmI(), worker_type="ray", **kw))[0]
    pids = {int(p) for b in got for p in b["pid"]}
    assert os.getpid() not in pids and len(pids) == 2
    for b in got + ref:
        del b["pid"]
    assert_same(got, ref)
    assert [int(o) for b in got for o in b["offset"]] == [100 * (i // 2 % 2 + 1) for i in range(8)]


def test_in_order_false_and_prefetch_factor(cluster):
    """in_order=False yields the same batches (in any order); prefetch_factor bounds the tasks sent ahead."""
    data = torch.arange(40).float().view(20, 2)  # no random draws: which worker makes a batch depends on timing
    ref = _torch(data, batch_size=2, num_workers=2)[0]
    # One loader for both (its actors' start is most of the test's time): the tasks owed are counted after the
    # first batch, before the rest of the epoch is taken.
    loader = fastfeed.DataLoader(data, batch_size=2, num_workers=2, worker_type="ray", in_order=False,
                                 prefetch_factor=1)  # fmt: skip
    seed_all(0)
    it = iter(loader)
    got = [copy_batch(next(it))]
    owed = sum(type(msg) is fastfeed._workers.messages.Task for w in _workers_of(loader) for msg, _ in w.pending)
    assert owed <= 2
    got += [copy_batch(b) for b in it]
    key = lambda b: float(b[0, 0])  # noqa: E731
    assert_same(sorted(got, key=key), sorted(ref, key=key))
    del it


def test_a_dataset_error_raises_its_type_with_the_actors_traceback(cluster, capfd):
    """A dataset's exception in an actor raises in the loop with its type, its message and the actor's traceback;
    it is not taken for a lost actor."""
    loader = fastfeed.DataLoader(rds.Failing(), batch_size=2, num_workers=2, worker_type="ray")
    with pytest.raises(KeyError) as caught:
        list(loader)
    text = str(caught.value)
    assert "no sample 5" in text and "Ray actor" in text and "Original Traceback" in text
    assert "in __getitem__" in text
    del loader, caught
    assert "was lost" not in capfd.readouterr().err


def test_timeout_raises_torchs_error_and_leaves_no_actor(cluster):
    """A batch slower than timeout raises torch's timeout error, and the stuck actor goes with the loader."""
    loader = fastfeed.DataLoader(rds.Sleepy(), batch_size=2, num_workers=2, worker_type="ray", timeout=2)
    with Within(15, "the timeout's error, the actors' start included"):
        with pytest.raises(RuntimeError, match="DataLoader timed out after 2 seconds"):
            list(loader)
    del loader
    gc.collect()
    assert wait_no_actors(GONE_S) == []


# The worker states a resume starts from come back over the actor's link (shm and stream alike: only the batch's
# bytes differ, which the tests above check per path) or through the object store.
@pytest.mark.parametrize("path", ["stream", "store"], indirect=True)
def test_resume_after_a_break_and_between_epochs(cluster, path):
    """state_dict() after a break resumes with the rest of the epoch, and between epochs with the next one,
    bit-identical to an uninterrupted run (torch's, which the loader's equals)."""
    data = ds.AugmentedDataset(n=24)
    kw = dict(batch_size=3, shuffle=True, num_workers=2)
    seed_all(3)
    whole = tud.DataLoader(data, generator=torch.Generator().manual_seed(1), **kw)
    ref = [[copy_batch(b) for b in whole] for _ in range(2)]
    seed_all(3)
    first = fastfeed.DataLoader(data, generator=torch.Generator().manual_seed(1), worker_type="ray", **kw)
    head = []
    for b in first:
        head.append(copy_batch(b))
        if len(head) == 3:
            break
    state = first.state_dict()
    del first
    resumed = fastfeed.DataLoader(data, generator=torch.Generator().manual_seed(99), worker_type="ray", **kw)
    resumed.load_state_dict(state)
    rest = [copy_batch(b) for b in resumed]
    between = resumed.state_dict()
    assert_same(head + rest, ref[0])
    # Into a loader whose actors ran another epoch: the state, not they or the generator, says what comes next.
    resumed.load_state_dict(between)
    assert_same([copy_batch(b) for b in resumed], ref[1])


@pytest.mark.parametrize("path", ["shm", "stream"])
def test_an_actor_that_cannot_set_its_path_up_uses_the_object_store_and_says_so(cluster, monkeypatch, caplog, path):
    """An actor that cannot map the ring's shared memory (another container's /dev/shm, another user), or whose
    connection to the loader's stream is refused (a firewall), falls back to the object store, with one log line
    per worker, and the batches are torch's."""
    monkeypatch.setenv("FASTFEED_RAY_PATH", path)
    if path == "shm":
        made = ray_pool.RayPool.__init__

        def unseen(self, ray_, nw, first, spec, *args, **kw):  # the actors look for a control block not there
            made(self, ray_, nw, first, spec._replace(control=spec.control[:-4] + "0000"), *args, **kw)

        monkeypatch.setattr(ray_pool.RayPool, "__init__", unseen)
        why = "shm could not be set up (FileNotFoundError"
    else:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()
        link = ray_pool.RayPool._make_link
        monkeypatch.setattr(ray_pool.RayPool, "_make_link", lambda self, *a: {**link(self, *a), "stream": closed})
        why = "stream could not be set up (ConnectionRefusedError"
    data = ds.AugmentedDataset(n=12, width=4)
    kw = dict(batch_size=3, num_workers=2)
    loader = fastfeed.DataLoader(data, worker_type="ray", **kw)
    with caplog.at_level(logging.WARNING, logger="fastfeed"):
        assert_same(_epochs(loader), _torch(data, **kw))
    assert loader.stats().worker_paths == ("object store", "object store")
    said = [r.getMessage() for r in caplog.records if "object store" in r.getMessage()]
    assert len(said) == 2 and all(why in line for line in said), said


def test_a_connection_without_the_token_is_refused_and_changes_nothing(cluster, monkeypatch):
    """The loader's stream takes nothing from a connection that does not present its token: it is closed, counted,
    and the epoch's batches are torch's."""
    monkeypatch.setenv("FASTFEED_RAY_PATH", "stream")
    data = ds.AugmentedDataset(n=24, width=4)
    kw = dict(batch_size=3, num_workers=2)
    loader = fastfeed.DataLoader(data, worker_type="ray", **kw)
    seed_all(0)
    got = []
    for b in loader:
        got.append(copy_batch(b))
        if len(got) == 2:
            receiver = _workers_of_pool(loader)._receiver
            from fastfeed._workers.ray.sender import CONNECT_TRIES, Sender

            with pytest.raises(ConnectionRefusedError, match="refused worker 0"):  # closed on it, no ack
                Sender.connect(receiver.address, b"x" * 32, 0, 1, 5.0)
            # Sender.connect tries again when refused. The actor drops a receiver whose challenge fails before that
            # receiver has counted the connection, so the last count may come a moment later.
            deadline = time.monotonic() + 5
            while receiver.stats()["refused"] < CONNECT_TRIES and time.monotonic() < deadline:
                time.sleep(0.01)
            assert receiver.stats()["refused"] == CONNECT_TRIES
    assert_same([got], _torch(data, **kw))


def test_a_stream_cut_mid_batch_yields_no_partial_batch_and_the_batch_is_made_again(cluster, monkeypatch, capfd):
    """The loader's side of a stream breaks after half of batch 3's bytes: that slot is given back, the actor is
    replaced from its last state, and the epoch is torch's, no batch lost, repeated or torn."""
    from fastfeed._workers.ray import link as ray_stream

    monkeypatch.setenv("FASTFEED_RAY_PATH", "stream")
    fill, bodies = ray_stream.fill, []

    def cut_once(sock, view):
        if not isinstance(view.obj, bytearray):  # a batch's bytes (a slot's memory), not a header or an answer
            bodies.append(len(view))
            if len(bodies) == 3:
                fill(sock, view[: len(view) // 2])
                raise ConnectionResetError("cut by the test")
        return fill(sock, view)

    monkeypatch.setattr(ray_stream, "fill", cut_once)
    data = ds.AugmentedDataset(n=30, width=64)
    kw = dict(batch_size=3, shuffle=True, num_workers=2)
    ref = _torch(data, generator=torch.Generator().manual_seed(5), **kw)
    loader = fastfeed.DataLoader(data, worker_type="ray", generator=torch.Generator().manual_seed(5), **kw)
    assert_same(_epochs(loader), ref)
    assert len(bodies) >= 3  # the cut happened
    # The stream is the actor's link: its end is the actor lost, and a new actor makes the batch again.
    assert "(Ray actor) was lost (StreamBroken)" in capfd.readouterr().err
    assert loader.stats().worker_paths == ("stream", "stream")


def test_the_dataset_is_pickled_once_per_epoch_not_per_task(cluster):
    """The dataset goes to the object store once per epoch (persistent_workers=False), whatever the batches."""
    data = rds.CountsPickles(n=24)
    loader = fastfeed.DataLoader(data, batch_size=2, num_workers=2, worker_type="ray")
    for _ in range(2):
        assert sum(1 for _ in loader) == 12
    assert rds.CountsPickles.pickled == 2


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_kept_states_hold_no_view_of_a_batchs_object(cluster):
    """The states kept for replacements own their arrays: a view would pin the batch's whole object (megabytes)
    in the object store for as long as the state is kept, and the store fills and spills."""
    import numpy as np

    loader = fastfeed.DataLoader(ds.BigItemDataset(n=16, nbytes=1 << 18), batch_size=2, num_workers=2,
                                 worker_type="ray")  # fmt: skip
    it = iter(loader)
    for _ in range(5):
        next(it)
    arrays = []
    for w in _workers_of(loader):
        for reply in [w.start, *w.states.values()]:
            for part in (reply.state, reply.epoch_start):
                arrays += [part["torch"], part["numpy"][1]]
    assert arrays and all(isinstance(a, np.ndarray) and a.base is None for a in arrays)
    del it


def test_local_processes_and_ray_actors_in_one_loader_equal_torch(cluster):
    """worker_type=("process", "ray") with num_workers=(1, 1) gives torch's batches for num_workers=2: worker 0 a
    process of this machine's, worker 1 an actor."""
    kw = dict(batch_size=2, num_workers=2, worker_init_fn=rds.set_offset)
    ref = _torch(rds.WhereAmI(), **kw)[0]
    loader = fastfeed.DataLoader(rds.WhereAmI(), batch_size=2, num_workers=(1, 1), worker_init_fn=rds.set_offset,
                                 worker_type=("process", "ray"))  # fmt: skip
    assert loader.num_workers == 2 and loader.worker_split == (1, 1)
    got = _epochs(loader)[0]
    by_worker = {int(w): int(p) for b in got for w, p in zip(b["worker"], b["pid"])}
    assert _leaks.is_alive(by_worker[1]) and by_worker[0] != by_worker[1]
    for b in got + ref:
        del b["pid"]
    assert_same(got, ref)
    data = ds.AugmentedDataset(n=18)
    ref = _torch(data, batch_size=3, num_workers=3, shuffle=True, generator=torch.Generator().manual_seed(5))
    got = _epochs(fastfeed.DataLoader(data, batch_size=3, num_workers=(2, 1), worker_type=("process", "ray"),
                                      shuffle=True, generator=torch.Generator().manual_seed(5)))  # fmt: skip
    assert_same(got, ref)
    # Out of order, over an iterable whose local worker ends long before the actor: the same samples.
    ref = _torch(ds.UnevenIterable(n=23), batch_size=2, num_workers=2)[0]
    got = _epochs(fastfeed.DataLoader(ds.UnevenIterable(n=23), batch_size=2, num_workers=(1, 1), in_order=False,
                                      worker_type=("process", "ray")))[0]  # fmt: skip
    key = lambda b: int(b["index"][0])  # noqa: E731
    assert_same(sorted(got, key=key), sorted(ref, key=key))


def test_ray_options_place_the_actors(cluster):
    """ray_options' resources put every actor on the node labelled for preprocessing."""
    _, nodes = cluster
    loader = fastfeed.DataLoader(rds.WhereAmI(), batch_size=2, num_workers=2, worker_type="ray",
                                 ray_options={"num_cpus": 0.25, "resources": {"prep": 0.5}})  # fmt: skip
    it = iter(loader)
    next(it)
    assert {_where(loader, i)["node_id"] for i in range(2)} == {nodes[1].node_id}
    del it


def test_fastfeed_info_lists_the_label_ray_options_name(cluster):
    """`fastfeed info` in a connected process lists the labelled node's custom resource beside its CPUs, and the
    cluster's total: what ray_options={"resources": {"prep": ...}} is checked against."""
    from fastfeed import info

    got = info._ray()
    lines = info._render_ray(got)
    assert got["status"] == "connected (this process)" and got["cluster"]["resources"] == {"prep": 1.0}
    assert lines[0].endswith(" CPUs, prep 1") and sum(line.endswith(": 1 CPUs, prep 1") for line in lines) == 1


def test_bad_arguments_say_what_to_pass():
    """Mismatched worker_type / num_workers / ray_options raise ValueErrors naming the fix."""
    data = torch.arange(4)
    with pytest.raises(ValueError, match=r"num_workers=\(local, remote\)"):
        fastfeed.DataLoader(data, worker_type=("process", "ray"), num_workers=2)
    with pytest.raises(ValueError, match="takes one count"):
        fastfeed.DataLoader(data, worker_type="ray", num_workers=(1, 1))
    with pytest.raises(ValueError, match="ray_options are Ray's actor options"):
        fastfeed.DataLoader(data, num_workers=1, ray_options={"num_cpus": 1})
    with pytest.raises(ValueError, match="the one pair of worker types"):
        fastfeed.DataLoader(data, worker_type=("thread", "ray"), num_workers=(1, 1))


def test_an_actor_no_node_can_ever_host_raises_at_once(cluster, monkeypatch):
    """ray_options no single node has (2 CPUs, which only the nodes together have: an actor cannot span them; a
    resource no node has) raise before any actor starts, however long the start timeout, naming the options, what
    the cluster has and what to change; nothing is left."""
    monkeypatch.setenv("FASTFEED_RAY_START_TIMEOUT_S", "600")
    total = ray.cluster_resources()
    for options, has in (({"num_cpus": 2}, f"(CPU {total['CPU']:g} in all)"),
                         ({"num_cpus": 0.5, "resources": {"nonexistent_resource": 1}},
                          f"(CPU {total['CPU']:g}, nonexistent_resource 0 in all)")):  # fmt: skip
        loader = fastfeed.DataLoader(torch.arange(8), batch_size=2, num_workers=2, worker_type="ray",
                                     ray_options=options)  # fmt: skip
        with pytest.raises(RuntimeError) as caught:
            next(iter(loader))
        # Not raised after waiting, told by its words rather than by a time that load stretches: they are the check
        # the pool makes before it starts its first actor, where a wait would end in the start timeout's ("found no
        # node with room for it in 600 s").
        text = str(caught.value)
        assert f"no node of the Ray cluster can ever host one actor with ray_options {options}" in text, text
        assert has in text and "Lower ray_options" in text and "ray start --address" in text, text
        del loader, caught
        gc.collect()
        assert wait_no_actors(GONE_S) == []


def test_a_node_type_the_autoscaler_may_add_makes_it_a_wait_not_an_error(monkeypatch):
    """never_fits counts alive nodes (one actor on one node, fractions as Ray sums them) and the node types an
    autoscaler reports to the cluster (those it may still add): options only such a type has wait for the node;
    with none that fits, the error says the autoscaler cannot add one either."""
    import types

    from ray._private import state
    from ray.core.generated import autoscaler_pb2

    from fastfeed._workers.ray import connect as ray_connect

    fake = types.SimpleNamespace(nodes=lambda: [{"Alive": True, "Resources": {"CPU": 4.0, "memory": 8e9}},
                                                {"Alive": False, "Resources": {"CPU": 64.0, "preprocess": 8.0}}])
    config = autoscaler_pb2.ClusterConfig(node_group_configs=[
        autoscaler_pb2.NodeGroupConfig(name="cpu", resources={"CPU": 16, "preprocess": 16}, max_count=10),
        autoscaler_pb2.NodeGroupConfig(name="big", resources={"CPU": 128}, max_count=0)])  # fmt: skip
    monkeypatch.setattr(state.state, "get_cluster_config", lambda: config)
    assert ray_connect.never_fits(fake, {"num_cpus": 8, "resources": {"preprocess": 1}}) is None
    text = ray_connect.never_fits(fake, {"num_cpus": 64})  # only a type the autoscaler may add no more of has it
    assert "and no node type its autoscaler may add has it either" in text, text
    monkeypatch.setattr(state.state, "get_cluster_config", lambda: None)  # a cluster started by hand
    text = ray_connect.never_fits(fake, {"num_cpus": 8, "resources": {"preprocess": 1}})
    assert "needs CPU 8, preprocess 1 on one node" in text, text
    assert ("1 alive node(s) have 1 x (CPU 4, preprocess 0) (CPU 4, preprocess 0 in all), and it reports no "
            "autoscaler node types") in text, text  # the dead node counts for nothing
    assert ray_connect.never_fits(fake, {"num_cpus": 4, "memory": 4e9}) is None  # fits, busy or not: a wait
    tenths = types.SimpleNamespace(nodes=lambda: [{"Alive": True, "Resources": {"CPU": 0.3}}])
    assert ray_connect.never_fits(tenths, {"num_cpus": 0.1 + 0.2}) is None


def test_actors_waiting_for_room_are_logged_within_seconds_then_time_out(cluster, monkeypatch, caplog):
    """With every CPU of the cluster held by another loader's actors, a loader's actor (which fits a node, once
    one is free) waits: within moments the fastfeed logger says how many actors wait, with which options, and what
    the cluster has free; the start timeout then raises naming them, whichever way the loop waits (in order, out of
    order, with a local worker beside the actor), and no actor is left."""
    cpus = int(ray.cluster_resources()["CPU"])
    holder = fastfeed.DataLoader(torch.arange(64), batch_size=2, num_workers=cpus, worker_type="ray")
    held = iter(holder)
    next(held)  # mid-epoch: its actors stay, each on a CPU
    assert all(_where(holder, i) for i in range(cpus)), "the holding loader's actors did not all start"
    monkeypatch.setattr(ray_pool, "EARLY_NOTICE_S", 0.5)
    monkeypatch.setenv("FASTFEED_RAY_START_TIMEOUT_S", "4")
    caplog.set_level(logging.WARNING, logger="fastfeed")
    ways = (("ray", 1, True), ("ray", 1, False), (("process", "ray"), (1, 1), False))
    for worker_type, num_workers, in_order in ways:
        caplog.clear()
        # timeout: a loop that never applied the start timeout would otherwise wait for ever
        loader = fastfeed.DataLoader(torch.arange(8), batch_size=2, num_workers=num_workers, worker_type=worker_type,
                                     in_order=in_order, timeout=60)  # fmt: skip
        expected = (r"DataLoader worker \d \(Ray actor\) found no node with room for it in 4 s \(actor options "
                    r"\{'num_cpus': 1\}; each needs CPU 1 on one node, and the cluster has CPU 0 free, of CPU \d in "
                    r"all\): free those")  # fmt: skip
        with pytest.raises(RuntimeError, match=expected):
            list(loader)
        raised = time.time()
        notes = [r for r in caplog.records if "Ray actors of this DataLoader to start" in r.getMessage()]
        assert len(notes) == 1 and notes[0].name == "fastfeed", [r.getMessage() for r in caplog.records]
        text = notes[0].getMessage()
        assert "waiting for 1 of 1 Ray actors" in text and "1 not placed on a node yet, 0 placed" in text, text
        assert (f"ray_options {{'num_cpus': 1}}: each needs CPU 1 on one node, and the cluster has CPU 0 free, of "
                f"CPU {cpus} in all. The loader waits for room") in text, text  # fmt: skip
        assert raised - notes[0].created > 2, f"{worker_type}, in_order={in_order}: the notice came only at the end"
        del loader
        gc.collect()
    del held, holder
    gc.collect()
    assert wait_no_actors(GONE_S) == []


def test_an_actor_placed_but_slow_to_start_is_not_blamed_on_room(cluster, monkeypatch, caplog, tmp_path):
    """An actor Ray placed whose start does not end (its worker_init_fn hangs): the notice counts it as placed and
    starting, and the start timeout's error says it was placed and what may hang, not that no node had room.

    The loop looks every 0.2 s here, and the notice and the timeout are brought forward only once the actor is
    known to run (its worker_init_fn made a file) and the notice was logged: each step waits on an event."""
    monkeypatch.setattr(fastfeed._workers.pool, "STATUS_CHECK_S", 0.2)
    monkeypatch.setattr(ray_pool, "EARLY_NOTICE_S", 600.0)
    monkeypatch.setenv("FASTFEED_RAY_START_TIMEOUT_S", "600")
    caplog.set_level(logging.WARNING, logger="fastfeed")
    marker = tmp_path / "init-runs"
    loader = fastfeed.DataLoader(torch.arange(8), batch_size=2, num_workers=1, worker_type="ray",
                                 worker_init_fn=functools.partial(rds.init_then_hang, str(marker)))  # fmt: skip

    def noticed():
        return [r for r in caplog.records if "Ray actors of this DataLoader to start" in r.getMessage()]

    def steer():
        deadline = time.monotonic() + 60  # bounds only a test gone wrong
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setattr(ray_pool, "EARLY_NOTICE_S", 0.0)
        while not noticed() and time.monotonic() < deadline:
            time.sleep(0.01)
        monkeypatch.setenv("FASTFEED_RAY_START_TIMEOUT_S", "0")

    steering = threading.Thread(target=steer, daemon=True)
    steering.start()
    try:
        with pytest.raises(RuntimeError, match=r"DataLoader worker 0 \(Ray actor, pid \d+ on its node\) was placed but "
                                               r"has not started in 0 s: .*worker_init_fn takes that long or hangs"):
            list(loader)
    finally:
        steering.join()
    (note,) = noticed()
    text = note.getMessage()
    assert "0 not placed on a node yet, 1 placed and starting" in text and "Their start is what takes long" in text
    del loader
    gc.collect()
    assert wait_no_actors(GONE_S) == []


def test_without_ray_installed_the_error_names_the_extra(monkeypatch):
    """Where Ray is not installed, a Ray loader says which extra installs it (and building one needs nothing)."""
    monkeypatch.setitem(sys.modules, "ray", None)
    loader = fastfeed.DataLoader(torch.arange(8), batch_size=2, num_workers=1, worker_type="ray")
    with pytest.raises(ImportError, match=r"pip install 'fastfeed\[ray\]'"):
        iter(loader)


# Forced paths only: "auto" here is one actor on each of shm and stream, each checked alone.
@pytest.mark.parametrize("path", FORCED, indirect=True)
def test_kill_9_of_an_actor_mid_epoch_loses_and_repeats_nothing(cluster, capfd, path):
    """An actor killed with SIGKILL mid-epoch is replaced from its last state: the epoch equals torch's."""
    data = rds.SlowAugmented(n=40, delay=0.02)
    kw = dict(batch_size=4, shuffle=True, num_workers=2)
    ref = _torch(data, generator=torch.Generator().manual_seed(2), **kw)[0]
    loader = fastfeed.DataLoader(data, worker_type="ray", generator=torch.Generator().manual_seed(2), **kw)
    seed_all(0)
    got = []
    for b in loader:
        got.append(copy_batch(b))
        if len(got) == 3:
            os.kill(_where(loader, 0)["pid"], signal.SIGKILL)
    assert_same(got, ref)
    assert "DataLoader worker 0 (Ray actor) was lost" in capfd.readouterr().err
    check_paths(loader, path)


def test_removing_a_node_mid_epoch_loses_and_repeats_nothing(cluster, capfd):
    """A node removed mid-epoch (its actor with it) costs nothing: the epoch completes with torch's batches."""
    c, nodes = cluster
    data = ds.ShardedIterable(n=40)
    kw = dict(batch_size=4, num_workers=2)
    ref = _torch(data, **kw)[0]
    loader = fastfeed.DataLoader(data, worker_type="ray", **kw)
    seed_all(0)
    got, lost = [], None
    for b in loader:
        got.append(copy_batch(b))
        if len(got) == 3:  # a worker node, not the head, whose end would be the cluster's
            lost = next(i for i in range(2) if _where(loader, i)["node_id"] in {n.node_id for n in nodes})
            assert loader.stats().worker_paths[lost] == "stream"  # another node's: its stream breaks with it
            c.remove_node(next(n for n in nodes if n.node_id == _where(loader, lost)["node_id"]))
    assert_same(got, ref)
    assert f"DataLoader worker {lost} (Ray actor) was lost" in capfd.readouterr().err


def test_a_batch_that_keeps_killing_its_actor_raises_naming_it(cluster, monkeypatch):
    """A batch whose every attempt ends its actor raises after a bounded number of replacements, naming the batch
    and its sample indices, though an earlier batch of its actor was in flight when it first died."""
    # A bound of 1 (3 by default): each replacement is an actor's start, and the bound is counted the same way.
    monkeypatch.setattr(ray_pool, "MAX_LOSSES", 1)
    loader = fastfeed.DataLoader(rds.KillsItsActor(), batch_size=2, num_workers=2, worker_type="ray")
    with pytest.raises(fastfeed._workers.pool.WorkerDied, match=r"lost 2 times while it held batch 3 "
                                                                 r"\(sample indices \[6, 7\]\)"):  # fmt: skip
        list(loader)


def test_an_unrecoverable_iterable_position_raises_a_clear_error(cluster):
    """An IterableDataset that keeps its position in itself across epochs of persistent workers cannot be rebuilt
    on a new actor: losing one then raises saying so (in the first epoch it is replayed instead)."""
    loader = fastfeed.DataLoader(rds.PositionInSelf(), batch_size=None, num_workers=2, worker_type="ray",
                                 persistent_workers=True)  # fmt: skip
    first = []
    for b in loader:
        first.append(b.tolist())
        if len(first) == 2:
            os.kill(_where(loader, 0)["pid"], signal.SIGKILL)
    assert sorted(first) == sorted([w, k] for w in (0, 1) for k in range(1, 7))
    with pytest.raises(fastfeed._workers.pool.WorkerDied, match="its position cannot be rebuilt"):
        for i, _ in enumerate(loader):
            if i == 1:
                os.kill(_where(loader, 0)["pid"], signal.SIGKILL)
    del loader
    gc.collect()


def _interrupt_once_inside(code, limit_s=60.0) -> threading.Thread:
    """A thread that sends SIGINT to the main thread (as Ctrl-C does) once the main thread runs ``code`` (a frame of
    it is on its stack): an interrupt at a point the test knows, not after a guessed delay. ``limit_s`` only bounds
    a test that went wrong."""
    main = threading.main_thread().ident

    def watch():
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            frame = sys._current_frames().get(main)
            while frame is not None and frame.f_code is not code:
                frame = frame.f_back
            if frame is not None:
                signal.pthread_kill(main, signal.SIGINT)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, name="interrupt-when-waiting", daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("path", FORCED, indirect=True)
def test_nothing_is_left_behind_after_delete_error_or_ctrl_c(cluster, tmp_path, path):
    """After a loader is deleted (mid-epoch or after whole epochs), a dataset error or Ctrl-C while the loop waits
    for a batch, no actor of fastfeed's is alive and no object reference of its remains."""
    gc.collect()
    # The earlier test's actors, ended, may still be in the table on a busy machine (CI: 2 of them, 4 read here);
    # each test checks its own are gone.
    wait_no_actors(GONE_S)
    refs = owned_refs()
    loader = fastfeed.DataLoader(rds.SlowAugmented(n=40, delay=0.01), batch_size=2, num_workers=2,
                                 worker_type="ray")  # fmt: skip
    for _ in loader:
        pass
    assert len(alive_actors()) == 2  # kept for the next epoch
    it = iter(loader)
    next(it)
    del it, loader
    gc.collect()
    assert wait_no_actors(GONE_S) == [] and owned_refs() <= refs
    loader = fastfeed.DataLoader(rds.Failing(), batch_size=2, num_workers=2, worker_type="ray")
    with pytest.raises(KeyError):
        list(loader)
    del loader
    gc.collect()
    assert wait_no_actors(GONE_S) == [] and owned_refs() <= refs
    gate = tmp_path / "gate"
    # The gate holds batch 1 until the test opens it (at most limit_s): its actor may start minutes before the other
    # on a busy machine, and a gate that gave way meanwhile would hand the batch over before the Ctrl-C.
    loader = fastfeed.DataLoader(rds.Gated(str(gate), limit_s=600.0), batch_size=2, num_workers=2, worker_type="ray")
    it = iter(loader)
    next(it)  # batch 0: the epoch is under way; batch 1 (samples 2 and 3) waits at the gate, which stays shut
    sender = _interrupt_once_inside(ray_pool.RayPool.recv.__code__)  # the loop waits there for batch 1
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)
    finally:
        sender.join()
        gate.touch()  # an actor Ctrl-C failed to kill finishes its samples instead of waiting out the gate
    assert wait_no_actors(GONE_S) == [], "Ctrl-C kills the actors at once, even while the loader lives"
    del it
    del loader
    gc.collect()
    assert owned_refs() <= refs


def test_every_connection_of_the_cluster_stays_on_loopback(cluster):
    """Every node's address is 127.0.0.1 and every TCP connection of the cluster's processes is loopback."""
    import psutil

    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}
    loader = fastfeed.DataLoader(torch.arange(32).float(), batch_size=4, num_workers=2, worker_type="ray")
    it = iter(loader)
    next(it)
    procs = [psutil.Process()] + psutil.Process().children(recursive=True)
    outward = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for conn in conns:
            ends = [conn.laddr] + ([conn.raddr] if conn.raddr else [])
            if conn.raddr and not all(e.ip.removeprefix("::ffff:").startswith("127.") or e.ip == "::1" for e in ends):
                outward.append((p.pid, p.name(), conn))
    del it
    assert outward == []


# -- a link that no peer can stall or lock out ----------------------------------------------------------------------


class _Flood:
    """``count`` connections to ``address`` that never say a word, held open: each one the receiver drops is opened
    again every ``every`` seconds (as a stranger renewing its connections would), until ``stop``."""

    def __init__(self, address, count: int = 200, every: float = 2.0):
        self.address, self.every = address, every
        self.socks = [socket.create_connection(address, timeout=10) for _ in range(count)]
        self.renewed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()

    def _renew(self):
        import select

        while not self._stop.wait(self.every):
            readable, _, _ = select.select(self.socks, [], [], 0)  # closed by the receiver: EOF is readable
            for sock in readable:
                try:
                    fresh = socket.create_connection(self.address, timeout=10)
                except OSError:
                    return  # the receiver is gone
                self.socks[self.socks.index(sock)] = fresh
                sock.close()
                self.renewed += 1

    def stop(self):
        self._stop.set()
        self._thread.join(30)
        for sock in self.socks:
            sock.close()


def test_two_hundred_idle_connections_leave_the_epoch_torchs_and_every_actor_streaming(cluster, monkeypatch):
    """200 silent connections opened before the actors connect, and renewed as the receiver drops them, all epoch
    long: the batches are torch's and every actor still streams over its link (none is locked out to the object
    store)."""
    monkeypatch.setenv("FASTFEED_RAY_PATH", "stream")
    floods = []
    link = ray_pool.RayPool._make_link

    def flooded(self, *a):  # the flood is there before any actor's start call
        made = link(self, *a)
        floods.append(_Flood(self._receiver.address))
        return made

    monkeypatch.setattr(ray_pool.RayPool, "_make_link", flooded)
    data = rds.SlowAugmented(n=24, width=4, delay=0.1)  # an epoch of a few seconds: the flood is renewed in it
    kw = dict(batch_size=3, num_workers=2)
    loader = fastfeed.DataLoader(data, worker_type="ray", **kw)
    try:
        got = _epochs(loader)
    finally:
        for flood in floods:
            flood.stop()
    assert_same(got, _torch(data, **kw))
    assert loader.stats().worker_paths == ("stream", "stream")
    assert floods and floods[0].renewed > 0  # the receiver kept dropping them, and they kept coming back


@pytest.mark.hang_limit(180)
def test_an_actor_frozen_mid_epoch_is_named_by_the_timeout_or_replaced_never_waited_for(cluster, monkeypatch, capfd):
    """An actor stopped with SIGSTOP mid-epoch (its link open, its small tasks taken by the kernel, no answer) under
    timeout=10: within 60 s the loader raises torch's timeout error naming that worker and its actor, or replaces
    the actor and ends the epoch with torch's batches; it never waits for it."""
    monkeypatch.setenv("FASTFEED_RAY_PATH", "stream")
    data = rds.SlowAugmented(n=40, width=4, delay=0.02)
    kw = dict(batch_size=4, num_workers=2)
    # timeout: long enough for the actor that runs to answer on a busy machine (its batches take 0.08 s), short
    # enough that the wait for the frozen one is not most of the test.
    loader = fastfeed.DataLoader(data, worker_type="ray", timeout=10, **kw)
    seed_all(0)
    got, frozen, error, guard = [], None, None, None
    it = iter(loader)
    # Both actors started before the first batch is waited for: timeout bounds each batch's wait, and a start on a
    # busy machine may take longer than that.
    assert all(_where(loader, i) for i in range(2)), "the actors did not start"
    try:
        for b in it:
            got.append(copy_batch(b))
            if len(got) == 3:
                break
        if len(got) == 3:
            frozen = _where(loader, 0)["pid"]
            os.kill(frozen, signal.SIGSTOP)
            # The test's own guard: past 60 s the actor runs again, so a loader waiting for it ends, and fails.
            guard = threading.Timer(60, os.kill, (frozen, signal.SIGCONT))
            guard.start()
            with Within(60, "the rest of the epoch after an actor froze"):
                try:
                    for b in it:
                        got.append(copy_batch(b))
                except RuntimeError as e:
                    error = str(e)  # not the exception: its traceback would hold the iterator, and its actors, alive
    finally:
        if guard is not None:
            guard.cancel()
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)  # a stopped process takes SIGKILL: nothing waits for it to wake
            except ProcessLookupError:
                pass
    assert frozen is not None, "the epoch ended before an actor was frozen"
    if error is not None:
        import re

        assert re.match(rf"DataLoader timed out after 10 seconds: no answer from DataLoader worker 0 \(Ray actor, "
                        rf"pid {frozen} on ", error), error  # fmt: skip
    else:
        assert "DataLoader worker 0 (Ray actor) was lost" in capfd.readouterr().err
        assert_same([got], _torch(data, **kw))
    del it, loader
    gc.collect()
    assert wait_no_actors(GONE_S) == []
