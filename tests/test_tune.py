"""Auto-tuning: the search on synthetic curves, fastfeed.tune(), num_workers="auto" end to end, torchrun."""

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import fastfeed
from fastfeed.tuning import measure, offline
from fastfeed.tuning.recheck import Recheck
from fastfeed.tuning.result import Setting, Trial
from fastfeed.tuning.search import Search
from _load import OthersLoad, skip_if_others_held

pytestmark = pytest.mark.fastfeed_only


class Busy(Dataset):
    """Samples that cost ``cost_s`` of CPU each."""

    def __init__(self, n=4000, cost_s=0.0, shape=(8,), sleep_s=0.0):
        self.n, self.cost_s, self.shape, self.sleep_s = n, cost_s, shape, sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)  # I/O-like: workers help whatever the load on the cores
        end = time.perf_counter() + self.cost_s
        while time.perf_counter() < end:
            pass
        return torch.full(self.shape, i, dtype=torch.int64)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFEED_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# -- the search, on synthetic noisy curves -----------------------------------------------------


def _search(curve, *, hi, noise=0.01, stall=0.5, seed=0, pf_gain=None, tail=None, cpu_share=None, **kw):
    """A search run to its end on ``curve`` (batches/s by nw). ``tail``: every trial's ``load_tail``; ``cpu_share``:
    the share of their time per batch the workers spend on the CPU (None: not read)."""
    rng = random.Random(seed)
    search = Search(max_workers=hi, tolerance=0.03, **kw)
    while (s := search.propose()) is not None:
        level = curve(s.num_workers) * (pf_gain(s.prefetch_factor) if pf_gain and s.prefetch_factor else 1)
        read = {"load_tail": tail}
        if cpu_share is not None:
            read.update(worker_cpu_s=0.02 * cpu_share, load_s=0.02, worker_wait_s=0.0)
        search.report(Trial(s, [level * (1 + rng.uniform(-noise, noise)) for _ in range(3)], stall_fraction=stall,
                            **(read if s.num_workers else {})))  # fmt: skip
    return search


def _knee(curve, hi, tol=0.03):
    best = max(curve(n) for n in range(hi + 1))
    return min(n for n in range(hi + 1) if curve(n) >= (1 - tol) * best)


CURVES = {
    "cpu-bound, 4 cores": (lambda n: min(n, 4) * 100 - max(0, n - 4) * 8 if n else 60, 16),
    "latency-bound": (lambda n: n * 50 if n else 20, 16),
    "in-memory": (lambda n: 500 if n == 0 else 300, 8),
    "saturating": (lambda n: 1000 * (1 - 0.5**n), 32),
}


@pytest.mark.parametrize("name", CURVES)
@pytest.mark.parametrize("seed", range(5))
def test_search_finds_the_knee_of_a_noisy_curve(name, seed):
    """On each curve, with 1% noise, the choice is within 5% of the best and at most the knee + 1, in few trials."""
    curve, hi = CURVES[name]
    search = _search(curve, hi=hi, seed=seed)
    chosen = search.choice()
    best = max(curve(n) for n in range(hi + 1))
    assert curve(chosen.num_workers) >= 0.95 * best
    assert chosen.num_workers <= _knee(curve, hi) + 1
    measured = [t for t in search.order if t.windows]
    assert len(measured) <= 2 * (hi + 1).bit_length() + 3  # bisection, not a sweep


def test_search_not_input_bound_takes_the_cheapest_and_stops():
    """A small stall fraction at the small setting: fewer workers are tried while within tolerance, nothing else."""
    search = _search(lambda n: 100 if n else 90, hi=16, stall=0.01)
    assert not search.input_bound
    assert search.choice() == Setting("process", 1, 2)
    assert [t.setting.num_workers for t in search.order] == [2, 1, 0]


def test_search_prefetch_follows_its_gain_and_memory():
    """prefetch 4 is kept when it gains more than the tolerance; 1 is tried only when memory is tight."""
    gain = _search(lambda n: min(n, 2) * 100 + 1, hi=4, pf_gain=lambda pf: {1: 0.8, 2: 1, 4: 1.2, 8: 1.21}[pf])
    assert gain.choice().prefetch_factor == 4
    flat = _search(lambda n: min(n, 2) * 100 + 1, hi=4, pf_gain=lambda pf: 1.0)
    assert flat.choice().prefetch_factor == 2
    assert all(t.setting.prefetch_factor != 1 for t in flat.order)
    tight = _search(lambda n: min(n, 2) * 100 + 1, hi=4, pf_gain=lambda pf: 1.0, tight=lambda s: True)
    assert tight.choice().prefetch_factor == 1


