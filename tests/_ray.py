"""A local Ray cluster for the tests: a head with no CPUs and worker "nodes" (raylets) on this machine.

``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes every node listen and connect on 127.0.0.1; Ray otherwise takes the
machine's outward address even for a one-machine cluster. Actor processes are started by the raylets, which
inherit this process's environment: ``PYTHONPATH`` gets tests/ so that they import the tests' datasets by name.
"""

import contextlib
import gc
import os
import time

import pytest

# Read by Ray when it is imported (conftest sets it first too): every node on 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Ray starts worker processes (the actors) at nice 15, below anything else on the machine: beside other work (two
# busy loops) an actor then gets a sliver of a core and takes minutes to import torch. The tests' cluster stands for
# nodes of its own, so its actors run at the ordinary priority (the raylets read RAY_worker_niceness when they start).
os.environ["RAY_worker_niceness"] = "0"
# The head notices a removed node within about a second (Ray's defaults: 15 s).
FAST_FAILURE = {"health_check_period_ms": 200, "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}


@pytest.fixture(scope="module", autouse=True)
def patient_starts():
    """Actors may take minutes to start on a machine busy with other work (a process, Ray's and torch's imports):
    the loaders of a module that imports this fixture wait FASTFEED_RAY_START_TIMEOUT_S=600 s for them, not the
    120 s default, the cluster's warm-up included (autouse in that module, so set before it). Tests of the start
    timeout set their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTFEED_RAY_START_TIMEOUT_S", "600")
        yield


@contextlib.contextmanager
def local_cluster(nodes=(1, 1), resources=None, head_cpus=0):
    """Start a head (with ``head_cpus``) and one node per entry of ``nodes`` (its CPUs), connect, and take it all
    down afterwards.

    ``resources``: per node, a dict of custom resources (a label such as {"prep": 1}). Yields
    ``(cluster, [node, ...])``."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    assert not ray_constants.ENABLE_RAY_CLUSTER, "ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set"
    path = os.environ.get("PYTHONPATH", "")
    if TESTS_DIR not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, path) if p)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "_system_config": FAST_FAILURE})
    try:
        added = [cluster.add_node(num_cpus=cpus, resources=(resources or [None] * len(nodes))[i] or {})
                 for i, cpus in enumerate(nodes)]  # fmt: skip
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=True)
        cluster.wait_for_nodes()
        yield cluster, added
    finally:
        ray.shutdown()
        cluster.shutdown()


def alive_actors(class_name="RayWorker") -> list:
    """Actors of fastfeed's worker class the cluster still counts as alive (from the GCS's actor table)."""
    import ray

    table = ray._private.state.actors()
    return [a for a in table.values() if a.get("ActorClassName", "").endswith(class_name)
            and a.get("State") not in ("DEAD",)]  # fmt: skip


def wait_no_actors(timeout=10.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        left = alive_actors()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def owned_refs() -> int:
    """Object references this driver holds (its reference table: every ray.put and every call's result)."""
    import ray

    counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts()
    return sum(1 for c in counts.values() if c.get("local", 0) or c.get("submitted", 0))


@pytest.fixture(scope="module")
def cluster():
    """The Ray tests' module cluster: a head with one CPU (where the tests' process is) and two nodes of one CPU,
    the second labelled {"prep": 1}; nothing of fastfeed's (process, fd, /dev/shm segment) is left when it ends."""
    import torch

    import _leaks
    import fastfeed

    before = _leaks.children()
    with local_cluster(nodes=(1, 1), resources=[None, {"prep": 1}], head_cpus=1) as (c, nodes):
        # Warm up: the driver's connections to each node's raylet and object store open here, not inside a test
        # whose descriptor check would count them.
        loader = fastfeed.DataLoader(torch.arange(64).float(), batch_size=8, num_workers=2, worker_type="ray")
        for _ in range(2):
            for _ in loader:
                pass
        del loader
        gc.collect()
        wait_no_actors()
        yield c, nodes
    gc.collect()
    assert _leaks.wait_for_no_leaks(_leaks.Snapshot(before, _leaks.open_fds(), _leaks.shm_segments()), 10) == []
