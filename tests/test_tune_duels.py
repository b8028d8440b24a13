"""The tuner on a noisy machine: noisy trials measured again, close settings measured in turn (duels), the model of
what the cores can run, and a simulated noisy machine over four workloads. Pure: synthetic trials, no loader."""

from __future__ import annotations

import math
import random
import statistics

import pytest

import fastfeed
from fastfeed import cli
from fastfeed.tuning import measure, offline
from fastfeed.tuning.duel import MAX_ROUNDS, Duel
from fastfeed.tuning.result import Setting, Trial, TuneResult
from fastfeed.tuning.search import MAX_DUELS, MAX_REPEATS, MODEL_SLACK, REPEAT_SHARE, Search

pytestmark = pytest.mark.fastfeed_only

QUIET = 0.1  # others' cores on a quiet machine
BURST = 1.5  # ... while a neighbour's burst holds the cores


def cpu2(n: int) -> float:
    """CPU-bound samples on 2 cores (the issue's figures): 2 workers are the knee, 3 and 4 oversubscribe them."""
    return {0: 55.0, 1: 62.0, 2: 117.0, 3: 95.0, 4: 88.0}[n]


def readings(rate, cpu_s=None, loop_s=0.001):
    """The CPU readings a trial of ``rate(nw)`` carries: CPU-bound workers (``cpu_s`` per batch, busy all their time
    per batch) or, with ``cpu_s`` None, none."""
    if cpu_s is None:
        return lambda s: {}
    return lambda s: ({"worker_cpu_s": cpu_s, "load_s": s.num_workers / rate(s.num_workers), "loop_cpu_s": loop_s}
                      if s.num_workers else {"loop_cpu_s": loop_s})  # fmt: skip


def drive(search: Search, figure, cpu=lambda s: {}, others=lambda s, n: QUIET, stall=0.5, spread=0.0) -> Search:
    """Run ``search`` to its end: the ``n``-th measurement of a setting (``n`` counted from 0 over ordinary trials
    and duel rounds alike) reads ``figure(setting, n, in_duel)`` batches/s in each window (an ordinary trial's
    windows ``spread`` apart, around it), with ``others(setting, n)`` of others' cores."""
    seen: dict[Setting, int] = {}
    for _ in range(200):  # a search that never ends fails here, not by hanging
        s = search.propose()
        if s is None:
            return search
        n = seen[s] = seen.get(s, -1) + 1
        level = figure(s, n, search.in_duel)
        windows = [level] * 2 if search.in_duel else [level * (1 - spread / 2), level, level * (1 + spread / 2)]
        search.report(Trial(s, windows, stall_fraction=stall, others_cores=others(s, n), **cpu(s)))
    raise AssertionError("the search proposed 200 settings")


def test_a_noisy_trial_is_measured_again_and_the_quiet_figure_believed():
    """A burst during nw=4's first trial (0.6x, others holding 1.5 cores): measured again, the quiet figure stands for
    the setting (not merged with the burst's), and the choice is the true best."""
    rate = lambda n: n * 50.0 if n else 20.0  # noqa: E731  latency-bound: more workers, more batches
    burst = lambda s, n: s == Setting("process", 4, 2) and n == 0  # noqa: E731
    search = drive(Search(max_workers=4, tolerance=0.03), lambda s, n, duel: rate(s.num_workers) * (
        0.6 if burst(s, n) else 1.0), others=lambda s, n: BURST if burst(s, n) else QUIET)  # fmt: skip
    four = search.trials[Setting("process", 4, 2)]
    assert four.repeated == 1 and four.others_cores == QUIET and four.median == 200.0
    assert len(four.windows) == 3  # replaced, not merged
    assert search.choice().num_workers == 4
    assert search.noise()["repeated"] == 1 and search.noise()["max_cores"] == BURST


def test_steady_load_repeats_nothing():
    """Others holding the cores through every trial alike: the trials are comparable, none is measured again."""
    rate = lambda n: n * 50.0 if n else 20.0  # noqa: E731
    search = drive(Search(max_workers=4, tolerance=0.03), lambda s, n, duel: rate(s.num_workers),
                   others=lambda s, n: BURST)  # fmt: skip
    assert all(t.repeated == 0 for t in search.order) and search.noise()["repeated"] == 0


