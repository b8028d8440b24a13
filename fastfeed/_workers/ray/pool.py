"""Ray actors as the loader's workers, behind the same face as ``Pool`` and ``ThreadPool``.

Each worker is an actor (``actor.RayWorker``) running the ordinary worker loop. Ray starts, places, replaces and
kills it; its ``start`` is a Ray call. The messages of each start after that are numbered and go over the actor's
*link*, one TCP connection from the actor to this process's ``link.Receiver``, and so do their answers: a Ray
call and its ``ray.get`` would cost the loop's thread about a millisecond a batch, a frame costs it a ``sendall`` and
a look-up, as a worker process's pipe does. The actor hands them to its loop in that order at once, so that the loop
(and a dataset's read-ahead) sees the tasks sent ahead of the one it runs. Until a start has answered, whether its
actor has a link is not known, and what is sent to it waits here (``_UNSENT``); an actor without one (the object
store path, or a listener that could not be made) gets its messages as numbered Ray calls instead. The epoch's
``WorkerSpec`` (and with it the dataset) goes into Ray's object store once per epoch, and each actor takes it from
there: it is not pickled per task.

A batch reaches the ring by one of three paths, chosen per actor at its start (``actor._writer_for``): an actor on
this process's node writes it into a ring slot itself (``shm``), as a worker process does; one on another node sends
its bytes over a TCP stream that a thread of this process reads straight into a slot (``stream``, see
``link``); and where neither can be set up, it comes back as one Ray object that the main process copies once
into a slot (``object store``). Only the small ``Done`` comes back on the first two, over the link, so the loop's
cost per batch is a look-up, as with worker processes; pinning, the device stage and the leases downstream are
theirs too.
``stats().worker_paths`` says which path each worker took. ``FASTFEED_RAY_PATH`` (``shm``, ``stream``, ``store``)
forces one, for tests and benchmarks.

Losing a worker. Every answer carries the worker's state right after it (its RNGs, a stateful dataset's position,
the batches it made), which is what a worker process keeps for ``DataLoader.state_dict()``. When an actor or its node
dies, or an answer is lost with its node (a link that ends is the same news: the kernel closes a dead process's
connection), a new actor starts from the state after the last answer taken, as
``load_state_dict`` restarts a worker process, and the tasks still owed are sent to it again, in order: the user sees
the batches of an uninterrupted run. A batch that keeps killing its actor raises after ``MAX_LOSSES`` replacements.
The owed tasks are redone one at a time (the next sent once the last has answered), then the calls go pipelined
again: the actor holds one task when it dies, so the loss is charged to the batch that caused it.

Waiting for room. An actor no node of the cluster could ever host (``ray_options`` asking for more than any one node
has) raises before anything starts. One that fits but finds every node busy waits: after ``EARLY_NOTICE_S`` the
``fastfeed`` logger says how many actors wait, for what, and what the cluster has free; after
``start_timeout_s()`` the loader raises. These times run from the actor's start call, whichever way the loop waits:
for one worker (in order), or for any (``in_order=False``, where other workers' answers come meanwhile).

Beside local worker processes (``MixedPool``), the loop waits for either kind in one ``poll``: each Ray answer it
waits for writes a byte into a pipe when it arrives (a callback of Ray's), and the pipe is polled with the processes'.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import select
import sys
import threading
import time
import weakref

import numpy as np

from ..._native import C
from .. import messages as m
from . import connect as ray_connect
from ..loop import SlotWriter
from ..pool import _READY, STATUS_CHECK_S, Clock, WorkerDied
from .actor import PATH_ENV, PATHS, SHM, STORE, from_wire, owned

log = logging.getLogger("fastfeed")

MAX_LOSSES = 3  # replacement actors one batch may cost before it, not the cluster, is blamed
SPARE_GRACE_S = 1.0  # an actor not placed by then may be waiting for CPUs that idle spare actors hold
# An actor not started by then is waiting for room (or a slow node): say so long before the start timeout, which must
# be long enough for a busy cluster to free room and so would otherwise be minutes of silence.
EARLY_NOTICE_S = 5.0
DEFAULT_OPTIONS = {"num_cpus": 1}  # a worker uses a core, as a worker process does
_START = "start"  # the pending entry of an actor's start call
_LOCAL = "local"  # a StateRequest, answered here from the states that came with the answers
# A call not sent yet: its actor's start has not answered, so whether its calls go over the link is not known. (A
# call sent over the link is its number, an int; one sent through Ray, its reference.)
_UNSENT = "unsent"
_NOT_YET = "not yet"  # a link answer not here within the wait
# Waiting for a streamed batch whose Done has come: its bytes were all sent before it, so only a connection that
# stalls without breaking takes this long, and the actor is then replaced as if it were lost.
STREAM_WAIT_S = 60.0


def start_timeout_s() -> float:
    """How long an actor may wait for a node with room for it before the loader says so (it would wait forever)."""
    return float(os.environ.get("FASTFEED_RAY_START_TIMEOUT_S", "120"))


_actor_classes: dict = {}


def actor_class(ray):
    cls = _actor_classes.get(id(ray))
    if cls is None:
        from .actor import RayWorker

        # max_restarts=0: a lost actor is replaced by the loader, which knows the state to start it from.
        cls = _actor_classes[id(ray)] = ray.remote(max_restarts=0, max_task_retries=0)(RayWorker)
    return cls


def _lost_errors(ray) -> tuple:
    """Ray's errors that mean the actor or its answer is gone, not that the dataset raised."""
    e = ray.exceptions
    return (e.RayActorError, e.ObjectLostError, e.WorkerCrashedError, e.NodeDiedError, e.TaskCancelledError)