def test_search_tries_a_deeper_prefetch_only_when_slow_batches_outlast_the_prefetch():
    """Workers that mostly wait (a tenth of their time on the CPU), whose slowest batches (95th percentile) last 1.4
    typical ones: 2 per worker absorb them, so prefetch 4 is not measured and a note says why; memory tight, 1 is
    still tried. Slow ones lasting 3 typical ones, or CPU-bound workers (which wait for a core once a slot frees):
    4 is measured, and kept when it gains."""
    curve = lambda n: min(n, 2) * 100 + 1  # noqa: E731
    gain = lambda pf: {1: 0.8, 2: 1, 4: 1.2, 8: 1.21}[pf]  # noqa: E731
    steady = _search(curve, hi=4, pf_gain=gain, tail=1.4, cpu_share=0.1, cores=2)
    assert all(t.setting.prefetch_factor in (2, None) for t in steady.order), steady.order
    assert steady.choice().prefetch_factor == 2
    assert [n for n in steady.notes if n.startswith("prefetch_factor 4 not tried")], steady.notes
    assert "1.4x a typical one" in steady.notes[0]
    tight = _search(curve, hi=4, pf_gain=lambda pf: 1.0, tail=1.4, cpu_share=0.1, cores=2, tight=lambda s: True)
    assert {t.setting.prefetch_factor for t in tight.order} == {1, 2} and tight.choice().prefetch_factor == 1
    for tailed in (_search(curve, hi=4, pf_gain=gain, tail=3.0, cpu_share=0.1, cores=2),
                   _search(curve, hi=4, pf_gain=gain, tail=1.4, cpu_share=1.0, cores=2),
                   _search(curve, hi=4, pf_gain=gain, tail=1.4)):  # fmt: skip
        assert tailed.choice().prefetch_factor == 4
        assert not [n for n in tailed.notes if n.startswith("prefetch_factor 4 not tried")], tailed.notes


def test_search_skips_what_does_not_fit_and_says_why():
    """Settings the budget rejects are recorded as skipped, with the reason, and never measured."""
    search = _search(lambda n: n * 100 + 1, hi=8, fits=lambda s: "over budget" if s.num_workers > 3 else None)
    skipped = [t for t in search.order if t.skipped]
    assert skipped and all(t.setting.num_workers > 3 and t.skipped == "over budget" for t in skipped)
    assert search.choice().num_workers == 3


# -- fastfeed.tune() ------------------------------------------------------------------------------


def test_tune_chooses_workers_for_a_latency_bound_dataset_and_saves_a_config(tmp_path, monkeypatch):
    """A latency-bound dataset gets workers; the saved config builds a loader; the table lists every trial. Each
    trial was asked for exactly offline.TRIAL_WINDOWS windows (a duel's round for DUEL_WINDOWS), never more for
    their spread."""
    # 3 ms of sleep per sample: a batch waits 24 ms and needs almost no CPU, so workers win by about their count
    # however busy the cores are (at 1 ms, a loaded machine's wake-up delays made nw=0 measure as fast).
    ds = Busy(sleep_s=0.003)
    asked, run = [], measure.run

    def spy(*args, windows=None, **kwargs):
        asked.append(windows)
        return run(*args, windows=windows, **kwargs)

    monkeypatch.setattr(measure, "run", spy)
    result = fastfeed.tune(ds, batch_size=8, budget_s=60, max_workers=2)
    assert asked and set(asked) <= {offline.TRIAL_WINDOWS, offline.DUEL_WINDOWS}, asked
    assert asked.count(offline.TRIAL_WINDOWS) >= len([t for t in result.trials if t.windows])
    assert result.converged and result.input_bound and result.num_workers >= 1
    assert result.throughput > 0 and result.samples_per_s == pytest.approx(result.throughput * 8)
    table = str(result)
    assert all(f"{t.setting.num_workers:>3}" in table for t in result.trials)
    path = tmp_path / "cfg.json"
    result.save(path)
    loader = fastfeed.DataLoader(ds, batch_size=8, **fastfeed.load_config(path))
    assert (loader.num_workers, loader.prefetch_factor) == (result.num_workers, result.prefetch_factor)
    assert next(iter(loader)).shape == (8, 8)