def test_beside_steady_load_a_trial_of_few_workers_is_not_repeated_for_the_share_the_others_took():
    """Two busy loops on 2 cores, steady: the scheduler splits the cores by runnable process, so the others hold 1.0
    core beside nw=2 and 0.4 beside nw=8. The trial of 2 workers reads "noisy" beside nw=8's, but no quieter figure
    of it could reach the bar: it is not measured again, and nw=8 is chosen."""
    rate = lambda n: n * 50.0 if n else 20.0  # noqa: E731  latency-bound: more workers, more batches
    search = drive(Search(max_workers=8, tolerance=0.03, cores=2), lambda s, n, duel: rate(s.num_workers),
                   others=lambda s, n: 2 * 2 / (2 + s.num_workers))  # fmt: skip
    assert search._noisy(search.trials[Setting("process", 2, 2)])
    assert search.noise()["repeated"] == 0 and search.choice().num_workers == 8


def test_noise_that_never_settles_repeats_a_bounded_share():
    """A neighbour's job starts after the first trial and holds 1.5 cores to the end (0.6x): every later trial reads
    noisy beside the first, and measuring each again changes nothing; repeats stay within REPEAT_SHARE of the
    settings measured (at least MAX_REPEATS)."""
    count = {"n": 0}

    def figure(s, n, duel):
        count["n"] += 1
        return (s.num_workers * 50.0 if s.num_workers else 20.0) * (1.0 if count["n"] == 1 else 0.6)

    search = drive(Search(max_workers=8, tolerance=0.03, cores=2), figure,
                   others=lambda s, n: QUIET if count["n"] == 1 else BURST)  # fmt: skip
    repeats = search.noise()["repeated"]
    assert 0 < repeats <= max(MAX_REPEATS, math.ceil(REPEAT_SHARE * len(search.order))), (repeats, len(search.order))
    assert search.choice().num_workers == 8


def test_two_counts_within_noise_end_with_the_cheaper():
    """CPU-bound, nw=2 and nw=3 on 2 cores truly alike, nw=3's one trial 4% high (so the only one within tolerance
    of it): measured in turn, nw=2 is taken, and a note says so."""
    rate = lambda n: {0: 55.0, 1: 62.0, 2: 117.0, 3: 116.0, 4: 110.0}[n]  # noqa: E731
    high = lambda s, n, duel: rate(s.num_workers) * (1.04 if s.num_workers == 3 and n == 0 else 1.0)  # noqa: E731
    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), high, cpu=readings(rate, 0.97 / 62))
    assert search.choice() == Setting("process", 2, 2)
    assert any(d.cheap == Setting("process", 2, 2) and d.outcome in ("cheap", "tie") for d in search.duels)
    assert any("nw=2 pf=2 process as good" in n or "tie, the cheaper taken" in n for n in search.notes)


def test_a_dearer_setting_clearly_better_in_every_round_wins():
    """prefetch 4 truly 8% better, its one trial only 2% (within tolerance, so the cheaper prefetch 2 was the choice
    by the bar): measured in turn it wins every round, and is taken."""
    def figure(s, n, duel):
        gain = 1.0 if s.prefetch_factor != 4 else (1.08 if duel else 1.02)
        return min(s.num_workers, 2) * 100.0 * gain if s.num_workers else 40.0

    search = drive(Search(max_workers=4, tolerance=0.03), figure)
    assert search.choice() == Setting("process", 2, 4)
    duel = next(d for d in search.duels if d.dear == Setting("process", 2, 4))
    assert duel.outcome == "dear" and len(duel.rounds) >= 2 and all(r > 1.03 for r in duel.ratios)
    assert any("nw=2 pf=4 process clearly better" in n for n in search.notes)


def test_the_search_takes_a_gain_that_wins_every_round_on_the_mean_though_one_round_was_within_the_tolerance():
    """prefetch 4 truly 5% better, its one trial 2% (so prefetch 2 is the choice by the bar), its duel's rounds
    1.02, 1.08 and 1.05x: not better by the tolerance in every round, so the every-round rule called it a tie after
    the first; better in every round and by 4.8% on the mean, it is taken."""
    gains = {0: 1.02, 1: 1.02, 2: 1.08, 3: 1.05}

    def figure(s, n, duel):
        gain = gains.get(n, 1.05) if s.prefetch_factor == 4 else 1.0
        return min(s.num_workers, 2) * 100.0 * gain if s.num_workers else 40.0

    search = drive(Search(max_workers=4, tolerance=0.03), figure)
    assert search.choice() == Setting("process", 2, 4), search.notes
    duel = next(d for d in search.duels if d.dear == Setting("process", 2, 4))
    assert duel.by_mean and duel.outcome == "dear" and [round(r, 2) for r in duel.ratios] == [1.02, 1.08, 1.05]


