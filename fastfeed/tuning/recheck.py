"""``num_workers="auto"`` on a cache hit: the cached setting, used at once, and confirmed on the first epoch.

A cached answer was measured on the machine as it was then: the other jobs beside it, its cores,
its storage. When that changes, the cached ``num_workers`` may no longer be the knee, and a loader
that trusted the cache would keep it run after run. So while the cached setting serves the first
epoch, ``Recheck`` has it measured against its neighbours, one worker more and one fewer (the
prefetch factor and worker type as cached), in turn (``duel.Duel``: A B B A, short trials), on
the user's own batches and step (``online.TuningIter``: each trial an iterator over the epoch's one
sampler, so the epoch's batches are those of a fixed setting).

- One worker more replaces the cached setting when it measured better by more than ``UP_BAND`` in
  every round (the duel's "clearly better"): a clear gain, not the noise of two short trials on a
  busy machine.
- One worker fewer wins its duel whenever the cached setting was not clearly better (by more than
  the tolerance, every round), the tuner's rule of the cheapest within tolerance; it replaces the
  cached setting when it also measured at least as well in every round played. A cached answer is
  not given up for a round's noise, but an oversubscribed count (fewer workers measuring better)
  is.
- Anything less (a duel cut short by the budget) keeps the cached setting.
- A neighbour that won is compared with its own other neighbour next (a hill climb, the way the
  machine moved), up to ``MAX_DUELS`` duels in all.

Pure, with ``search.Search``'s protocol (``propose()``, ``report()``, ``choice()``, ``stop()``,
``evidence()``, ``done``, ``input_bound``, ``trials``, ``order``), so ``online.OnlineTuner`` drives it
as it drives a search.
"""

from __future__ import annotations

import statistics
from typing import Callable

from .duel import MIN_ROUNDS, Duel
from .result import Setting, Trial
from .search import DEFAULT_PREFETCH

MAX_DUELS = 3  # the cached setting's two neighbours, or a climb of three steps
UP_BAND = 0.10  # one worker more must win each round by this much: two windows' noise is of this order
TRIAL_WINDOWS = 2  # a duel's figure is rounds of short trials, not one long one
# The trials a recheck usually takes (two settings a round), and room for the batches in flight when a trial ends,
# which come on top of its part of the epoch's tuning share.
TRIALS = MAX_DUELS * MIN_ROUNDS * 2 + 4


