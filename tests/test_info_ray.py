"""`fastfeed info` and Ray: its version, a connected cluster's nodes, CPUs and custom resources, and a bounded probe
for one."""

from __future__ import annotations

import json
import sys
import types

import pytest

import fastfeed._workers.ray
from fastfeed import info

pytestmark = pytest.mark.fastfeed_only

SUMMARY = {"nodes": [{"node_id": "a1b2c3d4e5f6a7b8", "address": "127.0.0.1", "cpus": 0.0, "alive": True},
                     {"node_id": "0f0e0d0c0b0a0908", "address": "127.0.0.1", "cpus": 4.0, "alive": True},
                     {"node_id": "99887766554433", "address": "127.0.0.1", "cpus": 2.0, "alive": False}],
           "cpus": 4.0}  # fmt: skip


@pytest.fixture
def ray_installed(monkeypatch):
    """Ray 9.9.9 appears installed, whatever this environment has."""
    real = info._package
    monkeypatch.setattr(info, "_package", lambda module, dist: "9.9.9" if module == "ray" else real(module, dist))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_without_ray_info_says_how_to_install_it(monkeypatch):
    """No ray package: info reports it not installed, naming the extra, and probes nothing."""
    real = info._package
    monkeypatch.setattr(info, "_package", lambda module, dist: None if module == "ray" else real(module, dist))
    monkeypatch.setattr(info.subprocess, "run", lambda *a, **k: pytest.fail("probed a cluster without Ray"))
    ray = info._ray()
    assert ray == {"version": None, "cluster": None, "status": "not installed (pip install 'fastfeed[ray]')"}
    assert info._render_ray(ray) == ["ray: not installed (pip install 'fastfeed[ray]')"]


def test_a_connected_process_shows_the_clusters_nodes_and_cpus(ray_installed, monkeypatch):
    """ray.is_initialized() here: the cluster summary is read in this process and rendered node by node."""
    fake_ray = types.SimpleNamespace(is_initialized=lambda: True)
    connect = types.ModuleType("fastfeed._workers.ray.connect")
    connect.cluster_summary = lambda: SUMMARY
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setitem(sys.modules, "fastfeed._workers.ray.connect", connect)
    monkeypatch.setattr(fastfeed._workers.ray, "connect", connect, raising=False)
    monkeypatch.setattr(info.subprocess, "run", lambda *a, **k: pytest.fail("probed though connected"))
    ray = info._ray()
    assert ray["cluster"] == SUMMARY and ray["status"] == "connected (this process)"
    lines = info._render_ray(ray)
    assert lines[0] == "ray 9.9.9: connected (this process), 2 node(s) alive of 3, 4 CPUs"
    assert lines[2] == "  ray node 0f0e0d0c0b0a 127.0.0.1: 4 CPUs" and lines[3].endswith("(dead)")


def test_each_nodes_custom_resources_and_gpus_are_listed(ray_installed, monkeypatch):
    """The resources ray_options names (a node label such as preprocess, GPUs) are listed per node and for the
    cluster, after its CPUs: what a user checks an actor's options against."""
    summary = {"nodes": [{"node_id": "a1b2c3d4e5f6a7b8", "address": "10.0.0.1", "cpus": 0.0, "resources": {},
                          "alive": True},
                         {"node_id": "0f0e0d0c0b0a0908", "address": "10.0.0.2", "cpus": 32.0,
                          "resources": {"GPU": 1.0, "preprocess": 32.0}, "alive": True}],
               "cpus": 32.0, "resources": {"GPU": 1.0, "preprocess": 32.0}}  # fmt: skip
    lines = info._render_ray({"version": "9.9.9", "cluster": summary, "status": "connected (this process)"})
    assert lines == ["ray 9.9.9: connected (this process), 2 node(s) alive of 2, 32 CPUs, GPU 1, preprocess 32",
                     "  ray node a1b2c3d4e5f6 10.0.0.1: 0 CPUs",
                     "  ray node 0f0e0d0c0b0a 10.0.0.2: 32 CPUs, GPU 1, preprocess 32"]  # fmt: skip