A, B = Setting("process", 2, 2), Setting("process", 3, 2)


def test_a_duel_on_the_mean_stops_at_a_round_the_dearer_did_not_win_and_needs_a_larger_mean_over_two_rounds():
    def duel(*ratios):
        d = Duel(A, B, 0.03, "test", by_mean=True)
        for r in ratios:
            d.record(d.next(), 100.0 if d.next() == A else 100.0 * r)
            d.record(d.next(), 100.0 if d.next() == A else 100.0 * r)
        return d

    assert duel(1.10, 0.99).outcome == "tie" and duel(1.10, 0.99).winner == A  # a round lost: no more rounds
    assert duel(0.99).outcome == "tie" and len(duel(0.99).rounds) == 1
    assert duel(1.01, 1.02).outcome == "cheap"  # better, but never by the tolerance
    assert duel(1.05, 1.06).outcome is None  # 5.5% over two rounds: under twice the tolerance, a third is run
    assert duel(1.05, 1.06, 1.04).outcome == "dear"  # 5% over three: over 1.5 times
    assert duel(1.07, 1.06).outcome == "dear"
    assert duel(1.04, 1.02, 1.03, 1.02).outcome == "tie"  # better each time, by too little: the cheaper at the end
    forfeited = duel(1.10)
    forfeited.forfeit()
    assert forfeited.outcome == "tie" and forfeited.winner == A


def _dearer_taken(gain: float, spread: float, by_mean: bool, seeds: int = 600) -> tuple[float, float]:
    """The share of seeded duels the dearer setting wins when it is truly ``gain`` better and each round's ratio is
    off by ``spread`` (its standard deviation, on the log), and the mean number of rounds played."""
    taken = rounds = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        d = Duel(A, B, 0.03, "test", by_mean=by_mean)
        while (s := d.next()) is not None:
            d.record(s, 100.0 * (1 + gain if s == B else 1.0) * math.exp(rng.gauss(0, spread / math.sqrt(2))))
        taken += d.outcome == "dear"
        rounds += len(d.rounds)
        assert len(d.rounds) <= MAX_ROUNDS
    return taken / seeds, rounds / seeds


@pytest.mark.parametrize("spread", [0.05, 0.08])
def test_on_the_mean_a_duel_finds_a_real_gain_more_often_and_still_keeps_a_tie_cheap(spread):
    """Rounds as noisy as a shared 2-core VM's (a round's ratio spread 5-10%): a true 6% or 9% gain is found
    clearly more often than by "better by the tolerance in every round", at most about half a round more; a true
    tie still goes to the cheaper setting at least 80% of the time."""
    for gain in (0.06, 0.09):
        every, every_rounds = _dearer_taken(gain, spread, by_mean=False)
        mean, mean_rounds = _dearer_taken(gain, spread, by_mean=True)
        assert mean >= every + 0.08, (gain, every, mean)
        assert mean_rounds <= every_rounds + 0.75, (gain, every_rounds, mean_rounds)
    assert _dearer_taken(0.0, spread, by_mean=True)[0] <= 0.2


def test_a_dearer_neighbour_that_read_within_the_noise_below_the_choice_is_measured_in_turn():
    """CPU-bound samples where 3 workers give 8% more than 2 on 2 cores and 4 clearly less (the machine's own, as
    `fastfeed bench tune`'s (a) found in duels), but nw=3's one trial read 3% below nw=2's: nw=2 is the choice by one
    trial each, and only a duel against the dearer neighbour shows that 3 win every round."""
    true = {0: 55.0, 1: 62.0, 2: 117.0, 3: 127.0, 4: 100.0}
    hidden = lambda s, n, duel: 114.0 if s.num_workers == 3 and not duel else true[s.num_workers]  # noqa: E731
    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), hidden, cpu=readings(true.get, 0.97 / 62))
    assert [d.reason for d in search.duels if d.reason.startswith("more workers")], search.notes
    assert search.choice().num_workers == 3, (search.choice(), search.notes)


