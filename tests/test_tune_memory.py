"""The tuner respects memory: a worker's cost predicted from the first trial's private memory, copy-on-read
growth included; no setting chosen that is predicted over the budget; and the result says when memory, not the
CPUs, set the limit. The machine's memory is simulated (a MemAvailable made up), never used up."""

from __future__ import annotations

import _memory_meta
import pytest

import fastfeed
from fastfeed import cli, topology
from fastfeed.sharing.find import Container
from fastfeed.tuning import measure, offline
from fastfeed.tuning.result import Setting, Trial, TuneResult

MB = 2**20
ITEMS = Container("items", "list", 1_000_000, 300 * MB)


def _budget(memory_budget, containers=(), length=1_000_000, parent=2048 * MB) -> offline.Budget:
    budget = offline.Budget(memory_budget, containers, length, parent_bytes=parent)
    budget.batch_bytes = MB
    return budget


def _first(start=20 * MB, end=60 * MB, samples=10_000) -> Trial:
    return Trial(Setting("process", 2, 2), windows=[10.0, 10.0, 10.0], batch_bytes=MB, worker_bytes=end,
                 worker_start_bytes=start, samples_per_worker=samples)  # fmt: skip


def test_a_workers_cost_includes_its_copy_on_read_growth_up_to_the_containers():
    """40 MB copied over 10k samples read: at that pace a worker copies all of the 300 MB list, not just 40 MB."""
    budget = _budget(None, [ITEMS])
    budget.learn(_first())
    assert budget.worker_bytes == 20 * MB + 300 * MB
    assert (budget.start_bytes, budget.growth_bytes, budget.projected_growth_bytes) == (20 * MB, 40 * MB, 300 * MB)


def test_without_containers_the_growth_is_capped_by_the_parents_memory():
    budget = _budget(None, [], parent=500 * MB)
    budget.learn(_first())
    assert budget.worker_bytes == 20 * MB + 500 * MB  # 4 KB a sample x 1M would be 4 GB: more than there is
    short = _budget(None, [], length=15_000, parent=500 * MB)
    short.learn(_first())
    assert short.worker_bytes == 20 * MB + int(40 * MB / 10_000 * 15_000)  # the whole dataset read, at that pace


def test_little_growth_is_taken_as_measured():
    budget = _budget(None, [ITEMS])
    budget.learn(_first(end=20 * MB + offline.COPY_ON_READ_MIN - 1))
    assert budget.worker_bytes == 20 * MB + offline.COPY_ON_READ_MIN - 1


def test_settings_over_the_budget_are_refused_and_memory_is_named_as_the_limit():
    budget = _budget(3 * 320 * MB + 12 * MB, [ITEMS])  # 3 workers of 320 MB and their 6 batches of 1 MB, just
    budget.learn(_first())
    assert budget(Setting("process", 3, 2)) is None
    why = budget(Setting("process", 4, 2))
    assert "memory budget" in why and "4 x 320 MB" in why
    assert budget.max_workers(Setting("process", 3, 2), 8) == 3
    trials = [_first(), Trial(Setting("process", 4, 2), skipped=why), Trial(Setting("process", 3, 2), windows=[1.0])]
    assert offline.limited_by_memory(budget, Setting("process", 3, 2), trials, 8)
    # the CPUs stopped it at 2 while 3 would have fit: memory did not decide
    assert not offline.limited_by_memory(budget, Setting("process", 2, 2), trials[:1], 8)


def test_result_says_memory_set_the_limit_in_its_table():
    result = _limited_result()
    text = str(result)
    assert "memory, not CPU, set the limit" in text and "at most 3 workers fit" in text
    assert "dataset.items" in text and "fastfeed.share(dataset)" in text
    again = TuneResult.from_dict(result.as_dict())
    assert again.limited_by == "memory" and again.memory == result.memory
    result.limited_by = None  # the CPUs decided: the estimate is still shown, without the claim
    assert str(result).splitlines()[1].startswith("memory: 320 MB per worker predicted")


