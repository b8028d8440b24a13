"""``fastfeed info``: the machine, this rank's placement plan and what is available, for a bug report."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from . import _native, config, topology
from ._version import __version__

_ENV = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "RAY_ADDRESS")
RAY_PROBE_S = 15.0  # importing Ray and asking a cluster for its nodes; a stale address must not hang `fastfeed info`

# Run in a child: ray.init(address="auto") connects to a running cluster (RAY_ADDRESS, or the one `ray start` left
# its address for) and never starts one; the child's exit ends the connection, and a timeout can kill it.
_RAY_PROBE = """
import json
try:
    from fastfeed._workers.ray import connect as ray_connect
    ray_connect.connect()
    print(json.dumps({"cluster": ray_connect.cluster_summary()}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
"""


def _package(module: str, dist: str) -> str | None:
    """The installed version of an optional package, or None; never imports it (only a namespace parent)."""
    # The module itself, not its top level: "nvidia" is there whenever any nvidia-* wheel is, DALI or not.
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):  # a parent that is not a package, or does not import
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def _nvml() -> str:
    try:
        import pynvml
    except ImportError:
        return "not installed (pip install fastfeed[nvml])"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:  # NVMLError_LibraryNotFound: no driver, so no GPU
        return f"no driver ({e})"
    try:
        return f"driver {pynvml.nvmlSystemGetDriverVersion()}"
    finally:
        pynvml.nvmlShutdown()


def _ray(timeout_s: float = RAY_PROBE_S) -> dict:
    """Ray's version and, when a cluster is connected or running, its nodes, their CPUs and the other resources
    ``ray_options`` can name (``ray.connect``'s summary).

    This process's own ``ray.init`` is read as it is; otherwise a child process tries ``ray.init(address="auto")``
    for at most ``timeout_s``. ``status`` says which, or why there is no cluster.
    """
    version = _package("ray", "ray")
    if version is None:
        return {"version": None, "cluster": None, "status": "not installed (pip install 'fastfeed[ray]')"}
    ray = sys.modules.get("ray")  # never imported here: that alone takes seconds
    if ray is not None and ray.is_initialized():
        from ._workers.ray import connect as ray_connect

        return {"version": version, "cluster": ray_connect.cluster_summary(), "status": "connected (this process)"}
    if not os.environ.get("RAY_ADDRESS") and not _gcs_running():
        return {"version": version, "cluster": None,
                "status": "no cluster running on this machine, and RAY_ADDRESS is not set"}  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this fastfeed, whatever the child's path
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    where = f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}" if os.environ.get("RAY_ADDRESS") else 'address="auto"'
    try:
        proc = subprocess.run([sys.executable, "-c", _RAY_PROBE], capture_output=True, text=True, env=env,
                              timeout=timeout_s, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"version": version, "cluster": None,
                "status": f"no answer from a cluster at {where} within {timeout_s:.0f} s"}  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if answer.get("cluster"):
        return {"version": version, "cluster": answer["cluster"], "status": f"running at {where}"}
    why = answer.get("error") or (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return {"version": version, "cluster": None, "status": f"no cluster connected at {where} ({why})"}


def _ray_started() -> bool:
    """Whether ``ray start --head`` ran on this machine and its head still runs: the address file it leaves
    (``ray_current_cluster`` in Ray's temp directory) and a gcs_server process. A cluster a process starts for
    itself (``ray.init()`` without an address, a test's ``ray.cluster_utils.Cluster``) leaves no such file, and
    ends with that process: advice that joins it would lose its actors when it goes."""
    base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
    if not os.path.isfile(os.path.join(base, "ray", "ray_current_cluster")):
        return False
    return _gcs_running()


def _gcs_running() -> bool:
    """Whether a Ray head runs on this machine (its gcs_server process), which address="auto" would find: without
    one and without RAY_ADDRESS there is nothing to connect to, and no need to spend seconds importing Ray."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True  # cannot tell: ask
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "gcs_server":
                    return True
        except OSError:
            continue
    return False


def _pinning() -> str:
    if not torch.cuda.is_available():
        return "no CUDA"
    from . import _pinning

    why_not = _pinning.enable()
    return why_not or f"cudaHostRegister through {_pinning.runtime_path()}"


def _shm(directory: str) -> dict:
    try:
        usage = shutil.disk_usage(directory)
    except OSError as e:
        return {"dir": directory, "error": str(e)}
    return {"dir": directory, "total_mb": round(usage.total / 1e6), "free_mb": round(usage.free / 1e6)}


def _reader() -> dict:
    """What ``DataLoader(ArrayFiles(...), device="cuda", reader="auto")`` picks here, and why."""
    from .io import gds

    ok, why = gds.available()
    return {"auto": "gds" if ok else "posix", "why": why}


def report() -> dict:
    """Everything ``fastfeed info`` prints, as plain values."""
    topo = topology.discover()
    rank = int(os.environ.get("LOCAL_RANK") or 0)
    world = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    device = f"cuda:{rank}" if topo.gpus or torch.cuda.is_available() else None
    plan = topology.plan(device, local_rank=rank, local_world_size=world, num_workers=os.cpu_count() or 1,
                         topology=topo)  # fmt: skip
    return {
        "fastfeed": {"version": __version__, "extension": _native.C.__file__},
        "torch": {
            "version": torch.__version__,
            "cuda_build": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(),
            "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        },
        "topology": topology.describe(topo, plan),
        "available": {
            "nvml": _nvml(),
            "pinning": _pinning(),
            "dali": _package("nvidia.dali", "nvidia-dali-cuda120"),
            "kvikio": _package("kvikio", "kvikio-cu12"),
        },
        "ray": _ray(),
        "reader": _reader(),
        "shm": [_shm("/dev/shm")] + ([_shm(config.shm_dir())] if config.shm_dir() != "/dev/shm" else []),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FASTFEED_") or k in _ENV},
    }


def render(info: dict) -> str:
    """The report as text a user can paste into a bug report."""
    t, topo = info["torch"], info["topology"]
    lines = [
        f"fastfeed {info['fastfeed']['version']}  (extension: {info['fastfeed']['extension']})",
        f"torch {t['version']}  CUDA build {t['cuda_build']}  available {t['cuda_available']}  "
        f"devices {t['cuda_devices']}",
        f"CPUs allowed: {topo['allowed_cpus']}  ({topo['cores']} cores x {topo['threads_per_core']} threads)  "
        f"topology from {topo['source']}",
    ]
    for node in topo["nodes"]:
        mem = f"{node['mem_total_kb'] // 1024} MiB" if node["mem_total_kb"] else "memory ?"
        lines.append(f"  node {node['id']}: CPUs {node['cpus']}  {mem}  distances {node['distances']}")
    for i, gpu in enumerate(topo["gpus"]):
        lines.append(f"  GPU {i} {gpu['bus_id']} {gpu['name'] or ''}: node {gpu['numa_node']}  "
                     f"local CPUs {gpu['local_cpus']}")  # fmt: skip
    if not topo["gpus"]:
        lines.append("  no NVIDIA GPU found")
    p = topo.get("plan")
    if p:
        lines.append(f"plan for local rank {p['local_rank']} of {p['local_world_size']} (GPU {p['gpu']}): "
                     f"node {p['node']}, workers on CPUs {p['worker_cpus'] or '(unchanged)'}, main process on "
                     f"{p['main_cpus'] or '(unchanged)'}, memory policy {p['mempolicy']}")  # fmt: skip
        lines.append(f"  why: {p['note']}")
    lines.append("available: " + ", ".join(f"{k} {v or 'no'}" for k, v in info["available"].items()))
    lines += _render_ray(info["ray"])
    r = info["reader"]
    lines.append(f"reader='auto' for ArrayFiles on a GPU: {r['auto']} ({r['why']})")
    for shm in info["shm"]:
        lines.append(f"shared memory {shm['dir']}: " + (shm.get("error") or
                     f"{shm['free_mb']} MB free of {shm['total_mb']} MB"))  # fmt: skip
    if info["env"]:
        lines.append("env: " + " ".join(f"{k}={v}" for k, v in info["env"].items()))
    return "\n".join(lines)


def _render_ray(ray: dict) -> list[str]:
    if ray["version"] is None:
        return [f"ray: {ray['status']}"]
    cluster = ray["cluster"]
    if not cluster:
        return [f"ray {ray['version']}: {ray['status']}"]
    nodes = cluster["nodes"]
    alive = [n for n in nodes if n["alive"]]
    lines = [f"ray {ray['version']}: {ray['status']}, {len(alive)} node(s) alive of {len(nodes)}, "
             f"{cluster['cpus']:g} CPUs{_resources(cluster)}"]  # fmt: skip
    for n in nodes:
        lines.append(f"  ray node {n['node_id'][:12]} {n['address']}: {n['cpus']:g} CPUs{_resources(n)}"
                     + ("" if n["alive"] else " (dead)"))  # fmt: skip
    return lines


def _resources(entry: dict) -> str:
    """A node's (or the cluster's) custom resources and GPUs, as ``ray_options`` names them (``, preprocess 32``);
    nothing when it has none."""
    return "".join(f", {name} {amount:g}" for name, amount in (entry.get("resources") or {}).items())
