"""Two settings measured in turn, A B B A A B ..., until one is clearly better or the rounds run out.

One trial after another, a neighbour's burst or the scheduler's placement of the workers moves a setting's figure
by more than the tolerance on a shared machine, so two medians measured a minute apart do not say which setting is
better. Measured in turn, each round pairs the two settings under the same conditions, and the drift falls on both
alike (the order alternates within rounds, so that a trend does not favour whichever runs second).

A duel decides, by its rule (``by_mean``):

- every round (the default): for the dearer setting when it was better by more than the tolerance in every round of
  at least ``MIN_ROUNDS``; for the cheaper one when the dearer was never better by more than the tolerance in
  ``MIN_ROUNDS`` or more; otherwise for the cheaper one, as a tie, as soon as a round found the dearer not clearly
  better (it can no longer win every round), or after ``MAX_ROUNDS``.
- on the mean (``by_mean=True``, the tuner's): for the dearer setting when it measured better in every round and
  the rounds' geometric mean ratio clears ``1 + MEAN_BARS[rounds] * tolerance`` (twice the tolerance over two
  rounds, 1.5 times over three or four); for the cheaper one as soon as a round found the dearer no better at all,
  when ``MIN_ROUNDS`` or more found it never better by more than the tolerance, or after ``MAX_ROUNDS``. A round's
  ratio on a shared 2-core VM spreads 5-10% (its standard deviation, `fastfeed bench tune`'s (a)) while the
  settings it must tell apart differ by 5-10%: "better by the tolerance in every round" then lost a true 6% gain
  about half the time (seeded, 5% spread: 0.53 taken; 8% spread: 0.42), the mean rule a third to a half (0.67;
  0.53), in half a round more (2.2 rounds against 1.7), and it still keeps a true tie's cheaper setting 84-93% of
  the time (the every-round rule: 87-92%).

Pure: the driver measures what ``next()`` asks for and hands each figure to ``record()``.
"""

from __future__ import annotations

import math
import statistics

from .result import Setting, duel_line

MIN_ROUNDS = 2
MAX_ROUNDS = 4
# The mean rule's bar, in multiples of the tolerance (on the log of the ratio), by the rounds played: two rounds
# both above 1 by chance are likelier than three, so two need the larger mean.
MEAN_BARS = {2: 2.0, 3: 1.5, 4: 1.5}


class Duel:
    """Args:
    cheap, dear: the settings compared; ``cheap`` is chosen unless ``dear`` measures clearly better.
    tolerance: the fraction by which ``dear`` must beat ``cheap`` in each round to count as better.
    reason: why the two are compared (shown in the result).
    by_mean: decide on the rounds' mean ratio (see the module's doc), not on "better by the tolerance in every
        round".
    """

    def __init__(self, cheap: Setting, dear: Setting, tolerance: float, reason: str, *, by_mean: bool = False):
        if cheap == dear:
            raise ValueError(f"a duel needs two settings, got {cheap} twice")
        self.cheap, self.dear = cheap, dear
        self.tolerance = tolerance
        self.reason = reason
        self.by_mean = by_mean
        self.rounds: list[tuple[float, float]] = []  # (cheap's batches/s, dear's) per round
        self._half: dict[Setting, float] = {}  # the round under way
        self.outcome: str | None = None  # "cheap", "dear", or "tie" (then cheap is taken)

    def _order(self) -> tuple[Setting, Setting]:
        return (self.cheap, self.dear) if len(self.rounds) % 2 == 0 else (self.dear, self.cheap)

    def next(self) -> Setting | None:
        """The setting to measure next, or None once decided."""
        if self.outcome is not None:
            return None
        for s in self._order():
            if s not in self._half:
                return s
        raise AssertionError("a complete round is recorded as soon as its second figure comes")

    def record(self, setting: Setting, rate: float) -> None:
        """``setting``'s batches/s in the round under way (what ``next()`` asked for)."""
        if setting != self.next():
            raise ValueError(f"the duel asked for {self.next()}, got a figure for {setting}")
        self._half[setting] = rate
        if len(self._half) == 2:
            self.rounds.append((self._half[self.cheap], self._half[self.dear]))
            self._half = {}
            self._decide()

    def forfeit(self) -> None:
        """No more rounds can be run (the budget ran out): decide on what was measured, the cheaper when unsure."""
        if self.outcome is None:
            self._decide(final=True)

    @property
    def ratios(self) -> list[float]:
        """dear / cheap, round by round (a round where cheap measured nothing counts as dear's)."""
        return [d / c if c > 0 else float("inf") for c, d in self.rounds]

    def _decide(self, final: bool = False) -> None:
        if self.by_mean:
            self._decide_by_mean(final)
            return
        ratios = self.ratios
        bar = 1 + self.tolerance
        if len(ratios) >= MIN_ROUNDS and min(ratios) > bar:
            self.outcome = "dear"
        elif len(ratios) >= MIN_ROUNDS and max(ratios) <= bar:
            self.outcome = "cheap"
        elif final or len(ratios) >= MAX_ROUNDS or (ratios and min(ratios) <= bar):
            self.outcome = "tie"

    def _decide_by_mean(self, final: bool) -> None:
        ratios, bar = self.ratios, 1 + self.tolerance
        n = len(ratios)
        # "as good": rounds enough, and the dearer never better by more than the tolerance; else a tie
        cheap = "cheap" if n >= MIN_ROUNDS and max(ratios) <= bar else "tie"
        # The dearer no better in a round (the mean can no longer be read as a gain), or better every time but never
        # by the tolerance (a gain too small to pay for)
        if (n and min(ratios) <= 1) or cheap == "cheap":
            self.outcome = cheap
        elif n >= MIN_ROUNDS and statistics.fmean(map(math.log, ratios)) > MEAN_BARS[n] * math.log(bar):
            self.outcome = "dear"
        elif final or n >= MAX_ROUNDS:
            self.outcome = cheap

    @property
    def winner(self) -> Setting | None:
        if self.outcome is None:
            return None
        return self.dear if self.outcome == "dear" else self.cheap

    def as_dict(self) -> dict:
        return {"cheap": str(self.cheap), "dear": str(self.dear), "reason": self.reason,
                "rounds": [[round(c, 3), round(d, 3)] for c, d in self.rounds], "outcome": self.outcome,
                "winner": None if self.winner is None else str(self.winner)}  # fmt: skip

    def __str__(self) -> str:
        return duel_line(self.as_dict())
