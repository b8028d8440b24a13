"""The doctor's verdict on recorded fake timelines: each bottleneck, including those only a GPU shows."""

from __future__ import annotations

import json

import pytest

from fastfeed.doctor import diagnose
from fastfeed.doctor.report import Report
from fastfeed.doctor.timeline import Timeline

from _timelines import make

pytestmark = pytest.mark.fastfeed_only

N = 200


def test_cpu_bound_workers_on_busy_cores_are_input_cpu_and_get_no_more_workers():
    """Workers busy computing with every core busy: input/cpu, and no advice to add local workers."""
    tl = make([0.010] * N, [0.010] * N, worker_s=0.040, worker_cpu=0.95, samples={"cpu_busy": 0.98, "main_cpu": 0.1})
    v = diagnose(tl)
    assert (v.bottleneck, v.cause, v.severity) == ("input", "cpu", "highly")
    settings = [a["setting"] for a in v.advice if a["setting"]]
    assert not [s for s in settings if "num_workers" in s and "worker_type" not in s]  # Ray's: test_doctor_ray.py
    assert "no core" in v.advice[0]["why"]


def test_too_few_workers_on_idle_cores_is_input_workers_with_a_predicted_gain():
    """One CPU-bound worker and a core idle: input/workers, advising more workers with the gain they would give."""
    tl = make([0.016] * N, [0.008] * N, num_workers=1, worker_s=0.024, worker_cpu=0.95,
              samples={"cpu_busy": 0.55, "main_cpu": 0.05})  # fmt: skip
    v = diagnose(tl)
    assert (v.bottleneck, v.cause) == ("input", "workers")
    first = v.advice[0]
    assert first["setting"] == {"num_workers": 2}
    assert first["predicted_gain"] > 1.3


def test_iowait_makes_it_input_io():
    """Input-bound with high iowait: input/io."""
    tl = make([0.02] * N, [0.01] * N, worker_s=0.06, worker_cpu=0.9, samples={"cpu_busy": 0.3, "iowait": 0.4})
    assert diagnose(tl).cause == "io"


def test_workers_busy_without_using_a_cpu_are_blocked_in_reads():
    """Workers busy all the time while using a tenth of a core: blocked, so input/io, advising more of them."""
    tl = make([0.02] * N, [0.01] * N, num_workers=1, worker_s=0.03, worker_cpu=0.1,
              samples={"cpu_busy": 0.1, "iowait": 0.0})  # fmt: skip
    v = diagnose(tl)
    assert (v.bottleneck, v.cause) == ("input", "io")
    assert v.advice[0]["setting"]["num_workers"] > 2  # not capped at the cores: they wait, not compute
    assert "prefetch(indices)" in v.advice[1]["change"]
    tl.loaders[0].prefetch = True  # a dataset that reads ahead already is not told to
    assert not any("prefetch(indices)" in a["change"] for a in diagnose(tl).advice)


def test_workers_short_of_a_core_on_busy_cores_are_input_cpu_not_blocked_in_reads():
    """8 CPU-bound workers on 2 busy cores use a quarter core each while always busy: waiting for a core, input/cpu."""
    tl = make([0.010] * N, [0.010] * N, num_workers=8, worker_s=0.16, worker_cpu=0.25,
              samples={"cpu_busy": 0.99, "main_cpu": 0.1, "iowait": 0.0})  # fmt: skip
    assert diagnose(tl).cause == "cpu"


def test_a_slow_step_is_compute():
    """Waits under 5% of the loop: not input-bound; with no GPU to look at, compute."""
    tl = make([0.0002] * N, [0.02] * N, worker_s=0.005, worker_cpu=0.5, samples={"cpu_busy": 0.3})
    v = diagnose(tl)
    assert (v.bottleneck, v.cause, v.severity) == ("compute", None, "not")
    assert not any(a["setting"] for a in v.advice)


@pytest.mark.parametrize("stall, severity", [(0.049, "not"), (0.051, "moderately"), (0.199, "moderately"),
                                             (0.201, "highly")])  # fmt: skip
def test_severity_follows_tensorboards_thresholds(stall, severity):
    """Highly input-bound from 20% of the loop waiting, moderately from 5%."""
    tl = make([stall * 0.01] * N, [(1 - stall) * 0.01] * N, samples={"cpu_busy": 0.5})
    assert diagnose(tl).severity == severity


def test_gpu_idle_with_no_input_wait_and_an_idle_host_is_host_sync():
    """No input wait, the GPU a third busy and the host thread mostly idle: host syncs (.item() every step)."""
    tl = make([0.0001] * N, [0.01] * N, gpu=True, samples={"gpu_util": 0.3, "main_cpu": 0.2, "cpu_busy": 0.2})
    v = diagnose(tl)
    assert v.bottleneck == "host_sync"
    assert ".item()" in v.advice[0]["change"]


def test_gpu_idle_with_a_busy_host_thread_is_launch_bound():
    """No input wait, the GPU a third busy and the host thread always busy: launch overhead."""
    tl = make([0.0001] * N, [0.002] * N, gpu=True, samples={"gpu_util": 0.3, "main_cpu": 0.97, "cpu_busy": 0.6})
    assert diagnose(tl).bottleneck == "launch"


def test_busy_gpu_with_no_input_wait_is_compute():
    """The GPU busy and no wait: compute."""
    tl = make([0.0001] * N, [0.01] * N, gpu=True, samples={"gpu_util": 0.95, "main_cpu": 0.3})
    assert diagnose(tl).bottleneck == "compute"