def test_tune_recognises_a_slow_step_as_not_input_bound_quickly():
    """A step much slower than loading: not input-bound, a cheap setting, found in three settings' trials (about 5 s
    on an idle machine), not a search of the 17 in the range. Counted in trials, which load cannot change: a noisy
    trial is measured again in place (``repeated``), not added."""
    result = fastfeed.tune(Busy(cost_s=0.0), batch_size=4, step=0.05, max_workers=4)
    assert not result.input_bound
    assert result.num_workers <= 2
    assert len(result.trials) <= 3 and not result.duels, [t.setting for t in result.trials]


def _slow_hand_over(monkeypatch, seconds: float) -> None:
    """Taking a batch from the ring costs ``seconds`` more, ready or not: the wake-up and hand-over of a loaded
    machine, where the loop's own share of each next() grew to 1-2% of a 50 ms step."""
    from fastfeed._iterator import RingDataLoaderIter

    take = RingDataLoaderIter._next_data

    def slowed(self):
        time.sleep(seconds)
        return take(self)

    monkeypatch.setattr(RingDataLoaderIter, "_next_data", slowed)


def test_a_ready_batchs_hand_over_is_the_loops_time_not_a_wait_for_input(monkeypatch):
    """A 30 ms step and a 3 ms hand-over of batches the workers made well ahead: the loop never waited for input,
    and fastfeed.tune says not input-bound at its first trial (counted as waits, the hand-over read a 9% stall, and
    the tuner searched every count for a gain that cannot be had)."""
    _slow_hand_over(monkeypatch, 0.003)
    result = fastfeed.tune(Busy(cost_s=0.0), batch_size=4, step=0.03, max_workers=4)
    assert result.trials[0].stall_fraction < 0.02, result.trials[0]
    assert not result.input_bound and len(result.trials) <= 3, str(result)


def test_auto_counts_a_ready_batchs_hand_over_as_the_loops_time_too(monkeypatch):
    """num_workers="auto" on the user's epoch reads the same: with a 30 ms step and a 3 ms hand-over, its trials'
    stall is the waits for batches not ready, not the hand-over, and it settles as not input-bound."""
    _slow_hand_over(monkeypatch, 0.003)
    loader = fastfeed.DataLoader(Busy(n=4000), batch_size=4, num_workers="auto")
    tuner = loader._ff_tuner
    for _ in loader:
        time.sleep(0.03)
        if tuner.result is not None:
            break
    first = tuner.search.order[0]
    assert first.setting.num_workers > 0 and first.stall_fraction < 0.02, first
    assert not tuner.result.input_bound, str(tuner.result)


def test_tune_memory_budget_skips_settings_and_says_so():
    """A budget of a few batches skips larger settings, naming the memory needed and the budget."""
    ds = Busy(shape=(64 * 1024,))  # 512 KB samples, 4 MB batches
    result = fastfeed.tune(ds, batch_size=8, max_workers=4, memory_budget=12 * 2**20)
    skipped = [t for t in result.trials if t.skipped]
    assert skipped and all("memory budget" in t.skipped for t in skipped)
    assert result.num_workers * (result.prefetch_factor or 0) * 4 * 2**20 <= 12 * 2**20
    assert "skipped" in str(result)


def test_tune_budget_too_small_returns_best_so_far_with_a_warning():
    """A budget shorter than one trial: the first trial's answer, converged=False, and a RuntimeWarning."""
    with pytest.warns(RuntimeWarning, match="budget"):
        result = fastfeed.tune(Busy(cost_s=0.0002), batch_size=8, budget_s=0.01, max_workers=4)
    assert not result.converged
    assert result.trials and result.trials[0].windows


def test_tune_step_that_raises_propagates_and_leaves_no_worker():
    """An exception in the step reaches the caller; the leak check confirms no worker is left."""
    def step(batch):
        raise KeyError("boom in step")

    with pytest.raises(KeyError, match="boom in step"):
        fastfeed.tune(Busy(), batch_size=4, step=step, max_workers=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget_s=0), "budget_s"),
    (dict(tolerance=1.5), "tolerance"),
    (dict(max_workers=-1), "max_workers"),
    (dict(worker_types=("fiber",)), "worker_types"),
    (dict(step="fast"), "step"),
    (dict(memory_budget=0), "memory_budget"),
    (dict(num_workers=2), "tune\\(\\) chooses num_workers"),
])  # fmt: skip
def test_tune_rejects_bad_values(kwargs, match):
    """Bad tuning arguments raise ValueError naming the argument."""
    with pytest.raises(ValueError, match=match):
        fastfeed.tune(Busy(n=64), batch_size=4, **kwargs)


