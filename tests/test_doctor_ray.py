"""The doctor and Ray workers: remote workers advised for input/cpu, re-runs that apply them, mixed loaders recorded."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

from fastfeed.doctor import diagnose, hooks, verdict, whatif
from fastfeed.doctor.report import Report
from fastfeed.doctor.timeline import Timeline
from fastfeed.loader import DataLoader as FastLoader

from _timelines import make

pytestmark = pytest.mark.fastfeed_only

N = 200
CPU_BOUND = dict(worker_s=0.040, worker_cpu=0.95, samples={"cpu_busy": 0.98, "main_cpu": 0.1})


class Numbers(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.tensor([i])


@pytest.fixture
def ray_here(monkeypatch):
    """The doctor sees Ray as installed, whether or not this environment has it (advice needs no cluster)."""
    monkeypatch.setattr(verdict, "ray_installed", lambda: True)


def _remote(v):
    return [a for a in v.advice if a["setting"] and "worker_type" in a["setting"]
            or "ray" in a["change"]]  # fmt: skip


def test_input_cpu_advises_the_shortfall_as_ray_actors_from_worker_time_and_step_rate(ray_here):
    """2 local workers at 40 ms a batch, a 10 ms step: want = ceil(100/s x 40 ms x 1.1) = 5, so 3 Ray actors."""
    v = diagnose(make([0.010] * N, [0.010] * N, **CPU_BOUND))
    assert (v.bottleneck, v.cause) == ("input", "cpu")
    (a,) = _remote(v)
    t, ceiling, local = 0.040, N / ((N - 1) * 0.010), 2  # the step rate: batches over the steps between them
    r = math.ceil(ceiling * t * 1.1) - local
    assert r == 3
    assert a["setting"] == {"worker_type": ("process", "ray"), "num_workers": (local, r)}
    assert a["change"] == f'worker_type=("process", "ray"), num_workers=({local}, {r})'
    assert a["predicted_samples_per_s"] == pytest.approx(min(ceiling, (local + r) / t) * 16)
    now = N / (N * 0.010 + (N - 1) * 0.010)
    assert a["predicted_gain"] == pytest.approx(min(ceiling, (local + r) / t) / now)
    assert "40.0 ms" in a["why"] and f"{ceiling:.1f} batches/s" in a["why"] and "5 workers" in a["why"]
    assert v.advice.index(a) == 1  # after "make each sample cheaper": the doctor's closing run measures it first


def test_a_measured_compute_ceiling_sets_the_remote_count(ray_here):
    """With the compute ceiling measured at 200 batches/s, the step calls for ceil(200 x 40 ms x 1.1) = 9 workers."""
    v = diagnose(make([0.010] * N, [0.010] * N, **CPU_BOUND), {"compute_ceiling": {"batches_per_s": 200.0}})
    (a,) = _remote(v)
    assert a["setting"]["num_workers"] == (2, 7)
    assert a["predicted_samples_per_s"] == pytest.approx(min(200.0, 9 / 0.040) * 16)


def test_without_ray_installed_the_remote_count_is_advised_with_how_to_get_ray(monkeypatch):
    """No ray package: the same count is advised, with no setting to re-run and the extra named in the why."""
    monkeypatch.setattr(verdict, "ray_installed", lambda: False)
    (a,) = _remote(diagnose(make([0.010] * N, [0.010] * N, **CPU_BOUND)))
    assert a["setting"] is None and "num_workers=(2, 3)" in a["change"]
    assert "pip install 'fastfeed[ray]'" in a["why"] and "cluster" in a["why"]


def test_a_torch_loader_is_advised_fastfeeds_loader_with_ray_actors(ray_here):
    """A torch loader's remote advice carries fastfeed=True: only fastfeed's DataLoader takes worker_type."""
    (a,) = _remote(diagnose(make([0.010] * N, [0.010] * N, kind="torch", **CPU_BOUND)))
    assert a["setting"] == {"worker_type": ("process", "ray"), "num_workers": (2, 3), "fastfeed": True}


def test_loading_in_the_loop_is_advised_ray_workers_alone(ray_here):
    """num_workers=0 with busy cores: the remote workers are all of them, worker_type="ray"."""
    tl = make([0.010] * N, [0.010] * N, num_workers=0, samples={"cpu_busy": 0.98, "main_cpu": 0.95})
    v = diagnose(tl)
    assert v.cause == "cpu"
    (a,) = _remote(v)
    assert a["setting"] == {"worker_type": "ray", "num_workers": 2}  # ceil(100/s x 10 ms x 1.1)


def test_a_mixed_loader_is_recorded_with_its_split_and_advised_only_more_remote_workers(ray_here):
    """A (2, 1) loader still short of workers gets (2, 3); one with enough actors gets no remote advice."""
    tl = make([0.010] * N, [0.010] * N, num_workers=3, **CPU_BOUND)
    rec = tl.loaders[0]
    rec.worker_type, rec.worker_split = "process+ray", [2, 1]
    (a,) = _remote(diagnose(tl))
    assert a["setting"]["num_workers"] == (2, 3)
    rec.worker_split = [2, 3]
    assert not _remote(diagnose(tl))
    again = Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))
    assert again.loaders[0].local_workers == 2 and again.loaders[0].remote_workers == 3
    text = Report(timeline=again, command=["test"]).summary()
    assert "num_workers=3 (2 local + 3 Ray actors, worker_type=process+ray)" in text


def test_worker_cpu_is_shared_among_the_local_processes_only():
    """The cores the worker processes used are divided by the local workers, not by the Ray actors too."""
    tl = make([0.010] * N, [0.010] * N, num_workers=2, **CPU_BOUND)
    rec = tl.loaders[0]
    from fastfeed.doctor.evidence import gather

    alone = gather(tl).worker_cpu
    rec.num_workers, rec.worker_type, rec.worker_split = 5, "process+ray", [2, 3]
    assert gather(tl).worker_cpu == pytest.approx(alone) == pytest.approx(0.95)


@pytest.mark.parametrize("worker_type, num_workers, split, recorded", [
    ("process", 4, None, ("process", None)),
    ("thread", 2, None, ("thread", None)),
    ("ray", 3, (0, 3), ("ray", [0, 3])),
    (("process", "ray"), 5, (2, 3), ("process+ray", [2, 3])),
])  # fmt: skip
def test_a_loaders_worker_type_and_split_are_recorded_as_json_able_values(worker_type, num_workers, split, recorded):
    """A loader's worker_type becomes a string ("process+ray" for the mixed form) and its split a list."""
    loader = SimpleNamespace(worker_type=worker_type, num_workers=num_workers, worker_split=split)
    assert hooks.worker_kind(loader) == recorded


