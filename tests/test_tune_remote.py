"""The tuner's remote phase: Ray actors beside the best local workers, bisected on synthetic curves, in its results,
configs and command line."""

from __future__ import annotations

import random
import sys
import types

import pytest

import fastfeed
import fastfeed._workers.ray
from fastfeed import cli
from fastfeed.tuning import offline
from fastfeed.tuning.result import Setting, Trial, TuneResult, load_config
from fastfeed.tuning.search import Search

import _tune_targets

pytestmark = pytest.mark.fastfeed_only


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFEED_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _search(curve, *, hi=8, max_remote=16, noise=0.01, seed=0, **kw):
    """Drive a Search to its end, measuring ``curve(local, remote)`` with noise (a fake of measure.run)."""
    rng = random.Random(seed)
    search = Search(max_workers=hi, tolerance=0.03, max_remote=max_remote, **kw)
    while (s := search.propose()) is not None:
        level = curve(s.num_workers, s.remote)
        search.report(Trial(s, [level * (1 + rng.uniform(-noise, noise)) for _ in range(3)], stall_fraction=0.5))
    return search


def cpu_bound(local, remote, cores=2, per=100.0, ceiling=1000.0, receive=1400.0):
    """2 local cores make 100 batches/s each, every actor another 100, up to the step's 1000/s; past 14 workers
    the loop receiving them is the limit and each extra one costs 2%."""
    made = min(local, cores) * per - max(0, local - cores) * 4 + remote * per
    over = max(0, local + remote - receive / per)
    return min(made, ceiling) * (1 - 0.02 * over) if local + remote else 40.0


@pytest.mark.parametrize("seed", range(5))
def test_remote_phase_bisects_the_actor_count_with_the_local_workers_fixed(seed):
    """Local knee 2 on 2 cores, then actors: the choice is 2 local + the fewest actors within 5% of the step's rate."""
    search = _search(cpu_bound, seed=seed)
    chosen = search.choice()
    local = [t for t in search.order if not t.setting.remote]
    remote = [t for t in search.order if t.setting.remote]
    assert chosen.num_workers == 2 and chosen.remote >= 1
    assert all(t.setting.num_workers == 2 for t in remote)  # the local count stays at its knee
    assert cpu_bound(2, chosen.remote) >= 0.95 * 1000.0
    assert chosen.remote <= 8 + 1  # 2 + 8 workers reach the ceiling: the knee
    assert len(remote) <= 2 * (16 + 1).bit_length() + 2  # bisection, not a sweep of 16
    assert local and max(t.setting.remote for t in remote) == 16  # the top of the range is measured
    result = offline._result(search, True, 1.0, 8)
    assert result.remote == chosen.remote and result.num_workers == 2
    assert result.loader_kwargs() == {"worker_type": ("process", "ray"), "num_workers": (2, chosen.remote),
                                      "prefetch_factor": chosen.prefetch_factor}  # fmt: skip


def test_actors_that_add_nothing_are_not_chosen():
    """A step-bound curve, flat in the actor count: the choice stays local, remote 0."""
    search = _search(lambda local, remote: min(local, 2) * 100.0 if local else 50.0)
    chosen = search.choice()
    assert chosen.remote == 0 and chosen.num_workers == 2
    assert any(t.setting.remote for t in search.order)  # they were tried, and lost on cost


def test_actors_past_the_memory_budget_are_skipped_and_said_so():
    """Settings whose batches in flight (local + remote) exceed the budget are skipped, never measured."""
    search = _search(cpu_bound, fits=lambda s: "over budget" if s.total > 7 else None)
    skipped = [t for t in search.order if t.skipped]
    assert skipped and all(t.setting.total > 7 and t.skipped == "over budget" for t in skipped)
    assert search.choice() == Setting("process", 2, 2, 5)


def test_no_remote_phase_unless_asked():
    """max_remote=0 (the default) never proposes an actor."""
    search = _search(cpu_bound, max_remote=0)
    assert not any(t.setting.remote for t in search.order) and search.choice().remote == 0


def test_ray_alone_when_the_best_local_count_is_zero():
    """Loading in the loop is the local choice: the remote settings are worker_type="ray" with the actors only."""
    s = Setting("process", 0, 2, 3)
    assert s.loader_kwargs() == {"worker_type": "ray", "num_workers": 3, "prefetch_factor": 2}
    assert str(Setting("process", 2, 2, 3)) == "nw=2+3 pf=2 process+ray"


