"""Where the GPU sits: NUMA nodes, SMT siblings and GPUs, and which CPUs each local rank's workers get.

Discovery reads sysfs (the root can be moved with ``FASTFEED_SYSFS_ROOT`` so tests can use
fake trees) and, on the real machine, NVML when ``nvidia-ml-py`` is installed. Planning is
pure: ``plan()`` returns a ``Plan`` and touches nothing; applying it (affinity, memory
policy) is another module's job.

Layout read from sysfs (paths under the root, ``/sys`` by default)::

    devices/system/node/nodeN/{cpulist,distance,meminfo}      NUMA nodes (absent: one node 0)
    devices/system/cpu/online                                  CPUs when there are no node dirs
    devices/system/cpu/cpuN/topology/thread_siblings_list      SMT siblings (absent: the CPU alone)
    bus/pci/devices/<bus>/{vendor,class,numa_node,local_cpulist}
    fs/cgroup/cpuset.cpus.effective                            cgroup v2 cpuset (optional)
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from dataclasses import dataclass
from collections.abc import Iterable, Mapping

import torch

from . import config

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)  # VGA controller, 3D controller (PCI class code without the prog-if byte)
REAL_ROOT = "/sys"


@dataclass(frozen=True)
class Node:
    """One NUMA node.

    Attributes:
        id: The node number.
        cpus: Its online CPUs (empty for a memory-only node).
        mem_total_kb: Its memory, from ``meminfo``; None when unreadable.
        distances: SLIT distances to every node, in the order sysfs lists them.
    """

    id: int
    cpus: frozenset[int]
    mem_total_kb: int | None
    distances: tuple[int, ...]


@dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU.

    Attributes:
        bus_id: PCI address, normalized to lowercase ``"0000:3b:00.0"``.
        numa_node: Its NUMA node; None when sysfs says -1 (unknown).
        local_cpus: The CPUs the kernel calls local to it.
        name: Product name, from NVML when present.
        uuid: ``"GPU-..."`` UUID, from NVML when present.
    """

    bus_id: str
    numa_node: int | None
    local_cpus: frozenset[int]
    name: str | None = None
    uuid: str | None = None


@dataclass(frozen=True)
class Topology:
    """What ``discover()`` found.

    Attributes:
        nodes: NUMA nodes by id.
        gpus: GPUs in PCI bus id order.
        allowed_cpus: CPUs this process may run on (affinity and cgroup cpuset).
        siblings: For each CPU, its SMT sibling group (itself included).
        source: Where the GPU list came from: ``"nvml"`` or ``"sysfs"``.
    """

    nodes: dict[int, Node]
    gpus: tuple[Gpu, ...]
    allowed_cpus: frozenset[int]
    siblings: dict[int, frozenset[int]]
    source: str

    def gpu_for_cuda_index(self, index: int, env: Mapping[str, str] | None = None) -> Gpu | None:
        """The GPU that CUDA calls ``cuda:index`` in a process with environment ``env``.

        Honours ``CUDA_VISIBLE_DEVICES`` (indices, or ``GPU-`` UUIDs and unique UUID prefixes;
        like CUDA, the list ends at the first entry that names no device). Devices are
        enumerated in PCI bus order: exact for ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and the best
        guess for CUDA's default ``FASTEST_FIRST``, which cannot be known without CUDA. When
        ``env`` is this process's own environment and torch sees CUDA, torch's answer (the
        device's PCI address) wins, since it is what CUDA actually did.

        Args:
            index: The CUDA device index.
            env: Environment to read; defaults to ``os.environ``.

        Returns:
            The GPU, or None when the index is out of range or the list cannot be parsed.
        """
        if env is None or env is os.environ:
            gpu = self._gpu_from_torch(index)
            if gpu is not None:
                return gpu
            env = os.environ
        visible = _visible_gpus(self.gpus, env.get("CUDA_VISIBLE_DEVICES"))
        return visible[index] if 0 <= index < len(visible) else None

    def _gpu_from_torch(self, index: int) -> Gpu | None:
        if not torch.cuda.is_available() or not 0 <= index < torch.cuda.device_count():
            return None
        address = _torch_pci_address(torch.cuda.get_device_properties(index))
        if address is None:
            return None
        # cudaDeviceProp has no PCI function number; GPUs are function 0, so match on the rest.
        return next((g for g in self.gpus if g.bus_id.rsplit(".", 1)[0] == address), None)