class Spare:
    """Actors kept between epochs by one loader, so a new epoch (``persistent_workers=False``) does not wait for
    new actor processes. Each epoch's ``start`` gives an actor that epoch's dataset, seed and ``worker_init_fn``
    afresh. Killed when the loader goes, at exit, or when another loader's actor finds no room on the cluster
    (``free_spares``): a spare must never hold CPUs that work is waiting for."""

    def __init__(self):
        self.actors: list = []  # (options key, handle)
        self.ray = None
        self._finalizer = None
        _all_spares.add(self)

    def take(self, key) -> object | None:
        for i, (k, actor) in enumerate(self.actors):
            if k == key:
                del self.actors[i]
                return actor
        return None

    def give(self, key, actor, ray) -> None:
        self.actors.append((key, actor))
        self.ray = ray
        if self._finalizer is None:
            # Only the process that made them kills them: a fork's copy exiting leaves its parent's actors be.
            self._finalizer = weakref.finalize(self, _kill_owned, os.getpid(), ray, self.actors)


_all_spares: weakref.WeakSet = weakref.WeakSet()


def free_spares() -> int:
    """Kill every loader's spare actors (their CPUs go back to the cluster); returns how many."""
    n = 0
    for spare in list(_all_spares):
        n += len(spare.actors)
        if spare.actors:
            _kill_all(spare.ray, spare.actors)
    return n


def _kill_owned(owner: int, ray, actors: list) -> None:
    if os.getpid() == owner:
        _kill_all(ray, actors)


def _kill_all(ray, actors: list) -> None:
    for _, actor in actors:
        _kill(ray, actor)
    actors.clear()


def _kill(ray, actor) -> None:
    try:
        if ray.is_initialized():
            ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 (already gone, or Ray shut down)
        pass


class _Worker:
    __slots__ = ("wid", "actor", "pending", "states", "start", "last", "resume_msg", "losses", "where", "epoch",
                 "calls", "asked", "direct", "redo")  # fmt: skip

    def __init__(self, wid: int, actor):
        self.wid = wid
        self.actor = actor
        self.epoch = None  # the key of the actor's start: its calls carry it, numbered from 0 (``calls``)
        self.calls = 0
        self.asked = 0.0  # when the actor's start was sent (monotonic): the start timeout runs from there
        self.direct: bool | None = None  # whether this start's calls go over the link (None: not known yet)
        self.pending: collections.deque = collections.deque()  # [message, ref] sent, answers not taken yet
        self.states: dict = {}  # task index -> StateReply right after it (recent ones)
        self.start = None  # StateReply at this epoch's start
        self.last = None  # StateReply after the last answer taken (None: none yet this epoch)
        self.resume_msg = None  # the Resume that began this epoch (persistent workers' later epochs)
        self.losses: collections.Counter = collections.Counter()  # actors lost, by the task they held
        # Owed answers a replacement still redoes one call at a time (``_send_unsent``): while it does, the task in
        # flight is the only one the actor holds, so a loss is charged to the batch that caused it.
        self.redo = 0
        self.where = None  # {"host", "pid", "node_id"} of the actor, once started