def test_waits_spent_copying_to_the_device_are_transfer():
    """Host-to-device copies as long as most of the wait: input/transfer, advising pinned memory or the device stage."""
    tl = make([0.010] * N, [0.01] * N, gpu=True, h2d=0.008, worker_s=0.01, worker_cpu=0.9,
              samples={"gpu_util": 0.5, "cpu_busy": 0.4})  # fmt: skip
    v = diagnose(tl)
    assert (v.bottleneck, v.cause) == ("input", "transfer")
    assert "pin_memory" in v.advice[-1]["change"]


def test_workers_off_the_gpus_node_are_numa():
    """A placement with workers off the GPU's node: input/numa."""
    tl = make([0.01] * N, [0.01] * N, gpu=True, placement={"off_node": True}, samples={"cpu_busy": 0.4})
    assert diagnose(tl).cause == "numa"


def test_stalls_every_num_workers_batches_are_reported_as_bursts():
    """Stalls every 4th batch with 4 workers: periodic, period 4, the workers finishing together."""
    waits = [0.02 if i % 4 == 0 else 0.0001 for i in range(N)]
    tl = make(waits, [0.01] * N, num_workers=4, worker_s=0.05, worker_cpu=0.9, cpus=8, samples={"cpu_busy": 0.5})
    v = diagnose(tl)
    assert v.periodic["period"] == 4 and v.periodic["bursts"]
    assert any(a["setting"] == {"prefetch_factor": 4} for a in v.advice)


def test_gpu_dips_are_tied_to_the_stalls_that_explain_them():
    """GPU utilisation dips while the loop waits: each dip is matched to the overlapping stall."""
    waits = [0.05 if i % 10 == 0 else 0.0001 for i in range(N)]
    steps = [0.01] * N
    tl = make(waits, steps, gpu=True, worker_s=0.02, worker_cpu=0.9, samples={"cpu_busy": 0.4})
    ev_ends = [(a, r) for a, r in zip(tl.loaders[0].epochs[0].asks, tl.loaders[0].epochs[0].returns)]
    for s in tl.samples:
        stalled = any(a < s["t"] and r > s["t"] - 0.1 and r - a > 0.01 for a, r in ev_ends)
        s["gpu_util"] = 0.1 if stalled else 0.9
    d = diagnose(tl).dips
    assert d["dips"] > 5 and d["explained"] == d["dips"]


def test_each_epochs_slow_start_advises_persistent_workers():
    """Epochs that each wait long for their first batch, and little after: persistent_workers=True."""
    tl = make([0.0005] * 40, [0.01] * 40, first_wait=0.3, epochs=4, worker_s=0.01, worker_cpu=0.9,
              samples={"cpu_busy": 0.4})  # fmt: skip
    v = diagnose(tl)
    assert v.bottleneck == "input"
    assert v.advice[0]["setting"] == {"persistent_workers": True}
    assert v.advice[0]["predicted_gain"] > 1.2


def test_six_questions_are_answered_with_numbers():
    """Each of the six questions about a stalling loop gets a number."""
    waits = [0.02 if i % 3 == 0 else 0.001 for i in range(N)]
    tl = make(waits, [0.01 + 0.001 * (i % 5) for i in range(N)], worker_s=0.02, worker_cpu=0.9, gpu=True,
              samples=lambda t: {"cpu_busy": 0.5, "gpu_util": 0.5 + 0.4 * ((int(t * 10) % 3) == 0)})  # fmt: skip
    qs = diagnose(tl).questions
    assert len(qs) == 6
    assert all(isinstance(q["value"], float) for q in qs), qs


def test_the_report_is_json_with_the_documented_keys_and_the_timeline_round_trips():
    """report.json has the schema's top-level keys; a timeline survives to_dict/from_dict."""
    tl = make([0.01] * N, [0.01] * N, worker_s=0.02, worker_cpu=0.9, samples={"cpu_busy": 0.5})
    again = Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))
    assert again == tl
    report = Report(timeline=tl, command=["test"])
    d = json.loads(json.dumps(report.to_dict()))
    for key in ("verdict", "stall_fraction", "steps", "questions", "advice", "whatif", "system", "workers"):
        assert key in d
    assert set(d["verdict"]) >= {"bottleneck", "cause", "severity"}
    assert report.summary().splitlines()[0] == d["verdict"]["line"]
    assert d["verdict"]["line"].startswith("verdict: ")


def test_placement_counts_workers_on_off_and_across_the_gpus_node():
    """Workers allowed only on the GPU's node, only off it, or across nodes are counted apart; one node: None."""
    from fastfeed.doctor.watch import placement
    from fastfeed.topology import Gpu, Node, Topology

    nodes = {0: Node(0, frozenset({0, 1}), None, ()), 1: Node(1, frozenset({2, 3}), None, ())}
    topo = Topology(nodes, (Gpu("0000:3b:00.0", 1, frozenset({2, 3})),), frozenset(range(4)), {}, "sysfs")
    got = placement(topo, 0, [frozenset({2, 3}), frozenset({0}), frozenset({0, 1, 2, 3})])
    assert got == {"gpu_node": 1, "on_node": 1, "off_node": 1, "across_nodes": 1}
    one = Topology({0: nodes[0]}, (Gpu("0000:3b:00.0", 0, frozenset({0, 1})),), frozenset({0, 1}), {}, "sysfs")
    assert placement(one, 0, [frozenset({0})]) is None
