"""NUMA discovery and binding plans, on fake sysfs trees (tests/_sysfs.py) and on this machine.

The DGX-like tree follows how Linux numbers a 2-socket machine with SMT: node 0 holds cores
0-7 and their siblings 16-23, node 1 holds 8-15 and 24-31, so each core is the pair (i, i+16).
Four GPUs hang off each node.
"""

import json
import os
import sys
import types
import warnings

import pytest
import torch

from _sysfs import make_tree
from fastfeed import topology
from fastfeed.topology import Gpu, Node, Topology, describe, discover, format_cpus, parse_cpulist, plan

DGX_GPUS = [  # given out of bus order on purpose: discovery sorts them
    ("0000:87:00.0", 1, "8-15,24-31"),
    ("0000:07:00.0", 0, "0-7,16-23"),
    ("0000:0f:00.0", 0, "0-7,16-23"),
    ("0000:47:00.0", 0, "0-7,16-23"),
    ("0000:4e:00.0", 0, "0-7,16-23"),
    ("0000:90:00.0", 1, "8-15,24-31"),
    ("0000:b7:00.0", 1, "8-15,24-31"),
    ("0000:bd:00.0", 1, "8-15,24-31"),
]
DGX_NODES = {0: "0-7,16-23", 1: "8-15,24-31"}
DGX_SIBLINGS = [f"{i},{i + 16}" for i in range(16)]


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    # Plans must come from the fake trees alone, even on a machine with GPUs.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "FASTFEED_SYSFS_ROOT"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def dgx(tmp_path):
    return discover(make_tree(tmp_path, nodes=DGX_NODES, siblings=DGX_SIBLINGS, gpus=DGX_GPUS))


def cpus(text):
    return parse_cpulist(text)