def test_cli_passes_the_memory_budget_and_its_table_says_memory_decided(monkeypatch, capsys, tmp_path):
    """``fastfeed tune --memory-budget MB`` hands tune() the bytes, and the table it prints leads with the memory
    line when memory set the limit."""
    monkeypatch.setenv("FASTFEED_CACHE_DIR", str(tmp_path / "cache"))  # the command caches its result
    seen = {}

    def tune(dataset, **kwargs):
        seen.update(kwargs)
        return _limited_result()

    monkeypatch.setattr(fastfeed, "tune", tune)
    assert cli.main(["tune", "_memory_meta:dataset", "--batch-size", "16", "--memory-budget", "972"]) == 0
    assert seen["memory_budget"] == 972 * MB
    out = capsys.readouterr().out
    assert "memory, not CPU, set the limit" in out and "*   3   2 process" in out


def _limited_result() -> TuneResult:
    memory = {"worker_bytes": 320 * MB, "start_bytes": 20 * MB, "growth_bytes": 40 * MB,
              "projected_growth_bytes": 300 * MB, "containers": [list(ITEMS)], "budget_bytes": 972 * MB,
              "max_workers": 3}  # fmt: skip
    trials = [_first(), Trial(Setting("process", 3, 2), windows=[9.0, 9.0, 9.0]),
              Trial(Setting("process", 4, 2), skipped="needs ~1,284 MB, memory budget 972 MB")]  # fmt: skip
    return TuneResult(3, 2, "process", 9.0, 144.0, 0.5, True, trials, 1.0, True, 16, limited_by="memory",
                      memory=memory)  # fmt: skip


def test_tune_picks_what_fits_when_memory_allows_3_workers_and_the_cpus_8(monkeypatch):
    """A dataset of 200k metadata dicts whose workers wait on reads (more of them always help, whatever the
    cores), on a machine whose available memory is made to hold 3 of its workers: the tuner, allowed 8, takes at
    most 3 and says that memory decided."""
    ds = _memory_meta.dataset(200_000, sleep_s=0.002)
    base = {"batch_size": 16, "shuffle": True}
    containers, length = offline.dataset_memory(ds)
    assert containers and containers[0].name == "items" and length == 200_000
    # One worker's predicted cost, measured as tune() will measure it on its first trial (2 workers)...
    probe = offline.Budget(None, containers, length)
    trial = measure.run(fastfeed.DataLoader, ds, base, Setting("process", 2, 2), None, tolerance=0.03,
                        deadline=float("inf"), first=True)  # fmt: skip
    probe.learn(trial)
    assert trial.growth_bytes > 0 and probe.projected_growth_bytes >= trial.growth_bytes
    cost = probe.worker_bytes
    ring = 3 * 2 * trial.batch_bytes
    # ...and a machine whose default budget (RAM_SHARE of what is available) holds 3.5 such workers.
    available = int((3.5 * cost + ring) / offline.RAM_SHARE)
    real = topology.meminfo_bytes
    monkeypatch.setattr(topology, "meminfo_bytes",
                        lambda field, *a: available if field == "MemAvailable" else real(field, *a))  # fmt: skip
    result = fastfeed.tune(ds, max_workers=8, budget_s=45, **base)
    assert result.memory is not None and result.memory["max_workers"] == 3
    assert result.num_workers <= 3
    skipped = [t for t in result.trials if t.skipped]
    assert {t.setting.num_workers for t in skipped} >= {4, 5, 6, 7, 8}
    assert all("memory budget" in t.skipped for t in skipped)
    assert result.limited_by == "memory", str(result)
    assert "memory, not CPU, set the limit" in str(result)
    predicted = result.num_workers * result.memory["worker_bytes"]
    assert predicted <= offline.RAM_SHARE * available  # never predicted to leave less than the safe share