def test_overrides_that_only_fastfeed_takes_reach_fastfeeds_loader():
    """A re-run's worker_type override reaches the loader the script builds (torch's, made fastfeed's)."""
    h = hooks.Hooks(lambda: None, overrides={"worker_type": "thread", "num_workers": 1}, to_fastfeed=True).install()
    try:
        loader = TorchLoader(Numbers(), batch_size=4)
    finally:
        h.close()
    assert isinstance(loader, FastLoader)
    assert (loader.worker_type, loader.num_workers) == ("thread", 1)
    args, kwargs = hooks._override((Numbers(),), {"batch_size": 4},
                                   {"worker_type": ("process", "ray"), "num_workers": (2, 3)})  # fmt: skip
    assert kwargs["worker_type"] == ("process", "ray") and kwargs["num_workers"] == (2, 3)


def test_rerun_of_ray_advice_builds_fastfeeds_loaders_with_the_setting(monkeypatch):
    """whatif.rerun applies a Ray setting as overrides on fastfeed's loader, even where the script builds torch's."""
    seen = {}

    def fake_run(target, argv, module, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(whatif.script, "run", fake_run)
    with pytest.raises(RuntimeError, match="stop here"):
        whatif.rerun("train.py", [], False, 50, {"worker_type": ("process", "ray"), "num_workers": (2, 3)})
    assert seen["overrides"] == {"worker_type": ("process", "ray"), "num_workers": (2, 3)}
    assert seen["to_fastfeed"] is True
    with pytest.raises(RuntimeError):
        whatif.rerun("train.py", [], False, 50, {"num_workers": 4})
    assert seen["to_fastfeed"] is False


def test_the_warm_rate_leaves_out_each_workers_first_batch():
    """Three workers whose first batches wait 2 s each (actors starting): the warm rate is the steady 50/s."""
    from fastfeed.doctor.evidence import gather

    ev = gather(make([2.0] * 3 + [0.010] * (N - 3), [0.010] * N, num_workers=3, **CPU_BOUND))
    assert ev.warm_batches_per_s == pytest.approx(1 / 0.020)
    assert ev.batches_per_s < 0.5 * ev.warm_batches_per_s