# -- DataLoader(num_workers="auto") -----------------------------------------------------------------


def _first_column(loader):
    return torch.cat([b[:, 0].clone() for b in loader])


def test_auto_tunes_on_the_first_epoch_with_fixed_order_and_caches(cache_dir):
    """The tuning epoch yields every sample once, in a fixed setting's order (epochs 1 and 2), then the cache hits."""
    ds = Busy(n=8000, cost_s=0.00005)
    torch.manual_seed(7)
    auto = fastfeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers="auto")
    assert auto.tune_result is None and auto._ff_tuner is not None
    tuned = [_first_column(auto), _first_column(auto)]
    torch.manual_seed(7)
    fixed = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=0)
    reference = [_first_column(fixed), _first_column(fixed)]
    for got, want in zip(tuned, reference):
        assert torch.equal(got, want)
    assert sorted(tuned[0].tolist()) == list(range(len(ds)))
    result = auto.tune_result
    assert result is not None and len(result.trials) >= 2
    assert (auto.num_workers, auto.prefetch_factor) == (result.num_workers, result.prefetch_factor)
    entries = json.loads((cache_dir / "tune.json").read_text())["entries"]
    assert len(entries) == 1
    again = fastfeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers="auto")
    assert again.tune_result.setting == result.setting and again.num_workers == result.num_workers
    assert isinstance(again._ff_tuner.search, Recheck)  # only re-checked against its neighbours, not tuned again


def test_auto_prefetch_only_keeps_num_workers():
    """prefetch_factor="auto" with a fixed num_workers searches only the prefetch factor."""
    loader = fastfeed.DataLoader(Busy(n=4000), batch_size=4, num_workers=1, prefetch_factor="auto")
    assert sum(len(b) for b in loader) == 4000
    assert loader.num_workers == 1 and {t.setting.num_workers for t in loader.tune_result.trials} == {1}


def _torch_epochs(ds, seed: int, epochs: int = 2) -> list:
    """torch's own epochs of ``ds`` (batch 4, shuffled) from ``torch.manual_seed(seed)``: the first columns."""
    torch.manual_seed(seed)
    fixed = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=0)
    return [_first_column(fixed) for _ in range(epochs)]


def _taken(loader, k: int) -> list:
    """The batches' first columns up to ``k`` into the tuner's second trial (past the end of its first), then a
    ``break``, as a training loop that stops to save leaves it."""
    seen, more = [], None
    for batch in loader:
        seen.append(batch[:, 0].clone())
        if more is None and loader._ff_tuner.search.order:
            more = len(seen) + k
        if len(seen) == more:
            break
    return seen


@pytest.mark.parametrize("resumed_with", ["fixed", "auto"])
def test_a_state_saved_in_the_tuning_epoch_resumes_it_exactly(resumed_with, cache_dir):
    """A run that checkpoints during num_workers="auto"'s first epoch (one long epoch is a whole LLM run) and is
    resumed from it goes on with the epoch's next batch and then the next epoch, as torch's uninterrupted epochs:
    resumed with the tuned values (a fixed loader), or with "auto" again where the tuning had not settled, which
    then tunes on the rest of the epoch. Saved after a ``break``, JSON and back, 3 batches into the second
    setting's trial, so the state spans two settings' iterators."""
    ds = Busy(n=4000)
    want = _torch_epochs(ds, 11)
    torch.manual_seed(11)
    saving = fastfeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers="auto")
    seen = _taken(saving, 3)
    assert saving._ff_tuner.result is None  # tuning, not settled
    state = json.loads(json.dumps(saving.state_dict()))
    assert state["mid_epoch"] and state["yielded"] == len(seen) and state["workers"] is None
    del saving
    if resumed_with == "fixed":
        loader = fastfeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
    else:
        assert not (cache_dir / "tune.json").exists()  # not settled, so nothing cached: "auto" tunes again
        loader = fastfeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers="auto")
    torch.manual_seed(999)  # the state's RNGs, not these, are what the resumed run draws from
    loader.load_state_dict(state)
    rest = _first_column(loader)
    assert torch.equal(torch.cat([*seen, rest]), want[0])
    if resumed_with == "auto":
        assert loader.tune_result is not None and loader.tune_result.trials  # tuned on the epoch's rest
    assert torch.equal(_first_column(loader), want[1])


