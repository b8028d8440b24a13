"""Finding the Ray cluster that ``worker_type="ray"`` runs its actors on.

fastfeed joins a cluster that is already running (the user's ``ray.init``, or ``ray.init(address="auto")``, which
finds one started with ``ray start`` on this machine or named by ``RAY_ADDRESS``). It never starts one: a cluster
started silently inside a training script would put every "remote" worker on the GPU node's own cores, the very
cores that ran out, and would outlive nothing it was meant to.
"""

from __future__ import annotations

import os

INSTALL = "pip install 'fastfeed[ray]'"
HOW_TO_START = (
    "start one first: `ray start --head` on one machine, `ray start --address=<head>:6379` on each CPU node "
    "(or call ray.init(address=...) yourself before iterating the loader)"
)


def import_ray():
    """The ``ray`` module, or ImportError naming the extra that installs it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"worker_type='ray' needs Ray: {INSTALL}") from e
    return ray


def connect():
    """The ``ray`` module, connected: the caller's own ``ray.init`` if there is one, else a running cluster's.

    Raises:
        RuntimeError: no cluster is running, with how to start one.
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    try:
        ray.init(address="auto", log_to_driver=True, logging_level="WARNING")
    except ConnectionError as e:
        where = os.environ.get("RAY_ADDRESS")
        found = f"none at RAY_ADDRESS={where}" if where else "none on this machine and RAY_ADDRESS is not set"
        raise RuntimeError(f"worker_type='ray' runs on a running Ray cluster and found {found}; {HOW_TO_START}. "
                           f"({e})") from None  # fmt: skip
    return ray


def cluster_summary() -> dict | None:
    """The connected cluster's nodes and CPUs (``fastfeed info``), or None when Ray is absent or not connected."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    nodes = []
    for node in ray.nodes():
        nodes.append({"node_id": node["NodeID"], "address": node.get("NodeManagerAddress", ""),
                      "cpus": float(node.get("Resources", {}).get("CPU", 0.0)), "alive": bool(node.get("Alive"))})
    return {"nodes": nodes, "cpus": sum(n["cpus"] for n in nodes if n["alive"])}