@pytest.mark.parametrize("gain, chosen, decided", [(0.95, 2, True), (1.25, 3, False)], ids=["rejected", "clearly"])
def test_the_model_rejects_more_workers_than_cores_unless_they_win_clearly(gain, chosen, decided):
    """CPU-bound on 2 cores, nw=3's one trial 10% above nw=2: kept only when it wins in turn clearly (truly 25%
    better); truly 5% worse, nw=2 is taken, and the result says the model decided."""
    rate = lambda n: {0: 55.0, 1: 62.0, 2: 117.0, 3: 117.0 * gain, 4: 117.0 * gain * 0.9}[n]  # noqa: E731

    def figure(s, n, duel):
        return max(117.0 * 1.1, rate(3)) if s.num_workers == 3 and n == 0 and not duel else rate(s.num_workers)

    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), figure, cpu=readings(rate, 0.97 / 62))
    model = search.model()
    assert model["cpu_bound"] and model["max_useful_workers"] == 2 and model["decided"] is decided
    assert search.choice().num_workers == chosen
    assert any(d.reason.startswith("the model") for d in search.duels)
    assert any(n.startswith("the model decided") for n in search.notes) is decided


def test_beside_steady_load_cpu_bound_workers_past_the_cores_are_searched_and_kept_when_they_win():
    """Two busy loops hold 1.8 of the 2 cores through every trial (the bench's busy runs): the scheduler shares the
    cores by runnable process, so nw=4 takes more of them than nw=2 (100.8 against 92.2 batches/s measured). The
    model's range (then one past the cores) ended at nw=3, whose one trial reads low: beside such load the whole range
    is searched, and nw=4, clearly better in turn, is chosen. On a quiet machine with 8 workers allowed, the range
    stands at MODEL_SLACK past the cores: nothing past nw=4 is measured."""
    busy = {0: 20.0, 1: 48.0, 2: 92.2, 3: 97.0, 4: 100.8}

    def figure(s, n, duel):  # nw=3's first trial reads low (a burst of the neighbours'): it is not seen as the best
        return busy[s.num_workers] * (0.9 if s.num_workers == 3 and n == 0 and not duel else 1.0)

    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), figure,
                   cpu=readings(lambda n: busy[n], 0.97 / 62), others=lambda s, n: 1.8)  # fmt: skip
    assert any(t.setting.num_workers == 4 for t in search.order)
    assert search.choice().num_workers == 4, search.notes
    rate = lambda n: cpu2(n) if n <= 4 else 88.0 - 4 * (n - 4)  # noqa: E731  oversubscribed: falling on
    quiet = drive(Search(max_workers=8, tolerance=0.03, cores=2), lambda s, n, duel: rate(s.num_workers),
                  cpu=readings(rate, 0.97 / 62))  # fmt: skip
    assert max(t.setting.num_workers for t in quiet.order) == 2 + MODEL_SLACK and quiet.choice().num_workers == 2


def test_a_burst_that_lowers_nw2_does_not_hand_the_choice_to_nw3():
    """A burst during nw=2's trial (nw=3 reads high beside it) and during its repeat: the quietest figure of nw=2,
    then the model's duel, keep nw=2; the duel's own noisy rounds are measured again."""
    bursts = {(2, 0), (2, 1)}  # nw=2's first trial and its repeat

    def figure(s, n, duel):
        return cpu2(s.num_workers) * (0.6 if (s.num_workers, n) in bursts else 1.0)

    def others(s, n):
        return BURST if (s.num_workers, n) in bursts else QUIET

    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), figure, cpu=readings(cpu2, 0.97 / 62),
                   others=others)  # fmt: skip
    assert search.choice().num_workers == 2
    assert search.trials[Setting("process", 2, 2)].repeated == 2


def test_a_noisy_duel_round_is_measured_again():
    """A burst during a duel's first figure: that figure is measured again, and the quiet one recorded."""
    state = {"duel figures": 0, "burst": False}

    def figure(s, n, duel):
        state["duel figures"] += duel
        state["burst"] = duel and state["duel figures"] == 1
        if s.num_workers == 3 and n == 0:
            return 125.0  # nw=3's trial reads high: the model's duel follows
        return cpu2(s.num_workers) * (0.6 if state["burst"] else 1.0)

    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), figure, cpu=readings(cpu2, 0.97 / 62),
                   others=lambda s, n: BURST if state["burst"] else QUIET)  # fmt: skip
    duel = search.duels[0]
    assert state["duel figures"] == 2 * len(duel.rounds) + 1  # one figure measured twice
    assert all(c == cpu2(2) for c, _ in duel.rounds)  # the burst's 0.6x figure was not recorded
    assert search.noise()["repeated"] == 1 and search.choice().num_workers == 2


# -- a simulated noisy machine ---------------------------------------------------------------------------------