@dataclass(frozen=True)
class Plan:
    """Which CPUs and memory policy one local rank's loader should use.

    An empty ``worker_cpus`` means there was nothing to bind to (no allowed CPUs): leave affinity alone.

    Attributes:
        node: The GPU's NUMA node, or None when unknown or there is no GPU.
        worker_cpus: CPUs for the worker processes.
        main_cpus: CPUs kept for the main (training) process; equal to ``worker_cpus`` when
            there are too few to keep any apart.
        mempolicy: ``"preferred"`` (prefer ``node`` for memory) or ``"none"``.
        local_rank: The rank this plan is for.
        local_world_size: How many local ranks share the machine.
        gpu: The target GPU, if found.
        note: Why the plan looks the way it does, for humans.
    """

    node: int | None
    worker_cpus: frozenset[int]
    main_cpus: frozenset[int]
    mempolicy: str
    local_rank: int
    local_world_size: int
    gpu: Gpu | None
    note: str


# ---------------------------------------------------------------------------------------------------------------------
# cpulists


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel cpulist such as ``"0-3,8-11"`` (empty and whitespace allowed).

    Args:
        text: The list.

    Returns:
        The CPUs it names.

    Raises:
        ValueError: If a part is not a number or a ``low-high`` range.
    """
    cpus: set[int] = set()
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"bad cpulist entry {part!r} in {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"bad cpulist range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """Format CPUs as a compact cpulist, e.g. ``{0, 1, 2, 3, 8}`` as ``"0-3,8"``.

    Args:
        cpus: CPU ids.

    Returns:
        The cpulist; ``""`` for no CPUs.
    """
    parts: list[str] = []
    for first, last in _runs(sorted(set(cpus))):
        parts.append(str(first) if first == last else f"{first}-{last}")
    return ",".join(parts)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for cpu in ids:
        if runs and runs[-1][1] == cpu - 1:
            runs[-1] = (runs[-1][0], cpu)
        else:
            runs.append((cpu, cpu))
    return runs


# ---------------------------------------------------------------------------------------------------------------------
# discovery


def discover(root: str | None = None, allowed_cpus: Iterable[int] | None = None) -> Topology:
    """Read this machine's NUMA nodes, SMT siblings and GPUs.

    Args:
        root: The sysfs root; defaults to ``$FASTFEED_SYSFS_ROOT`` or ``/sys``. With any other
            root NVML is not asked (it describes the real machine), and that tree's CPUs stand in
            for this process's affinity.
        allowed_cpus: CPUs this process may use; defaults to ``os.sched_getaffinity(0)``
            (for a fake root: the tree's CPUs) intersected with the cgroup v2 cpuset when readable.

    Returns:
        The topology. Missing files make a smaller picture, never an error.
    """
    root = root or config.sysfs_root()
    real = os.path.realpath(root) == REAL_ROOT
    nodes = _read_nodes(root)
    all_cpus = frozenset().union(*(n.cpus for n in nodes.values()))
    if allowed_cpus is None:
        allowed = _allowed_cpus(root, real, all_cpus)
    else:
        allowed = frozenset(allowed_cpus)
    devices = _nvml_devices() if real else None
    gpus = _gpus_from_sysfs(root, nodes) if devices is None else _gpus_from_nvml(root, nodes, devices)
    return Topology(
        nodes=nodes,
        gpus=tuple(sorted(gpus, key=lambda g: _bus_key(g.bus_id))),
        allowed_cpus=allowed,
        siblings=_read_siblings(root, all_cpus),
        source="sysfs" if devices is None else "nvml",
    )


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # absent, or a file the kernel refuses to read here: both mean "unknown"
        return None


def _read_nodes(root: str) -> dict[int, Node]:
    base = os.path.join(root, "devices/system/node")
    nodes = {}
    for path in glob.glob(os.path.join(base, "node[0-9]*")):
        name = os.path.basename(path)
        if re.fullmatch(r"node\d+", name):
            nodes[int(name[4:])] = _read_node(path, int(name[4:]))
    if nodes:
        return dict(sorted(nodes.items()))
    # A kernel built without NUMA has no node directory: the machine is one node.
    return {0: Node(id=0, cpus=_online_cpus(root), mem_total_kb=None, distances=(10,))}


def _online_cpus(root: str) -> frozenset[int]:
    online = _read(os.path.join(root, "devices/system/cpu/online"))
    if online is not None:
        return parse_cpulist(online)
    names = (os.path.basename(p) for p in glob.glob(os.path.join(root, "devices/system/cpu/cpu[0-9]*")))
    return frozenset(int(name[3:]) for name in names if re.fullmatch(r"cpu\d+", name))


def _read_node(path: str, node_id: int) -> Node:
    distances = _read(os.path.join(path, "distance")) or ""
    return Node(
        id=node_id,
        cpus=parse_cpulist(_read(os.path.join(path, "cpulist")) or ""),
        mem_total_kb=_mem_total_kb(_read(os.path.join(path, "meminfo")) or ""),
        distances=tuple(int(d) for d in distances.split()),
    )


def meminfo_bytes(field: str, path: str = "/proc/meminfo") -> int | None:
    """A ``/proc/meminfo`` field (``"MemTotal"``, ``"MemAvailable"``) in bytes, or None when unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mem_total_kb(meminfo: str) -> int | None:
    match = re.search(r"MemTotal:\s*(\d+)\s*kB", meminfo)
    return int(match.group(1)) if match else None


def _read_siblings(root: str, cpus: frozenset[int]) -> dict[int, frozenset[int]]:
    siblings = {}
    for cpu in sorted(cpus):
        text = _read(os.path.join(root, f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"))
        siblings[cpu] = parse_cpulist(text or "") | {cpu}
    return siblings


def _allowed_cpus(root: str, real: bool, all_cpus: frozenset[int]) -> frozenset[int]:
    # This process's affinity describes the real machine, so a fake tree's own CPUs stand in for it.
    allowed = frozenset(os.sched_getaffinity(0)) if real else all_cpus
    cpuset = _read(os.path.join(root, "fs/cgroup/cpuset.cpus.effective"))
    if cpuset:
        try:
            allowed &= parse_cpulist(cpuset)
        except ValueError:
            pass  # an unreadable cpuset restricts nothing we can know about
    return allowed


def _gpus_from_sysfs(root: str, nodes: dict[int, Node]) -> list[Gpu]:
    gpus = []
    for path in glob.glob(os.path.join(root, "bus/pci/devices/*")):
        if _is_nvidia_gpu(path):
            gpus.append(_read_gpu(root, nodes, os.path.basename(path)))
    return gpus


def _is_nvidia_gpu(path: str) -> bool:
    try:
        vendor = int(_read(os.path.join(path, "vendor")) or "", 16)
        pci_class = int(_read(os.path.join(path, "class")) or "", 16)
    except ValueError:
        return False
    return vendor == NVIDIA_VENDOR and pci_class >> 8 in GPU_CLASSES


def _read_gpu(root: str, nodes: dict[int, Node], bus_id: str, name: str | None = None, uuid: str | None = None) -> Gpu:
    path = os.path.join(root, "bus/pci/devices", bus_id)
    try:
        node = int(_read(os.path.join(path, "numa_node")) or "-1")
    except ValueError:
        node = -1
    node_id = None if node < 0 else node
    local = _read(os.path.join(path, "local_cpulist"))
    if local is not None:
        local_cpus = parse_cpulist(local)
    elif node_id in nodes:
        local_cpus = nodes[node_id].cpus
    else:
        local_cpus = frozenset().union(*(n.cpus for n in nodes.values()))
    return Gpu(bus_id=normalize_bus_id(bus_id), numa_node=node_id, local_cpus=local_cpus, name=name, uuid=uuid)


def normalize_bus_id(bus_id: str) -> str:
    """A PCI address as sysfs writes it: NVML's ``"00000000:3B:00.0"`` becomes ``"0000:3b:00.0"``.

    Args:
        bus_id: ``domain:bus:device.function`` in hex, any case and domain width.

    Returns:
        The normalized address, or ``bus_id`` lowercased when it is not of that form.
    """
    match = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])", bus_id.strip())
    if not match:
        return bus_id.strip().lower()
    domain, bus, device, function = (int(part, 16) for part in match.groups())
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


def _bus_key(bus_id: str) -> tuple:
    try:
        return tuple(int(part, 16) for part in re.split(r"[:.]", bus_id))
    except ValueError:
        return (float("inf"), bus_id)


def _torch_pci_address(props) -> str | None:
    """``"dddd:bb:dd"`` from torch device properties, whether it gives a string or numbers."""
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, str):
        return normalize_bus_id(bus).rsplit(".", 1)[0]
    device = getattr(props, "pci_device_id", None)
    if not isinstance(bus, int) or not isinstance(device, int):
        return None
    return f"{getattr(props, 'pci_domain_id', 0) or 0:04x}:{bus:02x}:{device:02x}"