def test_a_state_saved_mid_tuning_epoch_continues_the_same_loader_and_a_tuning_loader_after_a_settled_one(
        cache_dir):  # fmt: skip
    """The loader that saved goes on as if nothing happened; a state saved in the next run's first epoch, while
    the cached setting is being re-checked, resumes into an "auto" loader whose cache hits (its recheck dropped:
    the cached setting serves the rest of the epoch)."""
    ds = Busy(n=4000)
    want = _torch_epochs(ds, 5)
    torch.manual_seed(5)
    loader = fastfeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers="auto")
    it = iter(loader)
    seen = [next(it)[:, 0].clone() for _ in range(30)]
    loader.state_dict()  # in the middle of a trial: it must not disturb the trial or the order
    seen += [b[:, 0].clone() for b in it]
    assert torch.equal(torch.cat(seen), want[0]) and loader.tune_result is not None
    torch.manual_seed(5)
    settled = fastfeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers="auto")  # a cache hit: a recheck
    head = _taken(settled, 3)  # in the recheck's second trial
    assert settled._ff_tuner.result is None
    state = settled.state_dict()
    again = fastfeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers="auto")
    again.load_state_dict(state)
    assert again._ff_tuner is None and again.tune_result == loader.tune_result
    assert again.num_workers == loader.tune_result.num_workers
    assert torch.equal(torch.cat([*head, _first_column(again)]), want[0])


class _Positioned(Busy):
    """A dataset that keeps its own position (torchdata's Stateful protocol)."""

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_a_state_the_tuning_epoch_cannot_hold_is_a_clear_error():
    """A stateful dataset's state lives in each setting's workers, which the tuning replaces: state_dict() in the
    tuning epoch names that and the way out."""
    loader = fastfeed.DataLoader(_Positioned(n=400), batch_size=4, num_workers="auto")
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match="tuning epoch: the dataset's own state.*tune_result.loader_kwargs"):
        loader.state_dict()
    del it


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_workers="autoo"), ValueError, "num_workers='autoo'.*'auto'"),
    (dict(num_workers=2, prefetch_factor="max"), ValueError, "prefetch_factor='max'.*'auto'"),
    (dict(num_workers="auto", persistent_workers=True, prefetch_factor="fast"), ValueError, "prefetch_factor"),
])  # fmt: skip
def test_auto_bad_values(kwargs, error, match):
    """Misspelt "auto" values raise ValueError naming the valid values."""
    with pytest.raises(error, match=match):
        fastfeed.DataLoader(Busy(n=8), batch_size=4, **kwargs)


def test_auto_prefetch_without_workers_is_torchs_error():
    """prefetch_factor="auto" with num_workers=0 raises torch's own error for a prefetch factor without workers."""
    with pytest.raises(ValueError) as torch_error:
        torch.utils.data.DataLoader(Busy(n=8), batch_size=4, num_workers=0, prefetch_factor=2)
    with pytest.raises(ValueError) as ours:
        fastfeed.DataLoader(Busy(n=8), batch_size=4, num_workers=0, prefetch_factor="auto")
    assert str(ours.value) == str(torch_error.value)


def test_auto_iterable_dataset_is_a_clear_error():
    """An IterableDataset cannot switch settings mid-epoch: the error says to use fastfeed.tune and a config."""
    with pytest.raises(ValueError, match="IterableDataset.*load_config"):
        fastfeed.DataLoader(Stream(), batch_size=2, num_workers="auto")


# -- the measurement layer ------------------------------------------------------------------------


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_stats_report_waits_steps_and_worker_times(worker_type):
    """stats() counts the batches, times the workers' fetches, and sees a slow step as a low stall fraction."""
    loader = fastfeed.DataLoader(Busy(n=160, cost_s=0.0005), batch_size=4, num_workers=2, worker_type=worker_type)
    with OthersLoad() as others:
        for _ in loader:
            time.sleep(0.01)
    st = loader.stats()
    assert st.batches == 40 and st.num_workers == 2 and len(st.worker_busy) == 2
    assert st.fetch_mean_s >= 4 * 0.0005
    assert st.step_p50_s >= 0.01 and st.stall_fraction >= 0
    # Two workers make a batch in 2 ms of CPU against a 10 ms step, given the cores: with others holding them, the
    # loop may well wait, and the stall fraction says so rightly.
    if st.stall_fraction >= 0.5:
        skip_if_others_held(others, f"the stall fraction was {st.stall_fraction:.2f}, over 0.5 (the slow step shows "
                                    "as one only on cores the workers get)")
    assert st.stall_fraction < 0.5
    assert all(0 < b <= 1 for b in st.worker_busy)
    assert "stall" in str(st)


