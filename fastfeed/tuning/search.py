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
   not bisected: it is measured when the workers' own per-batch time says that loading in
   the loop could come within ``ZERO_MARGIN`` of the best seen (in-memory data, say).
   the smallest count within ``tolerance`` of the best throughput seen. When the best point
   has an unmeasured gap to a clearly worse right neighbour (too many workers for the
   cores), the gap is bisected too: the peak may lie inside it.
3. **``prefetch_factor``** at the knee, from ``PREFETCH``: 4 first; 8 only when 4 gained
   more than the tolerance; else 1, when memory is tight (a batch less per worker).
4. **``worker_type``**, when several are allowed, at the chosen counts.
5. **Remote workers** (``max_remote``, ``fastfeed.tune(remote=...)``): the local workers fixed at the
   choice so far, Ray actors added beside them (Pecan's order: the host's own cores first, the
   shortfall sent away). The actor count is bisected over ``[1, max_remote]`` as ``num_workers``
   was, the choice so far standing for 0 actors: the smallest count within ``tolerance`` of the
   best, and the gap to a clearly worse right neighbour (the loop receiving no faster) bisected too.
6. **Confirmation**: a choice that trails the best measured setting by more than half the
   tolerance is measured again, its windows added to its first trial's, and the choice made anew.

The choice is always the cheapest measured setting (fewest Ray actors, then fewest workers,
then least prefetch, then the first worker type listed) within ``tolerance`` of the best one measured (its median
less half its spread, up to half the tolerance: see ``_bar``).
"""

from __future__ import annotations

from typing import Callable

from .result import Setting, Trial

NOT_INPUT_BOUND = 0.02  # stall fraction below which loading is not the bottleneck
ZERO_MARGIN = 0.8  # num_workers=0 is measured when its estimate reaches this share of the best
PREFETCH = (1, 2, 4, 8)
DEFAULT_PREFETCH = 2


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
    """

    def __init__(
        self, *, max_workers: int, tolerance: float, worker_types=("process",), num_workers: int | None = None,
        prefetch_factor: int | None = None, min_workers: int = 0, fits: Callable[[Setting], str | None] | None = None,
        tight: Callable[[Setting], bool] | None = None, max_remote: int = 0,
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
        self._confirmed: set[Setting] = set()  # measured a second time (see _confirm)

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
        """Record a measured (or skipped) setting; a second trial of one adds its windows to the first's."""
        known = self.trials.get(trial.setting)
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
        while True:
            step = getattr(self, f"_{self._phase}")()
            if step is not _NEXT_PHASE:
                return step

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
        time a worker spent loading it.
        """
        measured = [t for t in self._measured() if t.load_s is not None and t.median > 0]
        if not measured:
            return False
        best = max(measured, key=lambda t: t.median)
        step_s = (1 - best.stall_fraction) / best.median
        return 1 / (best.load_s + step_s) >= ZERO_MARGIN * best.median

    def _next_workers(self) -> Setting | None:
        zero = self._setting(0)
        if self.lo == 0 and zero not in self.trials and self._zero_promising():
            proposal = self._new(zero)
            if proposal is not None:
                return proposal
        proposal, self.hi = self._fitting_top(self.hi, self.lo, self._setting)
        if proposal is not None:
            return proposal
        trials = self._curve()
        if not trials:
            return None
        curve = {nw: t.median for nw, t in trials.items()}
        return self._refine(curve, self._bar(trials.values()), self.lo - 1, self._setting)

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
            order = []
            if base is not None:
                order.append(4)
                if 4 in t and t[4] > (1 + self.tolerance) * base:
                    order.append(8)
                elif 4 in t and self.tight(self._setting(knee.num_workers, DEFAULT_PREFETCH, knee.worker_type)):
                    order.append(1)  # less memory, when memory is what is short
            for pf in order:
                if at[pf] is None:
                    proposal = self._new(self._setting(knee.num_workers, pf, knee.worker_type))
                    if proposal is not None:
                        return proposal
        self._phase = "types"
        return _NEXT_PHASE

    def _types(self):
        chosen = self._knee()
        if chosen.num_workers > 0:
            for wt in self.types[1:]:
                proposal = self._new(Setting(wt, chosen.num_workers, chosen.prefetch_factor))
                if proposal is not None:
                    return proposal
        self._phase = "remote" if self.max_remote > 0 else "confirm"
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
        self._phase = "confirm"
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

    def _confirm(self):
        """A choice cheaper than the best measured is measured once more before it is taken.

        Within tolerance of the best by one trial's median may be luck: on a busy machine a
        setting's figure moves a few percent from one start to the next (where the scheduler
        put its workers), more than between the windows of one trial.
        """
        chosen = self.choice()
        best = max(self._measured(), key=lambda t: t.median, default=None)
        if chosen is not None and best is not None and chosen not in self._confirmed:
            margin = self.trials[chosen].median / best.median
            if margin < 1 - self.tolerance / 2:  # in the band where one start's luck decides
                self._confirmed.add(chosen)
                return chosen
        self._phase = "done"
        return _NEXT_PHASE

    def _done(self):
        return None

    @property
    def done(self) -> bool:
        return self._phase == "done"

    # -- the answer -------------------------------------------------------------------------

    def choice(self) -> Setting | None:
        """The cheapest measured setting within tolerance of the best one (None before any)."""
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