CORES = 2
GRID = 1 + 2 * CORES * 4  # nw=0, and nw 1..4 x prefetch 1, 2, 4, 8: the bench's exhaustive grid
DUEL_COST = 2 / 3  # a duel's round: 2 windows of an ordinary trial's 3
# name: (batches/s by nw, stall fraction, the workers' CPU s per batch, the loop's, a worker's s per batch by nw,
# the part of it the worker sleeps (the rest it runs or waits for a core), the slowest batches over a typical one)
WORKLOADS = {
    "cpu-bound": (cpu2, 0.5, 0.97 / 62, 0.001, lambda n: n / cpu2(n), 0.0, 1.5),
    "latency-bound": (lambda n: n * 50.0 if n else 20.0, 0.5, 0.002, 0.001, lambda n: 0.02, 0.018, 1.05),
    "slow step": (lambda n: 19.5 if n == 0 else 20.0, 0.01, 0.0008, 0.001, lambda n: 0.0009, 0.0001, 1.0),
    "in-memory": (lambda n: 500.0 if n == 0 else 300.0, 0.4, 0.001, 0.002, lambda n: 0.0012, 0.0002, 1.1),
}


def simulate(name: str, seed: int, noise=0.15, bursts=0.15, waits=True) -> tuple[float, float, Search]:
    """One tuning on a noisy machine: each trial's level is off by up to ``noise`` either way, its windows by 2%
    more, and a ``bursts`` share of trials (duel rounds too) run during a neighbour's burst (0.6x, others holding
    1.2-1.7 cores). ``waits``: the trials carry the workers' run-queue waits (False: a kernel without schedstat).
    Returns the choice's true throughput over the best's, the cost in ordinary trials, the search."""
    rate, stall, cpu_s, loop_s, load_s, sleep_s, tail = WORKLOADS[name]
    rng = random.Random(seed)
    search = Search(max_workers=2 * CORES, tolerance=0.03, cores=CORES)
    cost = 0.0
    while (s := search.propose()) is not None:
        level = rate(s.num_workers) * (1 + rng.uniform(-noise, noise))
        others = rng.uniform(0, 0.2)
        if rng.random() < bursts:
            level, others = level * 0.6, 1.2 + rng.uniform(0, 0.5)
        cpu = {"worker_cpu_s": cpu_s, "load_s": load_s(s.num_workers), "load_tail": tail} if s.num_workers else {}
        if cpu and waits:
            cpu["worker_wait_s"] = max(0.0, load_s(s.num_workers) - cpu_s - sleep_s)
        windows = [level * (1 + rng.uniform(-0.02, 0.02)) for _ in range(2 if search.in_duel else 3)]
        cost += DUEL_COST if search.in_duel else 1
        search.report(Trial(s, windows, stall_fraction=stall, others_cores=others, loop_cpu_s=loop_s, **cpu))
    best = max(rate(n) for n in range(2 * CORES + 1))
    return rate(search.choice().num_workers) / best, cost, search


@pytest.mark.parametrize("waits", [True, False], ids=["waits", "no-schedstat"])
def test_on_a_simulated_noisy_machine_the_choice_is_within_5_percent_of_the_best(waits):
    """200 seeded tunings of each of four workloads with 15% noise per trial and bursts on 15% of trials, with the
    workers' run-queue waits read and without (a kernel without schedstat): every choice's true throughput is at
    least 0.95 of the best, and the cost (a duel's round as 2/3 of a trial) is a quarter of the exhaustive grid's on
    average (0.35 at most for any one workload's average); duels stay within their bounds.

    Measured (this commit), with waits and without alike but for in-memory: quality 1.00 at the minimum on cpu-,
    latency-bound and in-memory, 0.975 (nw=0 under a slow step, 2.5% below the rest) on the slow step; cost / grid,
    mean (90th percentile, max): cpu-bound 0.32 (0.43, 0.59), latency-bound 0.19 (0.24, 0.41), slow step 0.17
    (0.24, 0.29), in-memory 0.24 with waits, 0.21 without (0.29, 0.35).
    """
    means = {}
    for name in WORKLOADS:
        quality, costs = [], []
        for seed in range(200):
            q, cost, search = simulate(name, seed, waits=waits)
            quality.append(q)
            costs.append(cost / GRID)
            assert len(search.duels) <= MAX_DUELS and all(len(d.rounds) <= MAX_ROUNDS for d in search.duels)
        assert min(quality) >= 0.95, (name, sorted(quality)[:5])
        means[name] = statistics.fmean(costs)
        assert means[name] <= 0.35, (name, means[name])
    assert statistics.fmean(means.values()) <= 0.25, means