class Recheck:
    """Args:
    cached: the setting the cache holds (local workers: ``remote == 0``).
    lo, hi: the ``num_workers`` allowed (as ``Search``'s ``min_workers`` and ``max_workers``).
    tolerance: settings within this fraction count as equal (one worker fewer is taken then).
    input_bound: the cached result's (passed on to the result when the setting changes).
    fits: ``fits(setting)`` -> None, or why the setting cannot run (memory): a neighbour that does
        not fit is not compared.
    prefetch_factor: a neighbour's with workers when the cached setting has none (nw=0): the loader's fixed one,
        or None for ``DEFAULT_PREFETCH``.
    """

    def __init__(self, cached: Setting, *, lo: int, hi: int, tolerance: float, input_bound: bool = True,
                 fits: Callable[[Setting], str | None] | None = None, prefetch_factor: int | None = None):  # fmt: skip
        if cached.remote:
            raise ValueError(f"a recheck compares counts of local workers, and {cached} has Ray actors")
        self.cached = cached
        self.incumbent = cached  # the setting that stands so far
        self.lo, self.hi = lo, hi
        self.tolerance = tolerance
        self.input_bound = input_bound
        self.fits = fits or (lambda setting: None)
        self._pf = cached.prefetch_factor or prefetch_factor or DEFAULT_PREFETCH
        self.trials: dict[Setting, Trial] = {}  # one per setting: its rounds' windows together
        self.order: list[Trial] = []  # as first reported
        self.duels: list[Duel] = []
        self._duel: Duel | None = None  # the one under way
        self._others: list[float] = []  # others' cores in each trial (the noise)
        self._done = False

    def _setting(self, nw: int) -> Setting:
        return Setting(self.cached.worker_type, nw, None if nw == 0 else self._pf)

    def _next_duel(self) -> Duel | None:
        """The incumbent against a neighbour it has not met; None when there is none.

        One worker more first: a duel's first trial is then its cheaper setting, the cached one, which the
        loader runs already and which every rank measures first (``agree.pace`` compares ranks there).
        """
        if len(self.duels) >= MAX_DUELS:
            return None
        met = {frozenset((d.cheap, d.dear)) for d in self.duels}
        here = self.incumbent
        for nw in (here.num_workers + 1, here.num_workers - 1):
            other = self._setting(nw)
            if not self.lo <= nw <= self.hi or frozenset((here, other)) in met or self._skipped(other):
                continue
            if nw > here.num_workers:
                return Duel(here, other, UP_BAND, f"one worker more than {here}")
            return Duel(other, here, self.tolerance, f"one worker fewer than {here}")
        return None

    # -- the protocol -----------------------------------------------------------------------

    def propose(self) -> Setting | None:
        """The next setting to measure (a duel's next trial), or None when the recheck is done."""
        while not self._done:
            if self._duel is None:
                self._duel = self._next_duel()
                if self._duel is None:
                    self._done = True
                    break
                self.duels.append(self._duel)
            setting = self._duel.next()
            if setting is not None:
                # The memory budget learns from each trial: a neighbour may turn out not to fit after a round.
                why = self.fits(setting)
                if not why:
                    return setting
                self._add(Trial(setting, skipped=why))
                self._duel.forfeit()  # decided on what was measured; report() never saw it, so nothing moves
            self._duel = None  # decided (report() took its outcome)
        return None

    def _skipped(self, setting: Setting) -> bool:
        trial = self.trials.get(setting)
        return trial is not None and trial.skipped is not None

    def report(self, trial: Trial) -> None:
        """Record a measured trial (what ``propose()`` asked for): a figure of the duel under way."""
        self._add(trial)
        if trial.others_cores is not None:
            self._others.append(trial.others_cores)
        if trial.skipped or not trial.windows or self._duel is None:
            return
        duel = self._duel
        duel.record(trial.setting, trial.median)
        winner = duel.winner
        if winner is None or winner == self.incumbent:
            return
        # One worker more won clearly; one worker fewer won as the cheaper, and must not have measured worse.
        if winner == duel.dear or max(duel.ratios) <= 1.0:
            self.incumbent = winner

    def _add(self, trial: Trial) -> None:
        known = self.trials.get(trial.setting)
        if known is None:
            self.trials[trial.setting] = trial
            self.order.append(trial)
        elif known.windows and trial.windows:  # another round: the setting's windows together, as Search does
            n, m = len(known.windows), len(trial.windows)
            known.stall_fraction = (known.stall_fraction * n + trial.stall_fraction * m) / (n + m)
            known.windows.extend(trial.windows)
            known.seconds += trial.seconds

    def stop(self) -> None:
        """No more can be measured (the budget ran out): a duel under way ends undecided, the incumbent stands."""
        if self._duel is not None:
            self._duel.forfeit()  # a forfeit never gives a clear win (it ends a duel short of its rounds)
            self._duel = None

    def evidence(self) -> dict:
        """``TuneResult``'s fields on how the setting was reached: the duels, the noise seen, a note."""
        noise = None
        if self._others:
            noise = {"mean_cores": round(statistics.fmean(self._others), 3), "max_cores": round(max(self._others), 3),
                     "repeated": 0}  # fmt: skip
        return {"duels": [d.as_dict() for d in self.duels], "noise": noise, "model": None, "notes": [self.note]}

    @property
    def done(self) -> bool:
        return self._done

    def choice(self) -> Setting | None:
        """The setting that stands: the cached one until a neighbour clearly won (None before it was measured)."""
        trial = self.trials.get(self.incumbent)
        return self.incumbent if trial is not None and trial.windows else None

    @property
    def moved(self) -> bool:
        """Whether a neighbour replaced the cached setting."""
        return self.incumbent != self.cached

    @property
    def note(self) -> str:
        """What the recheck found, in a line."""
        if self.moved:
            return f"the cached {self.cached} was measured against its neighbours: {self.incumbent} replaced it"
        return f"the cached {self.cached} was measured against its neighbours and kept"