def test_the_summary_lists_custom_resources_and_leaves_out_bytes_and_address_labels(monkeypatch):
    """ray_connect's summary, from ray.nodes() as Ray gives them: each node's custom resources and GPUs, summed over
    the alive nodes; not its memory and object store (bytes) or its node:<address> label."""
    nodes = [{"NodeID": "aa", "NodeManagerAddress": "10.0.0.1", "Alive": True,
              "Resources": {"CPU": 8.0, "preprocess": 8.0, "memory": 3e10, "object_store_memory": 1e10,
                            "node:10.0.0.1": 1.0, "node:__internal_head__": 1.0}},
             {"NodeID": "bb", "NodeManagerAddress": "10.0.0.2", "Alive": True,
              "Resources": {"CPU": 4.0, "preprocess": 4.0, "GPU": 2.0, "accelerator_type:A100": 1.0}},
             {"NodeID": "cc", "NodeManagerAddress": "10.0.0.3", "Alive": False,
              "Resources": {"CPU": 4.0, "preprocess": 100.0}}]  # fmt: skip
    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, nodes=lambda: nodes)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    from fastfeed._workers.ray import connect as ray_connect

    summary = ray_connect.cluster_summary()
    assert [n["resources"] for n in summary["nodes"]] == [
        {"preprocess": 8.0}, {"GPU": 2.0, "accelerator_type:A100": 1.0, "preprocess": 4.0}, {"preprocess": 100.0}]
    assert summary["cpus"] == 12.0
    assert summary["resources"] == {"GPU": 2.0, "accelerator_type:A100": 1.0, "preprocess": 12.0}


def test_the_probe_reads_a_running_clusters_summary_from_a_child(ray_installed, monkeypatch):
    """Not connected here: a child process's summary of the cluster at RAY_ADDRESS is what info shows."""
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    monkeypatch.setattr(info, "_RAY_PROBE", f"import json; print(json.dumps({{'cluster': {SUMMARY!r}}}))")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    ray = info._ray()
    assert ray["cluster"] == SUMMARY and ray["status"] == "running at RAY_ADDRESS=127.0.0.1:6379"


def test_no_cluster_is_a_state_with_the_reason(ray_installed, monkeypatch):
    """The child's connection error becomes the status; info still renders."""
    probe = "import json; print(json.dumps({'error': 'RuntimeError: ray start --head'}))"
    monkeypatch.setattr(info, "_RAY_PROBE", probe)
    monkeypatch.setattr(info, "_gcs_running", lambda: True)
    ray = info._ray()
    assert ray["cluster"] is None and "no cluster connected" in ray["status"] and "ray start --head" in ray["status"]
    assert info._render_ray(ray) == [f"ray 9.9.9: {ray['status']}"]
    json.dumps(ray)


def test_a_probe_that_hangs_is_cut_off(ray_installed, monkeypatch):
    """A cluster address that never answers costs at most the probe's time limit."""
    monkeypatch.setattr(info, "_RAY_PROBE", "import time; time.sleep(60)")
    monkeypatch.setattr(info, "_gcs_running", lambda: True)
    ray = info._ray(timeout_s=1.5)
    # "no answer ... within 2 s" is said only when subprocess.run gave up on the child at timeout_s (TimeoutExpired):
    # the 60 s sleep was cut off at the limit, not waited for. A load-proof measure, where a time taken is not.
    assert ray["cluster"] is None and "no answer" in ray["status"] and "within 2 s" in ray["status"]


def test_with_no_head_here_and_no_address_info_asks_no_child(ray_installed, monkeypatch):
    """No Ray head process on this machine and no RAY_ADDRESS: the status says so at once, without a probe."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(info, "_gcs_running", lambda: False)

    def no_child(*args, **kwargs):
        raise AssertionError("no probe should run")

    monkeypatch.setattr(info.subprocess, "run", no_child)
    ray = info._ray()
    assert ray["cluster"] is None and ray["status"] == "no cluster running on this machine, and RAY_ADDRESS is not set"


def test_only_a_ray_start_head_counts_as_a_cluster_the_doctors_advice_may_join(monkeypatch, tmp_path):
    """A gcs_server of a cluster some process started for itself (a test's, a script's ray.init()) is no cluster to
    advise: it ends with that process, and Ray actors on it with it. `ray start --head` leaves its address file."""
    from fastfeed.doctor import verdict

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(info, "_gcs_running", lambda: True)
    assert not info._ray_started() and not verdict.ray_cluster_reachable()
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")
    assert info._ray_started() and verdict.ray_cluster_reachable()
    monkeypatch.setattr(info, "_gcs_running", lambda: False)  # the file of a head since stopped
    assert not verdict.ray_cluster_reachable()