def _visible_gpus(gpus: tuple[Gpu, ...], visible: str | None) -> list[Gpu]:
    if visible is None:
        return list(gpus)
    chosen = []
    for entry in visible.split(","):
        gpu = _visible_entry(gpus, entry.strip())
        if gpu is None:
            break  # CUDA ignores everything from the first entry that names no device
        chosen.append(gpu)
    return chosen


def _visible_entry(gpus: tuple[Gpu, ...], entry: str) -> Gpu | None:
    if re.fullmatch(r"\d+", entry):
        index = int(entry)
        return gpus[index] if index < len(gpus) else None
    if entry.lower().startswith("gpu-"):
        matches = [g for g in gpus if g.uuid and g.uuid.lower().startswith(entry.lower())]
        return matches[0] if len(matches) == 1 else None
    return None  # MIG instances and anything else cannot be mapped without CUDA


# NVML -----------------------------------------------------------------------------------------------------------------


def _nvml_devices() -> list[tuple[str, str | None, str | None]] | None:
    """``(bus id, name, uuid)`` for each GPU NVML sees, or None when NVML is not usable."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, a driver mismatch, a broken wrapper: all mean "no NVML"
        return None
    try:
        return [_nvml_device(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # one unreadable GPU: sysfs still sees them all, so trust it instead
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass  # shutting down is a courtesy; a failure changes nothing we read


def _nvml_device(pynvml, index: int) -> tuple[str, str | None, str | None]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    bus_id = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    return normalize_bus_id(bus_id), _text(pynvml.nvmlDeviceGetName(handle)), _text(pynvml.nvmlDeviceGetUUID(handle))


def _text(value) -> str:
    # Older nvidia-ml-py releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else str(value)


def _gpus_from_nvml(root: str, nodes: dict[int, Node], devices) -> list[Gpu]:
    return [_read_gpu(root, nodes, bus_id, name, uuid) for bus_id, name, uuid in devices]


# ---------------------------------------------------------------------------------------------------------------------
# planning


def plan(
    device,
    *,
    local_rank: int = 0,
    local_world_size: int = 1,
    num_workers: int,
    allowed_cpus: Iterable[int] | None = None,
    topology: Topology | None = None,
    node: int | None = None,
) -> Plan:
    """Choose CPUs and a memory policy for one local rank's loader. Pure: applies nothing.

    The GPU's node is split between the local ranks whose GPUs share it (torchrun's convention:
    local rank ``r`` uses ``cuda:r``). The node's allowed CPUs are grouped into cores (SMT
    sibling groups), and each rank takes a contiguous near-equal run of cores, earlier ranks
    taking the extra ones; siblings are never split unless there are fewer cores than ranks.
    The first core of a rank's share is kept for the main process, the rest go to workers.
    Without a known node (CPU device, no GPU, NUMA node -1) the same split runs over all
    allowed CPUs. If ``device`` is not ``cuda:local_rank``, the other ranks' GPUs are unknown and
    this rank takes its whole node.

    Args:
        device: None, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int N, or a ``torch.device``.
        local_rank: This process's rank on the machine.
        local_world_size: How many ranks run on the machine.
        num_workers: The loader's workers; only reported in the note, sets are not shrunk to it.
        allowed_cpus: CPUs that may be used; defaults to ``topology.allowed_cpus``.
        topology: Defaults to ``discover()``.
        node: Use this NUMA node whatever the GPU's (``DataLoader(numa=N)``); its CPUs are split
            between all local ranks.

    Returns:
        The plan. No CPU in it lies outside the allowed CPUs.

    Raises:
        ValueError: If ``local_rank`` is not in ``range(local_world_size)`` or ``num_workers < 0``.
    """
    _check_ranks(local_rank, local_world_size, num_workers)
    topology = topology or discover()
    allowed = topology.allowed_cpus if allowed_cpus is None else frozenset(allowed_cpus)
    index = _cuda_index(device)
    gpu = None if index is None else topology.gpu_for_cuda_index(index)
    if node is not None:
        node, pool, ranks, notes = _forced_pool(topology, allowed, gpu, node, local_world_size)
    else:
        node, pool, ranks, notes = _pool(topology, allowed, gpu, index, local_rank, local_world_size)
    units, split_notes = _split(pool, topology.siblings, ranks, local_rank)
    main, workers, keep_note = _main_and_workers(units)
    notes += split_notes + keep_note + [f"{_count(num_workers, 'worker')} on {_count(len(workers), 'CPU')}"]
    return Plan(
        node=node,
        worker_cpus=workers,
        main_cpus=main,
        mempolicy="none" if node is None else "preferred",
        local_rank=local_rank,
        local_world_size=local_world_size,
        gpu=gpu,
        note="; ".join(notes),
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _check_ranks(local_rank: int, local_world_size: int, num_workers: int) -> None:
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be at least 1, got {local_world_size}")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank must be in range(local_world_size={local_world_size}), got {local_rank}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")


def _cuda_index(device) -> int | None:
    """The CUDA device index ``device`` names, or None for a CPU (or other non-CUDA) device."""
    if device is None:
        return None
    if isinstance(device, int):
        return device  # torch reads a bare int as a CUDA index
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _pool(topology, allowed, gpu, index, local_rank, local_world_size):
    """The node, the CPUs to split, the ranks splitting them (in order), and notes saying why."""
    everyone = list(range(local_world_size))
    if gpu is None:
        why = "no CUDA device" if index is None else f"cuda:{index} matches no GPU found"
        return None, allowed, everyone, [f"{why}: splitting all allowed CPUs between local ranks"]
    node = _node_of(topology, gpu)
    if node is None or node not in topology.nodes:
        why = f"GPU {gpu.bus_id} has no known NUMA node"
        return None, allowed, everyone, [f"{why}: splitting all allowed CPUs between local ranks"]
    node_cpus = topology.nodes[node].cpus & allowed
    if not node_cpus:
        _warn_no_cpus(node, gpu, allowed)
        return node, allowed, everyone, [f"node {node} of GPU {gpu.bus_id} has no allowed CPUs: using all allowed CPUs"]
    ranks, notes = _ranks_on_node(topology, node, index, local_rank, local_world_size)
    notes.insert(0, f"node {node} of GPU {gpu.bus_id}, shared by {len(ranks)} local rank(s)")
    return node, node_cpus, ranks, notes


def _node_of(topology, gpu: Gpu) -> int | None:
    if gpu.numa_node is None and len(topology.nodes) == 1:
        return next(iter(topology.nodes))  # -1 on a one-node machine (VMs say so): there is no other
    return gpu.numa_node


def _forced_pool(topology, allowed, gpu, node, local_world_size):
    """As ``_pool``, for a node chosen by the caller: every local rank is assumed to choose it too."""
    if node not in topology.nodes:
        raise ValueError(f"NUMA node {node} does not exist here; the nodes are {sorted(topology.nodes)}")
    everyone = list(range(local_world_size))
    node_cpus = topology.nodes[node].cpus & allowed
    if not node_cpus:
        _warn_no_cpus(node, gpu, allowed)
        return node, allowed, everyone, [f"node {node} (asked for) has no allowed CPUs: using all allowed CPUs"]
    return node, node_cpus, everyone, [f"node {node} (asked for), shared by {local_world_size} local rank(s)"]


def _warn_no_cpus(node: int, gpu: Gpu | None, allowed: frozenset[int]) -> None:
    of_gpu = f" of GPU {gpu.bus_id}" if gpu is not None else ""
    warnings.warn(
        f"fastfeed: NUMA node {node}{of_gpu} has none of the allowed CPUs "
        f"({format_cpus(allowed) or 'none'}); workers will run on the allowed CPUs of other nodes, "
        f"and memory will still prefer node {node}",
        UserWarning,
        stacklevel=4,
    )


def _ranks_on_node(topology, node, index, local_rank, local_world_size) -> tuple[list[int], list[str]]:
    if index != local_rank:
        if local_world_size == 1:
            return [local_rank], []
        why = f"device cuda:{index} is not cuda:{local_rank}, so other local ranks' GPUs are unknown"
        return [local_rank], [f"{why}: this rank takes its whole node"]
    ranks = []
    for rank in range(local_world_size):
        other = topology.gpu_for_cuda_index(rank)
        if other is not None and _node_of(topology, other) == node:
            ranks.append(rank)
    return ranks, []


def _split(pool, siblings, ranks, local_rank) -> tuple[list[frozenset[int]], list[str]]:
    """This rank's share of ``pool``: a list of units (cores, or single CPUs when cores run short)."""
    count, position = len(ranks), ranks.index(local_rank)
    cores = _cores(pool, siblings)
    if len(cores) >= count:
        return _chunk(cores, count, position), []
    singles = [frozenset({cpu}) for cpu in sorted(pool)]
    if len(singles) >= count:
        return _chunk(singles, count, position), [f"{len(cores)} cores for {count} ranks: SMT siblings are split"]
    if not singles:
        return [], ["no allowed CPUs: nothing to bind"]
    return [singles[position % len(singles)]], [f"{len(singles)} CPUs for {count} ranks: ranks share CPUs"]