class RayPool:
    """``num_workers`` Ray actors, as workers ``first_id .. first_id + num_workers - 1`` of an iterator.

    Args:
        ray: the connected ``ray`` module.
        spec: the epoch's ``WorkerSpec`` (placement and ring names play no part on another machine).
        resumes: per worker, where ``load_state_dict`` restarts it (or None).
        writer: places a batch's bytes in the ring (a ``SlotWriter`` of the main process).
        options: Ray's actor options (``ray_options``), over ``DEFAULT_OPTIONS``.
        spare: the loader's ``Spare`` actors, taken first and given back at a clean stop.
        replay_index: what one task of an IterableDataset asks for (a replacement replays with it).
        unrecoverable: why a lost worker's position cannot be rebuilt in a persistent later epoch, or None.
    """

    def __init__(self, ray, num_workers: int, first_id: int, spec, resumes, writer: SlotWriter, options=None,
                 spare: Spare | None = None, hang_dump_s: float = 0, replay_index=None,
                 unrecoverable: str | None = None):  # fmt: skip
        self.ray = ray
        self.first_id = first_id
        self.hang_dump_s = hang_dump_s
        self.blocked = 0
        # Whether no actor may still write into the ring: an actor on the shm path writes into its slots itself, so
        # one killed with a task owed (stop) may still be writing as the next epoch would take the ring over.
        self.all_gone = True
        self.paths: dict[int, str] = {}  # worker id -> the path its batches take (stats().worker_paths)
        self._writer = writer
        self._options = dict(DEFAULT_OPTIONS, **(options or {}))
        self._key = repr(sorted(self._options.items()))
        self._cls = actor_class(ray).options(**self._options)
        self._spare = spare
        self._replay_index = replay_index
        self._unrecoverable = unrecoverable
        self._lost = _lost_errors(ray)
        self._spec_ref = ray.put(spec)
        self._receiver = None
        # Rung by Ray's callbacks for the references waited for and by the receiver for each answer and lost link,
        # so one poll waits for all of them (and for worker processes, in a MixedPool).
        self.wakeup = _Wakeup()
        try:
            self._link = self._make_link(ray, writer)
        except BaseException:
            self.wakeup.close()
            raise
        self._warned_paths: set = set()
        self._freed = False  # other loaders' spare actors were killed to make room
        self._checked = False  # the cluster was asked whether any node can host an actor at all
        self._noticed = False  # the log said what the actors not started wait for
        self.workers: list[_Worker] = []
        try:
            for i in range(num_workers):
                wid = first_id + i
                w = _Worker(wid, self._new_actor())
                self.workers.append(w)
                w.pending.append([_START, self._begin(w, resumes[i])])
        except BaseException:
            self.stop(idle=False)
            raise

    def _new_actor(self):
        actor = self._spare.take(self._key) if self._spare is not None else None
        if actor is not None:
            return actor
        if not self._checked:
            self._checked = True
            # Ray would keep such an actor pending for ever; waiting out the start timeout would tell the user
            # nothing more than this does now.
            why = ray_connect.never_fits(self.ray, self._options)
            if why:
                raise RuntimeError(f"worker_type='ray': {why}")
        return self._cls.remote()

    def _worker(self, wid: int) -> _Worker:
        return self.workers[wid - self.first_id]

    def _make_link(self, ray, writer) -> dict | None:
        """What each actor's start is told of the ring's paths (``actor._writer_for``), with the stream's
        receiver made when actors may use it; None: every actor uses the object store."""
        forced = os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"
        forced = STORE if forced == "store" else forced
        if forced not in (*PATHS, "auto"):
            raise ValueError(f"{PATH_ENV}={forced!r}: expected auto, shm, stream or store")
        if forced == STORE:
            return None
        try:
            node = ray.get_runtime_context().get_node_id()
            host = ray.util.get_node_ip_address()
        except Exception as e:  # noqa: BLE001 (a client connection has no node of its own: the object store)
            log.warning("fastfeed: Ray workers use the object store: this process is on no Ray node (%s)", e)
            return None
        stream = token = None
        from .link import Receiver

        try:
            # Every actor's link: its calls and answers, and the batches of those on other nodes.
            self._receiver = Receiver(writer, host, on_news=self.wakeup.ring)
        except OSError as e:
            log.warning("fastfeed: Ray workers on other nodes use the object store, and every worker's calls go "
                        "through Ray: no listener on %s (%s: %s)", host, type(e).__name__, e)  # fmt: skip
        else:
            stream, token = self._receiver.address, self._receiver.token
        return {"node": node, "path": None if forced == "auto" else forced, "stream": stream, "token": token}

    def _begin(self, w: _Worker, resume, sync=None):
        """Start ``w``'s actor (its ``start`` call's reference); the calls after it are numbered afresh."""
        if self._receiver is not None and w.epoch is not None:
            self._receiver.discard(w.wid, w.epoch)  # the last start's connection and what it sent, not taken
        # Unguessable, so that no key of a start to come can be named before the pool gives it to its actor.
        w.epoch, w.calls, w.asked = secrets.randbits(64), 0, time.monotonic()
        w.direct = None if self._receiver is not None else False
        return w.actor.start.remote(w.epoch, w.wid, self._spec_ref, resume, sync, self._link)

    def _call(self, w: _Worker, message):
        """Send ``message`` to ``w``'s actor: over its link (the call's number), through Ray (the reference), or,
        before its start has said which, not yet (``_UNSENT``: sent once it has, ``_took``)."""
        if w.direct is None:
            return _UNSENT
        n, w.calls = w.calls, w.calls + 1
        if w.direct:
            self._receiver.send(w.wid, w.epoch, n, m.dumps(message))
            return n
        return w.actor.call.remote(w.epoch, n, message)

    def _take_starts(self) -> None:
        """Take every start that has answered (their unsent calls go out), so that no actor idles waiting for the
        loop to look at it."""
        fronts = {w.pending[0][1]: w for w in self.workers if w.pending and w.pending[0][0] is _START}
        if not fronts:
            return
        done, _ = self.ray.wait(list(fronts), num_returns=len(fronts), timeout=0)
        for ref in done:
            w = fronts[ref]
            answer = self._get(w, ref)
            if answer is not None:
                w.pending.popleft()
                self._took(w, _START, answer)

    # -- the pool's face -----------------------------------------------------------------

    def send(self, wid: int, message) -> None:
        w = self._worker(wid)
        kind = type(message)
        if kind is m.StateRequest:
            w.pending.append([message, _LOCAL])
            return
        if kind is m.Stop:
            return  # the actor is kept for the next epoch, or killed, by stop()
        if kind is m.Resume:
            w.resume_msg = message
        w.pending.append([message, _UNSENT if w.redo else self._call(w, message)])

    def retire(self, wid: int) -> None:
        """A worker whose IterableDataset ended: nothing more is sent to it (its actor waits for stop)."""

    def ready(self, wid: int) -> bool:
        """Whether worker ``wid``'s next answer is here (recv would not wait, short of a task skipped after its
        iterable ended)."""
        w = self._worker(wid)
        while w.pending:
            msg, ref = w.pending[0]
            if ref is _LOCAL:
                return True
            if type(ref) is int:
                return self._receiver.ready(w.wid, w.epoch, ref)
            done, _ = self.ray.wait([ref], timeout=0)
            if not done:
                return False
            if msg is not _START:
                return True
            answer = self._get(w, ref)  # a start answers nothing the iterator sees: take it now
            if answer is not None:
                w.pending.popleft()
                self._took(w, msg, answer)
        return False

    def recv(self, wid: int, timeout: float | None):
        """The next answer from worker ``wid``; raises on timeout, or once its batch has cost ``MAX_LOSSES`` actors."""
        w = self._worker(wid)
        clock = self._clock(timeout, [w])
        first = True
        while True:
            if not w.pending:
                raise RuntimeError(f"DataLoader worker {wid} (Ray actor) was asked for an answer it does not owe")
            msg, ref = w.pending[0]
            if ref is _LOCAL:
                w.pending.popleft()
                return self._state_reply(w, msg.after_idx)
            if type(ref) is int:  # over the link: the common case, kept to a look-up when the answer is here
                answer = self._link_answer(w, ref, 0.0)
                if answer is _NOT_YET:
                    if first:
                        self.blocked += 1  # not here yet: the consumer waits (fastfeed.stats' ``ready``)
                        self._take_starts()  # the other actors' starts, while this one's answer comes
                    first = False
                    answer = self._link_answer(w, ref, clock.next_wait())
                    if answer is _NOT_YET:
                        clock.check()
                        continue
            else:
                done, _ = self.ray.wait([ref], timeout=0)
                if not done:
                    if first:
                        self.blocked += 1  # the answer is not here yet: the consumer waits
                    first = False
                    done = self._wait_for(w, ref, msg, clock)
                    if not done:
                        continue
                answer = self._get(w, ref)
            if answer is None:  # the actor was lost and replaced: its tasks are owed again
                continue
            w.pending.popleft()
            got = self._took(w, msg, answer)
            if got is not None:
                return got

    def recv_any(self, timeout: float | None):
        """The next answer from whichever worker answers first."""
        clock = self._clock(timeout, None)
        while True:
            self.wakeup.drain()  # before looking: an answer that comes after the look rings the poll below
            self._take_starts()  # a start that answered sends what waited for it
            fronts, linked, took = {}, False, False
            for w in self.workers:
                if w.pending:
                    msg, ref = w.pending[0]
                    if ref is _LOCAL:
                        return self.recv(w.wid, timeout)
                    if type(ref) is int:
                        if self._receiver.ready(w.wid, w.epoch, ref):
                            got = self._take(w)
                            if got is not None:
                                return got
                            took = True
                        linked = True
                    else:
                        fronts[ref] = w
            if took:
                continue  # nothing for the iterator (a lost actor, a task past its iterable's end): look again
            if not fronts and not linked:
                raise RuntimeError("recv_any() with no answer owed by any Ray actor")
            starting = [w for w in fronts.values() if w.pending[0][0] is _START]
            wait = min(clock.next_wait(), STATUS_CHECK_S, self._watch_starts(starting))
            if linked:
                self.wait(wait)
                clock.check()
                continue
            done, _ = self.ray.wait(list(fronts), num_returns=1, timeout=wait)
            if done:
                got = self._take(fronts[done[0]])
                if got is not None:
                    return got
                continue
            clock.check()

    def _clock(self, timeout: float | None, workers: list | None) -> Clock:
        """The clock of one wait for answers of ``workers`` (None: whichever owe one), whose timeout error names
        them. The loader's ``timeout`` is also how long an actor may leave a task on its link unread before it
        counts as lost (``link.Receiver.send_timeout_s``; ``link.SEND_TIMEOUT_S`` without one)."""
        self.link_timeout(timeout)
        return _NamingClock(timeout, self.hang_dump_s, self.dump_stacks, lambda: self._named(workers))

    def link_timeout(self, timeout: float | None) -> None:
        """Make the loader's ``timeout`` (None or 0: none) the links' send timeout."""
        if self._receiver is not None:
            from .link import SEND_TIMEOUT_S

            self._receiver.send_timeout_s = timeout if timeout and timeout > 0 else SEND_TIMEOUT_S

    def _named(self, workers: list | None) -> str:
        if workers is None:
            workers = [w for w in self.workers if w.pending and w.pending[0][1] is not _LOCAL]
        return ", ".join(f"DataLoader worker {w.wid} (Ray actor, pid {(w.where or {}).get('pid', '?')} on "
                         f"{(w.where or {}).get('host', '?')})" for w in workers) or "no worker"  # fmt: skip

    def wait(self, seconds: float, fds: tuple = ()) -> None:
        """Until an answer an actor owes at the front of its queue (over its link or through Ray) may be here, a
        lost link, or one of ``fds`` (``select.poll`` masks by descriptor, a MixedPool's processes) is ready, or
        ``seconds`` have passed. The caller drained the wakeup before it looked."""
        fronts = [w.pending[0][1] for w in self.workers if w.pending]
        self.wakeup.watch([ref for ref in fronts if ref is not _LOCAL and type(ref) is not int])
        poller = select.poll()
        poller.register(self.wakeup.fd, select.POLLIN)
        for fd, mask in fds:
            poller.register(fd, mask)
        poller.poll(seconds * 1000)

    def _take(self, w: _Worker):
        """Take ``w``'s first answer, which has arrived: the message for the iterator, or None (a start, a task
        after its iterable ended, an answer lost with its actor, which was replaced)."""
        msg, ref = w.pending[0]
        if ref is _LOCAL:
            w.pending.popleft()
            return self._state_reply(w, msg.after_idx)
        answer = self._link_answer(w, ref, 0.0) if type(ref) is int else self._get(w, ref)
        if answer is None or answer is _NOT_YET:
            return None
        w.pending.popleft()
        return self._took(w, msg, answer)

    def _wait_for(self, w: _Worker, ref, msg, clock: Clock) -> bool:
        """Wait for ``ref`` up to the clock's next look; an actor never placed is an error, not a hang."""
        wait = clock.next_wait()
        if msg is _START:
            wait = min(wait, self._watch_starts([w]))
        done, _ = self.ray.wait([ref], timeout=wait)
        if done:
            return True
        clock.check()
        return False

    def _watch_starts(self, starting: list) -> float:
        """While actors ``starting`` have not started, counted from the earliest start call of theirs: after
        SPARE_GRACE_S, kill other loaders' idle actors if the cluster lacks room; after EARLY_NOTICE_S, log what
        the actors wait for (once); after ``start_timeout_s()``, raise. Returns the seconds until the next of these
        is due.

        Not from when the loop began to wait: out of order, other workers' answers end each wait within moments."""
        if not starting:
            return STATUS_CHECK_S
        waited = time.monotonic() - min(w.asked for w in starting)
        limit = start_timeout_s()
        if waited >= limit:
            self._start_timed_out(starting, limit)
            return 0.0  # they answered since the caller looked: it takes their starts now
        due = [limit]
        if not self._freed:
            if waited < SPARE_GRACE_S:
                due.append(SPARE_GRACE_S)
            else:
                self._freed = True
                # Other loaders' idle actors may hold the resources this one waits for.
                need = ray_connect.demand(self._options)
                if not ray_connect.fits(self.ray.available_resources(), need) and free_spares():
                    due.append(waited + 0.1)  # look again soon: the freed room is taken within moments
        if not self._noticed:
            if waited < EARLY_NOTICE_S:
                due.append(EARLY_NOTICE_S)
            else:
                self._noticed = True
                self._notice(waited, limit)
        return max(0.0, min(due) - waited)

    def _room(self) -> str:
        """What one actor needs and what the cluster has free and in all, for messages."""
        need = ray_connect.demand(self._options)
        free, total = self.ray.available_resources(), self.ray.cluster_resources()
        return (f"each needs {ray_connect.describe(need, need)} on one node, and the cluster has "
                f"{ray_connect.describe(free, need)} free, of {ray_connect.describe(total, need)} in all")  # fmt: skip

    def _not_started(self, workers: list) -> list[int]:
        """The ids of ``workers`` whose start, in front of what they owe, has not answered."""
        fronts = {w.pending[0][1]: w for w in workers if w.pending and w.pending[0][0] is _START}
        if not fronts:
            return []
        done, _ = self.ray.wait(list(fronts), num_returns=len(fronts), timeout=0)
        done = set(done)
        return [w.wid for ref, w in fronts.items() if ref not in done]

    def _pids(self, wids: list[int]) -> dict[int, int] | None:
        """Per worker of ``wids``, the pid of its actor's process (0: Ray has not placed it on a node yet), from
        Ray's actor table; None when the table cannot say (a Ray whose private state moved)."""
        try:
            from ray._private import state

            return {wid: int(state.actors(actor_id=self._worker(wid).actor._actor_id.hex()).get("Pid") or 0)
                    for wid in wids}  # fmt: skip
        except Exception:  # noqa: BLE001 (only for messages)
            return None

    def _start_timed_out(self, starting: list, limit: float) -> None:
        """Raise for the actors of ``starting`` that still have not started (none: return), naming why: no node
        with room, or a start that takes too long where it was placed."""
        ids = self._not_started(starting)
        if not ids:
            return
        pids = self._pids(ids) or {}
        unplaced = [wid for wid in ids if not pids.get(wid)]
        if not unplaced:
            wid = ids[0]
            raise RuntimeError(
                f"DataLoader worker {wid} (Ray actor, pid {pids[wid]} on its node) was placed but has not started in "
                f"{limit:.0f} s: starting its process (runtime_env, imports), unpickling the dataset or "
                "worker_init_fn takes that long or hangs (`ray stack` on its node shows where; "
                "FASTFEED_RAY_START_TIMEOUT_S sets the wait)"
            )
        who = f"worker {unplaced[0]} (Ray actor)" if len(unplaced) == 1 else f"workers {_short(unplaced)} (Ray actors)"
        raise RuntimeError(
            f"DataLoader {who} found no node with room for {'it' if len(unplaced) == 1 else 'them'} in {limit:.0f} s "
            f"(actor options {self._options}; {self._room()}): free those resources, add nodes, lower "
            "num_workers, or pass smaller ray_options such as {'num_cpus': ...} (FASTFEED_RAY_START_TIMEOUT_S "
            "sets the wait)"
        )

    def _notice(self, waited: float, limit: float) -> None:
        """Log how many actors have not started, whether Ray has placed them, what one needs and what the cluster
        has free."""
        waiting = self._not_started(self.workers)
        if not waiting:
            return
        pids = self._pids(waiting)
        placed = None if pids is None else sum(1 for wid in waiting if pids[wid])
        if placed is None:
            where = "placed on a node or not: Ray's actor table did not say"
        else:
            where = (f"{len(waiting) - placed} not placed on a node yet, {placed} placed and starting (process, "
                     "imports, worker_init_fn)")  # fmt: skip
        if placed == len(waiting):
            then = (f"Their start is what takes long; the loader raises after FASTFEED_RAY_START_TIMEOUT_S "
                    f"({limit:.0f} s) if it does not end.")  # fmt: skip
        else:
            then = (f"The loader waits for room (other actors and tasks to end, nodes to join) and raises after "
                    f"FASTFEED_RAY_START_TIMEOUT_S ({limit:.0f} s); to start sooner, free those resources, add "
                    "nodes, or lower num_workers or ray_options.")  # fmt: skip
        log.warning("fastfeed: waiting for %d of %d Ray actors of this DataLoader to start (workers %s, %.0f s so "
                    "far): %s. ray_options %s: %s. %s", len(waiting), len(self.workers), _short(waiting), waited,
                    where, self._options, self._room(), then)  # fmt: skip

    def _get(self, w: _Worker, ref):
        """The answer behind ``ref``, or None when the actor (or the answer) was lost and has been replaced. A batch
        that came over the stream is in its slot by then (a stream that broke under it counts as the actor lost:
        the batch is made again)."""
        try:
            answer = self.ray.get(ref)
        except self._lost as e:
            self._replace(w, e)
            return None
        return self._landed(w, answer)

    def _link_answer(self, w: _Worker, number: int, timeout: float):
        """The answer to call ``number`` of ``w``'s link, as ``_get``'s; ``_NOT_YET`` if not within ``timeout``;
        None when the link ended first (the actor, its node or the connection lost): the actor has been replaced.
        The exception the actor's loop raised, if it did, is raised here."""
        from .link import StreamBroken

        try:
            answer = self._receiver.answer(w.wid, w.epoch, number, timeout)
        except StreamBroken as e:
            self._replace(w, e)
            return None
        if answer is None:
            return _NOT_YET
        if isinstance(answer, BaseException):
            raise answer
        return self._landed(w, answer)

    def _landed(self, w: _Worker, answer):
        """``answer`` with a streamed batch's slot filled in, once its bytes are in it; None when its stream broke
        under it (the actor has been replaced: the batch is made again)."""
        if type(answer) is tuple and self._receiver is not None:
            reply = answer[0]
            if type(reply) is m.Done and reply.nbytes and answer[2] is None and reply.slot_id is None \
                    and reply.made is None:  # fmt: skip
                try:
                    slot_id, made = self._streamed(w, reply.idx, reply.nbytes)
                except ConnectionError as e:
                    self._replace(w, e)
                    return None
                answer = (reply._replace(slot_id=slot_id, made=made), answer[1], None)
        return answer

    def _streamed(self, w: _Worker, idx: int, nbytes: int):
        """The slot into which the stream read task ``idx``'s batch, of the ``nbytes`` its ``Done`` declares;
        raises ConnectionError if it never will (a frame of another size included: its link is ended)."""
        from .link import StreamBroken

        deadline = time.monotonic() + STREAM_WAIT_S
        while True:
            got = self._receiver.take(w.wid, w.epoch, idx, min(1.0, max(0.0, deadline - time.monotonic())), nbytes)
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                raise StreamBroken(w.wid, w.epoch, f"DataLoader worker {w.wid} (Ray actor): batch {idx} reported "
                                   f"sent, not received in {STREAM_WAIT_S:.0f} s")  # fmt: skip

    def _took(self, w: _Worker, msg, answer):
        """Record an answer; returns the message to hand to the iterator, or None (nothing to hand)."""
        if msg is _START:
            if w.start is None:  # a replacement's start is its resumed state, not the epoch's
                w.start = owned(answer["state"])
                if answer.get("restored") is not None:  # load_state_dict's, as task RESTORED until its next task
                    w.last = w.states[m.RESTORED] = owned(answer["restored"])
            w.where = answer["where"]
            self.paths[w.wid] = answer.get("path", STORE)
            if answer.get("fallback"):
                self._warn_path(w, f"its batches go through Ray's object store: {answer['fallback']}")
            w.direct = bool(answer.get("direct"))
            self._send_unsent(w)  # what was sent to it meanwhile goes now, the way it says, in order
            return None
        if w.redo:
            w.redo -= 1
            self._send_unsent(w)  # the next owed call, or (the owed ones done) every call held back meanwhile
        reply, state, buf = answer
        if reply is None:
            return None  # a task after its iterable ended: torch's worker sends nothing for it either
        state = owned(state)
        if state is not None:
            if type(reply) is m.ResumeAck:
                w.start, w.last = state, None
                w.states.clear()
            else:
                w.last = w.states[reply.idx] = state
                if len(w.states) > 4 * max(1, len(w.pending)) + 64:  # keep the recent ones (state_dict asks those)
                    for idx in sorted(w.states)[: len(w.states) // 2]:
                        del w.states[idx]
        if type(reply) is m.Done and buf is not None:  # the object store's path
            return self._into_ring(reply, buf)
        return reply

    def _send_unsent(self, w: _Worker) -> None:
        """Send ``w``'s calls that wait here (``_UNSENT``), in order: all of them, or while a replacement redoes
        owed answers (``w.redo``), the next one only once no call is in flight, so that the actor holds one task."""
        for entry in w.pending:
            msg, ref = entry
            if msg is _START or ref is _LOCAL:
                continue
            if ref is not _UNSENT:
                if w.redo:
                    return  # an owed call is in flight: the next one goes once it has answered
                continue
            entry[1] = self._call(w, msg)
            if w.redo or entry[1] is _UNSENT:  # one at a time, or the start has not answered yet
                return

    def _warn_path(self, w: _Worker, what: str) -> None:
        if w.wid not in self._warned_paths:  # one line per worker, however many starts it has
            self._warned_paths.add(w.wid)
            log.warning("fastfeed: DataLoader worker %d (Ray actor on %s): %s", w.wid,
                        (w.where or {}).get("host", "?"), what)  # fmt: skip

    def _into_ring(self, reply: m.Done, buf: np.ndarray) -> m.Done:
        """Copy the batch's bytes into a slot: its one copy on this machine."""
        slot_id, made, base = self._writer.claim(reply.nbytes)
        try:
            C.gather(base.data_ptr(), [(buf.ctypes.data, reply.nbytes)])
        except BaseException:
            self._writer.abandon(slot_id, made)
            raise
        return reply._replace(slot_id=slot_id, made=made)

    def _state_reply(self, w: _Worker, after_idx: int | None) -> m.StateReply:
        if after_idx is None:
            return from_wire(w.start)
        state = from_wire(w.states.get(after_idx))
        if state is None:
            raise RuntimeError(f"DataLoader worker {w.wid} (Ray actor) no longer holds its state after task "
                               f"{after_idx}")  # fmt: skip
        return state

    # -- losing an actor -------------------------------------------------------------------

    def _replace(self, w: _Worker, error: BaseException) -> None:
        held = next((msg for msg, _ in w.pending if type(msg) is m.Task), None)
        key = None if held is None else held.idx
        w.losses[key] += 1
        if w.losses[key] > MAX_LOSSES:
            what = "before its first task" if held is None else f"while it held batch {held.idx} (sample indices " \
                                                                  f"{_short(held.index)})"  # fmt: skip
            raise WorkerDied(f"DataLoader worker {w.wid} (Ray actor) was lost {w.losses[key]} times {what}: "
                             f"{type(error).__name__}: {_first_line(error)}") from error  # fmt: skip
        if self._unrecoverable and w.resume_msg is not None:
            raise WorkerDied(f"DataLoader worker {w.wid} (Ray actor) was lost and its position cannot be rebuilt: "
                             f"{self._unrecoverable}") from error  # fmt: skip
        _kill(self.ray, w.actor)
        w.actor = self._cls.remote()  # not a spare: one of those may sit on the node that just went
        last = from_wire(w.last if w.last is not None else w.start)
        resume = None
        if last is not None:
            resume = {"state": last.state, "epoch_start": last.epoch_start, "mid_epoch": True,
                      "replay_index": self._replay_index}  # fmt: skip
        sync = None
        if w.resume_msg is not None:
            sync = {"shared_seed": w.resume_msg.shared_seed, "dataset_sync": w.resume_msg.dataset_sync}
        owed = [entry for entry in w.pending if entry[0] is not _START]
        start = self._begin(w, resume, sync)
        # Owed calls are redone one at a time (``_send_unsent``), pipelined again once they have answered: sent
        # together, a later one that kills the actor would lose the earlier ones' answers with it, and the loss
        # would be charged to the first of them (the batch ``held`` names above).
        for entry in owed:
            if entry[1] is not _LOCAL:
                entry[1] = _UNSENT
        w.redo = sum(entry[1] is _UNSENT for entry in owed)
        w.pending = collections.deque([[_START, start], *owed])
        self._send_unsent(w)
        self._noticed = False  # a replacement that finds no room is worth its own notice
        print(f"fastfeed: DataLoader worker {w.wid} (Ray actor) was lost ({type(error).__name__}); a new actor "
              f"continues from its last batch and redoes {sum(type(e[0]) is m.Task for e in owed)} owed, one at a "
              f"time",
              file=sys.stderr, flush=True)  # fmt: skip

    def dump_stacks(self, waited: float) -> None:
        where = ", ".join(f"worker {w.wid}: pid {w.where['pid']} on {w.where['host']}" for w in self.workers
                          if w.where)  # fmt: skip
        print(f"fastfeed: no batch for {waited:.0f} s from the Ray actor workers ({where or 'not started yet'}); "
              "`ray stack` on an actor's node prints its Python stack.", file=sys.stderr, flush=True)  # fmt: skip

    def on_own_thread(self) -> bool:
        """Whether the caller runs on one of the pool's own threads (its link's receiver's): ``stop`` from there
        would wait on that thread."""
        receiver = self._receiver
        return receiver is not None and receiver.on_own_thread()

    def stop(self, grace: float = STATUS_CHECK_S, idle: bool = False) -> None:
        """Drop every owed answer; actors that owe nothing go back to the loader's spares, the others are killed
        (one may be stuck in the dataset, and the next epoch must not queue behind it)."""
        ray = self.ray
        writing = []  # owed Ray calls of killed actors that write into the ring themselves (the shm path)
        linked = []  # the links of such actors whose calls went over them
        for w in self.workers:
            owed = [ref for msg, ref in w.pending if ref is not _LOCAL and msg is not _START]
            clean = not owed and ray.is_initialized()
            w.pending.clear()
            if clean and self._spare is not None:
                self._spare.give(self._key, w.actor, ray)
            else:
                _kill(ray, w.actor)
                sent = [ref for ref in owed if ref is not _UNSENT]  # an unsent call makes it write nothing
                if sent and self.paths.get(w.wid) == SHM:
                    if w.direct:
                        linked.append((w.wid, w.epoch))
                    else:
                        writing += sent
            w.actor = None
        self.workers = []
        self._spec_ref = None
        if writing:
            # ray.kill returns before the actor is gone, and until then it may write a slot or make a segment
            # under the ring's name. Each owed call ends (with an error) once it is gone: only then is the ring
            # free to be taken over, or its names swept with nothing made after the sweep.
            try:
                _, left = ray.wait(writing, num_returns=len(writing), timeout=grace)
            except Exception:  # noqa: BLE001 (Ray shut down meanwhile: its processes are gone with it)
                left = []
            if left:
                self.all_gone = False  # still writing: the ring is closed, not taken over
        if linked and self._receiver is not None:
            # Likewise: an actor's end of its link closes when its process is gone.
            if self._receiver.wait_gone(linked, grace):
                self.all_gone = False
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        self.wakeup.close()


class _NamingClock(Clock):
    """A ``Clock`` whose timeout error (torch's text) goes on to name the Ray actors waited for."""

    def __init__(self, timeout: float | None, dump_s: float, dump, named):
        super().__init__(timeout, dump_s, dump)
        self._named = named  # () -> which workers, in words

    def check(self) -> None:
        try:
            super().check()
        except RuntimeError as e:
            raise RuntimeError(f"{e}: no answer from {self._named()}") from None


def _short(index) -> str:
    text = repr(list(index) if isinstance(index, (list, tuple, range)) else index)
    return text if len(text) <= 80 else text[:77] + "..."


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else ""


class _Wakeup:
    """A pipe that polls readable once a Ray answer the loop waits for has arrived, so the loop waits for actors and
    worker processes in one ``poll``: Ray calls back, from a thread of its own, as each watched reference is ready."""

    def __init__(self):
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)  # a full pipe polls readable already: a ring never waits
        self._lock = threading.Lock()  # a callback after close() must not write into a descriptor number reused
        self._closed = False
        self._watched: set = set()  # the watched references' ids (a reference kept would keep its answer's object)

    def watch(self, refs: list) -> None:
        """Ring once each of ``refs`` is ready (one already ready rings at once); each is watched once."""
        ids = set()
        for ref in refs:
            key = ref.binary()
            if key not in self._watched:
                ref.future().add_done_callback(self.ring)
            ids.add(key)
        self._watched = ids  # the others were taken: their callbacks have rung or will, once

    def ring(self, _future=None) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"\0")
            except BlockingIOError:
                pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.fd)
                os.close(self._write_fd)