def test_without_noise_readings_nothing_is_repeated_and_duels_stay_bounded():
    """Trials with no others' reading (threads, old drivers) repeat nothing; over many noisy curves the duels are at
    most MAX_DUELS of at most MAX_ROUNDS rounds each."""
    for seed in range(50):
        rng = random.Random(seed)
        search = drive(Search(max_workers=4, tolerance=0.03, cores=2),
                       lambda s, n, duel: cpu2(s.num_workers) * (1 + rng.uniform(-0.15, 0.15)),
                       cpu=readings(cpu2, 0.97 / 62), others=lambda s, n: None)  # fmt: skip
        assert search.noise() is None and all(t.repeated == 0 for t in search.order)
        assert len(search.duels) <= MAX_DUELS and all(len(d.rounds) <= MAX_ROUNDS for d in search.duels)
        assert search.choice().num_workers == 2



def tie2(n: int, pf: int | None) -> float:
    """CPU-bound samples on a quiet 2-core VM as `fastfeed bench tune`'s (a) measured them in 16 rounds in turn: nw=2
    to 4 within 1% of each other, nw=3 at prefetch 2 3% below (its three workers share two cores unevenly)."""
    return {0: 107.0, 1: 106.0, 2: 186.0, 3: 186.0 * (0.97 if (pf or 0) <= 2 else 1.007), 4: 186.0 * 1.01}[n]


def test_on_a_quiet_machine_cpu_bound_ties_never_take_more_than_one_worker_past_the_cores():
    """400 seeded tunings of the tie above, each trial's level off by the 6.5% (standard deviation) such trials
    spread: the choice is never more than one worker past the cores (the grid's knee is 2, so nw=4 would be past
    knee + 1), and within 0.95 of the best; nw=4 is measured at all in 1% of them at most. With the range at 2 past the cores, 44 of 400 took nw=4: a duel of 2-4
    rounds reads a tie as a clear gain about one time in five at this spread."""
    chosen, past = [], 0
    for seed in range(400):
        rng = random.Random(seed)

        def figure(s, n, duel, rng=rng):
            return tie2(s.num_workers, s.prefetch_factor) * math.exp(rng.gauss(0, 0.065))

        search = drive(Search(max_workers=4, tolerance=0.03, cores=2), figure,
                       cpu=readings(lambda n: tie2(n, 2), 16 * 0.0006))  # fmt: skip
        chosen.append(search.choice())
        assert search.model()["cpu_bound"] and search.model()["max_useful_workers"] == 2
        past += any(t.setting.num_workers > 3 for t in search.order)
    assert max(c.num_workers for c in chosen) <= 3
    assert min(tie2(c.num_workers, c.prefetch_factor) for c in chosen) >= 0.95 * tie2(4, 2)
    assert past <= 4  # nw=3's one trial 25% above nw=2's (MODEL_SHORT) by noise alone: the whole range searched


@pytest.mark.parametrize("lift, searched", [(1.2, 3), (1.3, 4)], ids=["noise", "model-short"])
def test_cpu_bound_counts_past_the_cores_are_searched_only_when_one_more_reads_far_above_the_cores(lift, searched):
    """CPU-bound readings on a quiet 2-core machine: nw=3 reading 20% above nw=2 is within what the trials' noise
    gives, and nothing past 3 is measured; 30% above (past MODEL_SHORT) says the model fell short, and the whole range
    is searched."""
    rate = {0: 55.0, 1: 62.0, 2: 117.0, 3: 117.0 * lift, 4: 117.0 * lift}
    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), lambda s, n, duel: rate[s.num_workers],
                   cpu=readings(rate.get, 0.97 / 62))  # fmt: skip
    assert search.model()["cpu_bound"] and search.model()["max_useful_workers"] == 2
    assert max(t.setting.num_workers for t in search.order) == searched


# -- the driver and the result ---------------------------------------------------------------------------------


