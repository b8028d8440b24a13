"""``num_workers="auto"`` on a cache miss: tuning on the epoch the user consumes, with the user's step.

On a cache hit the same machinery re-checks the cached setting: ``recheck.Recheck`` takes the
search's place, and its duels' short trials (``OnlineTuner(windows=...)``) end at their windows.

One epoch's sampler is drawn once, as a fixed setting draws it, and its batch indices are
dealt out in order to a succession of iterators, one per setting tried: each takes indices
through a ``_Gate`` until its trial has its windows, then the gate closes, the iterator
yields what its workers still hold, ends, and the next setting's iterator takes the
following indices. So no batch is lost or repeated, and the order of sample indices is the
fixed setting's. The iterators after the first reuse its worker base seed and draw nothing
from the RNGs, so later epochs are those of a fixed setting too.

Tuning stops when the search is done, or after about ``EPOCH_SHARE`` of the epoch or
``BUDGET_S`` seconds (a trial under way is finished first; an epoch too short for one trial
hands the search on to the next). Then the loader settles on the choice, for the rest of the
epoch and after; the cache and ``loader.tune_result`` get it, and one line goes to the
``fastfeed`` logger.

The epoch's position is the sampler's alone (each setting's workers start afresh), so ``state_dict()`` gives it as a
fixed setting's iterator would, without worker states: a run resumed from it continues with the next batch, with the
tuned values or with ``"auto"`` (whose ``TuningIter`` then tunes on the rest of the epoch). Where the position is more
than the sampler's (a dataset's own state, a stateful sampler, ``in_order=False``), both raise (``positioned``).

Under ``torch.distributed`` each rank settles on its own choice first and publishes it
(``agree``); every ``POLL_S`` it looks whether all ranks' choices are in, and then settles
on the slowest rank's (the same on every rank), switching to it mid-epoch if it differs (the
gate closes, as at a trial's end). The loader keeps its tuner, epoch after epoch, until that
has happened.
"""

from __future__ import annotations

import logging
import time
import warnings

from .. import _state, affinity, stats
from .._iterator import RingDataLoaderIter
from .._single import SingleProcessIter
from . import agree
from .measure import (MAX_WINDOWS, MIN_WINDOWS, WINDOW_BATCHES, WindowsCpu, batch_bytes, load_seconds,
                      load_tail, private_bytes)
from .result import Setting, Trial, TuneResult
from .search import Search

log = logging.getLogger("fastfeed")

EPOCH_SHARE = 0.1  # of an epoch's batches spent tuning
BUDGET_S = 60.0  # tuning time in all
TRIALS = 6  # what a search usually takes: each trial gets its share of the epoch's share
WINDOW_S = BUDGET_S / TRIALS / (MIN_WINDOWS + 1)  # the longest window, so trials fit in the time budget
POLL_S = 0.5  # how often a rank that settled looks whether every rank's choice is in


class _Gate:
    """The shared sampler iterator, as one trial's iterator sees it: closed, it has ended."""

    def __init__(self, source):
        self.source = source
        self.open = True

    def __iter__(self):
        return self

    def __next__(self):
        if not self.open:
            raise StopIteration
        return next(self.source)