def test_stats_off_records_nothing(monkeypatch):
    """FASTFEED_STATS=0 turns the layer off: stats() is empty."""
    monkeypatch.setenv("FASTFEED_STATS", "0")
    loader = fastfeed.DataLoader(Busy(n=16), batch_size=4, num_workers=1)
    assert len(list(loader)) == 4
    assert loader.stats().batches == 0


# -- torch.distributed -----------------------------------------------------------------------------


RANKS_SCRIPT = """
import json, os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_tune import Busy
import fastfeed

dist.init_process_group("gloo")
rank = dist.get_rank()
# Each rank's own optimum differs (rank 1's samples cost much more), so only agreement makes them equal.
ds = Busy(n=6000, cost_s=0.0 if rank == 0 else 0.0004)
tuned = fastfeed.tune(ds, batch_size=4, max_workers=3, budget_s=30)
loader = fastfeed.DataLoader(ds, batch_size=4, num_workers="auto")
for epoch in range(4):
    for _ in loader:
        pass
    dist.barrier()
with open(os.path.join({out!r}, f"rank{{rank}}.json"), "w") as f:  # one file each: stdout lines interleave
    json.dump({{"tune": tuned.loader_kwargs(), "auto": loader.tune_result.loader_kwargs(),
               "loader": [loader.num_workers, loader.prefetch_factor]}}, f)
dist.destroy_process_group()
"""


# A job that checkpoints in num_workers="auto"'s first epoch (argv: "save" or "resume", the folder): each rank
# takes 3 batches past its tuner's first trial, saves (after a `break`) and exits; the resumed job's ranks load their
# states into fresh "auto" loaders and write every batch they received, both jobs together, for the test to compare
# with the rank's own DistributedSampler order.
RESUME_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_tune import Busy
import fastfeed

mode, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
ds = Busy(n=4000)
sampler = torch.utils.data.DistributedSampler(ds, shuffle=True, seed=3)
sampler.set_epoch(0)
loader = fastfeed.DataLoader(ds, batch_size=4, sampler=sampler, num_workers="auto")
path = os.path.join(out, f"rank{{rank}}")
seen, more = [], None
if mode == "save":
    for batch in loader:
        seen.append(batch[:, 0].tolist())
        if more is None and loader._ff_tuner.search.order:
            more = len(seen) + 3
        if len(seen) == more:
            break
    torch.save(loader.state_dict(), path + ".pt")
    json.dump(seen, open(path + ".head.json", "w"))
else:
    loader.load_state_dict(torch.load(path + ".pt", weights_only=True))
    rest = [batch[:, 0].tolist() for batch in loader]
    json.dump(rest, open(path + ".rest.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.hang_limit(240)
def test_torchrun_ranks_resume_a_state_saved_in_the_tuning_epoch(tmp_path):
    """Under torchrun (2 ranks, gloo, a DistributedSampler), a job that saves each rank's state during
    num_workers="auto"'s first epoch and a new job that loads them: every rank's batches, both jobs together, are its
    own sampler's order, each sample once."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for mode in ("save", "resume"):
        out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script), mode, str(tmp_path)],
                             capture_output=True, text=True, timeout=100, env=env)  # fmt: skip
        assert out.returncode == 0, (mode, out.stderr[-3000:])
    ds = Busy(n=4000)
    for rank in (0, 1):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(0)
        want = list(sampler)
        head, rest = (json.loads((tmp_path / f"rank{rank}.{part}.json").read_text()) for part in ("head", "rest"))
        got = [i for batch in head + rest for i in batch]
        assert 0 < len(head) < len(want) // 4 and got == want, (rank, len(head), len(got))


@pytest.mark.hang_limit(240)
def test_torchrun_ranks_end_with_the_same_choice(tmp_path):
    """Under torchrun (2 ranks, gloo), fastfeed.tune and num_workers="auto" give every rank the same result (the
    slowest rank's: tests/test_tune_ranks.py)."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), out=str(tmp_path)))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script)], capture_output=True,
                         text=True, timeout=220, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert a["tune"] == b["tune"]
    assert a["auto"] == b["auto"] and a["loader"] == b["loader"]