def test_a_remote_result_round_trips_and_its_config_gives_the_mixed_form(tmp_path):
    """TuneResult with remote survives as_dict/from_dict, prints its actors, and load_config gives tuples back."""
    trials = [Trial(Setting("process", 2, 2), [200.0] * 3), Trial(Setting("process", 2, 2, 6), [800.0] * 3)]
    result = TuneResult(num_workers=2, prefetch_factor=2, worker_type="process", throughput=800.0,
                        samples_per_s=6400.0, stall_fraction=0.1, input_bound=True, trials=trials, elapsed_s=3.0,
                        converged=True, batch_size=8, remote=6)  # fmt: skip
    assert TuneResult.from_dict(result.as_dict()) == result
    assert "nw=2+6 pf=2 process+ray" in str(result) and " ray " in str(result).splitlines()[1]
    result.save(tmp_path / "c.json")
    assert load_config(tmp_path / "c.json") == {"worker_type": ("process", "ray"), "num_workers": (2, 6),
                                                "prefetch_factor": 2}  # fmt: skip
    old = TuneResult.from_dict({k: v for k, v in result.as_dict().items() if k != "remote"})  # an older file
    assert old.remote == 0


@pytest.fixture
def fake_ray_connect(monkeypatch):
    """A stand-in for fastfeed._workers.ray.connect: a connected cluster of ``state["cpus"]`` CPUs."""
    state = {"cpus": 6.0, "connected": 0}
    mod = types.ModuleType("fastfeed._workers.ray.connect")

    def connect():
        state["connected"] += 1
        if state.get("error"):
            raise state["error"]
        return object()

    mod.connect = connect
    mod.cluster_summary = lambda: {"nodes": [], "cpus": state["cpus"]}
    monkeypatch.setitem(sys.modules, "fastfeed._workers.ray.connect", mod)
    monkeypatch.setattr(fastfeed._workers.ray, "connect", mod, raising=False)
    return state


def test_remote_true_tries_as_many_actors_as_the_cluster_has_cpus(fake_ray_connect):
    """remote=True: the connected cluster's CPUs; a number is taken as it is; either connects first."""
    assert offline.remote_actors(True) == 6 and offline.remote_actors(3) == 3
    assert fake_ray_connect["connected"] == 2
    assert offline.remote_actors(False) == offline.remote_actors(0) == 0 and fake_ray_connect["connected"] == 2
    fake_ray_connect["cpus"] = 0.0
    with pytest.raises(RuntimeError, match="no CPU for an actor"):
        offline.remote_actors(True)


@pytest.mark.parametrize("bad", [-1, 2.5, "4"])
def test_remote_rejects_what_is_not_a_count(bad):
    """remote must be a bool or an int >= 0; anything else is a ValueError naming it."""
    with pytest.raises(ValueError, match="remote must be True"):
        offline.remote_actors(bad)


def test_no_cluster_fails_before_any_trial(fake_ray_connect):
    """tune(remote=N) with no cluster raises the connection's error before measuring anything."""
    fake_ray_connect["error"] = RuntimeError("no Ray cluster: start one with ray start --head")
    with pytest.raises(RuntimeError, match="ray start --head"):
        fastfeed.tune(_tune_targets.rows, remote=4, budget_s=5, batch_size=8)


def test_cli_remote_passes_the_count_and_does_not_cache_a_remote_choice(monkeypatch, capfd, tmp_path):
    """--remote MAX reaches tune(remote=MAX); a choice with actors is saved with --out but not cached for "auto"."""
    trials = [Trial(Setting("process", 2, 2, 3), [300.0] * 3)]
    result = TuneResult(num_workers=2, prefetch_factor=2, worker_type="process", throughput=300.0,
                        samples_per_s=2400.0, stall_fraction=0.1, input_bound=True, trials=trials, elapsed_s=1.0,
                        converged=True, batch_size=8, remote=3)  # fmt: skip
    calls = []

    def fake(dataset, *, on_trial=None, **kwargs):
        calls.append(kwargs)
        on_trial(trials[0], trials[0])
        return result

    monkeypatch.setattr(fastfeed, "tune", fake)
    out = tmp_path / "c.json"
    assert cli.main(["tune", "_tune_targets:rows", "--remote", "8", "--out", str(out)]) == 0
    assert calls[0]["remote"] == 8
    err = capfd.readouterr().err
    assert "not cached" in err and "cached in" not in err
    assert load_config(out)["num_workers"] == (2, 3)


def test_cli_remote_without_a_cluster_says_why_and_exits_1(monkeypatch, capfd):
    """--remote with no Ray (or no cluster) prints the connection's message and exits 1."""

    def fake(dataset, **kwargs):
        raise ImportError("Ray workers need Ray: pip install 'fastfeed[ray]'")

    monkeypatch.setattr(fastfeed, "tune", fake)
    assert cli.main(["tune", "_tune_targets:rows", "--remote", "2"]) == 1
    assert "pip install 'fastfeed[ray]'" in capfd.readouterr().err