class MixedPool:
    """Local worker processes (ids ``0 .. local-1``) and Ray actors (the rest) as one pool."""

    def __init__(self, local, remote: RayPool):
        self.local, self.remote = local, remote
        self._split = remote.first_id
        self.hang_dump_s = local.hang_dump_s
        self._retired: set = set()  # local workers told to stop (their iterable ended): their exit is no death
        self._blocked = 0  # recv_any calls that found no answer waiting, and waited

    def _of(self, wid: int):
        return self.local if wid < self._split else self.remote

    @property
    def blocked(self) -> int:
        return self.local.blocked + self.remote.blocked + self._blocked

    @property
    def all_gone(self) -> bool:
        return self.local.all_gone and self.remote.all_gone

    @property
    def pids(self):
        return self.local.pids

    def send(self, wid, message):
        self._of(wid).send(wid, message)

    def recv(self, wid, timeout):
        return self._of(wid).recv(wid, timeout)

    def ready(self, wid) -> bool:
        return self._of(wid).ready(wid)

    def retire(self, wid) -> None:
        if wid < self._split:
            self._retired.add(wid)
        self._of(wid).retire(wid)

    def recv_any(self, timeout):
        """Whichever answers first, a process or an actor, both waited for in one ``poll`` (``in_order=False``)."""
        clock = Clock(timeout, self.hang_dump_s, self.dump_stacks)
        self.remote.link_timeout(timeout)
        waited = False
        while True:
            self.remote.wakeup.drain()  # before looking: an answer that comes after the look rings the poll below
            for wid in range(self._split):
                if wid not in self._retired and self.local.workers and self.local.ready(wid):
                    return self.local.recv(wid, timeout)
            took = False
            for w in self.remote.workers:
                if w.pending and self.remote.ready(w.wid):
                    got = self.remote._take(w)
                    if got is not None:
                        return got
                    took = True
            if took:
                continue  # nothing for the iterator (a lost actor, a task past its iterable's end): look again
            if not waited:
                self._blocked += 1
                waited = True
            # ready() took every start that had answered: a start still in front has not.
            starting = [w for w in self.remote.workers if w.pending and w.pending[0][0] is _START]
            self._wait(min(clock.next_wait(), self.remote._watch_starts(starting)))
            clock.check()

    def _wait(self, seconds: float) -> None:
        """Until a local worker's message (or exit) or an actor's answer is here, or ``seconds`` have passed."""
        fds = []
        for wid, w in enumerate(self.local.workers):
            if wid not in self._retired:  # its exit is no news, and its ended pipe would poll readable for ever
                fds += [(w.results.fileno(), _READY), (w.process.sentinel, _READY)]
        self.remote.wait(seconds, tuple(fds))

    def dump_stacks(self, waited: float) -> None:
        self.local.dump_stacks(waited)
        self.remote.dump_stacks(waited)

    def on_own_thread(self) -> bool:
        return self.local.on_own_thread() or self.remote.on_own_thread()

    def stop(self, grace: float = STATUS_CHECK_S, idle: bool = False) -> None:
        try:
            self.local.stop(grace, idle)
        finally:
            self.remote.stop(grace, idle)