def test_drive_measures_duel_rounds_short_and_forfeits_a_duel_the_budget_cuts():
    """offline.drive: the search says which proposals are duel rounds (measured short); when the budget runs out in
    the middle of a duel, the duel decides on the rounds it has, and the result carries it."""
    search = Search(max_workers=4, tolerance=0.03, cores=2)
    asked = []

    def trial_of(s: Setting, first: bool) -> Trial:
        asked.append(search.in_duel)
        if search.in_duel and asked.count(True) == 3:  # the second round's first figure: out of time
            raise measure.OutOfTime(None)
        level = 140.0 if s.num_workers == 3 else cpu2(s.num_workers)  # nw=3 wins the first round clearly
        return Trial(s, [level] * (2 if search.in_duel else 3), stall_fraction=0.5, others_cores=QUIET,
                     **readings(cpu2, 0.97 / 62)(s))  # fmt: skip

    assert offline.drive(search, trial_of) is False
    result = offline._result(search, False, 1.0, 16)
    assert asked.count(True) == 3 and asked[-1] and not any(asked[:-3])  # rounds follow the ordinary trials
    assert result.num_workers == 2 and not result.converged  # one round is not "clearly", every round
    assert result.duels and result.duels[0]["outcome"] == "tie" and len(result.duels[0]["rounds"]) == 1
    assert result.model["cpu_bound"] and result.model["decided"] and result.noise["repeated"] == 0
    assert any(n.startswith("the model decided") for n in result.notes)


def test_a_duel_round_is_measured_with_exactly_its_windows():
    """measure.run(windows=2), as offline.tune measures a duel's round: two windows, however much they spread
    (tolerance 0 would otherwise ask for more, up to MAX_WINDOWS)."""
    trial = measure.run(fastfeed.DataLoader, list(range(64)), {"batch_size": 4}, Setting("process", 0, None), None,
                        tolerance=0.0, deadline=float("inf"), window_s=0.01, windows=2)  # fmt: skip
    assert len(trial.windows) == 2
    again = measure.run(fastfeed.DataLoader, list(range(64)), {"batch_size": 4}, Setting("process", 0, None), None,
                        tolerance=0.0, deadline=float("inf"), window_s=0.01)  # fmt: skip
    assert len(again.windows) >= measure.MIN_WINDOWS


def _result() -> TuneResult:
    search = drive(Search(max_workers=4, tolerance=0.03, cores=2),
                   lambda s, n, duel: 125.0 if s.num_workers == 3 and n == 0 else cpu2(s.num_workers),
                   cpu=readings(cpu2, 0.97 / 62), others=lambda s, n: BURST if (s.num_workers, n) == (2, 0) else QUIET)
    return offline._result(search, True, 2.0, 16)


def test_the_result_shows_the_noise_the_duels_and_the_notes():
    """The table has each trial's spread and others' cores (``r``: measured again); below it the noise seen, a line
    per duel and the notes. A result saved before these fields loads with their defaults."""
    result = _result()
    text = str(result)
    header = text.splitlines()[1]
    assert "spread" in header and "noise" in header
    rows = {line.split()[0]: line.split() for line in text.splitlines()[2:] if line.startswith("*")}
    assert rows["*"][1:3] == ["2", "2"] and rows["*"][-3] == f"{QUIET:.2f}r"  # the choice, measured again
    assert f"{BURST:.2f} at most; 1 trial(s) measured again as noisy" in text
    assert "duel: nw=3 pf=2 process vs nw=2 pf=2 process (the model" in text
    assert "note: the model decided" in text
    again = TuneResult.from_dict(result.as_dict())
    assert again == result
    old = {k: v for k, v in result.as_dict().items() if k not in ("duels", "noise", "model", "notes")}
    assert TuneResult.from_dict(old).duels == [] and TuneResult.from_dict(old).notes == []


