"""Fake sysfs trees for topology tests: the files fastfeed.topology reads, and nothing else.

``make_tree`` writes NUMA nodes, SMT siblings, NVIDIA GPUs and an optional cgroup cpuset
under a directory, plus two PCI devices that must be ignored: an NVIDIA bridge (an NVSwitch
is vendor 0x10de but not a GPU) and a network card.
"""

from __future__ import annotations

import os

from fastfeed.topology import format_cpus, parse_cpulist

IGNORED_DEVICES = {
    "0000:00:01.0": ("0x10de", "0x068000"),  # NVIDIA bridge: right vendor, wrong class
    "0000:5e:00.0": ("0x15b3", "0x020700"),  # Mellanox InfiniBand card
}


def make_tree(
    tmp_path,
    nodes: dict[int, str] | None = None,
    siblings: list[str] = (),
    gpus: list[tuple] = (),
    distances: dict[int, str] | None = None,
    cpuset: str | None = None,
    online: str | None = None,
) -> str:
    """Write a fake sysfs tree and return its root.

    Args:
        tmp_path: Directory to write under (the tree goes in ``tmp_path / "sys"``).
        nodes: cpulist per NUMA node; None writes no node directory at all (a non-NUMA kernel).
        siblings: SMT groups as cpulists, e.g. ``["0,16", "1,17"]``; other CPUs are alone.
        gpus: ``(bus_id, numa_node, local_cpulist or None)``; None leaves local_cpulist out.
        distances: distance line per node; defaults to 10 to itself and 20 to the others.
        cpuset: Contents of ``fs/cgroup/cpuset.cpus.effective``; None writes no file.
        online: Contents of ``devices/system/cpu/online``; defaults to every node's CPUs.
    """
    root = os.path.join(str(tmp_path), "sys")
    cpus = frozenset().union(*(parse_cpulist(c) for c in (nodes or {}).values()))
    if online is None:
        online = format_cpus(cpus)
    _write(root, "devices/system/cpu/online", online)
    _write_nodes(root, nodes, distances)
    _write_siblings(root, cpus | parse_cpulist(online), siblings)
    for bus_id, numa_node, local_cpulist in gpus:
        _write_pci(root, bus_id, "0x10de", "0x030200", numa_node, local_cpulist)
    for bus_id, (vendor, pci_class) in IGNORED_DEVICES.items():
        _write_pci(root, bus_id, vendor, pci_class, 0, None)
    if cpuset is not None:
        _write(root, "fs/cgroup/cpuset.cpus.effective", cpuset)
    return root


def _write(root: str, relative: str, text: str) -> None:
    path = os.path.join(root, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")  # the kernel ends every attribute with a newline


def _write_nodes(root: str, nodes: dict[int, str] | None, distances: dict[int, str] | None) -> None:
    if nodes is None:
        return
    for node, cpulist in nodes.items():
        default = " ".join("10" if other == node else "20" for other in sorted(nodes))
        _write(root, f"devices/system/node/node{node}/cpulist", cpulist)
        _write(root, f"devices/system/node/node{node}/distance", (distances or {}).get(node, default))
        meminfo = f"Node {node} MemTotal:       {1048576 * (node + 1)} kB\nNode {node} MemFree:        1024 kB"
        _write(root, f"devices/system/node/node{node}/meminfo", meminfo)
    _write(root, "devices/system/node/online", format_cpus(nodes))  # a file beside the node dirs, to be skipped


def _write_siblings(root: str, cpus: frozenset[int], siblings: list[str]) -> None:
    group_of = {cpu: cpu_list for cpu_list in siblings for cpu in parse_cpulist(cpu_list)}
    for cpu in cpus:
        _write(root, f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", group_of.get(cpu, str(cpu)))


def _write_pci(root, bus_id, vendor, pci_class, numa_node, local_cpulist) -> None:
    base = f"bus/pci/devices/{bus_id}"
    _write(root, f"{base}/vendor", vendor)
    _write(root, f"{base}/class", pci_class)
    _write(root, f"{base}/numa_node", str(-1 if numa_node is None else numa_node))
    if local_cpulist is not None:
        _write(root, f"{base}/local_cpulist", local_cpulist)