class _Run:
    """The trial under way: its warm-up and windows, over batch numbers of the epoch's recorder.

    The CPU meter (``noise``) is read where each window begins and ends, as ``measure`` reads it: the trial gets
    the noise and the CPU each side spent, the workers' own when they are local processes.
    """

    def __init__(self, trial: Trial, start: int, warm: int, window: int, pids=()):
        """``pids``: the setting's local worker processes, whose run-queue waits the windows read (as ``measure``'s
        trials do: the model tells CPU-bound workers from ones that wait for a core by them)."""
        self.trial = trial
        # Windows of whole rounds of the workers, as measure's: in order, each worker's batch comes in turn, the
        # ready ones at once and then a wait, so a window of part of a round reads its phase. 4 batches of 3
        # workers read from 600 to 1 600 batches/s.
        self.per_round = max(1, trial.setting.total)
        self.window = window  # batches per window (fewer when a window takes WINDOW_S)
        self.mark = start + warm  # where the current window began
        self.waits = self.steps = 0.0
        s = trial.setting
        self.workers = s.worker_type == "process" and s.num_workers > 0 and not s.remote  # the descendants' CPU
        self.pids = list(pids) if self.workers else []
        self.cpu = WindowsCpu(self.pids)
        self.metering = False  # the first window has begun, and the meter was read there
        self.start = start  # the trial's first batch
        self.start_bytes = 0  # one worker's private memory after the trial's first batch...
        self.start_batch: int | None = None  # ...and the batch it was read before
        self.handed = 0.0  # the window's seconds taking batches that were ready (the loop's own time: see measure)
        self.window_metered = 0.0  # the window's seconds of readings, inside its asks (see update)
        self.metered = (-1, 0.0)  # the batch whose ask the last readings were in, and their seconds

    def handed_over(self, number: int, seconds: float) -> None:
        """Batch ``number`` of the epoch was ready when asked for, and taking it took ``seconds``."""
        if number >= self.mark:
            at, metered = self.metered
            self.handed += seconds - metered if number == at else seconds

    def update(self, rec: stats.Recorder, tolerance: float) -> bool:
        """Close a window if one is complete; True once the trial has enough windows.

        Called inside the epoch's ask for batch ``rec.batches``: the time its readings take (the meter, the
        workers' memory) is in that ask, so it is taken out of the window's, as ``measure``'s trials read the meter
        outside their timed span. Reading 4 workers' memory took 20-40 ms in a first window of 10 ms of batches,
        which read a third of the setting's rate and made every trial's spread too wide to stop before its last
        window."""
        began = time.perf_counter()
        n = rec.batches - self.mark
        if self.start_batch is None and rec.batches > self.start:
            # As measure's trials read it, once the workers have made the trial's first batch: what a worker grows
            # by from here to the trial's end is what it copied of the parent's memory by reading its objects
            # (copy-on-read), projected toward the dataset's containers. Read before the warm-up, whose batches
            # take what the workers made meanwhile, so that the first window does not read a full ring's drain.
            self.start_bytes = private_bytes(self.pids) if self.pids else 0
            self.start_batch = rec.batches
        if n >= 0 and not self.metering:  # called before each batch: the first window begins with the next one
            self.cpu.open()
            self.metering = True
        if n >= WINDOW_BATCHES and n % self.per_round == 0:
            wait, step = rec.window(self.mark, rec.batches)
            wait = max(0.0, wait - self.window_metered)
            handed = min(self.handed, wait)
            wait, step = wait - handed, step + handed
            if n >= self.window or wait + step >= WINDOW_S:
                self.trial.windows.append(n / (wait + step))
                self.waits, self.steps = self.waits + wait, self.steps + step
                total = self.waits + self.steps
                self.trial.stall_fraction = self.waits / total if total > 0 else 0.0
                self.mark, self.handed, self.window_metered = rec.batches, 0.0, 0.0
                self.cpu.close(n)  # and the next window begins here
                self.cpu.settle(self.trial, self.workers)
        if n >= 0:
            metered = time.perf_counter() - began
            self.window_metered += metered  # this ask is the current window's (the next one's, if it just closed)
            self.metered = (rec.batches, metered)
        t = self.trial
        return len(t.windows) >= MAX_WINDOWS or (len(t.windows) >= MIN_WINDOWS and t.spread <= tolerance)


