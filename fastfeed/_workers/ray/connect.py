"""Finding the Ray cluster that ``worker_type="ray"`` runs its actors on.

fastfeed joins a cluster that is already running (the user's ``ray.init``, or ``ray.init(address="auto")``, which
finds one started with ``ray start`` on this machine or named by ``RAY_ADDRESS``). It never starts one: a cluster
started silently inside a training script would put every "remote" worker on the GPU node's own cores, the very
cores that ran out, and would outlive nothing it was meant to.

What the cluster has is read here too: the nodes and resources ``fastfeed info`` lists, and whether any node could
ever host an actor with given ``ray_options`` (``never_fits``), which ``pool`` asks before it waits for room.
"""

from __future__ import annotations

import os
import socket

PROBE_S = 5.0  # a cluster's GCS that accepts no connection in this long is taken as gone

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
    _probe(ray)
    try:
        ray.init(address="auto", log_to_driver=True, logging_level="WARNING")
    except ConnectionError as e:
        where = os.environ.get("RAY_ADDRESS")
        found = f"none at RAY_ADDRESS={where}" if where else "none on this machine and RAY_ADDRESS is not set"
        raise RuntimeError(f"worker_type='ray' runs on a running Ray cluster and found {found}; {HOW_TO_START}. "
                           f"({e})") from None  # fmt: skip
    return ray


def _probe(ray) -> None:
    """Fail at once, naming it, when the cluster ``address="auto"`` would join does not answer: Ray itself retries
    an unreachable GCS for minutes (a cluster whose head is gone but whose address file stayed, a RAY_ADDRESS to a
    dead port), and the loader would hang silently meanwhile."""
    try:
        from ray._private import services

        address = services.canonicalize_bootstrap_address("auto")
    except Exception:  # noqa: BLE001 (none found, or a Ray whose private helpers moved: ray.init says it)
        return
    if address is None:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
    except (OSError, ValueError) as e:
        where = os.environ.get("RAY_ADDRESS")
        source = f"RAY_ADDRESS={where}" if where else "the address `ray start` left on this machine"
        raise RuntimeError(f"worker_type='ray': the Ray cluster at {address} ({source}) does not answer "
                           f"({type(e).__name__}: {e}); it is gone or unreachable from here. Start it again, "
                           f"point RAY_ADDRESS at a running one, or run `ray stop` to forget it; {HOW_TO_START}.") \
            from None  # fmt: skip


def cluster_summary() -> dict | None:
    """The connected cluster's nodes, CPUs and other resources (``fastfeed info``), or None when Ray is absent or not
    connected. ``resources`` are those ``ray_options`` can name (``preprocess``, ``GPU``, ...), per node and in all."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    nodes = []
    for node in ray.nodes():
        have = node.get("Resources", {})
        nodes.append({"node_id": node["NodeID"], "address": node.get("NodeManagerAddress", ""),
                      "cpus": float(have.get("CPU", 0.0)), "resources": named_resources(have),
                      "alive": bool(node.get("Alive"))})  # fmt: skip
    alive = [n for n in nodes if n["alive"]]
    total: dict = {}
    for n in alive:
        for k, v in n["resources"].items():
            total[k] = total.get(k, 0.0) + v
    return {"nodes": nodes, "cpus": sum(n["cpus"] for n in alive), "resources": dict(sorted(total.items()))}


def named_resources(have: dict) -> dict:
    """A node's resources other than its CPUs (listed on their own), its memory and object store (bytes, not what
    a user labels nodes with) and its ``node:<address>`` label: the custom resources and GPUs ``ray_options`` name."""
    return {k: float(v) for k, v in sorted(have.items())
            if k not in ("CPU", "memory", "object_store_memory") and not k.startswith("node:")}  # fmt: skip


# -- whether an actor can fit ------------------------------------------------------------------------------------------

_SLACK = 1e-6  # Ray counts resources in fixed point (1/10000): 0.1 + 0.2 on a node is 0.3 to it


def demand(options: dict) -> dict[str, float]:
    """The resources one actor with Ray actor ``options`` holds on its node, by the names nodes list them under.

    An actor must fit on one node: these are compared with each node's, never with the cluster's sum.
    """
    cpus = options.get("num_cpus")
    need = {"CPU": 1 if cpus is None else cpus, "GPU": options.get("num_gpus") or 0,
            "memory": options.get("memory") or 0, **(options.get("resources") or {})}  # fmt: skip
    if options.get("accelerator_type"):
        need[f"accelerator_type:{options['accelerator_type']}"] = 0.001  # Ray's own demand for the label
    return {k: float(v) for k, v in need.items() if v}


def fits(have: dict, need: dict) -> bool:
    """Whether resources ``have`` (a node's, or free ones) cover ``need``."""
    return all(float(have.get(k, 0.0)) + _SLACK >= v for k, v in need.items())


def describe(have: dict, need: dict) -> str:
    """``have`` as ``CPU 2, preprocess 0``: only the resources ``need`` names, each as a user would pass it."""
    return ", ".join(f"{k} {_amount(k, float(have.get(k, 0.0)))}" for k in need) or "nothing"


def _amount(key: str, value: float) -> str:
    return f"{value / 2**30:.3g} GiB" if key == "memory" else f"{value:g}"


def never_fits(ray, options: dict) -> str | None:
    """Why no node of the cluster can ever host one actor with ``options``, or None when one can (now or once
    others' actors end: that is a wait, not an error).

    "Ever" counts the nodes alive now and, where the cluster reports them (an autoscaler that publishes its node
    types, as KubeRay's does), the nodes it may add. A cluster grown by hand or by an autoscaler that publishes
    nothing must have a node that fits up before the loader starts.
    """
    need = demand(options)
    try:
        nodes = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]
    except Exception:  # noqa: BLE001 (cannot tell: the start timeout still bounds the wait)
        return None
    if any(fits(have, need) for have in nodes):
        return None
    types = _autoscaler_node_types()
    if types and any(fits(have, need) for have in types):
        return None
    shapes: dict = {}
    for have in nodes:
        text = describe(have, need)
        shapes[text] = shapes.get(text, 0) + 1
    listed = "; ".join(f"{n} x ({text})" for text, n in list(shapes.items())[:8])
    total = {k: sum(float(have.get(k, 0.0)) for have in nodes) for k in need}
    grows = ("and no node type its autoscaler may add has it either" if types else
             "and it reports no autoscaler node types that could add one (a cluster grown some other way must have "
             "such a node up first)")  # fmt: skip
    return (f"no node of the Ray cluster can ever host one actor with ray_options {options}: an actor needs "
            f"{describe(need, need)} on one node (it cannot span nodes); the cluster's {len(nodes)} alive node(s) "
            f"have {listed or 'nothing'} ({describe(total, need)} in all), {grows}. Lower ray_options (num_cpus, "
            "resources) to what one node has, or add a node that has it (`ray start --address=<head>:6379 "
            "--num-cpus=N --resources='{\"name\": N}'`) before iterating")


def _autoscaler_node_types() -> list[dict] | None:
    """The resources of each node type an autoscaler may still add (max count not 0), or None when the cluster
    reports none (a cluster started by hand) or Ray cannot say."""
    try:
        from ray._private import state

        config = state.state.get_cluster_config()
    except Exception:  # noqa: BLE001 (a Ray whose private state moved: only the alive nodes count)
        return None
    if config is None:
        return None
    return [dict(group.resources) for group in config.node_group_configs if group.max_count != 0]