def all_plans(topo, world, num_workers=4, **kwargs):
    return [
        plan(f"cuda:{r}", local_rank=r, local_world_size=world, num_workers=num_workers, topology=topo, **kwargs)
        for r in range(world)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# discovery


def test_discovery_reads_nodes_gpus_and_siblings(dgx):
    """Nodes, memory, distances, siblings and GPUs (in bus order, bridges and NICs ignored) come from sysfs."""
    assert sorted(dgx.nodes) == [0, 1]
    assert dgx.nodes[1] == Node(id=1, cpus=cpus("8-15,24-31"), mem_total_kb=2097152, distances=(20, 10))
    assert [g.bus_id for g in dgx.gpus] == sorted(bus for bus, _, _ in DGX_GPUS)
    assert [g.numa_node for g in dgx.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dgx.gpus[4].local_cpus == cpus("8-15,24-31")
    assert dgx.siblings[3] == dgx.siblings[19] == frozenset({3, 19})
    assert dgx.allowed_cpus == cpus("0-31")
    assert dgx.source == "sysfs"


def test_sysfs_root_comes_from_the_environment(tmp_path, monkeypatch):
    """FASTFEED_SYSFS_ROOT moves discovery to another tree."""
    monkeypatch.setenv("FASTFEED_SYSFS_ROOT", make_tree(tmp_path, nodes={0: "0-3"}, gpus=[("0000:07:00.0", 0, "0-3")]))
    topo = discover()
    assert topo.nodes[0].cpus == cpus("0-3")
    assert [g.bus_id for g in topo.gpus] == ["0000:07:00.0"]


def test_unknown_numa_node_and_missing_local_cpulist(tmp_path):
    """numa_node -1 reads as None; a missing local_cpulist falls back to the node's CPUs, or all CPUs."""
    root = make_tree(tmp_path, nodes={0: "0-3", 1: "4-7"}, gpus=[("0000:07:00.0", -1, None), ("0000:87:00.0", 1, None)])
    first, second = discover(root).gpus
    assert (first.numa_node, first.local_cpus) == (None, cpus("0-7"))
    assert (second.numa_node, second.local_cpus) == (1, cpus("4-7"))


def test_missing_sibling_files_leave_each_cpu_alone(tmp_path):
    """A CPU without thread_siblings_list is its own core."""
    root = make_tree(tmp_path, nodes={0: "0-3"}, siblings=["0,2"])
    os.remove(os.path.join(root, "devices/system/cpu/cpu1/topology/thread_siblings_list"))
    topo = discover(root)
    assert topo.siblings == {0: {0, 2}, 1: {1}, 2: {0, 2}, 3: {3}}


def test_no_node_directory_means_one_node_of_online_cpus(tmp_path):
    """A kernel without NUMA support gives one node 0 holding every online CPU."""
    root = make_tree(tmp_path, nodes=None, online="0-5", gpus=[("0000:07:00.0", -1, None)])
    topo = discover(root)
    assert topo.nodes == {0: Node(id=0, cpus=cpus("0-5"), mem_total_kb=None, distances=(10,))}
    assert topo.gpus[0].local_cpus == cpus("0-5")


def test_cgroup_cpuset_under_the_root_restricts_allowed_cpus(tmp_path):
    """The fake tree's cgroup cpuset limits allowed_cpus; an explicit allowed_cpus wins."""
    root = make_tree(tmp_path, nodes=DGX_NODES, cpuset="0-7,16-23,8,24")
    assert discover(root).allowed_cpus == cpus("0-8,16-24")
    assert discover(root, allowed_cpus={1, 2}).allowed_cpus == {1, 2}


def test_this_machine(monkeypatch):
    """On the real machine, discovery finds a node and allows at most this process's affinity."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the import fails: NVML absent, as on most CI
    topo = discover()
    affinity = frozenset(os.sched_getaffinity(0))
    assert topo.nodes and topo.allowed_cpus and topo.allowed_cpus <= affinity
    if not os.path.exists("/sys/fs/cgroup/cpuset.cpus.effective"):
        assert topo.allowed_cpus == affinity
    assert topo.source == "sysfs"
    json.dumps(describe(topo, plan("cpu", num_workers=2, topology=topo)))


# NVML -----------------------------------------------------------------------------------------------------------------


class NVMLError(Exception):
    pass


def fake_pynvml(devices=(), init_error=None):
    """A stand-in for nvidia-ml-py: ``devices`` are (busId, name, uuid) as NVML returns them."""
    module = types.SimpleNamespace(NVMLError=NVMLError, shutdowns=[])

    def init():
        if init_error:
            raise init_error

    module.nvmlInit = init
    module.nvmlShutdown = lambda: module.shutdowns.append(True)
    module.nvmlDeviceGetCount = lambda: len(devices)
    module.nvmlDeviceGetHandleByIndex = lambda i: devices[i]
    module.nvmlDeviceGetPciInfo = lambda d: types.SimpleNamespace(busId=d[0])
    module.nvmlDeviceGetName = lambda d: d[1]
    module.nvmlDeviceGetUUID = lambda d: d[2]
    return module


def test_nvml_bus_ids_are_normalized(monkeypatch):
    """NVML's 8-digit uppercase bus ids (str or bytes) become sysfs's form, and NVML is shut down."""
    devices = [(b"00000000:3B:00.0", b"NVIDIA H200", b"GPU-abc"), ("00000001:07:00.0", "NVIDIA H200", "GPU-def")]
    module = fake_pynvml(devices)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert topology._nvml_devices() == [
        ("0000:3b:00.0", "NVIDIA H200", "GPU-abc"),
        ("0001:07:00.0", "NVIDIA H200", "GPU-def"),
    ]
    assert module.shutdowns == [True]


def test_nvml_library_missing_is_no_nvml(monkeypatch):
    """An NVMLError from nvmlInit (e.g. library not found) means no NVML, never an exception."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=NVMLError("NVML Shared Library Not Found")))
    assert topology._nvml_devices() is None
    assert discover().source == "sysfs"


def test_fake_root_never_asks_nvml(tmp_path, monkeypatch):
    """NVML describes the real machine, so a fake tree's GPUs come from the tree."""
    module = fake_pynvml([("00000000:99:00.0", "real", "GPU-real")])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    topo = discover(make_tree(tmp_path, nodes={0: "0-3"}, gpus=[("0000:07:00.0", 0, "0-3")]))
    assert (topo.source, [g.bus_id for g in topo.gpus]) == ("sysfs", ["0000:07:00.0"])


# ---------------------------------------------------------------------------------------------------------------------
# cuda index to GPU


def test_cuda_visible_devices_reorders(dgx):
    """CUDA_VISIBLE_DEVICES="2,0" makes cuda:0 the third GPU by bus order and cuda:1 the first."""
    env = {"CUDA_VISIBLE_DEVICES": "2,0"}
    assert dgx.gpu_for_cuda_index(0, env).bus_id == "0000:47:00.0"
    assert dgx.gpu_for_cuda_index(1, env).bus_id == "0000:07:00.0"
    assert dgx.gpu_for_cuda_index(2, env) is None


def test_cuda_index_without_visible_devices_is_bus_order(dgx):
    """Without CUDA_VISIBLE_DEVICES, either device order maps indices in bus order; out of range is None."""
    for env in ({}, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}):
        assert [dgx.gpu_for_cuda_index(i, env) for i in range(8)] == list(dgx.gpus)
        assert dgx.gpu_for_cuda_index(8, env) is None and dgx.gpu_for_cuda_index(-1, env) is None


@pytest.mark.parametrize(
    "visible, expected",
    [("", []), ("1, 3", [1, 3]), ("1,x,0", [1]), ("1,9,0", [1]), ("-1", []), ("MIG-1234", [])],
)
def test_cuda_visible_devices_stop_at_the_first_bad_entry(dgx, visible, expected):
    """Like CUDA, the visible list ends at the first entry naming no device; an empty list hides all."""
    env = {"CUDA_VISIBLE_DEVICES": visible}
    found = [dgx.gpu_for_cuda_index(i, env) for i in range(len(expected) + 1)]
    assert found == [dgx.gpus[i] for i in expected] + [None]


def test_cuda_visible_devices_by_uuid():
    """GPU UUIDs and unique UUID prefixes select GPUs; an ambiguous prefix selects none."""
    gpus = tuple(
        Gpu(f"0000:0{i}:00.0", 0, frozenset({0}), "H200", uuid)
        for i, uuid in enumerate(["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-bbbb-3333"])
    )
    topo = Topology(
        nodes={0: Node(0, frozenset({0}), None, (10,))},
        gpus=gpus,
        allowed_cpus=frozenset({0}),
        siblings={0: frozenset({0})},
        source="nvml",
    )
    env = {"CUDA_VISIBLE_DEVICES": "GPU-bbbb-3333,GPU-aaaa"}
    assert [topo.gpu_for_cuda_index(i, env) for i in range(3)] == [gpus[2], gpus[0], None]
    assert topo.gpu_for_cuda_index(0, {"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}) is None


def test_plan_reads_cuda_visible_devices_from_the_process(dgx, monkeypatch):
    """plan() maps its device through this process's CUDA_VISIBLE_DEVICES."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    result = plan("cuda", num_workers=2, topology=dgx)
    assert (result.gpu.bus_id, result.node) == ("0000:90:00.0", 1)


# ---------------------------------------------------------------------------------------------------------------------
# plans


def test_single_node_one_gpu(tmp_path):
    """One node of 8 CPUs and one GPU: CPU 0 for the main process, 1-7 for workers, memory on node 0."""
    topo = discover(make_tree(tmp_path, nodes={0: "0-7"}, gpus=[("0000:07:00.0", 0, "0-7")]))
    result = plan("cuda:0", num_workers=8, topology=topo)
    assert (result.node, result.main_cpus, result.worker_cpus) == (0, {0}, cpus("1-7"))
    assert (result.mempolicy, result.gpu, result.local_rank, result.local_world_size) == (
        "preferred",
        topo.gpus[0],
        0,
        1,
    )
    assert "8 workers on 7 CPUs" in result.note


def test_dgx_ranks_stay_disjoint_on_their_gpus_node(dgx):
    """With 8 local ranks, each rank's CPUs are on its GPU's node, whole cores, and no two ranks overlap."""
    plans = all_plans(dgx, 8)
    taken = set()
    for rank, result in enumerate(plans):
        mine = result.main_cpus | result.worker_cpus
        assert result.node == dgx.gpus[rank].numa_node == rank // 4
        assert mine <= dgx.nodes[result.node].cpus and not mine & taken
        assert all(dgx.siblings[cpu] <= mine for cpu in mine)
        assert not result.main_cpus & result.worker_cpus
        taken |= mine
    assert taken == cpus("0-31")


def test_dgx_exact_plans_for_ranks_0_and_5(dgx):
    """Rank 0 takes node 0's first two cores, rank 5 the second two of node 1, the first core for main."""
    plans = all_plans(dgx, 8)
    assert (plans[0].node, plans[0].main_cpus, plans[0].worker_cpus) == (0, {0, 16}, {1, 17})
    assert (plans[5].node, plans[5].main_cpus, plans[5].worker_cpus) == (1, {10, 26}, {11, 27})
    assert plans[5].gpu.bus_id == "0000:90:00.0" and plans[5].mempolicy == "preferred"


def test_uneven_split_gives_earlier_ranks_the_extra_core(tmp_path):
    """5 cores for 2 ranks on one node: rank 0 gets 3 cores, rank 1 gets 2."""
    gpus = [("0000:07:00.0", 0, None), ("0000:08:00.0", 0, None)]
    topo = discover(make_tree(tmp_path, nodes={0: "0-4"}, gpus=gpus))
    first, second = all_plans(topo, 2)
    assert (first.main_cpus, first.worker_cpus) == ({0}, {1, 2})
    assert (second.main_cpus, second.worker_cpus) == ({3}, {4})


def test_unknown_numa_node_splits_all_allowed_cpus(tmp_path):
    """GPUs on node -1: no node, no memory policy, and ranks split every allowed CPU disjointly."""
    gpus = [(f"0000:0{i}:00.0", -1, None) for i in range(4)]
    topo = discover(make_tree(tmp_path, nodes={0: "0-7", 1: "8-15"}, gpus=gpus))
    plans = all_plans(topo, 4)
    assert all(p.node is None and p.mempolicy == "none" for p in plans)
    assert [(p.main_cpus, p.worker_cpus) for p in plans] == [
        ({0}, {1, 2, 3}),
        ({4}, {5, 6, 7}),
        ({8}, {9, 10, 11}),
        ({12}, {13, 14, 15}),
    ]
    assert "no known NUMA node" in plans[0].note


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_device_has_no_node(dgx, device):
    """Without a CUDA device there is no node or memory policy, and local ranks still split all CPUs."""
    first, second = [plan(device, local_rank=r, local_world_size=2, num_workers=2, topology=dgx) for r in range(2)]
    assert (first.node, first.gpu, first.mempolicy) == (None, None, "none")
    assert first.main_cpus == {0, 16} and second.main_cpus == {8, 24}
    assert not (first.main_cpus | first.worker_cpus) & (second.main_cpus | second.worker_cpus)


@pytest.mark.parametrize("device", [5, "cuda:5", torch.device("cuda", 5)])
def test_device_forms(dgx, device):
    """An int, a "cuda:N" string and a torch.device all name cuda:N."""
    assert plan(device, num_workers=1, topology=dgx).gpu.bus_id == "0000:90:00.0"


def test_bare_cuda_without_cuda_means_index_0(dgx):
    """ "cuda" without an index is cuda:0 when torch sees no CUDA."""
    assert plan("cuda", num_workers=1, topology=dgx).gpu == dgx.gpus[0]


def test_missing_gpu_has_no_node(tmp_path):
    """A CUDA index past the last GPU plans like a CPU device, and says why."""
    topo = discover(make_tree(tmp_path, nodes={0: "0-3"}))
    result = plan("cuda:0", num_workers=1, topology=topo)
    assert (result.node, result.gpu, result.main_cpus, result.worker_cpus) == (None, None, {0}, {1, 2, 3})
    assert "cuda:0 matches no GPU" in result.note


def test_plans_never_leave_the_cgroup_cpuset(tmp_path):
    """With one core of node 1 allowed, node 1's ranks share its two CPUs and no plan leaves the cpuset."""
    root = make_tree(tmp_path, nodes=DGX_NODES, siblings=DGX_SIBLINGS, gpus=DGX_GPUS, cpuset="0-7,16-23,8,24")
    topo = discover(root)
    plans = all_plans(topo, 8)
    assert all(p.main_cpus | p.worker_cpus <= topo.allowed_cpus for p in plans)
    assert [p.worker_cpus for p in plans[4:]] == [{8}, {24}, {8}, {24}]
    assert "ranks share CPUs" in plans[4].note


def test_allowed_cpus_argument_overrides_the_topology(dgx):
    """plan(allowed_cpus=...) confines the plan to those CPUs."""
    result = plan("cuda:0", num_workers=4, allowed_cpus=cpus("2-5,18-21"), topology=dgx)
    assert (result.main_cpus, result.worker_cpus) == ({2, 18}, cpus("3-5,19-21"))


def test_node_without_allowed_cpus_falls_back_with_a_warning(dgx):
    """A GPU whose node has no allowed CPU uses the allowed CPUs elsewhere, keeps memory on its node, and warns."""
    with pytest.warns(UserWarning, match=r"node 1 of GPU 0000:90:00.0 .*0-7,16-23"):
        result = plan(
            "cuda:5", local_rank=5, local_world_size=8, num_workers=2, allowed_cpus=cpus("0-7,16-23"), topology=dgx
        )
    assert (result.node, result.mempolicy) == (1, "preferred")
    assert result.main_cpus == result.worker_cpus == {5, 21}
    assert "no allowed CPUs" in result.note and "too few CPUs" in result.note


def test_smt_pairs_are_never_split(tmp_path):
    """With SMT pairs, every rank's share and its main CPUs are whole pairs."""
    topo = discover(
        make_tree(
            tmp_path,
            nodes={0: "0-11"},
            siblings=["0,6", "1,7", "2,8", "3,9", "4,10", "5,11"],
            gpus=[(f"0000:0{i}:00.0", 0, None) for i in range(3)],
        )
    )
    plans = all_plans(topo, 3)
    assert [(p.main_cpus, p.worker_cpus) for p in plans] == [({0, 6}, {1, 7}), ({2, 8}, {3, 9}), ({4, 10}, {5, 11})]


def test_one_core_is_shared_between_main_and_workers(tmp_path):
    """A share of one SMT pair gives the main process and workers the same pair, and says so."""
    topo = discover(
        make_tree(
            tmp_path,
            nodes={0: "0-3"},
            siblings=["0,2", "1,3"],
            gpus=[("0000:07:00.0", 0, None), ("0000:08:00.0", 0, None)],
        )
    )
    first, second = all_plans(topo, 2)
    assert first.main_cpus == first.worker_cpus == {0, 2}
    assert second.main_cpus == second.worker_cpus == {1, 3}
    assert "too few CPUs to keep one for the main process" in first.note


def test_fewer_cores_than_ranks_splits_siblings(tmp_path):
    """Two SMT pairs for four ranks: each rank gets one CPU, siblings split, and the note says so."""
    gpus = [(f"0000:0{i}:00.0", 0, None) for i in range(4)]
    topo = discover(make_tree(tmp_path, nodes={0: "0-3"}, siblings=["0,2", "1,3"], gpus=gpus))
    plans = all_plans(topo, 4)
    assert [p.worker_cpus for p in plans] == [{0}, {1}, {2}, {3}]
    assert "SMT siblings are split" in plans[0].note


def test_device_other_than_local_rank_takes_the_whole_node(dgx):
    """When a rank's device is not cuda:local_rank, other ranks' GPUs are unknown and it takes its whole node."""
    result = plan("cuda:0", local_rank=1, local_world_size=2, num_workers=2, topology=dgx)
    assert result.main_cpus | result.worker_cpus == dgx.nodes[0].cpus
    assert "other local ranks' GPUs are unknown" in result.note


def test_num_workers_only_informs_the_note(tmp_path):
    """More workers than CPUs leaves the sets as they are and says how many share them."""
    topo = discover(make_tree(tmp_path, nodes={0: "0-3"}, gpus=[("0000:07:00.0", 0, None)]))
    result = plan(0, num_workers=16, topology=topo)
    assert result.worker_cpus == {1, 2, 3} and "16 workers on 3 CPUs" in result.note


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"local_rank": 2, "local_world_size": 2}, "local_rank must be in range"),
        ({"local_rank": -1}, "local_rank must be in range"),
        ({"local_world_size": 0}, "local_world_size must be at least 1"),
        ({"num_workers": -1}, "num_workers must be >= 0"),
    ],
)
def test_bad_arguments_raise(dgx, kwargs, message):
    """A rank outside the local world, an empty world or negative workers is a ValueError naming the problem."""
    kwargs = {"num_workers": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan("cuda:0", topology=dgx, **kwargs)


def test_plan_has_no_side_effects(dgx):
    """Planning leaves this process's affinity alone and raises no warnings in the normal case."""
    before = os.sched_getaffinity(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        all_plans(dgx, 8)
    assert os.sched_getaffinity(0) == before


# ---------------------------------------------------------------------------------------------------------------------
# cpulists and reports


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", set()),
        ("\n", set()),
        ("5", {5}),
        ("0-3,8-11", {0, 1, 2, 3, 8, 9, 10, 11}),
        (" 0 - 2 , 7\n", {0, 1, 2, 7}),
        ("3,1,3", {1, 3}),
        ("0-0", {0}),
    ],
)
def test_parse_cpulist(text, expected):
    """Kernel cpulists parse with ranges, repeats, blanks and surrounding whitespace."""
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "0x3", "-2"])
def test_parse_cpulist_rejects_garbage(text):
    """A part that is not a number or an ascending range is a ValueError."""
    with pytest.raises(ValueError):
        parse_cpulist(text)


