"""The search: which setting to measure next, and which to choose. Pure: it never measures.

The driver (``offline.tune``, ``online.OnlineTuner`` on the user's own epoch) asks
``propose()`` for a setting, measures it and hands the ``Trial`` back with ``report()``,
until ``propose()`` returns None; ``choice()`` is the answer, at any point.

The phases:

1. **Is loading the bottleneck at all?** A small setting first. When the consumer waited for
   input less than ``NOT_INPUT_BOUND`` of the time, fewer workers are tried, down while they
   stay within tolerance, and nothing else: a tuner that spends minutes finding nothing to
   gain is a cost.
2. **The knee in ``num_workers``**, by bisection over ``[min, max]`` at a fixed prefetch:
   ``num_workers=0`` is another regime (no transport at all; loading in the loop), so it is
   not bisected: it is measured when the workers' own per-batch time (for CPU-bound samples,
   their CPU time over the core the loop could have) says that loading in the loop could come
   within ``ZERO_MARGIN`` of the best seen (in-memory data, say; CPU-bound samples beside busy neighbours).
   the smallest count within ``tolerance`` of the best throughput seen. When the best point
   has an unmeasured gap to a clearly worse right neighbour (too many workers for the
   cores), the gap is bisected too: the peak may lie inside it. With CPU readings, counts whose
   workers could not reach the best even on a core each are not measured (``_out_of_reach``), and
   for CPU-bound samples on a machine of its own the range ends ``MODEL_SLACK`` above what the cores can run
   (``_model_top``).
3. **``prefetch_factor``** at the knee, from ``PREFETCH``: 4 first; 8 only when 4 gained
   more than the tolerance; else 1, when memory is tight (a batch less per worker). Where the knee's slowest
   batches last no longer than ``DEFAULT_PREFETCH`` typical ones and the workers wait rather than compute (``_steady``),
   4 is not tried: only 1, when tight.
4. **``worker_type``**, when several are allowed, at the chosen counts.
5. **Remote workers** (``max_remote``, ``fastfeed.tune(remote=...)``): the local workers fixed at the
   choice so far, Ray actors added beside them (Pecan's order: the host's own cores first, the
   shortfall sent away). The actor count is bisected over ``[1, max_remote]`` as ``num_workers``
   was, the choice so far standing for 0 actors: the smallest count within ``tolerance`` of the
   best, and the gap to a clearly worse right neighbour (the loop receiving no faster) bisected too.
6. **Duels** (``fastfeed.tuning.duel``), at most ``MAX_DUELS``: two settings measured in turn (short trials) until
   one is clearly better, instead of believing medians measured a minute apart; decided on the mean of the rounds
   (``by_mean``: the dearer better in every round, and by a mean ratio past the tolerance). In order:
   a. the best measured setting against the choice (the cheapest within tolerance of it, by one trial each):
      when the best wins clearly, the cheapest within tolerance of it on its line (fewer workers) is the choice;
   b. for CPU-bound samples (``model()``), a choice with more workers than the cores can run
      (``max_useful_workers``) against that many (measured first when it was not): it is kept only if it wins
      clearly. Before (c), so that the bound on duels never starves it;
   c. the choice against the fewest workers measured within the noise band below it (``_band``; its prefetch, or
      ``num_workers=0``): CPU-bound samples beside busy loops, where loading in the loop was the grid's best (1.2x
      2 workers), read nw=0 below nw=2 in a trial whose windows spread 40%, and nw=1 was not within the noise;
   d. the choice against the best of the settings with more workers (its prefetch) that read within the noise band
      below it: a noisy trial may have hidden a real gain, which the choice by one trial each cannot see. CPU-bound
      samples on 2 cores in `fastfeed bench tune`: nw=4 read 0.3% below nw=2 (one trial each), and the choice of 2
      measured 0.85-0.91x of the grid's best head to head, where in other runs nw=4 beat 2 clearly in every round
      of a duel.

Throughout, **noise**: a trial during which other processes held more than ``NOISY_CORES`` cores above the
quietest trial's is measured again (while noisy, up to ``MAX_REPEATS`` times), and the quietest believed
(``Trial.repeated``), not merged; a duel's figure likewise. Only a trial whose quieter figure could change the choice
is measured again (``_could_change``), and repeats are bounded by ``REPEAT_SHARE`` of the settings measured. Load that
is steady over every trial repeats nothing: the trials stay comparable.

Until the duels, the choice is the cheapest measured setting (fewest Ray actors, then fewest workers,
then least prefetch, then the first worker type listed) within ``tolerance`` of the best one measured (its median
less half its spread, up to half the tolerance: see ``_bar``); after them, the last duel's winner.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from .duel import Duel
from .result import Setting, Trial

NOT_INPUT_BOUND = 0.02  # stall fraction below which loading is not the bottleneck
ZERO_MARGIN = 0.8  # num_workers=0 is measured when its estimate reaches this share of the best
PREFETCH = (1, 2, 4, 8)
DEFAULT_PREFETCH = 2
NOISY_CORES = 0.5  # others' cores above the quietest trial's that make a trial noisy: it is measured again
# ... up to this many times while it stays noisy: a burst that outlasts one trial (a neighbour's build) often
# outlasts the next too, and a figure believed from inside one can hand the choice to the wrong setting.
MAX_REPEATS = 2
# Repeats, of trials and of duels' figures together, may number at most this share of the settings measured (and
# MAX_REPEATS in any case): where neighbours come and go through the whole tuning, repeating every noisy trial spent 12
# trials of one run on repeats (0.85x the exhaustive grid's time) in `fastfeed bench tune`'s busy runs, and chose worse.
REPEAT_SHARE = 1 / 3
MAX_DUELS = 2
CPU_BOUND = 0.7  # the workers' CPU time over their time per batch from which samples count as CPU-bound
# For CPU-bound samples on a machine of its own the search goes this many workers past what the model says the cores
# can run: one more worker fills the pipeline's waits (a free slot, its next indices) while the others compute. More
# are not searched: CPU-bound workers past the cores have no core to run on, and a trial cannot tell them apart from
# the cores' count. On a quiet 2-core VM (`fastfeed bench tune`'s (a), 16 rounds in turn of 3 windows each), nw=4 gave
# 1.010x nw=2's throughput, nw=3 at prefetch 4 1.007x, while a round's ratio of two settings spread 6-10% (its
# standard deviation; 8-10% for windows of 0.25 s taken in turn from two live loaders, so the spread is the VM's
# speed, not the trials' start-ups): a duel of 2-4 rounds reads such a tie as a clear gain about one time in five, and
# with the range at 2 past the cores, 2 of 5 quiet runs of the bench took nw=4 where the knee was 2.
# The cost: on an earlier day 4 workers beat 2 by 3-10% in every round of duels for an hour, while 3 (at prefetch 2,
# its three workers sharing two cores unevenly) read below 2; a range cut at 3 then chose 2, 0.88x the grid's best.
MODEL_SLACK = 1
# ... unless the top of that range read this much more than the model's own count (its one trial each): a gain that
# the trials' noise (a trial's level spreads 6-7%) does not explain, so the model fell short and the whole range is
# searched.
MODEL_SHORT = 0.25
MIN_CORE_SHARE = 0.05  # the least share of a core a worker is taken to have had (cores all taken by others)
MAX_BAND = 0.25  # the widest noise band: settings further apart than this are not dueled, whatever the spread
# Others' cores, on average over the trials, from which the machine counts as shared: the kernel then splits the cores
# between runnable processes, so more workers take more of them from the others than the cores alone would give.
SHARED_CORES = 0.5


class Search:
    """Args:
    max_workers: the largest ``num_workers`` tried.
    tolerance: settings within this fraction of the best throughput count as equal.
    worker_types: the worker types allowed; the first is preferred at equal throughput.
    num_workers: a fixed ``num_workers`` (only prefetch is searched), or None.
    prefetch_factor: a fixed ``prefetch_factor``, or None to search it.
    min_workers: the smallest ``num_workers`` allowed (1 when the loader's other
        arguments need workers: ``persistent_workers``, ``multiprocessing_context``).
    fits: ``fits(setting)`` -> None, or why the setting cannot run (memory, say): it is then
        recorded as skipped, never measured.
    tight: ``tight(setting)`` -> whether its memory is a concern (a large share of the budget):
        only then is ``prefetch_factor=1`` tried, to save a batch per worker.
    max_remote: the most Ray actors tried beside the local workers (0: none, the remote phase is skipped).
    cores: the CPUs this rank may use (``offline.rank_cpus``), for the model of what more workers can give; None:
        no model.

    After the search, ``duels`` holds the duels run, ``notes`` a line on what each, and the model, decided.
    ``in_duel`` says whether the last proposal is a duel's round (the driver may measure it with a short trial).
    """

    def __init__(
        self, *, max_workers: int, tolerance: float, worker_types=("process",), num_workers: int | None = None,
        prefetch_factor: int | None = None, min_workers: int = 0, fits: Callable[[Setting], str | None] | None = None,
        tight: Callable[[Setting], bool] | None = None, max_remote: int = 0, cores: float | None = None,
    ):  # fmt: skip
        self.tolerance = tolerance
        self.max_remote = max_remote
        self._local: Setting | None = None  # the local choice the remote phase adds actors to
        self.types = tuple(worker_types)
        self.fixed_nw = num_workers
        self.fixed_pf = prefetch_factor
        self.lo = num_workers if num_workers is not None else min_workers
        self.hi = num_workers if num_workers is not None else max(max_workers, min_workers)
        self.fits = fits or (lambda setting: None)
        self.tight = tight or (lambda setting: False)
        self.trials: dict[Setting, Trial] = {}
        self.order: list[Trial] = []  # as reported
        self.input_bound = True
        self._phase = "check"
        self._small: Setting | None = None
        self.cores = cores
        self.duels: list[Duel] = []
        self.notes: list[str] = []
        self.in_duel = False
        self._duel: Duel | None = None  # the duel under way
        self._held: Trial | None = None  # a duel's noisy figure (the quietest), until it is measured again
        self._takes = 0  # ... and how many times it was
        self._winner: Setting | None = None  # the last duel's winner: the choice after the duels
        self._lost: set[Setting] = set()  # cheaper settings a duel found clearly worse
        self._repeating: Setting | None = None  # a noisy trial being measured again
        self._repeated: dict[Setting, int] = {}  # times each setting was measured again as noisy
        self._others: list[float] = []  # others' cores of every trial measured, duels' and repeats' included
        self._retaken = 0  # duel figures measured again because they were noisy
        self._model_decided = False

    # -- settings ---------------------------------------------------------------------------

    def _setting(self, nw: int, pf: int | None = None, wt: str | None = None) -> Setting:
        if nw == 0:
            pf = None
        elif pf is None:
            pf = self.fixed_pf or DEFAULT_PREFETCH
        return Setting(wt or self.types[0], nw, pf)

    def _new(self, setting: Setting) -> Setting | None:
        """``setting`` to measure, or None once it has been measured or found not to fit."""
        if setting in self.trials:
            return None
        why = self.fits(setting)
        if why:
            self.report(Trial(setting, skipped=why))
            return None
        return setting

    def _measured(self) -> list[Trial]:
        return [t for t in self.order if not t.skipped and t.windows]

    def _curve(self) -> dict[int, Trial]:
        """Trials by ``num_workers`` at the searched prefetch and first worker type."""
        base = self._setting(1).prefetch_factor
        return {t.setting.num_workers: t for t in self._measured() if t.setting.worker_type == self.types[0]
                and t.setting.prefetch_factor in (base, None) and not t.setting.remote}  # fmt: skip

    def _bar(self, trials) -> float:
        """The throughput a setting needs to count as equal to the best of ``trials``.

        The best is taken at its median less half its windows' spread (at most half the
        tolerance): the largest of several noisy medians is lucky more often than not, and a
        cheaper setting should not lose to luck; but a workload whose windows always vary (a
        heavy tail) must not make every setting look equal.
        """
        best = max(t.median * (1 - min(t.spread, self.tolerance) / 2) for t in trials)
        return (1 - self.tolerance) * best

    # -- the protocol -----------------------------------------------------------------------

    def report(self, trial: Trial) -> None:
        """Record a measured (or skipped) setting.

        A duel's round goes to the duel (its figures are paired, not a setting's trial); a noisy trial's repeat
        replaces it when quieter; any other second trial of a setting adds its windows to the first's.
        """
        if trial.windows and trial.others_cores is not None:
            self._others.append(trial.others_cores)
        if self.in_duel and self._duel is not None and trial.setting == self._duel.next():
            self._duel_figure(trial)
            return
        known = self.trials.get(trial.setting)
        if known is not None and trial.setting == self._repeating:
            self._repeating = None
            if trial.windows:
                self._believe_quieter(known, trial)
            return
        if known is not None and known.windows and trial.windows:
            n, m = len(known.windows), len(trial.windows)
            known.stall_fraction = (known.stall_fraction * n + trial.stall_fraction * m) / (n + m)
            known.windows.extend(trial.windows)
            known.seconds += trial.seconds
            return
        self.trials[trial.setting] = trial
        self.order.append(trial)

    def propose(self) -> Setting | None:
        """The next setting to measure, or None when the search is done."""
        self.in_duel = False
        noisy = self._noisy_trial()
        if noisy is not None:
            self._repeating = noisy.setting
            self._repeated[noisy.setting] = self._repeated.get(noisy.setting, 0) + 1
            return noisy.setting
        while True:
            step = getattr(self, f"_{self._phase}")()
            if step is not _NEXT_PHASE:
                self.in_duel = self._duel is not None and step == self._duel.next()
                return step

    # -- noise --------------------------------------------------------------------------------

    def _quietest(self) -> float | None:
        return min(self._others, default=None)

    def _noisy(self, trial: Trial) -> bool:
        """Whether others held the cores during ``trial`` more than during the quietest one (by ``NOISY_CORES``)."""
        quietest = self._quietest()
        return trial.others_cores is not None and quietest is not None and trial.others_cores > quietest + NOISY_CORES

    def _noisy_trial(self) -> Trial | None:
        """A measured trial to measure again because it was noisy and a quieter figure could change the choice
        (each setting up to ``MAX_REPEATS`` times, all of them within ``_may_repeat``); none while a duel is under way
        (its rounds stay paired) or once the search is done."""
        if self._duel is not None or self._phase == "done" or not self._may_repeat():
            return None
        for t in self._measured():
            if self._repeated.get(t.setting, 0) < MAX_REPEATS and self._noisy(t) and self._could_change(t):
                return t
        return None

    def _repeats(self) -> int:
        return sum(self._repeated.values()) + self._retaken

    def _may_repeat(self) -> bool:
        """Whether one more figure may be measured again: repeats are bounded by ``REPEAT_SHARE`` of the settings
        measured (at least ``MAX_REPEATS``), so that noise that never settles cannot spend the budget on them."""
        return self._repeats() < max(MAX_REPEATS, math.ceil(REPEAT_SHARE * len(self._measured())))

    def _could_change(self, trial: Trial) -> bool:
        """Whether a quieter figure of the noisy ``trial`` could change the choice: it is the choice, or the cores it
        lost to others (over the quietest trial's) could have held it below the bar.

        Beside steady load the others' share itself changes with the workers' count (the scheduler splits the cores
        by runnable process: fewer workers, more for the others), so a trial of few workers reads "noisy" beside one
        of many; it is measured again only when it might matter.
        """
        if trial.setting == self.choice():
            return True
        lost = _others(trial) - (self._quietest() or 0.0)
        if self.cores:  # it ran on the cores left to it: quiet, it could have had the quietest trial's
            lift = self.cores / max(self.cores - lost, self.cores / 2)
        else:
            lift = 1 + MAX_BAND
        return trial.median * lift >= self._bar(self._measured())

    def _believe_quieter(self, known: Trial, again: Trial) -> None:
        """Of a noisy trial and its repeat, the quieter stands for the setting (they are not merged: the noisy
        one's windows are what is not to be believed)."""
        quieter = again if _others(again) < _others(known) else known
        quieter.repeated = known.repeated + 1
        if quieter is again:
            self.trials[known.setting] = again
            self.order[self.order.index(known)] = again

    def _check(self):
        if self._small is None:
            self._small = self._setting(min(max(2, self.lo), self.hi))
        if self._small not in self.trials:  # proposed until it is measured (or found not to fit)
            proposal = self._new(self._small)
            if proposal is not None:
                return proposal
        small = self.trials.get(self._small)
        if small is not None and small.windows and small.stall_fraction < NOT_INPUT_BOUND:
            self.input_bound = False
            self._phase = "cheaper"
        else:
            self._phase = "workers" if self.fixed_nw is None else "prefetch"
        return _NEXT_PHASE

    def _cheaper(self):
        """Not input-bound: the cheapest setting that stays within tolerance of the small one."""
        reference = self.trials[self._small].median
        current = self._small
        while True:
            if self.fixed_nw is None and current.num_workers > self.lo:
                cheaper = self._setting(current.num_workers - 1)
            elif self.fixed_pf is None and current.prefetch_factor not in (None, PREFETCH[0]):
                cheaper = self._setting(current.num_workers, PREFETCH[0])
            else:
                break
            trial = self.trials.get(cheaper)
            if trial is None:
                proposal = self._new(cheaper)
                if proposal is not None:
                    return proposal
                break  # it does not fit
            if not trial.windows or trial.median < (1 - self.tolerance) * reference:
                break
            current = cheaper
        self._phase = "done"
        return _NEXT_PHASE

    def _workers(self):
        proposal = self._next_workers()
        if proposal is not None:
            return proposal
        self._phase = "prefetch"
        return _NEXT_PHASE

    def _zero_promising(self) -> bool:
        """Whether loading in the loop (``num_workers=0``) might rival the best setting measured.

        Estimated from the best trial: a batch would take the loop its step time, plus the
        time a worker spent loading it. For CPU-bound samples (the best trial's workers used the CPU they could
        have, as ``model`` reads it) the loading is the workers' CPU time per
        batch over the share of a core the loop could have (the cores others left, at most one): a worker's own time
        per batch counts its waits for a core among the other workers as well, which a loop loading alone does not
        have. Beside two busy loops on 2 cores, ``num_workers=0`` was the grid's best for CPU-bound samples (79
        batches/s, the workers' 57-68), and a run whose estimate left it unmeasured chose 2 workers, 0.83x of it
        (`fastfeed bench tune`'s (a), busy).
        """
        measured = [t for t in self._measured() if t.load_s is not None and t.median > 0]
        if not measured:
            return False
        best = max(measured, key=lambda t: t.median)
        step_s = (1 - best.stall_fraction) / best.median
        load_s = best.load_s
        # CPU-bound by the best trial's own reading, not the model's (which takes the largest share any trial read),
        # and only from a trial under the load another trial saw too: in a neighbour's burst, waiting workers get so
        # little of a core that they look CPU-bound.
        if (self.cores and best.worker_cpu_s and len(measured) > 1 and not self._noisy(best)
                and self._cpu_share(best) >= CPU_BOUND):
            loop_core = min(1.0, max(MIN_CORE_SHARE, self.cores - _others(best)))
            load_s = min(load_s, best.worker_cpu_s / loop_core)
        return 1 / (load_s + step_s) >= ZERO_MARGIN * best.median

    def _next_workers(self) -> Setting | None:
        zero = self._setting(0)
        if self.lo == 0 and zero not in self.trials and self._zero_promising():
            proposal = self._new(zero)
            if proposal is not None:
                return proposal
        top = self._model_top()
        proposal, fits = self._fitting_top(top, self.lo, self._setting)
        if fits < top or top == self.hi:  # over the memory budget above ``fits``
            self.hi = fits
        if proposal is not None:
            return proposal
        trials = self._curve()
        if not trials:
            return None
        curve = {nw: t.median for nw, t in trials.items()}
        bar = self._bar(trials.values())
        return self._refine({**self._out_of_reach(bar, fits), **curve}, bar, self.lo - 1, self._setting)

    def _model_top(self) -> int:
        """The top of the ``num_workers`` range to search: for CPU-bound samples (``model``), ``MODEL_SLACK`` more
        than the cores can run, unless the top measured more than ``MODEL_SHORT`` above that many (the model fell
        short: the whole range then)."""
        model = self.model()
        if not model or not model["cpu_bound"] or self.fixed_nw is not None:
            return self.hi
        if statistics.fmean(self._others or [0.0]) >= SHARED_CORES:
            # Beside other processes that keep cores busy (a neighbour's job), workers past the cores still gain: the
            # scheduler shares the cores by runnable process, so each one more takes a share from the others. With
            # two busy loops on 2 cores (`fastfeed bench tune`), nw=4 gave 1.09x nw=2's throughput for CPU-bound
            # samples, and a range cut at nw=3, whose one trial read low, left it unmeasured. The whole range is
            # searched; a count past the model's must still win its duel clearly.
            return self.hi
        useful = model["max_useful_workers"]
        top = max(self.lo, useful + MODEL_SLACK)
        measured = self._curve()
        if (top < self.hi and top in measured and useful in measured
                and measured[top].median > (1 + MODEL_SHORT) * measured[useful].median):
            return self.hi
        return min(top, self.hi)

    def _out_of_reach(self, bar: float, top: int) -> dict[int, float]:
        """Counts up to ``top`` that cannot reach ``bar`` by the workers' CPU time, with the most they could give:
        ``n`` workers make at most ``n`` batches per ``worker_cpu_s`` (each runs on one core at a time). These need
        no trial. Taken with the least CPU time per batch read, and ``MAX_BAND`` to spare, for the readings' noise.
        """
        cpu = [t.worker_cpu_s for t in self._measured() if t.worker_cpu_s and t.setting.num_workers > 0]
        if not cpu:
            return {}
        per_worker = 1 / min(cpu)
        return {n: n * per_worker for n in range(max(1, self.lo), top + 1) if n * per_worker < (1 - MAX_BAND) * bar}

    def _fitting_top(self, hi: int, lo: int, setting_for) -> tuple[Setting | None, int]:
        """The largest count in ``lo < n <= hi`` whose setting fits (the top of the range; those over the budget
        are skipped): a proposal to measure it, or None and the top found (``lo`` if none fits)."""
        while hi > lo:
            top = setting_for(hi)
            if top not in self.trials:
                proposal = self._new(top)
                if proposal is not None:
                    return proposal, hi
            if not self.trials[top].skipped:
                break
            hi -= 1
        return None, hi

    def _refine(self, rate: dict, bar: float, floor: int, setting_for) -> Setting | None:
        """The next count to measure on a curve of rates by count (workers, or Ray actors): halfway between the knee
        (the least count within tolerance of the best) and the measured count below it (``floor`` if none), or
        between the peak and a count after it that measured much lower. None: the curve is resolved."""
        knee = min(n for n, v in rate.items() if v >= bar)
        below = max((n for n in rate if n < knee), default=floor)
        if knee - below > 1:
            proposal = self._new(setting_for((below + knee + 1) // 2))  # rounded up: knees sit high
            if proposal is not None:
                return proposal
        peak = max(rate, key=rate.get)
        right = min((n for n in rate if n > peak), default=None)
        if right is not None and right - peak > 1 and rate[right] < (1 - self.tolerance) * rate[peak]:
            return self._new(setting_for((peak + right) // 2))
        return None

    def _knee(self) -> Setting:
        return self.choice() or self._setting(self.lo)

    def _prefetch(self):
        knee = self._knee()
        if self.fixed_pf is None and knee.num_workers > 0:
            at = {pf: self.trials.get(self._setting(knee.num_workers, pf, knee.worker_type)) for pf in PREFETCH}
            t = {pf: tr.median for pf, tr in at.items() if tr is not None and tr.windows}
            base = t.get(DEFAULT_PREFETCH)
            tight = self.tight(self._setting(knee.num_workers, DEFAULT_PREFETCH, knee.worker_type))
            order = []
            if base is not None and self._steady(at[DEFAULT_PREFETCH]):
                if tight:
                    order.append(1)  # less memory, when memory is what is short
            elif base is not None:
                order.append(4)
                if 4 in t and t[4] > (1 + self.tolerance) * base:
                    order.append(8)
                elif 4 in t and tight:
                    order.append(1)
            for pf in order:
                if at[pf] is None:
                    proposal = self._new(self._setting(knee.num_workers, pf, knee.worker_type))
                    if proposal is not None:
                        return proposal
        self._phase = "types"
        return _NEXT_PHASE

    def _steady(self, trial: Trial) -> bool:
        """Whether ``trial``'s workers wait rather than compute (not CPU-bound, ``_cpu_share``) and their slowest
        batches (``Trial.load_tail``) last no longer than ``DEFAULT_PREFETCH`` typical ones: a worker runs ahead
        until it has ``prefetch_factor`` batches waiting, so while one batch is slow the others go on working for that
        long, and a deeper prefetch would only hold more memory. Said in a note.

        In `fastfeed bench tune`, latency-bound samples' slowest batches lasted 1.0-1.1 typical ones, and prefetch 4
        was a tie with 2 in every duel of two runs, at 2-4 s a duel; a heavy tail (3% of samples 15 ms late) lasted
        3-12.
        """
        if trial.load_tail is None or trial.load_tail > DEFAULT_PREFETCH:
            return False
        if not trial.worker_cpu_s or not trial.load_s or self._cpu_share(trial) >= CPU_BOUND:
            # CPU-bound workers share the cores with the loop: one whose slots are full sleeps until the loop frees
            # one, and then waits for a core. With 3 ms batches a deeper prefetch gave 1.09-1.11x at every count
            # (`fastfeed bench tune`'s (a) grid, when the machine ran fast), steady as the batches were.
            return False
        if not any(n.startswith(_STEADY) for n in self.notes):
            self.notes.append(f"{_STEADY} {trial.setting}'s slowest batches (the 95th percentile) took "
                              f"{trial.load_tail:.1f}x a typical one, which its {DEFAULT_PREFETCH} batches per "
                              "worker absorb")  # fmt: skip
        return True

    def _types(self):
        chosen = self._knee()
        if chosen.num_workers > 0:
            for wt in self.types[1:]:
                proposal = self._new(Setting(wt, chosen.num_workers, chosen.prefetch_factor))
                if proposal is not None:
                    return proposal
        self._phase = "remote" if self.max_remote > 0 else "duels"
        return _NEXT_PHASE

    def _with_remote(self, remote: int) -> Setting:
        """The local choice with ``remote`` Ray actors beside its workers (process workers: the mixed form's)."""
        local = self._local
        pf = local.prefetch_factor or self.fixed_pf or DEFAULT_PREFETCH
        wt = "process" if local.num_workers else local.worker_type
        return Setting(wt, local.num_workers, pf, remote)

    def _remote(self):
        proposal = self._next_remote()
        if proposal is not None:
            return proposal
        self._phase = "duels"
        return _NEXT_PHASE

    def _next_remote(self) -> Setting | None:
        if self._local is None:
            self._local = self.choice()  # no remote trial yet: the best of the local ones
            if self._local is None:
                return None
        proposal, hi = self._fitting_top(self.max_remote, 1, self._with_remote)
        if proposal is not None:
            return proposal
        if hi == 1 and self._with_remote(1) not in self.trials:
            return self._new(self._with_remote(1))
        curve = {t.setting.remote: t for t in self._measured()
                 if t.setting.remote and t.setting == self._with_remote(t.setting.remote)}  # fmt: skip
        if not curve:
            return None
        curve[0] = self.trials[self._local]
        return self._refine({r: t.median for r, t in curve.items()}, self._bar(curve.values()), 0, self._with_remote)

    def _duels(self):
        """Duels in turn, each decided before the next is chosen (see the module's doc), at most ``MAX_DUELS``."""
        while True:
            if self._duel is not None:
                proposal = self._duel.next()
                if proposal is not None:
                    return proposal
                self._settle(self._duel)
            if len(self.duels) >= MAX_DUELS:
                break
            step = self._next_duel()
            if isinstance(step, Setting):  # measured first, as an ordinary trial
                return step
            if step is None:
                break
            self._duel = step
            self.duels.append(step)
        self._phase = "done"
        return _NEXT_PHASE

    def _settle(self, duel: Duel) -> None:
        """A decided duel: its winner is the choice, and a note says why."""
        self._duel, self._held, self._takes = None, None, 0
        self._winner = duel.winner
        said = {"dear": f"{duel.dear} clearly better", "cheap": f"{duel.cheap} as good, the cheaper taken",
                "tie": "tie, the cheaper taken"}[duel.outcome]  # fmt: skip
        if duel.outcome == "dear":
            self._lost.add(duel.cheap)
            if duel.reason.startswith(_BEST):
                # The choice fell short of the best: the cheapest within tolerance of the best on the best's own
                # line (its prefetch, type and actors; fewer workers) and dearer than the choice takes its place:
                # a duel against one setting with many more workers says nothing against the counts between.
                b, cost = duel.dear, self._cost(duel.cheap)
                bar = self._bar(self._measured())
                line = [t.setting for t in self._measured() if t.median >= bar and cost < self._cost(t.setting)
                        and (t.setting.prefetch_factor, t.setting.worker_type, t.setting.remote)
                        == (b.prefetch_factor, b.worker_type, b.remote) and t.setting.num_workers <= b.num_workers]
                self._winner = min(line, key=self._cost, default=b)
                if self._winner != duel.dear:
                    said += f"; {self._winner}, the next cheapest within {self.tolerance:.0%} of it, taken"
        self.notes.append(f"{duel.dear} vs {duel.cheap} measured in turn ({duel.reason}): {said}")
        if duel.reason.startswith(_MODEL) and duel.outcome != "dear":
            self._model_decided = True
            model = self.model()
            self.notes.append(f"the model decided: {duel.dear} is more workers than {_cores(self.cores)} can run for "
                              f"CPU-bound samples (at most {model['max_useful_workers']} useful), and it did not "
                              f"measure clearly better than {duel.cheap}")  # fmt: skip

    def _dueled(self, a: Setting, b: Setting) -> bool:
        return any({d.cheap, d.dear} == {a, b} for d in self.duels)

    def _next_duel(self) -> Duel | Setting | None:
        """The next duel worth running, a setting the model's duel needs measured first, or None."""
        measured = self._measured()
        if not measured:
            return None
        chosen = self.choice()
        best = max(measured, key=lambda t: t.median)
        if best.setting != chosen and not self.duels:  # (a): the first duel, or none
            # Within tolerance of the best by one trial each (the bar), so within the noise of each other.
            return self._duel_of(chosen, best.setting, f"{_BEST} vs the cheapest within {self.tolerance:.0%}")
        model = self.model()
        if (model and model["cpu_bound"] and self.fixed_nw is None and not chosen.remote
                and chosen.num_workers > model["max_useful_workers"]):  # fmt: skip
            useful = Setting(chosen.worker_type, model["max_useful_workers"], chosen.prefetch_factor)  # (b)
            if useful not in self.trials:
                proposal = self._new(useful)
                if proposal is not None:
                    return proposal
            if self.trials[useful].windows and not self.trials[useful].skipped and not self._dueled(useful, chosen):
                return self._duel_of(useful, chosen, f"{_MODEL}: {model['max_useful_workers']} workers use "
                                     f"{_cores(self.cores)}")  # fmt: skip
        fewer = [t for t in measured if t.setting.num_workers < chosen.num_workers and t.setting not in self._lost
                 and self._near(t, chosen, (chosen.prefetch_factor, None))]  # its prefetch, or nw=0's none
        if fewer:  # (c)
            cheaper = min(fewer, key=lambda t: t.setting.num_workers).setting
            return self._duel_of(cheaper, chosen, "fewer workers, within the noise")
        pf = chosen.prefetch_factor or self._setting(1).prefetch_factor
        more = [t for t in measured if t.setting.num_workers > chosen.num_workers and self._near(t, chosen, (pf,))]
        if more:  # (d)
            dearer = max(more, key=lambda t: t.median).setting
            return self._duel_of(chosen, dearer, "more workers, within the noise")
        return None

    def _duel_of(self, cheap: Setting, dear: Setting, reason: str) -> Duel:
        """A duel of the search's: at its tolerance, decided on the rounds' mean (``Duel(by_mean=True)``)."""
        return Duel(cheap, dear, self.tolerance, reason, by_mean=True)

    def _near(self, t: Trial, chosen: Setting, prefetch: tuple) -> bool:
        """Whether ``t`` is on ``chosen``'s line (its worker type and Ray actors, a prefetch in ``prefetch``), not
        dueled against it yet, and read no further below it than the noise band (``_band``)."""
        s, here = t.setting, self.trials[chosen]
        return (s.remote == chosen.remote and s.worker_type == chosen.worker_type and s.prefetch_factor in prefetch
                and not self._dueled(s, chosen) and t.median >= (1 - self._band(t, here)) * here.median)

    def _band(self, a: Trial, b: Trial) -> float:
        """How far apart two trials' medians may be and still be the same within the noise: the tolerance, or the
        mean of their windows' spreads when that is wider (up to ``MAX_BAND``)."""
        return max(self.tolerance, min(MAX_BAND, (a.spread + b.spread) / 2))

    def _duel_figure(self, trial: Trial) -> None:
        """A duel's round: a noisy figure is measured again (up to ``MAX_REPEATS`` times), the quietest recorded."""
        if self._held is not None and _others(self._held) <= _others(trial):
            trial = self._held
        if self._noisy(trial) and self._takes < MAX_REPEATS and self._may_repeat():
            self._held = trial
            self._takes += 1
            self._retaken += 1
            return
        self._held, self._takes = None, 0
        self._duel.record(trial.setting, trial.median)

    def stop(self) -> None:
        """No more can be measured (the budget ran out): a duel under way decides on the rounds it has."""
        if self._duel is not None:
            if self._held is not None:  # the noisy figure, for want of a quieter one
                self._duel.record(self._held.setting, self._held.median)
            self._duel.forfeit()
            self._settle(self._duel)
        self.in_duel = False

    def evidence(self) -> dict:
        """``TuneResult``'s fields on how the choice was made: the duels, the noise seen, the model, the notes."""
        return {"duels": [d.as_dict() for d in self.duels], "noise": self.noise(), "model": self.model(),
                "notes": list(self.notes)}  # fmt: skip

    # -- the model ----------------------------------------------------------------------------

    def model(self) -> dict | None:
        """What the cores can run, from the trials' CPU readings, or None without them (or without ``cores``).

        ``cpu_bound``: the workers spent at least ``CPU_BOUND`` of their time per batch on the CPU (in the trial
        where they did most). Then each worker keeps that share of a core busy, the loop its own CPU per batch
        times the batches/s, and ``max_useful_workers`` is how many workers the cores left beside the loop can run
        at once.
        """
        if not self.cores:
            return None
        read = [t for t in self._measured() if t.worker_cpu_s and t.load_s and t.setting.num_workers > 0]
        if not read:
            return None
        # Not from a trial in a neighbour's burst, where there are others: without run-queue waits, the CPU the
        # workers could have had is estimated from the cores the others left, and a burst that left them a sliver
        # makes sleeping workers look CPU-bound (a seeded simulation chose 3 latency-bound workers of 4, 0.75x).
        read = [t for t in read if not self._noisy(t)] or read
        # The largest share read, of the CPU each worker could get (``_cpu_share``): workers sharing too few cores
        # wait for one, which lowers their share of their time per batch (it grows, their CPU time does not), so it
        # is taken over the time they did not wait. On a busy machine, CPU-bound workers get a fraction of a core
        # each and use all of it.
        share = max(self._cpu_share(t) for t in read)
        best = max(read, key=lambda t: t.median)
        loop = (best.loop_cpu_s or 0.0) * best.median  # cores the loop keeps busy at the best rate read
        # Rounded to the nearest: a worker that would get less than half a core adds less than it costs in
        # switching (and a cheaper count it must beat clearly only costs a duel).
        useful = max(1, math.floor((self.cores - loop) / share + 0.5))
        return {"cores": self.cores, "cpu_bound": share >= CPU_BOUND, "max_useful_workers": useful,
                "decided": self._model_decided}  # fmt: skip

    def _cpu_share(self, t: Trial) -> float:
        """The share of the CPU each of ``t``'s workers could have had that they used, at most 1.

        Where their run-queue waits were read (``Trial.worker_wait_s``), the CPU they could have had is their time
        per batch less those waits: a worker with a core of its own would have run or slept through the rest. Beside
        two busy loops on 2 cores, latency-bound workers waited 44 of their 62 ms per batch for a core (each 1 ms
        sleep ended in a queue) and used 1.3 ms: 0.07 of the rest, where the estimate from the cores the others left
        (``_could_get``, for kernels without schedstat) read 0.67, near ``CPU_BOUND``, and once over it asked for two
        duels of worker counts (`fastfeed bench tune`'s (b), busy: 0.53x the grid's time).
        """
        if t.worker_wait_s is not None:
            return min(1.0, t.worker_cpu_s / max(t.load_s - t.worker_wait_s, 1e-9))
        return min(1.0, t.worker_cpu_s / t.load_s / self._could_get(t))

    def _could_get(self, t: Trial) -> float:
        """The share of a core each of ``t``'s workers could have had: the cores left by other processes (the
        trial's ``others_cores``) and the loop, split between them, at most one each."""
        loop = (t.loop_cpu_s or 0.0) * t.median
        left = self.cores - (t.others_cores or 0.0) - loop
        return min(1.0, max(MIN_CORE_SHARE, left / t.setting.num_workers))

    def noise(self) -> dict | None:
        """Others' cores over every trial measured (duels' and repeats' included), or None when not read."""
        if not self._others:
            return None
        return {"mean_cores": round(statistics.fmean(self._others), 3), "max_cores": round(max(self._others), 3),
                "repeated": self._repeats()}

    def _done(self):
        return None

    @property
    def done(self) -> bool:
        return self._phase == "done"

    # -- the answer -------------------------------------------------------------------------

    def choice(self) -> Setting | None:
        """The last duel's winner; before any duel decided, the cheapest measured setting within tolerance of the
        best one (None before any)."""
        if self._winner is not None:
            return self._winner
        measured = self._measured()
        if not measured:
            return None
        bar = self._bar(measured)
        good = [t.setting for t in measured if t.median >= bar]
        return min(good, key=self._cost)

    def _cost(self, s: Setting) -> tuple:
        kind = self.types.index(s.worker_type) if s.worker_type in self.types else len(self.types)
        return (s.remote, s.num_workers, s.prefetch_factor or 0, kind)


_NEXT_PHASE = object()  # a phase is over: ask the next one
_MODEL = "the model"  # how a duel the model asked for is named
_BEST = "the best measured"  # ... and one of the best against the choice
_STEADY = "prefetch_factor 4 not tried:"  # the note that says why


def _others(trial: Trial) -> float:
    return trial.others_cores or 0.0


def _cores(cores: float) -> str:
    return f"{cores:g} core" + ("" if cores == 1 else "s")