def _cores(pool: frozenset[int], siblings: dict[int, frozenset[int]]) -> list[frozenset[int]]:
    cores = {(siblings.get(cpu, frozenset()) | {cpu}) & pool for cpu in pool}
    return sorted(cores, key=min)


def _chunk(units: list, count: int, position: int) -> list:
    # Contiguous near-equal shares; the first `extra` ranks take one unit more.
    base, extra = divmod(len(units), count)
    start = position * base + min(position, extra)
    return units[start : start + base + (position < extra)]


def _main_and_workers(units: list[frozenset[int]]) -> tuple[frozenset[int], frozenset[int], list[str]]:
    if len(units) >= 2:
        return units[0], frozenset().union(*units[1:]), []
    share = frozenset().union(*units)
    note = ["too few CPUs to keep one for the main process"] if share else []
    return share, share, note


# ---------------------------------------------------------------------------------------------------------------------
# reporting


def describe(topology: Topology, plan: Plan | None = None) -> dict:
    """A JSON-able summary for ``fastfeed info --json``: sorted lists, cpulists as compact strings.

    Args:
        topology: What ``discover()`` found.
        plan: A plan to include, if any.

    Returns:
        A dict of plain values.
    """
    groups = set(topology.siblings.values())
    out = {
        "source": topology.source,
        "allowed_cpus": format_cpus(topology.allowed_cpus),
        "cores": len(groups),
        "threads_per_core": max((len(g) for g in groups), default=1),
        "nodes": [_describe_node(n) for n in sorted(topology.nodes.values(), key=lambda n: n.id)],
        "gpus": [_describe_gpu(g) for g in topology.gpus],
    }
    if plan is not None:
        out["plan"] = _describe_plan(plan)
    return out


def _describe_node(node: Node) -> dict:
    return {
        "id": node.id,
        "cpus": format_cpus(node.cpus),
        "mem_total_kb": node.mem_total_kb,
        "distances": list(node.distances),
    }


def _describe_gpu(gpu: Gpu) -> dict:
    return {
        "bus_id": gpu.bus_id,
        "numa_node": gpu.numa_node,
        "local_cpus": format_cpus(gpu.local_cpus),
        "name": gpu.name,
        "uuid": gpu.uuid,
    }


def _describe_plan(plan: Plan) -> dict:
    return {
        "node": plan.node,
        "worker_cpus": format_cpus(plan.worker_cpus),
        "main_cpus": format_cpus(plan.main_cpus),
        "mempolicy": plan.mempolicy,
        "local_rank": plan.local_rank,
        "local_world_size": plan.local_world_size,
        "gpu": plan.gpu.bus_id if plan.gpu else None,
        "note": plan.note,
    }
