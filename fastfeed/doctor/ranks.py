"""One job's ranks on one clock, and each rank's loop split into input, sync and compute.

In a data-parallel job every step ends in a collective (DDP's gradient all-reduce inside ``backward()``, FSDP's
gathers and reduce-scatters, a barrier), so every rank runs at the pace of the slowest one, and the others spend
the difference waiting inside that collective, which looks like compute from inside one process. Two measures,
neither of which hooks anything the user's code may also hook (DDP takes one comm hook), find that wait:

- **Alignment.** Each rank's "batch in hand" time per step (the loader's return), on rank 0's clock (offsets
  estimated through the job's store, ``fastfeed.doctor.jobstore``). A rank that had batch ``i`` in hand before
  the last rank did waits at least the difference during step ``i``, wherever the wait surfaces: in the
  all-reduce on a CPU backend, or at the next synchronisation with NCCL, whose kernels run asynchronously.
- **Sleep.** The consuming thread's sleep during the step (``fastfeed.doctor.blocked``): on a CPU backend the
  thread blocks inside every collective, so this also counts the collective's own transfer time, which
  alignment cannot see (every rank arrives together and still waits for the bytes to move). A process that
  uses CUDA also sleeps in stream and event synchronisations while the GPU computes, so there sleep is not
  counted and alignment alone measures sync.

Per step, sync is the larger of the two, never more than the step; compute is the rest of the step; input is
the loader's wait, as in the single-process doctor. Steps are matched by index: ranks iterate the same number of
batches per epoch (``DistributedSampler``), and the watch stops every rank after the same ``--steps``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .timeline import LoaderRecord, Timeline


@dataclass
class RankRecord:
    """What one rank recorded, as it travels through the job's store.

    ``offset``: seconds to add to this rank's clock (``time.perf_counter``) to read rank 0's (0 for rank 0, and
    about 0 on rank 0's machine, whose CLOCK_MONOTONIC all processes share). ``cuda``: CUDA was initialised in
    the rank, so its sleep is not sync (see the module's doc). ``distributed_s`` is in ``timeline``.
    """

    rank: int
    timeline: Timeline
    offset: float = 0.0
    host: str = ""
    local_rank: int = 0
    cuda: bool = False
    error: str | None = None  # the script's exception on this rank, if it ended with one

    def to_dict(self) -> dict:
        d = asdict(self)
        d["timeline"] = self.timeline.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RankRecord:
        return cls(**{**d, "timeline": Timeline.from_dict(d["timeline"])})


@dataclass
class RankSplit:
    """One rank's training loader, batch by batch, on rank 0's clock.

    ``asks``/``returns``: each batch's request and return (rank 0's clock). ``syncs``/``computes``: per batch,
    the step after it split in two (0 after an epoch's last batch, which has no step). ``epoch_ends``: the index
    of each epoch's last batch.
    """

    rank: int
    asks: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    syncs: list[float] = field(default_factory=list)
    computes: list[float] = field(default_factory=list)
    aligned: list[float] = field(default_factory=list)  # the alignment measure alone, per step
    epoch_ends: list[int] = field(default_factory=list)
    make_s: float = 0.0  # seconds the workers take to make one batch, all of them working (0: no record)

    @property
    def batches(self) -> int:
        return len(self.asks)

    @property
    def input_s(self) -> float:
        return sum(r - a for a, r in zip(self.asks, self.returns))

    @property
    def sync_s(self) -> float:
        return sum(self.syncs)

    @property
    def compute_s(self) -> float:
        return sum(self.computes)

    @property
    def loop_s(self) -> float:
        return self.input_s + self.sync_s + self.compute_s

    @property
    def waiting_for_others_s(self) -> float:
        """The part of sync that alignment explains: waiting for slower ranks to have their batch."""
        return sum(self.aligned)

    def shares(self) -> dict:
        """Input, sync and compute as fractions of this rank's loop."""
        loop = self.loop_s
        if loop <= 0:
            return {"input": 0.0, "sync": 0.0, "compute": 0.0}
        return {"input": self.input_s / loop, "sync": self.sync_s / loop, "compute": self.compute_s / loop}

    def _first_waits(self) -> float:
        """The waits of each epoch's first batch: starting workers, paid once per epoch, not at every step."""
        firsts = [0, *(e + 1 for e in self.epoch_ends[:-1])]
        return sum(self.returns[i] - self.asks[i] for i in firsts if i < self.batches)

    def own_per_step(self) -> float:
        """Seconds per batch this rank needs alone (input and compute, no sync), once its workers have started:
        its pace if others never slowed it; the job's pace is the slowest rank's.

        A rank that waits for others gives its workers that time too, so its batches are ready and its input
        wait shrinks below what it would be alone: equal ranks would then differ by which one leads. Its pace
        alone is also at least the time its workers take to make a batch."""
        steady = self.batches - len(self.epoch_ends)
        waited = (self.input_s - self._first_waits() + self.compute_s) / steady if steady > 0 else 0.0
        return max(waited, self.make_s) if steady > 0 else 0.0

    def step_per_batch(self) -> float:
        """Seconds per batch of this rank's loop once its workers have started (the job's step, as it ran)."""
        steady = self.batches - len(self.epoch_ends)
        return (self.loop_s - self._first_waits()) / steady if steady > 0 else 0.0


def _series(rec: LoaderRecord | None) -> tuple[list, list, list, list]:
    """A loader's asks, returns and sleep readings across epochs, and each epoch's last index."""
    asks, returns, blocked, ends = [], [], [], []
    for ep in rec.epochs if rec else ():
        n = min(len(ep.asks), len(ep.returns))
        if not n:
            continue
        asks += ep.asks[:n]
        returns += ep.returns[:n]
        slept = list(ep.blocked[:n])
        blocked += slept + [None] * (n - len(slept))
        ends.append(len(asks) - 1)
    return asks, returns, blocked, ends


def _make_per_batch(rec: LoaderRecord | None) -> float:
    """Seconds the loader's workers take to make one batch, all of them at work: their mean time per batch (in
    the dataset and collating) over their number. 0 where no worker recorded one."""
    if rec is None or not rec.num_workers:
        return 0.0
    made = [f + c for ep in rec.epochs for w in ep.workers for f, c in zip(w.fetch, w.collate)]
    if not made:
        return 0.0
    return sum(made) / len(made) / rec.num_workers


def split(ranks: list[RankRecord]) -> list[RankSplit]:
    """Each rank's loop split into input, sync and compute (see the module's doc), in the order of ``ranks``.

    Only the batches every rank recorded are compared; a rank's training loader is the one that yielded the
    most batches there (``Timeline.primary``).
    """
    series = [_series(r.timeline.primary()) for r in ranks]
    n = min((len(s[0]) for s in series), default=0)
    hands = [[t + r.offset for t in s[1][:n]] for r, s in zip(ranks, series)]  # batch in hand, rank 0's clock
    latest = [max(h[i] for h in hands) for i in range(n)]
    out = []
    for r, (asks, returns, blocked, ends), hand in zip(ranks, series, hands):
        sp = RankSplit(rank=r.rank, asks=[a + r.offset for a in asks[:n]], returns=hand,
                       epoch_ends=[e for e in ends if e < n - 1] + [n - 1] if n else [],
                       make_s=_make_per_batch(r.timeline.primary()))  # fmt: skip
        last = set(sp.epoch_ends)
        for i in range(n):
            if i in last or i + 1 >= n:
                sp.syncs.append(0.0)
                sp.computes.append(0.0)
                sp.aligned.append(0.0)
                continue
            step = max(0.0, asks[i + 1] - returns[i])
            aligned = min(step, max(0.0, latest[i] - hand[i]))
            sync = aligned
            if not r.cuda and blocked[i] is not None and blocked[i + 1] is not None:
                # Slept from this return to the next, less the next wait (the thread sleeps while a batch is
                # not ready): what it slept inside the step.
                slept = blocked[i + 1] - blocked[i] - (returns[i + 1] - asks[i + 1])
                sync = max(sync, min(step, max(0.0, slept)))
            sp.syncs.append(sync)
            sp.computes.append(step - sync)
            sp.aligned.append(aligned)
        out.append(sp)
    return out
