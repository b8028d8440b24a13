"""The doctor, the tuner and `fastfeed info` on a local Ray cluster: Ray actors advised for an input/cpu loop deliver
the gain predicted; a mixed setting is measured; the cluster's nodes and CPUs are shown. One cluster per module."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import _leaks
from _load import OthersLoad, load_stretch, skip_unless_idle

ray = pytest.importorskip("ray")

import fastfeed  # noqa: E402
from fastfeed import info  # noqa: E402
from fastfeed.doctor import cli as doctor_cli  # noqa: E402
from fastfeed.tuning import measure  # noqa: E402
from fastfeed.tuning.result import Setting  # noqa: E402

_ray = pytest.importorskip("_ray", reason="tests/_ray.py, the local test cluster, comes with worker_type='ray'")
local_cluster, wait_no_actors = _ray.local_cluster, _ray.wait_no_actors
patient_starts = _ray.patient_starts  # an autouse fixture: this module's loaders wait for slow actor starts

pytestmark = [pytest.mark.fastfeed_only, pytest.mark.hang_limit(120)]

# How long the cluster may take to count killed actors dead on a machine busy with other work (the wait ends as soon
# as none is left).
GONE_S = 60.0


# The gain the closing run measures is the actors' capacity added to what the local workers' two cores give: other
# processes on those cores while it runs change it, so the gain is checked only when they left this much of them.
IDLE_CORES = 1.75
NODE_CPUS = (2, 2)  # with the head's none, above this machine's free cores: the actors sleep, needing none

# Each sample costs COST_S: spun on this machine's CPU in a local worker process, slept in a Ray actor, standing
# for a CPU of another machine. Two local workers saturate two cores (input/cpu); actors add capacity.
SCRIPT = textwrap.dedent('''
    import sys
    import time

    import torch
    from torch.utils.data import Dataset

    import fastfeed

    COST_S, STEP_S, BATCH = 0.020, 0.040, 8


    def remote():
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


    class Decode(Dataset):
        def __len__(self):
            return 4096

        def __getitem__(self, i):
            if remote():
                time.sleep(COST_S)
            else:
                end = time.perf_counter() + COST_S
                while time.perf_counter() < end:
                    pass
            return torch.full((64,), float(i))


    loader = fastfeed.DataLoader(Decode(), batch_size=BATCH, num_workers=2, persistent_workers=True)
    for epoch in range(10):
        for batch in loader:
            time.sleep(STEP_S)  # the GPU step: the host waits
''')


@pytest.fixture(scope="module")
def cluster():
    before = _leaks.children()
    with local_cluster(nodes=NODE_CPUS) as (c, nodes):
        # Warm up: Ray's driver state and its connections to each node open here, not inside a test whose
        # descriptor check would count them (an actor on each node).
        loader = fastfeed.DataLoader(torch.arange(64).float(), batch_size=8, num_workers=len(NODE_CPUS),
                                     worker_type="ray", ray_options={"scheduling_strategy": "SPREAD"})  # fmt: skip
        for _ in loader:
            pass
        del loader
        gc.collect()
        wait_no_actors()
        yield c
    gc.collect()
    assert _leaks.wait_for_no_leaks(_leaks.Snapshot(before, _leaks.open_fds(), _leaks.shm_segments()), 10) == []


def test_input_cpu_is_advised_ray_actors_and_the_rerun_gives_the_predicted_gain(cluster, tmp_path):
    """Two local workers on two busy cores: the doctor advises (2, R) from t and the step rate, and the re-run with
    R actors measures at least 0.8x the gain it predicted."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with OthersLoad() as others:
        report = doctor_cli.examine(str(script), [], steps=48)
    d = report.to_dict()
    skip_unless_idle(others, IDLE_CORES, d)
    assert (d["verdict"]["bottleneck"], d["verdict"]["cause"]) == ("input", "cpu"), (d["verdict"], d["system"])
    [advice] = [a for a in d["advice"] if a["setting"] and "worker_type" in a["setting"]]
    local, remote = advice["setting"]["num_workers"]
    assert local == 2 and remote >= 1 and advice["setting"]["worker_type"] == ("process", "ray")
    closing = d["whatif"]["closing"]
    assert closing["setting"] == advice["setting"], d["whatif"]
    assert closing["gain"] >= 0.8 * advice["predicted_gain"], (closing, advice)
    assert closing["predicted_gain"] > 1.3  # a gain worth checking: the actors must add capacity


def test_info_shows_the_connected_clusters_nodes_and_cpus(cluster):
    """In a connected process and from `fastfeed info` (through RAY_ADDRESS), the head and both nodes with CPUs."""
    here = info._ray()
    address = cluster.address
    proc = subprocess.run([sys.executable, "-m", "fastfeed", "info", "--json"], capture_output=True, text=True,
                          env=dict(os.environ, RAY_ADDRESS=address), timeout=90, check=False)  # fmt: skip
    assert here["version"] == ray.__version__ and here["status"] == "connected (this process)"
    assert len(here["cluster"]["nodes"]) == 1 + len(NODE_CPUS) and here["cluster"]["cpus"] == sum(NODE_CPUS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = json.loads(proc.stdout)["ray"]
    assert shown["status"] == f"running at RAY_ADDRESS={address}", shown
    assert shown["cluster"]["cpus"] == sum(NODE_CPUS) and len(shown["cluster"]["nodes"]) == 1 + len(NODE_CPUS)


def test_the_tuner_measures_a_mixed_setting_on_the_cluster(cluster):
    """A remote Setting runs as a ("process", "ray") loader of local + remote workers, measured, then stopped."""
    setting = Setting("process", 1, 2, 2)
    # The deadline bounds the whole trial, the two actors' start included (a process importing torch each): 60 s on
    # an idle machine, more on a busy one; the trial ends as soon as it has measured.
    trial = measure.run(fastfeed.DataLoader, torch.arange(256).float(), {"batch_size": 8}, setting, None,
                        tolerance=0.5, deadline=time.monotonic() + 60 * load_stretch(), window_s=0.2)  # fmt: skip
    assert trial.windows and trial.median > 0 and trial.load_s is not None
    assert wait_no_actors(GONE_S) == []


def test_a_watched_mixed_loader_is_recorded_with_its_split_and_local_processes(cluster):
    """Under a watch, a (1, 2) loader is recorded as process+ray with 3 workers, split [1, 2], and its one process."""
    from fastfeed import doctor

    loader = fastfeed.DataLoader(torch.arange(96).float(), batch_size=8, worker_type=("process", "ray"),
                                 num_workers=(1, 2))  # fmt: skip
    with doctor.watch() as report:
        for _ in loader:
            pass
    rec = report.timeline.primary()
    assert (rec.worker_type, rec.num_workers, rec.worker_split) == ("process+ray", 3, [1, 2])
    assert len(rec.epochs[0].pids) == 1 and len(rec.epochs[0].workers) == 3
    del loader, report
    gc.collect()
    assert wait_no_actors(GONE_S) == []