class OnlineTuner:
    """The tuning state of one loader, kept across epochs until it settles.

    Args:
        search: the search over the allowed settings.
        budget: ``offline.Budget``, told what each trial measured.
        settle: called with the ``TuneResult`` once chosen, and again with the slowest rank's once
            every rank's is in (``agree``; at once without torch.distributed).
        tag: the name of this tuning in the process group's store (``agree``).
        trials: the trials the search usually takes (each gets its part of the epoch's tuning share).
        windows: the windows that complete a trial (a recheck's short trials); None: ``_Run``'s own rule, more
            windows while they spread.
    """

    def __init__(self, search: Search, budget, tolerance: float, settle, tag: str, batch_size: int | None,
                 trials: int = TRIALS, windows: int | None = None):  # fmt: skip
        self.search = search
        self.trials = trials
        self.windows = windows
        self.batch_size = batch_size
        self.budget = budget
        self.tolerance = tolerance
        self.settle = settle
        self.tag = tag
        self.spent_s = 0.0
        self.own: TuneResult | None = None  # this rank's choice, once made, as published
        self.result: TuneResult | None = None  # what the loader is settled on: self.own, then the slowest rank's
        self.agreed = False  # every rank's choice is in, and self.result is the slowest rank's

    def finish(self, converged: bool, elapsed_s: float) -> TuneResult:
        """This rank's choice, published for the other ranks and settled on; returns what was settled on.

        That is the slowest rank's result instead when every rank's is in already (this rank
        was the last), and this rank's own when it is alone. Unconverged, a duel under way decides on the rounds
        it has.
        """
        if not converged:
            self.search.stop()
        chosen = self.search.choice()
        trial = self.search.trials[chosen]
        self.result = TuneResult(
            num_workers=chosen.num_workers, prefetch_factor=chosen.prefetch_factor, worker_type=chosen.worker_type,
            throughput=trial.median, samples_per_s=trial.median * self.batch_size if self.batch_size else None,
            stall_fraction=trial.stall_fraction, input_bound=self.search.input_bound,
            trials=list(self.search.order), elapsed_s=elapsed_s, converged=converged and self.search.done,
            batch_size=self.batch_size, **self.search.evidence(),
        )  # fmt: skip
        hi = getattr(self.search, "hi", None)  # the most workers the search allowed
        if hi is not None and getattr(self.budget, "worker_bytes", 0):
            from .offline import limited_by_memory  # offline imports this module's neighbours, not this module

            self.result.memory = self.budget.summary(chosen, hi)
            if limited_by_memory(self.budget, chosen, self.result.trials, hi):
                self.result.limited_by = "memory"
        self.own = self.result
        agree.publish(self.result, self.tag)
        agreed = agree.poll(self.tag, self.own)  # this rank may be the last one in (or alone)
        if agreed is not None:
            self.result, self.agreed = agreed, True
        self.settle(self.result)
        return self.result

    def check_ranks(self) -> bool:
        """Once every rank's choice is in, settle on the slowest rank's; True when its setting differs from ours.

        Before that, nothing happens (False). The slowest rank's result is settled on even at
        our own setting: ``loader.tune_result`` and the cache then say which rank decided.
        """
        theirs = agree.poll(self.tag, self.own)
        if theirs is None:
            return False
        changed = theirs.setting != self.result.setting
        self.result, self.agreed = theirs, True
        self.settle(theirs)
        return changed