@pytest.mark.parametrize("min_workers, expected", [(0, 0), (1, 1)])
def test_when_even_the_first_trial_is_over_budget_the_tuner_falls_back(monkeypatch, min_workers, expected):
    """The first trial's workers turn out over the budget: num_workers=0 is measured instead where allowed; where
    the loader needs workers, the cheapest measured is taken with a warning naming the fix."""
    search = offline.Search(max_workers=4, tolerance=0.03, min_workers=min_workers)
    rejected = Trial(Setting("process", max(1, min_workers), 2), windows=[5.0, 5.0, 5.0],
                     skipped=f"{offline.REJECTED}: needs ~700 MB")  # fmt: skip
    search.report(rejected)

    def trial_of(setting, first):
        assert setting == Setting("process", 0, None)
        return Trial(setting, windows=[4.0, 4.0, 4.0])

    if min_workers:
        with pytest.warns(RuntimeWarning, match="fastfeed.share"):
            assert offline._within_memory(search, trial_of, "process", min_workers)
    else:
        assert offline._within_memory(search, trial_of, "process", min_workers)
    assert search.choice().num_workers == expected


def test_auto_says_memory_set_the_limit_as_tune_does(monkeypatch):
    """num_workers="auto" tunes through the same budget: on a machine whose memory holds 3 workers where the
    workers' figures would take more, the settled result names memory as the limit, with its estimate."""
    from fastfeed.tuning import agree
    from fastfeed.tuning.online import OnlineTuner
    from fastfeed.tuning.search import Search

    monkeypatch.setattr(agree, "publish", lambda result, tag: None)  # one process: no other rank to agree with
    monkeypatch.setattr(agree, "poll", lambda tag, own: own)
    budget = _budget(3 * 320 * MB + 12 * MB, [ITEMS])
    search = Search(max_workers=8, tolerance=0.03, fits=budget, tight=budget.tight)
    settled = []
    tuner = OnlineTuner(search, budget, 0.03, settled.append, "t", 16)
    while (s := search.propose()) is not None:  # more workers always help, up to the 3 that fit
        trial = _first() if s == Setting("process", 2, 2) else Trial(s, [10.0 * max(1, s.num_workers)] * 3)
        trial.windows, trial.stall_fraction = [10.0 * max(1, s.num_workers)] * 3, 0.5  # input-bound
        budget.learn(trial)
        search.report(trial)
    result = tuner.finish(True, 1.0)
    assert result.num_workers == 3 and settled == [result]
    assert result.limited_by == "memory" and result.memory["max_workers"] == 3, str(result)
    assert "memory, not CPU, set the limit" in str(result)


def test_auto_finds_the_datasets_containers_before_its_workers_fork():
    ds = _memory_meta.dataset(200_000, sleep_s=0.0)
    loader = fastfeed.DataLoader(ds, batch_size=16, num_workers="auto")
    assert [c.name for c in loader._ff_tuner.budget.containers] == ["items"]


def test_auto_measures_a_workers_copy_on_read_growth_on_the_users_epoch(tmp_path, monkeypatch):
    """num_workers="auto"'s trials read a worker's private memory where their windows begin and end, as
    fastfeed.tune's do: over 200k metadata dicts read in a shuffled order, each worker grows (copy-on-read), and the
    budget projects that growth toward the dataset's containers. Before, an online trial read the end alone: no
    growth, and a worker was priced at its start-up size."""
    monkeypatch.setenv("FASTFEED_CACHE_DIR", str(tmp_path))
    ds = _memory_meta.dataset(200_000, sleep_s=0.0)
    loader = fastfeed.DataLoader(ds, batch_size=16, shuffle=True, num_workers="auto")
    tuner = loader._ff_tuner
    for _ in loader:
        if any(t.setting.num_workers for t in tuner.search.order):
            break
    trial = next(t for t in tuner.search.order if t.setting.num_workers)
    assert trial.worker_start_bytes > 0 and trial.samples_per_worker > 0, trial
    assert trial.growth_bytes > 0, trial
    assert tuner.budget.projected_growth_bytes >= trial.growth_bytes > 0