def test_format_cpus_is_compact_and_round_trips():
    """format_cpus writes runs as ranges and parses back to the same set."""
    assert format_cpus({8, 0, 1, 2, 3, 10, 11}) == "0-3,8,10-11"
    assert format_cpus(()) == ""
    assert parse_cpulist(format_cpus(cpus("0-3,8,10-11"))) == cpus("0-3,8,10-11")


def test_describe_is_json(dgx):
    """describe() gives plain JSON with compact cpulists, GPUs in bus order and the plan."""
    result = plan("cuda:5", local_rank=5, local_world_size=8, num_workers=4, topology=dgx)
    report = json.loads(json.dumps(describe(dgx, result)))
    assert report["nodes"][0] == {"id": 0, "cpus": "0-7,16-23", "mem_total_kb": 1048576, "distances": [10, 20]}
    assert report["gpus"][5] == {
        "bus_id": "0000:90:00.0",
        "numa_node": 1,
        "local_cpus": "8-15,24-31",
        "name": None,
        "uuid": None,
    }
    assert (report["cores"], report["threads_per_core"], report["allowed_cpus"]) == (16, 2, "0-31")
    assert report["plan"]["main_cpus"] == "10,26" and report["plan"]["gpu"] == "0000:90:00.0"
    assert "plan" not in describe(dgx)


def test_a_chosen_node_overrides_the_gpus_and_is_split_between_ranks(dgx):
    """node=1 (DataLoader(numa=1)) puts every local rank on node 1, with disjoint whole-core shares."""
    first, second = all_plans(dgx, 2, node=1)
    assert (first.node, first.main_cpus, first.worker_cpus) == (1, {8, 24}, cpus("9-11,25-27"))
    assert (second.node, second.main_cpus, second.worker_cpus) == (1, {12, 28}, cpus("13-15,29-31"))
    assert "asked for" in first.note
    with pytest.raises(ValueError, match=r"NUMA node 7 does not exist here; the nodes are \[0, 1\]"):
        plan("cuda:0", num_workers=1, topology=dgx, node=7)


def test_unknown_numa_node_on_a_one_node_machine_is_that_node(tmp_path):
    """A GPU reporting node -1 on a machine with a single node (as VMs do) is placed on that node."""
    topo = discover(make_tree(tmp_path, nodes={0: "0-3"}, gpus=[("0000:07:00.0", -1, None)]))
    result = plan("cuda:0", num_workers=2, topology=topo)
    assert (result.node, result.mempolicy, result.main_cpus, result.worker_cpus) == (0, "preferred", {0}, {1, 2, 3})
