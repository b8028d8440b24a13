"""Placement applied on this machine: worker CPUs and memory policy, ring binding, torchrun, `fastfeed info`."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.utils.data as tud

import _sysfs

pytestmark = pytest.mark.fastfeed_only

import fastfeed  # noqa: E402
from fastfeed._native import C  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


class WhereAmI(tud.Dataset):
    """Each item says on which CPUs, and under which memory policy, the worker that made it runs."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        mode, nodes = C.numa_policy()
        return {"cpus": sorted(os.sched_getaffinity(0)), "mode": mode, "nodes": nodes}


def where(loader):
    seen = set()
    for batch in loader:
        for cpus, mode, nodes in zip(batch["cpus"], batch["mode"], batch["nodes"]):
            seen.add((tuple(cpus), mode, tuple(nodes)))
    return seen


def batch_of_lists(batch):
    return {"cpus": [b["cpus"] for b in batch], "mode": [b["mode"] for b in batch],
            "nodes": [b["nodes"] for b in batch]}  # fmt: skip


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_numa_node_places_workers_on_the_plans_cpus_preferring_its_memory(worker_type):
    """numa=0: every worker runs on exactly the plan's worker CPUs with memory policy 'preferred node 0'."""
    main_before = os.sched_getaffinity(0)
    loader = fastfeed.DataLoader(WhereAmI(), batch_size=2, num_workers=2, numa=0, worker_type=worker_type,
                                 collate_fn=batch_of_lists)  # fmt: skip
    seen = where(loader)
    plan = loader.numa_plan
    assert plan is not None and plan.node == 0 and plan.worker_cpus
    assert seen == {(tuple(sorted(plan.worker_cpus)), 1, (0,))}, (seen, plan)
    assert os.sched_getaffinity(0) == main_before and C.numa_policy() == (0, [])  # the training loop is untouched


def test_ring_memory_is_bound_to_the_node():
    """With numa=0 the ring's segments are created bound to node 0 (before they are touched)."""
    loader = fastfeed.DataLoader(tud.TensorDataset(torch.zeros(64, 1024)), batch_size=8, num_workers=2, numa=0)
    it = iter(loader)
    for _ in range(6):
        next(it)
    segments = [s.segment for s in it._ring._slots]  # adopted from workers, and made by the ring
    assert segments and all(C.numa_policy(s.address) == (1, [0]) for s in segments)


def test_numa_off_and_auto_without_cuda_place_nothing():
    """numa='off', and numa='auto' with no CUDA device targeted, leave workers on the main process's CPUs."""
    for numa in ("off", "auto"):
        loader = fastfeed.DataLoader(WhereAmI(), batch_size=2, num_workers=2, numa=numa, collate_fn=batch_of_lists)
        assert where(loader) == {(tuple(sorted(os.sched_getaffinity(0))), 0, ())}
        assert loader.numa_plan is None


@pytest.mark.parametrize(
    ("numa", "match"),
    [
        ("yes", "numa must be 'auto', 'off' or a NUMA node number"),
        (-1, "numa must be"),
        (63, r"numa=63: this machine's NUMA nodes are \["),
    ],
)
def test_bad_numa_values_are_clear_errors(numa, match):
    """An unknown numa value, or a node this machine lacks, is a ValueError at construction."""
    with pytest.raises(ValueError, match=match):
        fastfeed.DataLoader(WhereAmI(), numa=numa)


TORCHRUN_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
import torch.utils.data as tud
sys.path.insert(0, {tests!r})
import fastfeed
from fastfeed._native import C

class Items(tud.Dataset):
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return {{"i": i, "cpus": sorted(os.sched_getaffinity(0))}}

def collate(batch):
    return {{"i": [b["i"] for b in batch], "cpus": [b["cpus"] for b in batch]}}

dist.init_process_group("gloo")
rank = dist.get_rank()
sampler = tud.distributed.DistributedSampler(Items(), shuffle=True, seed=5)
loader = fastfeed.DataLoader(Items(), batch_size=4, sampler=sampler, num_workers=2, numa=0, collate_fn=collate)
epochs, cpus = [], set()
for epoch in range(2):
    sampler.set_epoch(epoch)
    order = []
    for batch in loader:
        order += batch["i"]
        cpus.update(c for cs in batch["cpus"] for c in cs)
    epochs.append(order)
out = [None] * dist.get_world_size()
dist.all_gather_object(out, {{"rank": rank, "epochs": epochs, "cpus": sorted(cpus),
                              "plan_workers": sorted(loader.numa_plan.worker_cpus)}})
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.hang_limit(180)
def test_torchrun_two_ranks_see_disjoint_samples_and_cpus(tmp_path):
    """torchrun --nproc_per_node 2 (gloo): ranks cover the dataset disjointly, set_epoch reshuffles,
    and the two ranks' workers run on disjoint CPUs."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to split between 2 ranks")
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT.format(tests=TESTS_DIR)))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True, text=True, timeout=150, check=False, cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    for epoch in range(2):
        a, b = (set(r["epochs"][epoch]) for r in ranks)
        assert not a & b and a | b == set(range(40)), epoch
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # set_epoch reshuffled
    assert set(ranks[0]["cpus"]).isdisjoint(ranks[1]["cpus"]), ranks
    assert all(r["cpus"] == r["plan_workers"] for r in ranks), ranks


def run_info(*args, **env):
    proc = subprocess.run([sys.executable, "-m", "fastfeed", "info", *args], capture_output=True, text=True,
                          timeout=60, check=False, env=dict(os.environ, **env), cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_fastfeed_info_describes_this_machine():
    """`fastfeed info` prints the CPUs, nodes, plan and availability; --json gives the same as JSON."""
    text = run_info()
    assert "CPUs allowed:" in text and "node 0:" in text and "plan for local rank 0 of 1" in text
    assert "shared memory /dev/shm:" in text
    report = json.loads(run_info("--json"))
    assert report["topology"]["nodes"] and "plan" in report["topology"]
    assert set(report["available"]) == {"nvml", "pinning", "dali", "kvikio"}
    expected = "posix" if not __import__("torch").cuda.is_available() else report["reader"]["auto"]
    assert report["reader"]["auto"] == expected and f"reader='auto' for ArrayFiles on a GPU: {expected}" in text


def test_fastfeed_info_on_a_fake_dgx_plans_for_its_local_rank(tmp_path):
    """With FASTFEED_SYSFS_ROOT at a 2-socket, 8-GPU tree and LOCAL_RANK=5 of 8, the plan is on GPU 5's node."""
    gpus = [(f"0000:{b:02x}:00.0", 0 if k < 4 else 1, "0-15" if k < 4 else "16-31")
            for k, b in enumerate((0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD))]  # fmt: skip
    root = _sysfs.make_tree(tmp_path, nodes={0: "0-15", 1: "16-31"}, gpus=gpus, cpuset="0-31")
    report = json.loads(run_info("--json", FASTFEED_SYSFS_ROOT=root, LOCAL_RANK="5", LOCAL_WORLD_SIZE="8"))
    plan = report["topology"]["plan"]
    assert len(report["topology"]["gpus"]) == 8 and plan["gpu"] == "0000:90:00.0" and plan["node"] == 1
    assert plan["local_rank"] == 5