class TuningIter:
    """One epoch of an ``"auto"`` loader while its tuner has not settled (see the module's doc)."""

    def __init__(self, loader, tuner: OnlineTuner, resume: dict | None = None):
        """``resume``: a loaded state to continue the epoch from (``loader.load_state_dict``), whose position is
        its sampler's alone (``positioned``); the tuning goes on over the rest of the epoch."""
        self._loader = loader
        self._tuner = tuner
        self._stats = stats.Recorder(0, None)  # the epoch's, across settings (trials read their windows here)
        self._timed = True  # False under a device stage, which records into self._stats instead
        self._source = _Source(iter(loader._index_sampler), loader.generator)
        self._shared = _state.Drawn(self._source)  # counts the asks, for the state's "asked"
        self._num_yielded = 0  # batches handed on this epoch, by every setting's iterator
        self._in_order = getattr(loader, "in_order", True)  # its settings' iterators deliver as the loader says
        self._base_seed = None  # drawn by the first iterator, reused by the others
        self._current = None
        self._gate: _Gate | None = None
        self._run: _Run | None = None
        self._finished = False
        self._started = time.monotonic()
        self._tuned = 0  # batches spent on trials this epoch
        self._share = max(1, int(len(loader) * EPOCH_SHARE)) if _sized(loader) else None
        # Batches per trial: the epoch's share split between the trials a search usually takes.
        self._windows = tuner.windows or MIN_WINDOWS
        self._per_trial = max(WINDOW_BATCHES * (self._windows + 1), (self._share or 0) // tuner.trials)
        self._run_start = 0
        self._run_began = 0.0
        self._next_poll = 0.0
        if resume is not None:
            self._resume(resume)

    def _resume(self, resume: dict) -> None:
        """Continue the epoch after the batches ``resume`` says were received: the sampler's order is drawn again
        from the RNGs it first drew from, and the batches seen are skipped unfetched (as a fixed setting's iterator
        fast-forwards). The workers' base seed is the saved one; nothing is drawn from the RNGs the user sees."""
        why = positioned(self._loader, resume)
        if why is not None:
            raise RuntimeError(f"load_state_dict() on a num_workers='auto' loader whose tuning has not settled: {why}."
                               " Build it with the tuned values (loader.tune_result.loader_kwargs() of the run that "
                               "saved the state)")  # fmt: skip
        if not resume["mid_epoch"]:  # saved between epochs: this one starts afresh
            return
        generator = self._loader.generator
        keep = _state.sampler_rngs(generator)
        self._base_seed = resume["base_seed"]
        if resume["sampler_rng"] is not None:  # (None: saved before the sampler's first ask, which draws as loaded)
            self._source.rng = resume["sampler_rng"]
            _state.restore_sampler_rngs(resume["sampler_rng"], generator)
        yielded = resume["yielded"]
        self._shared.replay(yielded, resume.get("asked", yielded))
        _state.restore_sampler_rngs(keep, generator)
        self._num_yielded = yielded

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._loader._index_sampler)

    def __next__(self):
        if not self._timed:
            return self._next_batch()
        ready = self._ready_count()
        handed = self._batch_ready()  # ready already: taking it is no wait for input (see _Run.handed_over)
        asked = time.perf_counter()
        data = self._next_batch()
        returned = time.perf_counter()
        number = self._stats.batches
        self._stats.add(asked, ready, returned)
        if handed and self._run is not None:
            self._run.handed_over(number, returned - asked)
        return data

    # -- what the loader and a device stage ask of an iterator --------------------------------

    def _ready_count(self) -> int:
        count = getattr(self._current, "_ready_count", None)  # none with num_workers=0
        return count() if count is not None else 0

    def _batch_ready(self) -> bool:
        ready = getattr(self._current, "_batch_ready", None)  # none with num_workers=0: the loop loads
        return ready is not None and ready()

    def end_epoch(self) -> None:
        self._shutdown_workers()

    def state_dict(self, held_back: int = 0) -> dict:
        """The epoch's position as a fixed setting's iterator gives it, ``held_back`` batches ago: the batches
        handed on, the sampler's asks and the RNGs it first drew from, the workers' base seed. The workers' own
        states are not in it (``workers`` is None): each setting's workers start afresh, so positions are the
        sampler's alone, and a loader with any ``num_workers`` (the tuned one, say) or a tuning loader continues
        from it."""
        why = positioned(self._loader)
        if why is not None:
            raise RuntimeError(
                f"DataLoader.state_dict() in the middle of num_workers='auto''s tuning epoch: {why}. Take it after "
                "this epoch, or pass the tuned values (loader.tune_result.loader_kwargs(), or a config from "
                "`fastfeed tune --out`)."
            )
        if self._finished and not held_back:
            return self._loader._between_epochs()
        return {
            "mid_epoch": True,
            "yielded": self._num_yielded - held_back,
            "sampler_rng": self._source.rng,
            "sampler_state": None,
            "base_seed": self._base_seed,
            "dataset": None,
            "dataset_iter": None,
            "num_workers": self._loader.num_workers,
            # Asks past the batches handed on were for tasks in flight (or a device stage's): asked again on
            # resuming, with the RNGs as saved, so that the sampler draws nothing twice
            "asked": self._shared.asked,
            "next_worker": 0,
            "workers": None,
            "received_ahead": [],
            "due": None,
        }

    def _shutdown_workers(self) -> None:
        current, self._current = self._current, None
        if current is not None and hasattr(current, "_shutdown_workers"):
            current._shutdown_workers()

    def __del__(self):
        self._shutdown_workers()

    # -- the epoch ----------------------------------------------------------------------------

    def _next_batch(self):
        while True:
            if self._current is None:
                if self._finished:
                    raise StopIteration
                self._begin(*self._next_setting())
            self._progress()
            try:
                data = next(self._current)
            except StopIteration:
                ended = self._gate.open  # still open: the sampler itself ended
                self._end_trial()
                self._current = None
                if ended:
                    self._finished = True
                    self._account()
                    raise
                continue
            if not self._tuner.budget.batch_bytes:
                self._tuner.budget.batch_bytes = batch_bytes(data)
            self._num_yielded += 1
            return data

    def _next_setting(self) -> tuple[Setting, bool]:
        """The setting for the next stretch of the epoch, and whether it is a trial to measure."""
        tuner = self._tuner
        if tuner.result is not None:
            return tuner.result.setting, False
        elapsed = tuner.spent_s + (time.monotonic() - self._started)
        proposal = tuner.search.propose()
        if proposal is None:
            return tuner.finish(True, elapsed).setting, False
        spent = elapsed > BUDGET_S or (self._share is not None and self._tuned >= self._share)
        if spent and tuner.search.choice() is not None:
            return tuner.finish(False, elapsed).setting, False
        return proposal, True

    def _begin(self, setting: Setting, trial: bool) -> None:
        loader = self._loader
        loader.num_workers, loader.prefetch_factor = setting.num_workers, setting.prefetch_factor
        loader.worker_type = setting.worker_type
        self._gate = _Gate(self._shared)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
            if setting.num_workers == 0:
                it = SingleProcessIter(loader, indices=self._gate, base_seed=self._base_seed)
            else:
                loader.check_worker_number_rationality()
                loader.numa_plan = affinity.plan_for(loader.numa, loader._cuda_target(), setting.num_workers)
                it = RingDataLoaderIter(loader, loader._ring_for, None, None, indices=self._gate,
                                        base_seed=self._base_seed)  # fmt: skip
        it._timed = False  # this epoch's recorder times the consumer
        self._base_seed = it._base_seed
        self._current = it
        self._stats.num_workers, self._stats.prefetch_factor = setting.num_workers, setting.prefetch_factor
        # Warm-up: the trial's first batch (the workers' start; the memory read after it, see _Run.update), then
        # what the workers made ahead meanwhile: a full ring and a batch in the making each, so that the windows
        # read what they make. Cut to a quarter of a recheck's 12-batch trial, it left 4 of the 6 batches 3 workers
        # had made ahead for the windows, which read how fast the loop empties a ring: 2 700 batches/s from workers
        # that make 1 000.
        warm = 1 + setting.num_workers * ((setting.prefetch_factor or 0) + 1) + 1
        window = max(WINDOW_BATCHES, (self._per_trial - warm) // self._windows)
        pool = getattr(it, "_pool", None)
        pids = () if pool is None or it._threads else list(pool.pids)
        self._run = _Run(Trial(setting), self._stats.batches, warm, window, pids) if trial else None
        self._run_start = self._stats.batches
        self._run_began = time.monotonic()

    def _progress(self) -> None:
        """Before each batch: close the trial's window, and its gate once it has them all; once this rank has
        settled, look every ``POLL_S`` whether every rank's choice is in (and close the gate to switch)."""
        run = self._run
        if run is not None and self._gate.open and self._trial_complete(run):
            self._gate.open = False
            current = self._current
            if current._stats is not None:
                run.trial.load_s = load_seconds(current._stats)
                run.trial.load_tail = load_tail(current._stats)
            if run.pids and run.start_batch is not None:  # its workers' memory, while they live
                trial = run.trial
                trial.worker_bytes = private_bytes(run.pids)
                trial.worker_start_bytes = min(run.start_bytes, trial.worker_bytes) if run.start_bytes else 0
                # The samples each worker read between the two readings (see measure): the batches since, shared out
                batches = self._stats.batches - run.start_batch
                trial.samples_per_worker = batches * (self._loader.batch_size or 1) / len(run.pids)
        if self._tuner.result is not None and not self._tuner.agreed and self._gate.open:
            now = time.monotonic()
            if now >= self._next_poll:
                self._next_poll = now + POLL_S
                if self._tuner.check_ranks():
                    self._gate.open = False  # switch to the slowest rank's choice

    def _trial_complete(self, run: _Run) -> bool:
        complete = run.update(self._stats, self._tuner.tolerance)  # closes a window, if one is due
        return complete or (self._tuner.windows is not None and len(run.trial.windows) >= self._tuner.windows)

    def _end_trial(self) -> None:
        run, self._run = self._run, None
        self._tuned += self._stats.batches - self._run_start if run is not None else 0
        if run is None or not run.trial.windows:
            return
        run.trial.batch_bytes = self._tuner.budget.batch_bytes
        run.trial.seconds = time.monotonic() - self._run_began
        self._tuner.budget.learn(run.trial)
        self._tuner.search.report(run.trial)

    def _account(self) -> None:
        if self._tuner.result is None:
            self._tuner.spent_s += time.monotonic() - self._started


class _Source:
    """The epoch's sampler iterator, shared by its settings' iterators: ``rng`` is what the sampler drew from just
    before its first index (the state's ``sampler_rng``: a resumed epoch draws its order again from it)."""

    def __init__(self, source, generator):
        self.source, self.generator = source, generator
        self.rng = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.rng is None:
            self.rng = _state.sampler_rngs(self.generator)
        return next(self.source)


def positioned(loader, state: dict | None = None) -> str | None:
    """Why a tuning epoch's position cannot be the sampler's alone (saved, or ``state`` resumed), or None.

    A tuning epoch's settings each start their workers afresh, so its state holds no worker's state: the dataset's
    own state, a stateful sampler's, or batches delivered out of order would be lost."""
    if _state.is_stateful_dataset(loader.dataset):
        return "the dataset's own state (state_dict) is kept by each setting's workers, which the tuning replaces"
    if _state.sampler_of(loader) is not None:
        return "a stateful sampler's position is not followed across the tuning's settings"
    if not getattr(loader, "in_order", True):
        return "with in_order=False the batches are delivered out of order"
    if state is not None and (state.get("due") is not None or state.get("received_ahead")
                              or state.get("sampler_state") is not None or state.get("dataset") is not None):
        return "the state holds a position of its own (a torchdata state's batches, or a sampler's or dataset's state)"
    return None


def _sized(loader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True