def test_the_cli_prints_them(monkeypatch, capsys, tmp_path):
    """``fastfeed tune`` prints the result's table with the noise column, the duels and the notes."""
    result = _result()
    monkeypatch.setenv("FASTFEED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fastfeed, "tune", lambda dataset, *, on_trial=None, **kwargs: result, raising=False)
    assert cli.main(["tune", "_tune_targets:rows", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "noise" in out and "duel: nw=3 pf=2 process vs nw=2 pf=2 process" in out and "note: the model decided" in out


def test_on_a_busy_machine_cpu_bound_workers_are_still_seen_as_cpu_bound():
    """Two busy loops hold 1.8 of the 2 cores: each of 2 CPU-bound workers runs a tenth of its time per batch, yet
    uses all the CPU it could have had, so the model still counts it CPU-bound; a sleeping (latency-bound) worker
    on a quiet machine uses a fraction of its time and is not."""
    busy = Search(max_workers=4, tolerance=0.03, cores=2)
    busy.report(Trial(Setting("process", 2, 2), [20.0] * 3, stall_fraction=0.5, others_cores=1.8,
                      worker_cpu_s=0.01, load_s=0.1, loop_cpu_s=0.0005))  # fmt: skip
    model = busy.model()
    assert model["cpu_bound"] and model["max_useful_workers"] == 2, model
    sleeping = Search(max_workers=4, tolerance=0.03, cores=2)
    sleeping.report(Trial(Setting("process", 2, 2), [20.0] * 3, stall_fraction=0.5, others_cores=0.05,
                          worker_cpu_s=0.005, load_s=0.1, loop_cpu_s=0.0005))  # fmt: skip
    assert not sleeping.model()["cpu_bound"]


def test_beside_busy_loops_workers_that_wait_for_a_core_are_read_by_the_time_they_did_not_wait():
    """Two busy loops hold 1.95 of 2 cores (`fastfeed bench tune`'s (b), busy): latency-bound workers wait 44 of
    their 62 ms per batch in a run queue (each sleep ends in one) and use 2.5 ms of CPU, 0.14 of the rest: not
    CPU-bound, so the model asks for no duel of worker counts, whose choice of 4 (latency-bound, more is better)
    stands. CPU-bound ones that wait 90 of their 100 ms use all of the 10 ms left: CPU-bound."""
    rate = lambda n: 16.0 * n if n else 56.0  # noqa: E731
    waiting = lambda s: ({"worker_cpu_s": 0.0025, "load_s": 0.062, "loop_cpu_s": 0.0005, "worker_wait_s": 0.044}
                         if s.num_workers else {"loop_cpu_s": 0.0005})  # noqa: E731  # fmt: skip
    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), lambda s, n, duel: rate(s.num_workers),
                   cpu=waiting, others=lambda s, n: 1.95, stall=0.98)  # fmt: skip
    assert not search.model()["cpu_bound"], search.model()
    assert not any(d.reason.startswith("the model") for d in search.duels), search.notes
    assert search.choice().num_workers == 4
    busy = Search(max_workers=4, tolerance=0.03, cores=2)
    busy.report(Trial(Setting("process", 2, 2), [20.0] * 3, stall_fraction=0.5, others_cores=1.8, worker_cpu_s=0.01,
                      load_s=0.1, loop_cpu_s=0.0005, worker_wait_s=0.09))  # fmt: skip
    assert busy.model()["cpu_bound"], busy.model()


def test_the_fewest_workers_within_the_noise_below_the_choice_are_measured_in_turn():
    """CPU-bound samples beside busy loops, where loading in the loop gives 1.2x 2 workers, but nw=0's one trial
    read 60 against nw=2's 65 (windows spreading 30%, as they did there): not the choice by one trial each, yet
    within the noise. The duel is against nw=0, the fewest workers within it, not nw=1 (which 2 beat clearly), and
    nw=0 wins it."""
    true = {0: 79.0, 1: 50.0, 2: 65.0, 3: 64.0, 4: 63.0}
    low = lambda s, n, duel: 60.0 if s.num_workers == 0 and not duel else true[s.num_workers]  # noqa: E731
    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), low, cpu=readings(true.get, 0.0098),
                   others=lambda s, n: 1.4, stall=0.98, spread=0.3)  # fmt: skip
    fewer = [d for d in search.duels if d.reason.startswith("fewer workers")]
    assert fewer and fewer[0].cheap.num_workers == 0, search.notes
    assert search.choice().num_workers == 0, (search.choice(), search.notes)


def test_beside_busy_loops_loading_in_the_loop_is_measured_when_the_workers_cpu_says_it_could_win():
    """CPU-bound samples beside two busy loops (`fastfeed bench tune`'s (a), busy): each of 2 workers waits for a core
    as long as it runs, so its time per batch is 3x its CPU time, and an estimate of loading in the loop from that time
    (0.5x of the best) never measured num_workers=0, the grid's best there (1.2x the workers'). From the workers' CPU
    time over the core the others left the loop, it is measured, and chosen."""

    def rate(n: int) -> float:
        return {0: 79.0, 1: 62.0, 2: 65.0, 3: 65.0, 4: 63.0}[n]

    search = drive(Search(max_workers=4, tolerance=0.03, cores=2), lambda s, n, duel: rate(s.num_workers),
                   cpu=readings(rate, 0.0098), others=lambda s, n: 1.4, stall=0.98)  # fmt: skip
    assert any(s.num_workers == 0 for s in search.trials), list(search.trials)
    assert search.choice().num_workers == 0, search.choice()
