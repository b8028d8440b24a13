"""The ray workload's cluster: a fake Ray cluster on this machine, started and shut down by the suite, and the
count of what it (or a loader) left behind.

``fastfeed bench ray`` (fastfeed/bench/suites/ray.py) runs every part inside :class:`LocalCluster`; each trial
(fastfeed/bench/suites/ray_trials.py) notes the cluster's processes while its actors live, so that their /dev/shm
entries count as the run's.
"""

from __future__ import annotations

import os
import time

from ..accounting import process_tree, shm_owner, wait_for_exit

CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
NODE_OBJECT_STORE = 1 << 30  # bytes per node: far above the batches in flight (16 actors x 2 x 0.8 MB)
# The head's own resource: the head has no CPUs, so an actor lands on it (the loop's node, as on a training node)
# only by asking for this, and every other actor, asking for CPUs, lands on another node.
TRAINER_RESOURCE = "trainer_node"
_STANDARD = ("CPU", "GPU", "memory", "object_store_memory")  # Ray's own resources: not a node's custom ones


class LocalCluster:
    """A fake Ray cluster on this machine, connected: a head with no CPUs (the driver's node) and CPU nodes.

    Args:
        nodes: Worker nodes.
        node_cpus: CPUs each declares (may exceed the machine's cores).
        head_resources: Custom resources of the head (``{TRAINER_RESOURCE: n}`` for actors placed beside the loop).
    """

    def __init__(self, nodes: int, node_cpus: float, head_resources: dict | None = None):
        self.nodes, self.node_cpus = nodes, node_cpus
        self.head_resources = dict(head_resources or {})
        self.cluster = None
        self.start_s = None
        self._env_was: str | None = None
        self._procs_before: set[int] = set()
        self._shm_before: set[str] = set()
        self._ours: set[int] = set()

    def __enter__(self) -> LocalCluster:
        # Every node then binds 127.0.0.1, not the machine's outward address. Ray reads the variable once, when
        # ray._private.ray_constants is first imported: it must be set before `import ray` (the nodes' and
        # actors' own processes import it afresh, from this environment), and where this process imported Ray
        # already, its constant is set too (services.get_node_ip_address reads it at each call).
        self._env_was = os.environ.get(CLUSTER_ENV)
        os.environ[CLUSTER_ENV] = "0"
        import ray
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        ray_constants.ENABLE_RAY_CLUSTER = False
        if ray.is_initialized():
            self._restore_env()
            raise RuntimeError("the ray suite starts a local cluster of its own: run it in a process where ray is "
                               "not initialised (fastfeed bench ray, or benchmarks/ray.py)")  # fmt: skip
        self._procs_before = set(process_tree())
        self._shm_before = set(os.listdir("/dev/shm"))
        t0 = time.perf_counter()
        try:
            head = {"num_cpus": 0, "object_store_memory": NODE_OBJECT_STORE}
            if self.head_resources:
                head["resources"] = self.head_resources
            self.cluster = Cluster(initialize_head=True, head_node_args=head)
            for _ in range(self.nodes):
                self.cluster.add_node(num_cpus=self.node_cpus, object_store_memory=NODE_OBJECT_STORE)
            ray.init(address=self.cluster.address, logging_level="warning")
            self.cluster.wait_for_nodes()
        except BaseException:
            self._stop()
            raise
        self.start_s = time.perf_counter() - t0
        global _RUNNING
        _RUNNING = self
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        import ray

        global _RUNNING
        _RUNNING = None

        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.watch()
            self.cluster.shutdown()
            self.cluster = None
        self._restore_env()

    def _restore_env(self) -> None:
        if self._env_was is None:
            os.environ.pop(CLUSTER_ENV, None)
        else:
            os.environ[CLUSTER_ENV] = self._env_was

    def describe(self) -> dict:
        """The cluster's nodes (as ``ray.nodes()`` gives them: CPUs, custom resources, whether the head), its CPUs
        and the node this process (the loop, Ray's driver) runs on, while it runs."""
        import ray

        nodes = []
        for n in ray.nodes():
            res = n.get("Resources", {})
            custom = {k: float(v) for k, v in res.items() if k not in _STANDARD and not k.startswith("node:")}
            nodes.append({"node_id": n["NodeID"], "address": n["NodeManagerAddress"],
                          "cpus": float(res.get("CPU", 0.0)), "alive": bool(n["Alive"]),
                          "head": "node:__internal_head__" in res, "resources": custom})  # fmt: skip
        return {"nodes": nodes, "cpus": sum(n["cpus"] for n in nodes if n["alive"]),
                "driver_node": ray.get_runtime_context().get_node_id(), "start_s": self.start_s,
                "machine_cores": os.cpu_count()}  # fmt: skip

    def watch(self) -> None:
        """Note the processes of this run now (this one, the nodes, their actors), whose /dev/shm entries count."""
        self._ours.update(process_tree())

    def left_behind(self) -> dict:
        """After the cluster is shut down: the processes it (or a loader) left alive, and the /dev/shm entries made
        by a process of this run (one named for its pid, as fastfeed's and torch's are) still there.

        Other programs on the machine make and remove their own entries meanwhile: those are not counted.
        """
        procs = wait_for_exit(set(process_tree()) - self._procs_before, timeout=10.0)
        new = set(os.listdir("/dev/shm")) - self._shm_before
        return {"procs": procs, "shm": sorted(n for n in new if shm_owner(n) in self._ours)}


_RUNNING: LocalCluster | None = None  # the cluster started, whose processes each trial notes (``running()``)


def alive_actors() -> int | None:
    """Actors alive in the cluster now (this suite's cluster runs only the loaders' actors); None if Ray cannot say.

    From the GCS's actor table (``ray.util.state`` needs the dashboard, which the suite's cluster does not run).
    """
    try:
        from ray._private import state
    except ImportError:
        return None
    try:
        table = state.actors()
    except Exception:  # a Ray whose private table moved: the count is unknown, not zero
        return None
    return sum(1 for a in table.values() if a.get("State") == "ALIVE")


def wait_actors_gone(timeout: float = 30.0) -> int | None:
    """Wait until no actor is alive; return how many still are (None: Ray cannot say).

    An actor is alive in the table until its process has exited and its raylet has told the GCS. Beside other work
    (CI: a test run's other worker) 14 actors of a quick run's trials still were after 10 s; a leak stays past any
    wait, so the longer one costs only a slow machine's time."""
    deadline = time.monotonic() + timeout
    while (left := alive_actors()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def running() -> LocalCluster | None:
    """The cluster started and not yet shut down, whose processes each trial notes; None outside one."""
    return _RUNNING
